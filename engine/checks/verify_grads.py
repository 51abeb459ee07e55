"""`forgebench verify-grads`: evidence that the LoRA gradient path is right, not merely descending.

Four independent angles, the battery an adapter runtime must pass:

1. a rank-1 worked example with hand-computed numbers (`worked_example`), reproduced through
   `engine.lora.LoRALinear` and the engine's AdamW — losses, dA, dB, dX and updated factors;
2. zero-structure at init: with B == 0, dL/dA is exactly zero and every dL/dB is not;
3. central finite differences through the full SFT loss (masking included) over sampled adapter
   elements after a warm-up that makes B != 0, in f64 on a tiny model;
4. frozen base: base weights never receive a gradient and their bytes (packed GGUF blocks
   included) are unchanged by training.

On an lm-sft config or run, 2-4 run on that base and data, and a fifth check compares the
packed model's f32 backward (W re-dequantized for dx) with the f64 dequantized model's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ForgebenchError
from engine.lora import LoRALinear, attach_lora, lora_parameters
from engine.train.loss import IGNORE, supervised_loss
from engine.train.optim import build_adamw

# Seed 004, "Actual output from the CPU run" (rank 1, alpha 1, AdamW lr 0.01, betas
# (0.9, 0.999), eps 1e-8, no decay), in row-vector convention: X [1,2] · A [2,1] · B [1,2].
WORKED_EXAMPLE = {
    1: {"loss_before": 0.616344, "dA": [0.0, 0.0], "dB": [-0.138026, 0.138026],
        "dX": [0.506094, -0.289854], "A_after": [0.1, -0.2], "B_after": [0.01, -0.01],
        "loss_after": 0.613588},
    2: {"loss_before": 0.613588, "dA": [0.009172, 0.018344], "dB": [-0.137579, 0.137579],
        "dX": [0.505372, -0.290749], "A_after": [0.092559, -0.207441],
        "B_after": [0.019999, -0.019999], "loss_after": 0.610433},
}
FD_COSINE_MIN = 0.9999
FD_RTOL, FD_ATOL = 1e-4, 1e-8  # per element, f64 central differences with eps 1e-6


def _rounded(t: torch.Tensor) -> list[float]:
    return [round(v, 6) + 0.0 for v in t.detach().flatten().tolist()]  # + 0.0 folds -0.0


def worked_example() -> dict:
    """Two AdamW steps of a rank-1 example with known numbers through the engine's LoRA layer.

    The example's row-vector factors map onto the layer's torch layout as lora_a = Aᵀ [r, in]
    and lora_b = Bᵀ [out, r]; W is the frozen base, an nn.Linear holding Wᵀ.
    """
    dtype = torch.float64
    base = nn.Linear(2, 2, bias=False, dtype=dtype)
    with torch.no_grad():
        base.weight.copy_(torch.tensor([[0.63, -0.47], [0.28, 0.91]], dtype=dtype).T)
    layer = LoRALinear(base, rank=1, alpha=1.0, dtype=dtype, target="o")
    with torch.no_grad():
        layer.lora_a.copy_(torch.tensor([[0.1, -0.2]], dtype=dtype))
    frozen = base.weight.detach().clone()
    x = torch.tensor([[1.0, 2.0]], dtype=dtype, requires_grad=True)
    target = torch.tensor([1])
    optimizer = build_adamw([("lora_a", layer.lora_a), ("lora_b", layer.lora_b)], lr=0.01,
                            weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    steps = {}
    for step in (1, 2):
        optimizer.zero_grad(set_to_none=True)
        x.grad = None
        loss = F.cross_entropy(layer(x), target)
        loss.backward()
        record = {"loss_before": round(loss.item(), 6), "dA": _rounded(layer.lora_a.grad),
                  "dB": _rounded(layer.lora_b.grad), "dX": _rounded(x.grad),
                  "base_grad_is_none": base.weight.grad is None}
        optimizer.step()
        with torch.no_grad():
            after = F.cross_entropy(layer(x), target)
        record.update(A_after=_rounded(layer.lora_a), B_after=_rounded(layer.lora_b),
                      loss_after=round(after.item(), 6),
                      W_unchanged=bool(torch.equal(base.weight, frozen)))
        steps[step] = record
    mismatches = [f"step {s} {k}: got {steps[s][k]}, article prints {v}"
                  for s, expected in WORKED_EXAMPLE.items() for k, v in expected.items()
                  if steps[s][k] != v]
    mismatches += [f"step {s}: base weight changed or got a gradient" for s in steps
                   if not (steps[s]["W_unchanged"] and steps[s]["base_grad_is_none"])]
    return {"check": "worked-example", "passed": not mismatches, "steps": steps,
            "mismatches": mismatches}


# -- full-model checks ---------------------------------------------------------------------
@dataclass
class Batch:
    """One or more SFT samples: inputs [T] and labels [T] (IGNORE = not supervised)."""

    samples: list[tuple[torch.Tensor, torch.Tensor]]

    def loss(self, model: nn.Module) -> torch.Tensor:
        """Token-weighted mean CE over the batch: summed CE / total supervised tokens."""
        total = sum(int((labels != IGNORE).sum()) for _, labels in self.samples)
        summed = sum(supervised_loss(model, inputs, labels) for inputs, labels in self.samples)
        return summed / total


def base_fingerprint(model: nn.Module) -> str:
    """SHA-256 over the bytes of every non-adapter tensor: parameters, buffers, and the packed
    GGUF blocks (and dense caches) of frozen quantized weights."""
    tensors = {name: t for name, t in model.state_dict(keep_vars=True).items()
               if ".lora_a" not in name and ".lora_b" not in name}
    for name, module in model.named_modules():
        raw = getattr(getattr(module, "weight", None), "raw", None)
        if isinstance(raw, torch.Tensor):
            tensors[f"{name}.weight.raw"] = raw
            if module.weight.dense is not None:
                tensors[f"{name}.weight.dense"] = module.weight.dense
    digest = hashlib.sha256()
    for name, tensor in sorted(tensors.items()):
        digest.update(name.encode())
        data = tensor.detach().contiguous().cpu()
        digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


def base_grads(model: nn.Module) -> list[str]:
    """Names of non-adapter parameters that require or hold a gradient (should be none)."""
    return [name for name, p in model.named_parameters()
            if ".lora_" not in name and (p.requires_grad or p.grad is not None)]


def zero_structure(model: nn.Module, adapters: dict[str, LoRALinear], batch: Batch) -> dict:
    """With every B == 0: dL/dA must be exactly zero, and each dL/dB must be non-zero."""
    if any(bool(a.lora_b.detach().abs().max() > 0) for a in adapters.values()):
        raise ValueError("zero-structure needs freshly initialised adapters (B == 0)")
    model.zero_grad(set_to_none=True)
    batch.loss(model).backward()
    nonzero_a = [n for n, a in adapters.items() if torch.count_nonzero(a.lora_a.grad) > 0]
    zero_b = [n for n, a in adapters.items() if torch.count_nonzero(a.lora_b.grad) == 0]
    model.zero_grad(set_to_none=True)
    return {"check": "zero-structure", "passed": not nonzero_a and not zero_b,
            "adapters": len(adapters), "nonzero_dA": nonzero_a, "zero_dB": zero_b}


def finite_differences(model: nn.Module, adapters: dict[str, LoRALinear], batch: Batch, *,
                       samples: int = 24, eps: float = 1e-6, seed: int = 0) -> dict:
    """Central differences of the full loss vs autograd over sampled A and B elements."""
    params = lora_parameters(adapters)
    names = [f"{n}.{k}" for n in adapters for k in ("lora_a", "lora_b")]
    if any(bool(a.lora_b.detach().abs().max() == 0) for a in adapters.values()):
        raise ValueError("finite differences need B != 0 (warm the adapters up first)")
    model.zero_grad(set_to_none=True)
    batch.loss(model).backward()
    analytic_all = [p.grad.detach().clone() for p in params]
    model.zero_grad(set_to_none=True)
    generator = torch.Generator().manual_seed(seed)
    analytic, numeric, where = [], [], []
    for i in range(samples):
        index = i % len(params) if i < len(params) else int(
            torch.randint(len(params), (1,), generator=generator))
        param = params[index]
        flat = int(torch.randint(param.numel(), (1,), generator=generator))
        with torch.no_grad():
            original = param.view(-1)[flat].item()
            param.view(-1)[flat] = original + eps
            plus = batch.loss(model).item()
            param.view(-1)[flat] = original - eps
            minus = batch.loss(model).item()
            param.view(-1)[flat] = original
        numeric.append((plus - minus) / (2 * eps))
        analytic.append(analytic_all[index].view(-1)[flat].item())
        where.append(f"{names[index]}[{flat}]")
    a, n = torch.tensor(analytic, dtype=torch.float64), torch.tensor(numeric, dtype=torch.float64)
    cosine = float(F.cosine_similarity(a, n, dim=0)) if a.norm() > 0 and n.norm() > 0 else 0.0
    # Cosine alone is dominated by the largest elements; every element must also agree.
    deviation = (a - n).abs()
    tolerance = FD_ATOL + FD_RTOL * n.abs()
    worst = int((deviation / tolerance).argmax())
    within = bool((deviation <= tolerance).all())
    return {"check": "finite-differences", "passed": cosine >= FD_COSINE_MIN and within,
            "cosine": cosine, "threshold": FD_COSINE_MIN, "elements": samples, "eps": eps,
            "elements_within_tolerance": int((deviation <= tolerance).sum()),
            "rtol": FD_RTOL, "atol": FD_ATOL, "max_abs_dev": float(deviation.max()),
            "worst_element": where[worst],
            "worst": {"analytic": analytic[worst], "numeric": numeric[worst]}}


def warm_up(model: nn.Module, adapters: dict[str, LoRALinear], batch: Batch, *,
            steps: int = 2, lr: float = 1e-2) -> dict:
    """A few AdamW steps so B != 0 (A-gradients live), checking the base stays frozen."""
    before = base_fingerprint(model)
    optimizer = build_adamw([(n, p) for n, p in model.named_parameters() if p.requires_grad],
                            lr=lr, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = batch.loss(model)
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
    grads = base_grads(model)
    optimizer.zero_grad(set_to_none=True)
    unchanged = base_fingerprint(model) == before
    trainable = {id(p) for p in lora_parameters(adapters)}
    extra = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in trainable]
    return {"check": "frozen-base", "passed": unchanged and not grads and not extra,
            "base_bytes_unchanged": unchanged, "base_params_with_grad": grads,
            "non_adapter_trainables": extra, "warmup_losses": losses}


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float64):
    """A small random Llama with LoRA on all seven projections (non-unit scale) and a batch.

    Two samples of different lengths with masked prompts, like real SFT data.
    """
    from engine.models.llama import Llama, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                         max_seq_len=64, tie_embeddings=False)
    model = Llama(config).to(dtype)
    adapters = attach_lora(model, targets=("q", "k", "v", "o", "gate", "up", "down"), rank=4,
                           alpha=6.0, seed=seed, dtype=dtype)
    generator = torch.Generator().manual_seed(seed + 1)
    samples = []
    for length, prompt in ((23, 9), (17, 5)):
        tokens = torch.randint(config.vocab_size, (length + 1,), generator=generator)
        labels = tokens[1:].clone()
        labels[:prompt - 1] = IGNORE
        samples.append((tokens[:-1], labels))
    return model, adapters, Batch(samples)


def verify_tiny(samples: int = 24, seed: int = 0) -> list[dict]:
    """The built-in battery: worked example, zero-structure, frozen base, f64 finite differences."""
    model, adapters, batch = tiny_model(seed)
    results = [worked_example(), zero_structure(model, adapters, batch)]
    results.append(warm_up(model, adapters, batch))
    results.append(finite_differences(model, adapters, batch, samples=samples, seed=seed))
    return results


def verify_config(config, samples: int = 24) -> list[dict]:
    """The battery on an lm-sft config's base and data (first two samples, dropout off).

    Zero-structure, frozen base and a warm-up run on the model as trained (packed weights,
    f32). Finite differences need f64, so they run on an f64 copy whose frozen weights are the
    dequantized blocks (the same reconstructed operator); the packed model's f32 backward
    (which re-dequantizes W for dx) is then compared with that f64 gradient.
    """
    from engine.models.gguf_model import densify
    from engine.recipes import lm_sft
    from engine.train.lm_base import load_base

    def prepared(dtype: torch.dtype):
        base = load_base(config)
        encoded, _ = lm_sft.encode_samples(config, base)
        if dtype == torch.float64:
            densify(base.model, base.path, quantized_ok=True)
            base.model.double()
        lora = config.lora
        adapters = attach_lora(base.model, targets=lora.targets, rank=lora.rank,
                               alpha=lora.alpha, seed=config.seed, dtype=dtype)
        base.model.eval()
        batch = Batch([(torch.tensor(s.input_ids), torch.tensor(s.labels)) for s in encoded[:2]])
        return base.model, adapters, batch

    model, adapters, batch = prepared(torch.float32)
    results = [zero_structure(model, adapters, batch),
               warm_up(model, adapters, batch, lr=max(config.optim.lr, 1e-2))]
    model.zero_grad(set_to_none=True)
    batch.loss(model).backward()
    packed_grads = [p.grad.detach().double() for p in lora_parameters(adapters)]

    model64, adapters64, batch64 = prepared(torch.float64)
    with torch.no_grad():
        for p64, p32 in zip(lora_parameters(adapters64), lora_parameters(adapters)):
            p64.copy_(p32)
    results.append(finite_differences(model64, adapters64, batch64, samples=samples,
                                      seed=config.seed))
    model64.zero_grad(set_to_none=True)
    batch64.loss(model64).backward()
    exact = torch.cat([p.grad.detach().flatten() for p in lora_parameters(adapters64)])
    packed = torch.cat([g.flatten() for g in packed_grads])
    cosine = float(F.cosine_similarity(exact, packed, dim=0))
    relative = float((exact - packed).norm() / exact.norm())
    results.append({"check": "packed-backward", "passed": cosine >= FD_COSINE_MIN,
                    "cosine": cosine, "relative_error": relative, "threshold": FD_COSINE_MIN,
                    "elements": int(exact.numel())})
    return results


def run_checks(target: str | None, samples: int = 24) -> list[dict]:
    """The battery for `forgebench verify-grads [TARGET]`.

    No target: the worked example and the f64 tiny model. An lm-sft config or run directory:
    the worked example, then zero-structure, frozen base and finite differences on that base
    and the first samples of that data.
    """
    if target is None:
        return verify_tiny(samples)
    from engine.config import load_config
    from engine.jobs import run_config
    from engine.rundir import RunDir

    path = Path(target)
    config = run_config(RunDir(path).require()) if path.is_dir() else load_config(path)
    if config.recipe != "lm-sft":
        raise ForgebenchError(f"verify-grads checks lm-sft configs, not '{config.recipe}'",
                              path=path, where="field 'recipe'")
    return [worked_example()] + verify_config(config, samples)


def format_results(results: list[dict]) -> str:
    lines = []
    for r in results:
        mark = "PASS" if r["passed"] else "FAIL"
        if r["check"] == "worked-example":
            s1, s2 = r["steps"][1], r["steps"][2]
            detail = (f"losses {s1['loss_before']:.6f} -> {s1['loss_after']:.6f} -> "
                      f"{s2['loss_after']:.6f}; step 2 dA {s2['dA']} dB {s2['dB']} dX {s2['dX']}")
        elif r["check"] == "zero-structure":
            detail = (f"{r['adapters']} adapters: dA == 0 exactly "
                      f"({len(r['nonzero_dA'])} violations), dB != 0 ({len(r['zero_dB'])} "
                      "violations)")
        elif r["check"] == "frozen-base":
            detail = (f"base bytes unchanged={r['base_bytes_unchanged']}, base params with grad="
                      f"{len(r['base_params_with_grad'])}, warm-up losses "
                      + ", ".join(f"{x:.6f}" for x in r["warmup_losses"]))
        elif r["check"] == "packed-backward":
            detail = (f"f32 packed-weight gradients vs the f64 dequantized model: cosine "
                      f"{r['cosine']:.8f}, relative error {r['relative_error']:.2e} over "
                      f"{r['elements']} elements")
        else:
            detail = (f"cosine {r['cosine']:.8f} (>= {r['threshold']}), "
                      f"{r['elements_within_tolerance']}/{r['elements']} elements within "
                      f"rtol {r['rtol']:g}, max |dev| {r['max_abs_dev']:.2e}, worst "
                      f"{r['worst_element']}")
        lines.append(f"{mark}  {r['check']:<20} {detail}")
    return "\n".join(lines)


def all_passed(results: list[dict]) -> bool:
    return all(r["passed"] for r in results)
