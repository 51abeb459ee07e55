"""RMSNorm's training path (a fused backward) against finite differences and against autograd
through the plain formula; its forward is the inference path's, bit for bit."""

from __future__ import annotations

import torch

from engine.models.blocks import RMSNorm


def _plain(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def test_backward_matches_finite_differences():
    norm = RMSNorm(6, 1e-5).double()
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(norm, (x,))


def test_forward_is_the_inference_forward_and_gradients_match_autograd():
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(5, 7, 64)
    with torch.no_grad():
        inference = norm(x)
    xg = x.clone().requires_grad_()
    trained = norm(xg)
    assert torch.equal(trained.detach(), inference)
    dy = torch.randn_like(x)
    dx, dw = torch.autograd.grad(trained, (xg, norm.weight), dy)
    xr, wr = x.clone().requires_grad_(), norm.weight.detach().clone().requires_grad_()
    ref_dx, ref_dw = torch.autograd.grad(_plain(xr, wr, 1e-6), (xr, wr), dy)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw, ref_dw, rtol=1e-5, atol=1e-5)


def test_a_frozen_weight_gets_no_gradient_and_bf16_inputs_stay_bf16():
    norm = RMSNorm(16, 1e-6)
    norm.weight.requires_grad_(False)
    x = torch.randn(3, 16, dtype=torch.bfloat16, requires_grad=True)
    y = norm(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.bfloat16 and norm.weight.grad is None
