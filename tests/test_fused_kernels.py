"""The training step's fused passes (engine/kernels/train_kernels.c through fused.py) against an
independent reference: the same formulas in f64 by torch's ops, rounded once to the result's
dtype. Each check has a twin showing that its tolerance rejects a plausible slip, and the modules
that use the passes (RMSNorm, the gated MLP, the fused LM-head loss) are held to torch's own op
chains, which run where the library cannot be built."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import fused, native
from engine.models.blocks import RMSNorm, apply_rope, gated_activation, rope_heads, rope_tables
from engine.models.lm_head_loss import linear_cross_entropy

pytestmark = pytest.mark.skipif(fused.train_kernels() is None,
                                reason="no C compiler (or not x86 with AVX2) to build "
                                       "train_kernels.c; torch's ops run instead")

DTYPES = [torch.float32, torch.bfloat16]


@functools.cache
def avx2_build():
    """train_kernels.c built for AVX2 alone (8 lanes), as an AVX2-only CPU builds it."""
    return native.build_train_kernels("avx2")


@pytest.fixture(autouse=True, params=["native", "avx2"])
def build(request, monkeypatch):
    """Every check runs on this machine's build and on the AVX2 one: where the CPU has AVX-512
    they are different code (16 lanes against 8), and both must hold."""
    if request.param == "avx2":
        if avx2_build() is None:
            pytest.skip("the AVX2 build of train_kernels.c failed (no -march=x86-64-v3)")
        monkeypatch.setattr(fused, "train_kernels", avx2_build)
    return request.param


def within_one_rounding(got: torch.Tensor, reference: torch.Tensor, f32_rtol: float) -> bool:
    """got (f32 or bf16) is the f64 reference to within f32_rtol (f32), or to within one bf16
    step of the reference's own bf16 rounding (bf16: 2^-8 relative, plus f32_rtol)."""
    rtol = f32_rtol if got.dtype == torch.float32 else 2.0 ** -8 + f32_rtol
    scale = reference.abs().amax().item()
    return bool(((got.double() - reference).abs() <= rtol * reference.abs() + 1e-6 * scale).all())


def softmax_reference(z, m, s):
    zr, mr = z.double(), m.double()
    m_new = torch.maximum(mr, zr.amax(1, keepdim=True))
    p = (zr - m_new).exp()
    return m_new, torch.exp(mr - m_new), p, s.double() * torch.exp(mr - m_new) + p.sum(1, True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("columns", [16384, 1000, 13])
def test_softmax_chunk_against_f64(dtype, columns):
    torch.manual_seed(0)
    z = (torch.randn(9, columns) * 6).to(dtype)
    m = torch.tensor([[-torch.inf], [2.0], [30.0], *[[0.5]] * 6])     # first chunk, lower, higher
    s = torch.rand(9, 1) * 3
    s[0] = 0.0
    m_new, rescale_ref, p_ref, s_ref = softmax_reference(z, m, s)
    zc, mc, sc = z.clone(), m.clone(), s.clone()
    rescale = fused.softmax_chunk(zc, mc, sc)
    assert torch.equal(mc.double(), m_new)                  # a max is exact
    assert within_one_rounding(zc, p_ref, 4e-7)
    torch.testing.assert_close(rescale.double(), rescale_ref, rtol=4e-7, atol=0)
    torch.testing.assert_close(sc.double(), s_ref, rtol=2e-6, atol=0)
    # twin: the same tolerance rejects probabilities taken against the max before this chunk
    stale = (z.double() - m.double()).exp()
    assert not within_one_rounding(stale.to(dtype), p_ref, 4e-7)


def test_softmax_chunk_keeps_nan_and_gives_exact_zeros():
    z = torch.tensor([[0.0, -torch.inf, 1.0, float("nan")], [0.0, -200.0, -torch.inf, 5.0]])
    m, s = torch.full((2, 1), -torch.inf), torch.zeros(2, 1)
    fused.softmax_chunk(z, m, s)
    assert torch.isnan(m[0]) and torch.isnan(s[0])        # a NaN logit is never swallowed
    assert z[1, 1] == 0.0 and z[1, 2] == 0.0 and z[1, 3] == 1.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [640, 37])
def test_rms_norm_forward_and_backward_against_f64(dtype, n):
    torch.manual_seed(1)
    x = (torch.randn(3, 11, n) * 3).to(dtype)
    weight, dy = torch.rand(n) + 0.5, torch.randn(3, 11, n).to(dtype)
    xr = x.double().requires_grad_()
    wr = weight.double().requires_grad_()
    y_ref = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6) * wr
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (xr, wr), dy.double())
    y, rstd = fused.rms_norm(x, weight, 1e-6)
    dx, dw = fused.rms_norm_backward(x, rstd, weight, dy, want_dw=True)
    assert y.dtype == dx.dtype == dtype and dw.dtype == torch.float32
    assert within_one_rounding(y, y_ref.detach(), 2e-6)
    assert within_one_rounding(dx, dx_ref, 4e-6)
    torch.testing.assert_close(dw.double(), dw_ref, rtol=1e-5, atol=1e-5)
    assert fused.rms_norm_backward(x, rstd, weight, dy, want_dw=False)[1] is None
    # twin: forgetting the mean term of dx is far outside the tolerance
    assert not within_one_rounding((dy.double() * weight.double() * rstd.double()).to(dtype),
                                   dx_ref, 4e-6)


