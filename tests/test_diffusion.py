"""DDPM schedule, posterior and sampler checked against closed-form Gaussian results."""

import math

import pytest
import torch

from engine.diffusion import (
    EMA,
    Schedule,
    ancestral_sample,
    cosine_betas,
    denoising_loss,
    drop_labels,
    guided_eps,
    min_snr_weights,
)
from engine.models.diffusion import AUDIO_8192, IMAGE_32, DenoisingUNet, UNetConfig


def test_cosine_schedule_follows_its_definition():
    T, s = 256, 0.008
    sched = Schedule(T)
    f = [math.cos((t / T + s) / (1 + s) * math.pi / 2) ** 2 for t in range(T + 1)]
    unclipped = cosine_betas(T) < 0.999
    expected = torch.tensor([f[t + 1] / f[0] for t in range(T)], dtype=torch.float64)
    assert torch.allclose(sched.alpha_bar[unclipped], expected[unclipped], rtol=1e-9)
    assert (sched.alpha_bar[1:] < sched.alpha_bar[:-1]).all()
    assert sched.alpha_bar[0] > 0.999 and sched.alpha_bar[-1] < 1e-4
    assert sched.betas.max() <= 0.999


def test_posterior_coefficients_match_bayes_rule():
    sched = Schedule(64)
    for i in (1, 10, 40, 63):
        prev, beta = sched.alpha_bar_prev[i], sched.betas[i]
        # Gaussian product: prior x_{t-1}|x0 ~ N(√prev·x0, 1−prev), likelihood x_t|x_{t-1}.
        var = 1 / (1 / (1 - prev) + (1 - beta) / beta)
        assert sched.posterior_var[i] == pytest.approx(float(var), rel=1e-9)
        assert sched.coef_x0[i] == pytest.approx(float(var * prev.sqrt() / (1 - prev)), rel=1e-9)
        assert sched.coef_xt[i] == pytest.approx(float(var * (1 - beta).sqrt() / beta), rel=1e-9)


def test_respaced_schedule_keeps_the_trained_noise_levels():
    full, fast = Schedule(256), Schedule(256, sample_steps=32)
    assert len(fast.timesteps) == 32 and fast.timesteps[-1] == 255
    assert torch.allclose(fast.alpha_bar, full.alpha_bar[fast.timesteps])
    assert torch.allclose(torch.cumprod(1 - fast.betas, 0), fast.alpha_bar)


def test_q_sample_has_the_right_marginal():
    sched = Schedule(100)
    x0 = torch.full((200_000,), 0.7, dtype=torch.float64)
    t = torch.full((200_000,), 50)
    x = sched.q_sample(x0, t, torch.randn(200_000, dtype=torch.float64))
    a = float(sched.alpha_bar[50])
    assert float(x.mean()) == pytest.approx(math.sqrt(a) * 0.7, abs=0.01)
    assert float(x.var()) == pytest.approx(1 - a, rel=0.02)


# Ancestral sampling plugs in E[x0 | x_t] and drops its uncertainty, so coarser (respaced)
# schedules lose a little variance: measured std 0.194 at 256 steps, 0.181 at 64.
@pytest.mark.parametrize("steps, sd_tolerance", [(None, 0.01), (64, 0.025)])
def test_sampler_with_the_exact_denoiser_recovers_the_data_distribution(steps, sd_tolerance):
    """For x0 ~ N(mu, s²) the optimal ε predictor is closed-form; sampling must give N(mu, s²)."""
    mu, sd, T = 0.3, 0.2, 256
    train = Schedule(T)

    def exact_eps(x, t, labels):
        a = train.alpha_bar[t].view(-1, 1).float()
        return (1 - a).sqrt() * (x - a.sqrt() * mu) / (a * sd ** 2 + 1 - a)

    gen = torch.Generator().manual_seed(0)
    x = ancestral_sample(exact_eps, Schedule(T, steps), (20_000, 1), torch.zeros(20_000).long(),
                         null_label=1, cfg=1.0, generator=gen, clip=None)
    assert float(x.mean()) == pytest.approx(mu, abs=0.01)
    assert float(x.std()) == pytest.approx(sd, abs=sd_tolerance)


