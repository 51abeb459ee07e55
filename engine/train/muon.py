"""nanochat's optimizer (karpathy/nanochat, nanochat/optim.py and the groups of
GPT.setup_optimizer at commit 92d63d4e8bb4): AdamW groups for the embeddings, the head and the
scalars, Muon groups for the transformer matrices, stacked by shape. Single-process, eager; the
arithmetic is the reference's op for op (its 0-D fp32 hyperparameter tensors included), so one
step and ten steps match it to float rounding (tests/test_nanochat_parity.py).

Muon here is nanochat's variant, not `torch.optim.Muon`. torch's Muon (checked on torch 2.13)
runs Keller Jordan's Newton-Schulz with ONE coefficient triple (3.4445, -4.775, 2.0315) in
bf16 and plain decoupled weight decay. nanochat's differs in every stage, so torch's cannot
compute it:

1. Nesterov momentum (lerp form) over the stacked gradients of a shape group;
2. MuonEq row equilibration (each row rescaled to the mean row norm);
3. Polar Express orthogonalisation (arXiv 2505.16932): five iterations, each with its OWN
   (a, b, c), the Gram matrix taken on the short side, input scaled by 1/(1.01 |X|_F + 1e-6);
4. Muon+ renormalisation of the Frobenius norm to sqrt(min(m, n));
5. NorMuon variance reduction (arXiv 2510.05491): a factored second moment (per row of a tall
   matrix, per column of a wide one) rescales the update, keeping its norm;
6. cautious weight decay: decay only where the update and the weight agree in sign;
   learning rate times sqrt(max(1, rows / cols)).

The orthogonalisation (MuonEq and Polar Express) runs in the parameters' dtype (fp32) for an
fp32 model and in bf16 for a bf16 one (`MuonAdamW(..., compute_dtype=torch.bfloat16)`), as the
reference does whenever its global compute dtype is bf16, on any device: the five iterations'
matmuls are most of the optimizer's time, and bf16 multiplies in hardware here. The momentum
buffers, the renormalisation, NorMuon and the update stay in the parameters' dtype. AdamW does
its arithmetic in fp32 whatever a parameter's dtype (a bf16 model stores its embeddings, and
so their moments, in bf16, and casts back after the step).

`nanochat_groups` is setup_optimizer (AdamW learning rates scaled by 1/sqrt(n_embd / 768));
`NanochatHyper` is scripts/base_train.py's derivation of batch-scaled learning rates
(sqrt(B / 2**19)), weight decay scaled by sqrt(B / B_ref) * D_ref / D, and its Muon momentum
and weight-decay schedules. State is the torch optimizer state_dict (AdamW state per parameter,
Muon state on each group's first parameter), so engine/train/checkpoint.py saves and resumes
it bit for bit like the other optimizers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

# Polar Express coefficients for 5 iterations (safety factor 2e-2, cushion 2), as the reference.
POLAR_EXPRESS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]


def _scalar(value: float) -> Tensor:
    """A 0-D fp32 tensor: the reference passes every hyperparameter this way, so its
    arithmetic (1 - beta, lr * wd, beta ** step) is fp32, not Python double."""
    return torch.tensor(value, dtype=torch.float32)


# AdamW works through a parameter in slices of this many elements: elementwise, so the numbers
# are those of the whole tensor at once, but each temporary is a cache-sized slice instead of a
# fresh allocation the size of the parameter (32768 x 384 floats for nanochat d6's tables,
# above malloc's mmap threshold, so every one was new zeroed pages)
ADAMW_SLICE = 1 << 16


def adamw_update(p: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: int,
                 lr: float, beta1: float, beta2: float, eps: float, wd: float) -> None:
    """One AdamW step in place (weight decay first, lerp moments, bias-corrected update), in
    fp32 whatever the dtype of the parameter and its moments (bf16 ones are cast back)."""
    step_t, lr_t, beta1_t, beta2_t, eps_t, wd_t = map(_scalar, (step, lr, beta1, beta2, eps, wd))
    decay = 1 - lr_t * wd_t
    bias1 = 1 - beta1_t ** step_t
    bias2 = 1 - beta2_t ** step_t
    coefficients = (decay, 1 - beta1_t, 1 - beta2_t, bias2, eps_t, lr_t / bias1)
    tensors = (p, grad, exp_avg, exp_avg_sq)
    if not all(t.is_contiguous() for t in tensors):
        _adamw_slice(*tensors, *coefficients)
        return
    flat = [t.view(-1) for t in tensors]
    for start in range(0, p.numel(), ADAMW_SLICE):
        _adamw_slice(*(t[start:start + ADAMW_SLICE] for t in flat), *coefficients)


def _adamw_slice(p: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, decay: Tensor,
                 one_minus_beta1: Tensor, one_minus_beta2: Tensor, bias2: Tensor, eps_t: Tensor,
                 step_size: Tensor) -> None:
    """The reference's fused AdamW arithmetic, op for op, on one slice (in place where the
    reference makes a temporary: the same roundings)."""
    p32, exp_avg32, exp_avg_sq32, grad32 = p.float(), exp_avg.float(), exp_avg_sq.float(), \
        grad.float()
    p32.mul_(decay)
    exp_avg32.lerp_(grad32, one_minus_beta1)
    exp_avg_sq32.lerp_(grad32.square(), one_minus_beta2)
    denom = torch.div(exp_avg_sq32, bias2).sqrt_().add_(eps_t)
    p32.add_(torch.div(exp_avg32, denom, out=denom), alpha=-step_size)
    for stored, computed in ((p, p32), (exp_avg, exp_avg32), (exp_avg_sq, exp_avg_sq32)):
        if computed is not stored:                        # an fp32 tensor was updated in place
            stored.copy_(computed)


def polar_express(X: Tensor, ns_steps: int) -> Tensor:
    """Approximate orthogonalisation of stacked matrices X [K, m, n]."""
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.01 + 1e-6)
    if X.size(-2) > X.size(-1):                              # tall: Gram on the n side
        for a, b, c in POLAR_EXPRESS[:ns_steps]:
            A = X.mT @ X                                     # [K, n, n]
            B = b * A + c * (A @ A)
            X = a * X + X @ B
    else:
        for a, b, c in POLAR_EXPRESS[:ns_steps]:
            A = X @ X.mT                                     # [K, m, m]
            B = b * A + c * (A @ A)
            X = a * X + B @ X
    return X


def muon_update(grads: Tensor, params: Tensor, momentum_buffer: Tensor,
                second_momentum_buffer: Tensor, momentum: float, lr: float, wd: float,
                beta2: float, ns_steps: int, red_dim: int,
                compute_dtype: torch.dtype = torch.float32) -> None:
    """One Muon step in place on stacked params [K, m, n] (grads is consumed); the
    orthogonalisation in bf16 where `compute_dtype` is bf16."""
    momentum_t, lr_t, wd_t, beta2_t = map(_scalar, (momentum, lr, wd, beta2))
    mom = momentum_t.to(grads.dtype)
    momentum_buffer.lerp_(grads, 1 - mom)
    g = grads.lerp_(momentum_buffer, mom)                    # Nesterov
    X = g.bfloat16() if compute_dtype == torch.bfloat16 else g
    target = X.float().norm(dim=(-2, -1), keepdim=True) / (X.size(-2) ** 0.5)
    row_norm = X.float().norm(dim=-1, keepdim=True).clamp_min(1e-6)
    X = X * (target / row_norm).to(X.dtype)                  # MuonEq
    g = polar_express(X, ns_steps).to(params.dtype)
    target_norm = min(g.size(-2), g.size(-1)) ** 0.5         # Muon+
    current_norm = g.float().norm(dim=(-2, -1), keepdim=True).clamp_min(1e-6)
    g = g * (target_norm / current_norm).to(g.dtype)
    b2 = beta2_t.to(g.dtype)                                 # NorMuon
    v_mean = g.float().square().mean(dim=red_dim, keepdim=True)
    red_dim_size = g.size(red_dim)
    v_norm = (v_mean.sum(dim=(-2, -1), keepdim=True) * red_dim_size).sqrt()
    second_momentum_buffer.lerp_(v_mean.to(dtype=second_momentum_buffer.dtype), 1 - b2)
    step_size = second_momentum_buffer.clamp_min(1e-10).rsqrt()
    scaled_sq_sum = (v_mean * red_dim_size) * step_size.float().square()
    v_norm_new = scaled_sq_sum.sum(dim=(-2, -1), keepdim=True).sqrt()
    g = g * (step_size * (v_norm / v_norm_new.clamp_min(1e-10))).to(g.dtype)
    lr_g, wd_g = lr_t.to(g.dtype), wd_t.to(g.dtype)
    params.sub_(lr_g * g + lr_g * wd_g * params * cautious_mask(g, params))


def cautious_mask(update: Tensor, params: Tensor) -> Tensor:
    """Where weight decay applies: only where the update and the weight agree in sign."""
    return (update * params) >= 0


class MuonAdamW(torch.optim.Optimizer):
    """Groups of kind 'adamw' (lr, betas, eps, weight_decay) and 'muon' (lr, momentum,
    ns_steps, beta2, weight_decay; all parameters of one shape). `compute_dtype` is the model's
    (the reference's COMPUTE_DTYPE): bf16 orthogonalises in bf16."""

    def __init__(self, param_groups: list[dict],
                 compute_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(param_groups, defaults={})
        if compute_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"compute dtype float32 or bfloat16, not {compute_dtype}")
        self.compute_dtype = compute_dtype
        for group in self.param_groups:
            if group["kind"] == "muon":
                shapes = {p.shape for p in group["params"]}
                if len(shapes) != 1 or len(next(iter(shapes))) != 2:
                    raise ValueError(f"a Muon group holds matrices of one shape, not {shapes}")
            elif group["kind"] != "adamw":
                raise ValueError(f"unknown optimizer group kind {group['kind']!r}")

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if group["kind"] == "adamw":
                self._adamw(group)
            else:
                self._muon(group)

    def _adamw(self, group: dict) -> None:
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            adamw_update(p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"],
                         group["lr"], beta1, beta2, group["eps"], group["weight_decay"])

    def _muon(self, group: dict) -> None:
        params = group["params"]
        if any(p.grad is None for p in params):
            return
        rows, cols = params[0].shape
        state = self.state[params[0]]                        # group-level state
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros(len(params), rows, cols,
                                                   dtype=params[0].dtype)
        if "second_momentum_buffer" not in state:
            shape = (len(params), rows, 1) if rows >= cols else (len(params), 1, cols)
            state["second_momentum_buffer"] = torch.zeros(shape, dtype=params[0].dtype)
        red_dim = -1 if rows >= cols else -2
        stacked = torch.stack(list(params))                  # [K, rows, cols]
        muon_update(torch.stack([p.grad for p in params]), stacked, state["momentum_buffer"],
                    state["second_momentum_buffer"], group["momentum"],
                    group["lr"] * max(1.0, rows / cols) ** 0.5, group["weight_decay"],
                    group["beta2"], group["ns_steps"], red_dim, self.compute_dtype)
        torch._foreach_copy_(list(params), list(stacked.unbind(0)))


def nanochat_groups(model, *, unembedding_lr: float = 0.004, embedding_lr: float = 0.2,
                    matrix_lr: float = 0.02, weight_decay: float = 0.0,
                    scalar_lr: float = 0.5) -> list[dict]:
    """GPT.setup_optimizer's groups for an engine.models.nanochat.NanochatGPT: six AdamW
    groups (lm_head, wte, value embeddings, resid scalars, x0 scalars, smear/backout) with
    learning rates scaled by 1/sqrt(n_embd / 768), then one Muon group per matrix shape
    (sorted). Each group records `initial_lr` (what the schedule multiplies)."""
    dmodel_lr_scale = (model.config.n_embd / 768) ** -0.5
    matrices = list(model.transformer.h.parameters())
    groups = [
        dict(kind="adamw", params=list(model.lm_head.parameters()),
             lr=unembedding_lr * dmodel_lr_scale, betas=(0.8, 0.96), eps=1e-10,
             weight_decay=0.01),
        dict(kind="adamw", params=list(model.transformer.wte.parameters()),
             lr=embedding_lr * dmodel_lr_scale, betas=(0.8, 0.995), eps=1e-10,
             weight_decay=0.001),
        dict(kind="adamw", params=list(model.value_embeds.parameters()),
             lr=embedding_lr * dmodel_lr_scale * 0.5, betas=(0.8, 0.995), eps=1e-10,
             weight_decay=0.01),
        dict(kind="adamw", params=[model.resid_lambdas], lr=scalar_lr * 0.01,
             betas=(0.8, 0.95), eps=1e-10, weight_decay=0.05),
        dict(kind="adamw", params=[model.x0_lambdas], lr=scalar_lr, betas=(0.96, 0.95),
             eps=1e-10, weight_decay=0.0),
        dict(kind="adamw", params=[model.smear_gate.weight, model.smear_lambda,
                                   model.backout_lambda], lr=0.2, betas=(0.8, 0.95),
             eps=1e-10, weight_decay=0.0),
    ]
    for shape in sorted({p.shape for p in matrices}):
        groups.append(dict(kind="muon", params=[p for p in matrices if p.shape == shape],
                           lr=matrix_lr, momentum=0.95, ns_steps=5, beta2=0.9,
                           weight_decay=weight_decay))
    for group in groups:
        group["initial_lr"] = group["lr"]
    return groups


B_REF = 2 ** 19   # base_train.py: the optimal batch (tokens) of its reference model, d12


def scaling_params(config) -> int:
    """base_train.py's scaling parameter count, transformer matrices + lm_head, of an
    engine.models.nanochat.NanochatConfig (counted from the shapes, nothing allocated)."""
    from engine.models.nanochat import VE_GATE_CHANNELS, has_value_embedding
    C, kv = config.n_embd, config.n_kv_head * config.head_dim
    per_layer = 2 * C * C + 2 * kv * C + 8 * C * C                     # q, proj, k, v, mlp
    gates = sum(VE_GATE_CHANNELS * config.n_kv_head for i in range(config.n_layer)
                if has_value_embedding(i, config.n_layer))
    return config.n_layer * per_layer + gates + config.padded_vocab_size * C


@dataclass(frozen=True)
class NanochatHyper:
    """scripts/base_train.py's learning-rate, weight-decay and momentum derivation for a model
    trained `total_steps` steps of `total_batch_size` tokens (defaults are its CLI's)."""

    total_batch_size: int
    total_steps: int
    target_tokens: int                 # target_param_data_ratio * scaling params of the model
    ref_tokens: float                  # the same for d12 with this vocabulary
    embedding_lr: float = 0.3
    unembedding_lr: float = 0.008
    matrix_lr: float = 0.02
    scalar_lr: float = 0.5
    weight_decay: float = 0.28

    @classmethod
    def derive(cls, config, total_batch_size: int, total_steps: int,
               param_data_ratio: float = 12.0, **lrs) -> "NanochatHyper":
        from engine.models.nanochat import NanochatConfig
        d12 = NanochatConfig.for_depth(12, vocab_size=config.vocab_size,
                                       head_dim=config.head_dim,
                                       max_seq_len=config.sequence_len,
                                       window_pattern=config.window_pattern)
        return cls(total_batch_size, total_steps,
                   int(param_data_ratio * scaling_params(config)),
                   param_data_ratio * scaling_params(d12), **lrs)

    @property
    def batch_lr_scale(self) -> float:
        ratio = self.total_batch_size / B_REF
        return 1.0 if ratio == 1.0 else ratio ** 0.5

    @property
    def scaled_weight_decay(self) -> float:
        return self.weight_decay * math.sqrt(self.total_batch_size / B_REF) * \
            (self.ref_tokens / self.target_tokens)

    def groups(self, model) -> list[dict]:
        s = self.batch_lr_scale
        return nanochat_groups(model, unembedding_lr=self.unembedding_lr * s,
                               embedding_lr=self.embedding_lr * s, scalar_lr=self.scalar_lr * s,
                               matrix_lr=self.matrix_lr * s,
                               weight_decay=self.scaled_weight_decay)

    def muon_momentum(self, step: int, warmdown_ratio: float = 0.65) -> float:
        """0.85 -> 0.97 over the first 400 steps, down to 0.90 over the warmdown."""
        warmdown = round(warmdown_ratio * self.total_steps)
        start = self.total_steps - warmdown
        if step < 400:
            frac = step / 400
            return (1 - frac) * 0.85 + frac * 0.97
        if step >= start:
            progress = (step - start) / warmdown
            return 0.97 * (1 - progress) + 0.90 * progress
        return 0.97

    def muon_weight_decay(self, step: int) -> float:
        """Cosine decay of the scaled weight decay to zero over the run."""
        return self.scaled_weight_decay * 0.5 * (1 + math.cos(math.pi * step / self.total_steps))


def apply_schedule(optimizer: MuonAdamW, lr_multiplier: float, momentum: float,
                   weight_decay: float) -> None:
    """base_train.py's per-step update of the groups: lr = initial_lr * multiplier, and the
    Muon groups' momentum and weight decay."""
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] * lr_multiplier
        if group["kind"] == "muon":
            group["momentum"] = momentum
            group["weight_decay"] = weight_decay