def test_rms_norm_rows_do_not_depend_on_the_batch():
    torch.manual_seed(2)
    x, weight = torch.randn(40, 640).bfloat16(), torch.rand(640)
    whole, _ = fused.rms_norm(x, weight, 1e-6)
    part, _ = fused.rms_norm(x[7:12].contiguous(), weight, 1e-6)
    assert torch.equal(whole[7:12], part)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_activation_forward_and_backward_against_f64(dtype, activation):
    torch.manual_seed(3)
    gate = (torch.randn(7, 2051) * 4).to(dtype)
    up, d_out = torch.randn(7, 2051).to(dtype), torch.randn(7, 2051).to(dtype)
    g, u = gate.double().requires_grad_(), up.double().requires_grad_()
    act = F.silu(g) if activation == "silu" else F.gelu(g, approximate="tanh")
    out_ref = act * u
    dg_ref, du_ref = torch.autograd.grad(out_ref, (g, u), d_out.double())
    out = fused.gated_activation(gate, up, activation)
    dg, du = fused.gated_activation_backward(gate, up, d_out, activation)
    assert within_one_rounding(out, out_ref.detach(), 4e-6)
    assert within_one_rounding(dg, dg_ref, 1e-5)
    assert within_one_rounding(du, du_ref, 4e-6)
    # twin: erf-GELU in place of tanh-GELU differs by more than the tolerance
    if activation == "gelu_tanh":
        assert not within_one_rounding((F.gelu(g) * u).detach().to(dtype), out_ref.detach(), 4e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope_type", ["neox", "norm"])
def test_rope_with_the_heads_transpose_against_f64(dtype, rope_type):
    torch.manual_seed(6)
    x = torch.randn(2, 9, 3, 40).to(dtype)                              # [B, T, H, hd]
    cos, sin = rope_tables(torch.arange(9) + 5, 40, 10000.0)
    g = torch.randn(2, 3, 9, 40)                                         # d out [B, H, T, hd]
    xr = x.double().requires_grad_()
    ref = apply_rope(xr.transpose(1, 2), cos.double(), sin.double(), rope_type) * 0.125
    (dx_ref,) = torch.autograd.grad(ref, xr, g.double())
    xs = x.clone().requires_grad_()
    out = rope_heads(xs, cos, sin, rope_type, 0.125)
    (dx,) = torch.autograd.grad(out, xs, g)
    assert out.shape == (2, 3, 9, 40) and out.dtype == torch.float32 and dx.dtype == dtype
    assert out.grad_fn.name().endswith("_RopeBackward")                # the fused pass ran
    assert within_one_rounding(out, ref.detach(), 2e-6)
    assert within_one_rounding(dx, dx_ref, 2e-6)
    # twin: the other pairing of a head's values is far outside the tolerance
    other = "norm" if rope_type == "neox" else "neox"
    swapped = apply_rope(x.double().transpose(1, 2), cos.double(), sin.double(), other) * 0.125
    assert not within_one_rounding(swapped.float(), ref.detach(), 2e-6)


def without_kernels(monkeypatch):
    """Make the fused passes look unbuilt: the modules take torch's op chains."""
    monkeypatch.setattr(fused, "train_kernels", lambda: None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_modules_agree_with_their_torch_op_chains(dtype, monkeypatch):
    torch.manual_seed(4)
    norm = RMSNorm(64, 1e-6)
    torch.nn.init.normal_(norm.weight, 1.0, 0.2)
    x = torch.randn(2, 9, 64).to(dtype)
    gate, up = torch.randn(2, 9, 128).to(dtype), torch.randn(2, 9, 128).to(dtype)

    def run():
        xs, gs, us = (t.clone().requires_grad_() for t in (x, gate, up))
        y = norm(xs)
        out = gated_activation(gs, us, "gelu_tanh")
        (y.float().square().sum() + out.float().square().sum()).backward()
        grads = [t.grad for t in (xs, gs, us)] + [norm.weight.grad.clone()]
        norm.weight.grad = None
        return [y.detach(), out.detach(), *grads]

    with_kernels = run()
    without_kernels(monkeypatch)
    reference = run()
    for got, ref in zip(with_kernels, reference):
        assert got.dtype == ref.dtype
        rtol = 2e-5 if dtype == torch.float32 else 2 ** -6
        torch.testing.assert_close(got.float(), ref.float(), rtol=rtol, atol=rtol * ref.abs().max())


def test_the_fused_head_loss_matches_f64_as_closely_as_its_torch_chain(monkeypatch):
    torch.manual_seed(5)
    h = torch.randn(6, 32, requires_grad=True)
    weight, targets = torch.randn(1000, 32), torch.randint(0, 1000, (6,))
    reference = F.cross_entropy(h.double() @ weight.double().T, targets, reduction="sum")
    (dh_ref,) = torch.autograd.grad(reference, h)

    def loss_and_dh():
        loss = linear_cross_entropy(h, weight, targets)
        return loss, torch.autograd.grad(loss, h)[0]

    fused_pass = loss_and_dh()
    without_kernels(monkeypatch)
    for loss, dh in (fused_pass, loss_and_dh()):
        torch.testing.assert_close(loss.double(), reference, rtol=1e-6, atol=0)
        torch.testing.assert_close(dh, dh_ref, rtol=1e-5, atol=1e-5 * dh_ref.abs().max().item())