def test_guidance_formula():
    def model(x, t, labels):
        return torch.where(labels.view(-1, 1) == 2, torch.zeros_like(x), torch.ones_like(x))

    x, t, labels = torch.zeros(3, 1), torch.zeros(3).long(), torch.zeros(3).long()
    assert torch.equal(guided_eps(model, x, t, labels, 2, 1.0), torch.ones(3, 1))
    # uncond 0, cond 1: 0 + 3 (1 - 0) = 3
    assert torch.equal(guided_eps(model, x, t, labels, 2, 3.0), torch.full((3, 1), 3.0))


def test_condition_dropout_rate_and_ema_update():
    gen = torch.Generator().manual_seed(0)
    dropped = drop_labels(torch.zeros(100_000).long(), 3, 0.1, gen)
    assert float((dropped == 3).float().mean()) == pytest.approx(0.1, abs=0.005)
    model = torch.nn.Linear(2, 2)
    ema = EMA(model, 0.999)
    before = {k: v.clone() for k, v in ema.params.items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update(model)
    expected = 0.999 * before["weight"] + 0.001 * model.weight.detach()
    assert torch.allclose(ema.params["weight"], expected)


def test_min_snr_weights_follow_their_definition():
    # SNR from the cosine formula itself: alpha_bar(t) = f(t + 1) / f(0) (0-based levels)
    T, s, gamma = 256, 0.008, 5.0

    def snr(t: int) -> float:
        f = [math.cos((u / T + s) / (1 + s) * math.pi / 2) ** 2 for u in (0, t + 1)]
        a = f[1] / f[0]
        return a / (1 - a)

    levels = torch.tensor([0, 20, 66, 67, 128, 255])
    weights = min_snr_weights(Schedule(T), levels, gamma)
    expected = [min(snr(t), gamma) / snr(t) for t in levels.tolist()]
    assert weights.tolist() == pytest.approx(expected, rel=1e-6)
    # worked numbers: level 0 is nearly clean (SNR 5295, weight 5 / 5295 = 9.4e-4); from
    # level 67 on (SNR 4.85 < 5) the weight is 1, a quarter of the levels weigh less
    assert snr(0) == pytest.approx(5294.86, rel=1e-5) and snr(66) > gamma > snr(67)
    assert weights[0] == pytest.approx(9.443e-4, rel=1e-3)
    assert weights[2] < 1 and (weights[3:] == 1).all()


def test_min_snr_loss_weights_each_example_by_its_level():
    """With clean images of zeros, x_t = √(1 − ᾱ) ε, so the drawn noise is read back from what
    the model saw; a model predicting zeros then has per-example MSE mean(ε²)."""
    sched, seen = Schedule(64), {}

    def model(x_t, t, labels):
        seen.update(x_t=x_t, t=t)
        return torch.zeros_like(x_t)

    x0, labels = torch.zeros(16, 3, 4, 4), torch.zeros(16).long()

    def loss(gamma):
        value = denoising_loss(model, sched, x0, labels, 3, 0.0,
                               torch.Generator().manual_seed(0), min_snr_gamma=gamma)
        a = sched.alpha_bar[seen["t"]].float().view(-1, 1, 1, 1)
        per_example = (seen["x_t"] / (1 - a).sqrt()).pow(2).mean(dim=(1, 2, 3))
        return float(value), per_example, seen["t"]

    plain, per_example, t = loss(None)
    assert plain == pytest.approx(float(per_example.mean()), rel=1e-5)
    weighted, per_example, t = loss(5.0)
    a = sched.alpha_bar[t]
    snr = a / (1 - a)
    expected = float((torch.clamp(snr, max=5.0) / snr * per_example.double()).mean())
    assert weighted == pytest.approx(expected, rel=1e-5)
    assert weighted < plain        # the twin: weighting is not a no-op on these levels


@pytest.mark.parametrize("preset, shape", [(IMAGE_32, (2, 3, 32, 32)), (AUDIO_8192, (2, 1, 8192))])
def test_unets_predict_noise_of_the_input_shape_and_use_the_class(preset, shape):
    torch.manual_seed(0)
    net = DenoisingUNet(UNetConfig(num_classes=3, **preset))
    torch.nn.init.normal_(net.head[-1].weight, std=0.1)
    x, t = torch.randn(shape), torch.tensor([5, 200])
    out_a = net(x, t, torch.tensor([0, 1]))
    out_b = net(x, t, torch.tensor([3, 3]))   # the null class
    assert out_a.shape == shape
    assert not torch.allclose(out_a, out_b)


def reference_attention(block, x: torch.Tensor) -> torch.Tensor:
    """Multi-head self-attention written out from its definition (softmax(QKᵀ/√d)·V per head,
    heads concatenated, then the output projection), with the block's own weights."""
    b, c = x.shape[:2]
    heads = block.attn.num_heads
    tokens = block.norm(x).flatten(2).transpose(1, 2)                        # [B, N, C]
    q, k, v = (tokens @ w.T + bias for w, bias in zip(block.attn.in_proj_weight.chunk(3),
                                                     block.attn.in_proj_bias.chunk(3)))
    split = lambda t: t.reshape(b, -1, heads, c // heads).transpose(1, 2)  # noqa: E731
    q, k, v = split(q), split(k), split(v)                                   # [B, H, N, d]
    weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(c // heads), dim=-1)
    out = (weights @ v).transpose(1, 2).reshape(b, -1, c)
    out = out @ block.attn.out_proj.weight.T + block.attn.out_proj.bias
    return x + out.transpose(1, 2).reshape(x.shape)


def test_self_attention_block_follows_its_definition_and_starts_as_the_identity():
    from engine.models.diffusion import SelfAttention

    torch.manual_seed(0)
    block = SelfAttention(16, heads=4)
    x = torch.randn(2, 16, 4, 4)
    assert torch.equal(block(x), x)            # zero output projection: the identity at first
    torch.nn.init.normal_(block.attn.out_proj.weight, std=0.3)
    with torch.no_grad():
        out, expected = block(x), reference_attention(block, x)
    assert torch.allclose(out, expected, atol=1e-5)
    # the twin: scaling the scores by 1/d instead of 1/√d is a different function, and seen
    block.attn.in_proj_weight.data[:16] /= math.sqrt(4)   # q scaled: as if divided by d
    with torch.no_grad():
        assert not torch.allclose(block(x), expected, atol=1e-3)


def test_unet_attention_is_off_by_default_and_adds_to_the_same_network_when_on():
    torch.manual_seed(0)
    plain = DenoisingUNet(UNetConfig(num_classes=3, **IMAGE_32))
    # off by default: the parameters of a checkpoint made before the option existed
    assert plain.state_dict().keys() == \
        DenoisingUNet(UNetConfig(num_classes=3, **IMAGE_32, attention=False)).state_dict().keys()
    assert not any("attention" in name for name in plain.state_dict())
    torch.nn.init.normal_(plain.head[-1].weight, std=0.1)
    net = DenoisingUNet(UNetConfig(num_classes=3, **IMAGE_32, attention=True))
    missing, unexpected = net.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and missing and all("attention" in name for name in missing)
    assert net.low_attention.norm.num_channels == IMAGE_32["channels"][-1]
    x, t, labels = torch.randn(2, 3, 32, 32), torch.tensor([5, 200]), torch.tensor([0, 1])
    with torch.no_grad():
        # its attention blocks start as the identity: the same function as the plain network
        assert torch.allclose(net(x, t, labels), plain(x, t, labels), atol=1e-6)
        # the twin: once an attention block has learned something, the function differs
        torch.nn.init.normal_(net.middle_attention.attn.out_proj.weight, std=0.1)
        assert not torch.allclose(net(x, t, labels), plain(x, t, labels), atol=1e-4)
