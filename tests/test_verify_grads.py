"""verify-grads: the rank-1 worked example, zero-structure, frozen base, finite differences."""

from __future__ import annotations

import pytest
import torch

from engine.checks import verify_grads as vg

torch.set_num_threads(1)


def test_worked_example_reproduces_the_article_printout():
    """Seed 004, 'Actual output from the CPU run', through the engine's LoRA layer and AdamW."""
    result = vg.worked_example()
    step1, step2 = result["steps"][1], result["steps"][2]
    assert [step1["loss_before"], step1["loss_after"], step2["loss_after"]] == \
        [0.616344, 0.613588, 0.610433]
    assert step1["dA"] == [0.0, 0.0]
    assert step1["dB"] == [-0.138026, 0.138026]
    assert step1["dX"] == [0.506094, -0.289854]
    assert step1["A_after"] == [0.1, -0.2] and step1["B_after"] == [0.01, -0.01]
    assert step2["dA"] == [0.009172, 0.018344]
    assert step2["dB"] == [-0.137579, 0.137579]
    assert step2["dX"] == [0.505372, -0.290749]
    assert step2["A_after"] == [0.092559, -0.207441]
    assert step2["B_after"] == [0.019999, -0.019999]
    assert step1["W_unchanged"] and step2["W_unchanged"]
    assert step1["base_grad_is_none"] and step2["base_grad_is_none"]
    assert result["passed"] and not result["mismatches"]


def test_tiny_model_battery_passes():
    results = {r["check"]: r for r in vg.verify_tiny(samples=24)}
    assert results["zero-structure"]["passed"], results["zero-structure"]
    assert results["zero-structure"]["adapters"] == 14
    frozen = results["frozen-base"]
    assert frozen["base_bytes_unchanged"] and not frozen["base_params_with_grad"]
    fd = results["finite-differences"]
    assert fd["cosine"] >= 0.9999 and fd["max_abs_dev"] < 1e-7, fd
    assert all(r["passed"] for r in results.values())


def test_finite_differences_catch_a_wrong_gradient():
    """A backward that is 10% off on one adapter must fail the check (it can fail)."""
    model, adapters, batch = vg.tiny_model()
    vg.warm_up(model, adapters, batch)
    adapters["layers.1.v"].lora_b.register_hook(lambda g: g * 1.1)
    adapters["layers.0.q"].lora_a.register_hook(lambda g: -g)
    result = vg.finite_differences(model, adapters, batch, samples=28)
    assert not result["passed"], result


def test_zero_structure_catches_a_nonzero_a_gradient():
    """If B were not zero at init, dL/dA would be live: the check must notice."""
    model, adapters, batch = vg.tiny_model()
    with torch.no_grad():
        adapters["layers.0.k"].lora_b.fill_(0.0)
    assert vg.zero_structure(model, adapters, batch)["passed"]
    model, adapters, batch = vg.tiny_model()
    adapters["layers.0.k"].lora_a.register_hook(lambda g: g + 1e-3)
    result = vg.zero_structure(model, adapters, batch)
    assert not result["passed"] and result["nonzero_dA"] == ["layers.0.k"]


def test_frozen_base_detects_a_base_weight_that_trains():
    model, adapters, batch = vg.tiny_model()
    model.layers[0].attn.q.base.weight.requires_grad_(True)
    result = vg.warm_up(model, adapters, batch)
    assert not result["passed"]
    assert "layers.0.attn.q.base.weight" in result["base_params_with_grad"]
    assert not result["base_bytes_unchanged"]


@pytest.mark.slow
def test_cli_runs_the_built_in_battery():
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "engine", "verify-grads", "--samples", "16",
                           "--json"], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    results = {r["check"]: r for r in json.loads(proc.stdout)}
    assert set(results) == {"worked-example", "zero-structure", "frozen-base",
                            "finite-differences"}
    assert results["worked-example"]["steps"]["2"]["loss_after"] == 0.610433
    assert results["finite-differences"]["cosine"] >= 0.9999


@pytest.mark.slow
def test_cli_on_an_lm_sft_config_over_a_packed_q4k_base(tmp_path):
    """verify-grads CONFIG: the battery on a real (tiny) Q4_K GGUF base and SFT samples."""
    import json

    from fixtures_gguf import write_tiny_gguf
    from lm_pretrain_support import forgebench
    from lm_sft_support import write_config

    base = write_tiny_gguf(tmp_path / "tiny.gguf", arch="gemma3", qtype="Q4_K", n_layers=2)
    config = write_config(tmp_path, base)
    result = forgebench("verify-grads", str(config), "--samples", "10", "--json")
    checks = {r["check"]: r for r in json.loads(result.stdout)}
    assert all(r["passed"] for r in checks.values())
    assert checks["finite-differences"]["elements_within_tolerance"] == 10
    assert checks["packed-backward"]["relative_error"] < 1e-5
    assert checks["frozen-base"]["base_bytes_unchanged"]