def pretrain_optimizer(model, optim, tokens_per_step: int, total_steps: int) -> MuonAdamW:
    """lm-pretrain's `optim.kind = "muon"`: nanochat's groups with optim.lr as Muon's matrix
    rate, the section's AdamW rates and weight decay, batch-scaled as base_train does when
    `batch_lr_scaling`. Each group's `lr_ratio` is its share of the scheduled lr
    (engine.train.optim.set_lr)."""
    hyper = NanochatHyper.derive(model.config, tokens_per_step, total_steps,
                                 embedding_lr=optim.embedding_lr,
                                 unembedding_lr=optim.unembedding_lr, matrix_lr=optim.lr,
                                 scalar_lr=optim.scalar_lr, weight_decay=optim.weight_decay)
    if not optim.batch_lr_scaling:
        hyper = NanochatHyper(B_REF, total_steps, 1, 1.0, embedding_lr=optim.embedding_lr,
                              unembedding_lr=optim.unembedding_lr, matrix_lr=optim.lr,
                              scalar_lr=optim.scalar_lr, weight_decay=optim.weight_decay)
    optimizer = MuonAdamW(hyper.groups(model), compute_dtype=model.compute_dtype)
    optimizer.hyper = hyper
    for group in optimizer.param_groups:
        group["lr_ratio"] = group["initial_lr"] / optim.lr
    return optimizer


def schedule_muon(optimizer: MuonAdamW, step: int) -> None:
    """base_train's per-step Muon momentum and weight decay (the rates follow the loop's
    schedule through lr_ratio)."""
    hyper = optimizer.hyper
    for group in optimizer.param_groups:
        if group["kind"] == "muon":
            group["momentum"] = hyper.muon_momentum(step)
            group["weight_decay"] = hyper.muon_weight_decay(step)
