"""precision = "auto": the decision table, this machine's answer, the record in run.json, exact
resume in bf16; and the FLOP counting and matmul peak behind the MFU in every metrics row."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lm_pretrain_support import assert_same_run, forgebench, make_corpus, write_config

from engine.config import validate_config
from engine.recipes.lm_pretrain_config import TrainSection
from engine.rundir import RunDir
from engine.train import metrics
from engine.train.precision import (
    BF16_MIN_SPEEDUP,
    autocast,
    choose_precision,
    cpu_bf16_features,
    migrate_autocast,
    resolve_precision,
)

AVX2 = frozenset({"avx", "avx2", "fma", "f16c"})
AVX512 = AVX2 | {"avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni"}


@pytest.mark.parametrize("features, speedup, expected", [
    (frozenset(), None, "f32"),                              # not x86 / nothing known
    (AVX2, None, "f32"),                                     # AVX2 only: bf16 is emulated
    (AVX2, 3.0, "f32"),                                      # ... whatever was measured
    (AVX512, None, "f32"),                                   # AVX-512 without BF16
    (AVX512 | {"avx512_bf16"}, None, "bf16"),                # not measured: the units decide
    (AVX512 | {"avx512_bf16"}, 2.9, "bf16"),                 # AMD EPYC (the figure)
    (AVX512 | {"avx512_bf16"}, 0.64, "f32"),                 # Intel Xeon, no AMX (measured)
    (AVX512 | {"avx512_bf16"}, BF16_MIN_SPEEDUP, "bf16"),    # the bound itself
    (AVX512 | {"amx_bf16", "amx_int8"}, 6.0, "bf16"),        # Sapphire Rapids and later
    (AVX512 | {"amx_int8"}, None, "f32"),                    # AMX-INT8 does not multiply bf16
])
def test_auto_chooses_bf16_only_with_bf16_units_that_measure_faster(features, speedup,
                                                                     expected):
    choice = choose_precision("auto", features, speedup)
    assert choice.precision == expected and choice.requested == "auto"
    has_units = bool(features & {"avx512_bf16", "amx_bf16"})
    assert ("no AVX512-BF16 or AMX" in choice.reason) == (not has_units)
    assert ("measured" in choice.reason) == (has_units and speedup is not None)
    if "measured" in choice.reason:
        assert f"measured {speedup:.2f}x f32" in choice.reason


@pytest.mark.parametrize("requested, expected", [("f32", "f32"), ("fp32", "f32"),
                                                 ("bf16", "bf16")])
def test_an_explicit_request_is_kept_whatever_the_cpu(requested, expected):
    for features in (AVX2, AVX512 | {"avx512_bf16"}):
        assert choose_precision(requested, features).precision == expected
    assert "emulates" in choose_precision("bf16", AVX2).reason
    with pytest.raises(ValueError):
        choose_precision("f16", AVX2)


def _cpuinfo_flags() -> set[str]:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return set()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def test_this_machine_answers_as_its_cpu_flags_and_measured_matmuls_say():
    """torch's own checks and /proc/cpuinfo agree on the bf16 units; "auto" follows them (f32
    on an AVX2 or plain AVX-512 machine) and, where they are, the two matmul peaks measured
    here, which the hardware decides: bf16 only if it multiplies BF16_MIN_SPEEDUP times f32."""
    flags = _cpuinfo_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags to compare with")
    units = cpu_bf16_features()
    assert ("avx512_bf16" in units) == ("avx512_bf16" in flags)
    assert ("amx_bf16" in units) == ("amx_bf16" in flags)
    faster = bool(units) and (metrics.peak_matmul_flops("bf16", 1)
                              >= BF16_MIN_SPEEDUP * metrics.peak_matmul_flops("f32", 1))
    expected = "bf16" if faster else "f32"
    assert resolve_precision("auto").precision == expected
    cast = autocast("auto")
    assert isinstance(cast, torch.autocast) == (expected == "bf16")


def _forbid(monkeypatch, module, name: str, what: str) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError(f"the form's precision note {what}")

    monkeypatch.setattr(module, name, refuse)


def _precision_note() -> str:
    from app.viewmodels.forms import RecipeForm

    return next(f for f in RecipeForm("lm-sft").fields if f.name == "train.precision").note


def test_the_forms_note_reads_the_flags_and_cached_peaks_alone_even_with_torch_loaded(
        monkeypatch):
    """The new-run form's "auto = ..." line runs on the GUI thread: it must never reach the
    native kernels (their first use compiles them: seconds), although torch is loaded here, nor
    time a matmul: it reads the peaks a job measured."""
    from engine.kernels import cpu, native

    expected = resolve_precision("auto").precision     # what a job here chooses (cpuid too)
    for cached in (cpu_bf16_features, cpu.detected, metrics.peak_matmul_flops):
        cached.cache_clear()                           # as in a fresh process
    _forbid(monkeypatch, native, "kernels", "reached the native kernels")
    _forbid(monkeypatch, metrics, "measure_peak_matmul_flops", "timed a matmul")
    assert _precision_note().startswith(f"auto = {expected} on this machine")


def test_the_forms_note_before_any_run_measured_says_what_will_decide(tmp_path, monkeypatch):
    from engine.train import precision

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))          # nothing measured yet
    _forbid(monkeypatch, metrics, "measure_peak_matmul_flops", "timed a matmul")
    monkeypatch.setattr(precision, "listed_bf16_features", lambda: frozenset({"avx512_bf16"}))
    assert _precision_note() == ("auto = bf16 or f32 on this machine: it has avx512_bf16; the "
                                 f"first run measures if its bf16 matmul is {BF16_MIN_SPEEDUP}x "
                                 "its f32")
    monkeypatch.setattr(precision, "listed_bf16_features", lambda: frozenset())
    assert _precision_note().startswith("auto = f32 on this machine (this CPU has no AVX512-BF16")


def test_configs_default_to_auto_and_old_autocast_keys_still_load():
    assert TrainSection().precision == "auto"
    assert TrainSection(autocast="none").precision == "f32"
    assert TrainSection(autocast="bf16").precision == "bf16"
    assert migrate_autocast({"precision": "bf16", "autocast": "none"}) == \
        {"precision": "bf16", "autocast": "none"}      # both given: the schema refuses it
    with pytest.raises(Exception, match="autocast"):
        TrainSection(precision="bf16", autocast="none")


def _tiny(tmp_path, precision: str | None, steps: int = 6, save_every: int = 0):
    return write_config(tmp_path / "tiny.toml", make_corpus(tmp_path), steps=steps,
                        save_every=save_every, precision=precision or "auto")


def test_run_json_records_the_choice_and_rows_carry_mfu(tmp_path):
    config = _tiny(tmp_path, None, steps=3)
    forgebench("run", str(config), "--out", str(tmp_path / "run"), "--threads", "1")
    run = RunDir(tmp_path / "run")
    recorded = run.manifest()["precision"]
    assert recorded == resolve_precision("auto").as_dict()
    assert run.manifest()["config"]["train"]["precision"] == "auto"
    rows = [m for m in run.metrics() if m.get("split") == "train"]
    # the tiny model's step: every row credited the FLOPs counted on the first one
    assert len({m["flops"] for m in rows}) == 1 and rows[0]["flops"] > 0
    for m in rows:
        assert m["mfu"] == pytest.approx(m["flops_per_s"] / metrics.peak_matmul_flops(
            recorded["precision"], 1), rel=1e-9)


def test_bf16_run_resumes_bit_for_bit(tmp_path):
    """Exact resume under bf16 autocast (f32 master weights), whatever the CPU: emulated bf16
    is slow but deterministic."""
    config = _tiny(tmp_path, "bf16", steps=4, save_every=2)
    forgebench("run", str(config), "--out", str(tmp_path / "whole"), "--threads", "1")
    forgebench("run", str(config), "--out", str(tmp_path / "cut"), "--threads", "1",
               "--stop-after-step", "2")
    forgebench("resume", str(tmp_path / "cut"))
    whole, cut = RunDir(tmp_path / "whole"), RunDir(tmp_path / "cut")
    assert whole.manifest()["precision"]["precision"] == "bf16"
    assert_same_run(whole, cut, 4)


# -- FLOPs and the peak ----------------------------------------------------------------------
def test_counting_flops_leaves_the_arithmetic_alone():
    """Counting a step must not change a bit of it (exact resume counts a resumed
    invocation's first step, the uninterrupted run does not)."""
    torch.manual_seed(0)
    x, w = torch.randn(3, 9, 16), torch.randn(24, 16, requires_grad=True)
    q = torch.randn(1, 4, 9, 8, requires_grad=True)

    def step():
        y = F.linear(x, w).view(3, 9, 3, 8).transpose(1, 2)
        out = F.scaled_dot_product_attention(y, y, y, is_causal=True)
        loss = (out.sum() + F.scaled_dot_product_attention(q, q, q).pow(2).sum())
        return torch.autograd.grad(loss, (w, q))

    plain = step()
    with metrics.StepFlops() as count:
        counted = step()
    assert count.total > 0
    assert all(torch.equal(a, b) for a, b in zip(plain, counted))



def test_step_flops_keeps_the_terminal_quiet():
    """Counting a step's FLOPs starts a torch.profiler session; kineto announces each session
    start and stop on stderr unless told not to. A training run's terminal and log get only
    the run's own lines. The twin runs the same session without the setting and sees them
    (where this torch's kineto prints nothing at all, the check has nothing to show)."""
    import subprocess
    import sys

    code = ("import torch\nfrom engine.train import metrics\n"
            "with metrics.StepFlops() as count:\n    torch.ones(3) @ torch.ones(3)\n")
    twin = ("import torch\nfrom torch.profiler import profile, ProfilerActivity\n"
            "with profile(activities=[ProfilerActivity.CPU]):\n    torch.ones(3) @ torch.ones(3)\n")
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}

    def stderr_of(source: str) -> str:
        return subprocess.run([sys.executable, "-c", source], env=env, capture_output=True,
                              text=True, check=True, cwd=Path(__file__).resolve().parents[1]).stderr

    assert "profiler_start" not in stderr_of(code)
    if "profiler_start" not in stderr_of(twin):
        pytest.skip("this torch's kineto prints nothing on a session start: nothing to hide")


def test_step_flops_counts_a_linear_forward_and_backward():
    x = torch.randn(7, 5, requires_grad=True)
    w = torch.randn(3, 5, requires_grad=True)
    with metrics.StepFlops() as count:
        F.linear(x, w).sum().backward()
    assert count.total == 3 * 2 * 7 * 5 * 3          # y, dx and dw: three 7x5x3 products


def test_step_flops_counts_products_with_a_prepacked_bf16_weight():
    """A bf16 dense cache multiplies through oneDNN's prepacked layout (`PackedWeight.product`):
    counted as the plain product it replaces, for a batch of sequences too."""
    from gguf import GGMLQuantizationType as T

    from engine.models.packed import PackedWeight, onednn_bf16

    if not onednn_bf16():
        pytest.skip("this CPU has no bf16 oneDNN: the plain product runs (counted above)")
    weight = PackedWeight(torch.randn(6, 8).view(torch.uint8), T.F32, 6, 8, "w")
    weight.cache(torch.bfloat16)
    x = torch.randn(2, 3, 8)
    with metrics.StepFlops() as count:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            weight.product(x, 0, 6, None)          # held as layouts: no plain rows
    assert weight.layout_bytes > 0                      # the prepacked product ran
    assert count.total == 2 * (2 * 3) * 8 * 6


def test_step_flops_counts_in_place_addmm_and_cpu_attention():
    """The fused LM-head loss accumulates with addmm_, attention runs the CPU flash kernel:
    both are counted, by torch's own formulas for attention."""
    acc, a, b = torch.zeros(4, 6), torch.randn(4, 8), torch.randn(8, 6)
    with metrics.StepFlops() as count:
        acc.addmm_(a, b)
    assert count.total == 2 * 4 * 8 * 6
    q = torch.randn(1, 4, 10, 16, requires_grad=True)
    k = torch.randn(1, 2, 10, 16, requires_grad=True)
    v = torch.randn(1, 2, 10, 16, requires_grad=True)
    with metrics.StepFlops() as count:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
    product = 2 * 4 * 10 * 10 * 16                      # one [10x16]·[16x10] for 4 heads
    assert count.total == 7 * product   # forward q·kᵀ, p·v; backward (torch's formula) q·kᵀ
                                        # again, dv, dp, dq, dk


@pytest.mark.parametrize("threads", [1, 3])
def test_fused_head_loss_counts_its_two_products(threads, monkeypatch):
    """On several threads the head's rows are split into shares that run on threads of their
    own: those products are counted too."""
    from engine.models import lm_head_loss

    monkeypatch.setattr(lm_head_loss, "HEAD_SHARE_MIN_ROWS", 1000)
    h = torch.randn(5, 16, requires_grad=True)
    weight = torch.randn(3000, 16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        chunk = lm_head_loss.HEAD_CHUNK_ROWS
        assert len(lm_head_loss.head_shares(3000, chunk, threads)) == threads
        with metrics.StepFlops() as count:
            targets = torch.tensor([1, 2, 3, 2000, 2999])
            lm_head_loss.linear_cross_entropy(h, weight, targets).backward()
    finally:
        torch.set_num_threads(before)
    assert count.total == 2 * (2 * 5 * 16 * 3000)      # logits and dh, in one pass


def test_step_utilisation_credits_each_step_by_its_work(monkeypatch):
    monkeypatch.setattr(metrics, "peak_matmul_flops", lambda precision, threads: 1e9)
    util = metrics.StepUtilisation("f32", 1)
    util.begin()
    F.linear(torch.randn(10, 4), torch.randn(2, 4))    # 160 FLOPs for 10 tokens
    first = util.step(10, 2.0)
    assert first == {"flops": 160, "flops_per_s": 80, "mfu": 80 / 1e9}
    util.begin()                                        # not counted again
    assert util.step(5, 1.0)["flops"] == 80


def test_peak_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(metrics, "measure_peak_matmul_flops",
                        lambda precision, threads: calls.append((precision, threads)) or 5e10)
    metrics.peak_matmul_flops.cache_clear()
    try:
        assert metrics.peak_matmul_flops("f32", 2) == 5e10
        metrics.peak_matmul_flops.cache_clear()
        assert metrics.peak_matmul_flops("f32", 2) == 5e10          # from the file
        assert calls == [("f32", 2)]
        saved = json.loads((tmp_path / "forgebench" / "peak-flops.json").read_text())
        assert list(saved.values()) == [5e10] and "|f32|2" in next(iter(saved))
    finally:
        metrics.peak_matmul_flops.cache_clear()


def test_measured_peak_is_a_real_matmul_rate():
    peak = metrics.measure_peak_matmul_flops("f32", 1)
    assert 1e8 < peak < 1e13                          # any CPU: between 0.1 and 10,000 GFLOP/s


def test_pirate_config_validates_with_auto():
    from engine.config import load_config
    from engine.recipes.lm_sft_config import LMSFTConfig

    config = load_config(__import__("pathlib").Path(__file__).parents[1] / "resources" /
                         "configs" / "lm-sft-pirate.toml")
    assert isinstance(config, LMSFTConfig) and config.train.precision == "auto"
    assert validate_config(config.model_dump(mode="json")).train.precision == "auto"


def test_runs_pane_shows_mfu_beside_throughput(tmp_path):
    """The runs pane's summary line reads the rows' `mfu` (a run logged before MFU existed
    shows throughput alone)."""
    from app.viewmodels.runs import RunSeries, throughput_text

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": i, "split": "train", "loss": 1.0, "tokens_per_s": 100.0 + i,
             "mfu": 0.25 + 0.01 * i} for i in range(1, 4)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    series = RunSeries(run)
    series.poll()
    assert throughput_text(series.train) == "throughput 102 tokens/s, MFU 27% (last 20)"
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "split": "train",
                                                   "tokens_per_s": 50.0}) + "\n")
    old = RunSeries(run)
    old.poll()
    assert throughput_text(old.train) == "throughput 50 tokens/s (last 20)"


@pytest.mark.parametrize("recipe", ["lm-sft", "lm-pretrain", "image-classify"])
def test_run_form_shows_what_auto_becomes_here(recipe):
    from app.viewmodels.forms import field_specs
    from engine.config import schema_for

    notes = {s.name: s.note for s in field_specs(schema_for(recipe)) if s.note}
    assert len(notes) == 1 and next(iter(notes)).endswith("precision")
    choice = resolve_precision("auto")
    assert next(iter(notes.values())).startswith(f"auto = {choice.precision} on this machine")


def test_matmul_roofline_puts_skinny_products_on_the_traffic_side():
    """A worked roofline (bench/costs.py) at 1 GFLOP/s and 1 GB/s: one row against a 512x512
    f32 weight does 2·512·512 FLOPs (0.52 ms) but moves (512 + 512·512 + 512)·4 bytes (1.05 ms),
    so traffic sets its floor; a 512x512 square does 268 MFLOP (268 ms) against 3.1 MB (3.1 ms),
    so arithmetic does."""
    from torch.profiler import ProfilerActivity, profile

    from bench.costs import matmul_roofline

    w = torch.randn(512, 512)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.mm(torch.randn(1, 512), w)
        torch.mm(torch.randn(512, 512), w)
    roof = matmul_roofline(prof.events(), peak_flops=1e9, bandwidth=1e9)
    skinny_traffic = (512 + 512 * 512 + 512) * 4 / 1e9
    assert roof["count"] == 2
    assert roof["traffic_bound_s"] == pytest.approx(skinny_traffic)
    assert roof["floor_s"] == pytest.approx(skinny_traffic + 2 * 512 ** 3 / 1e9)
    assert roof["measured_s"] > 0


SIMD_PROBE = """
import json, torch
from engine.kernels import native
from engine.train.precision import cpu_bf16_features, resolve_precision
lib = native.train_kernels()
print(json.dumps({"aten": torch.backends.cpu.get_cpu_capability(),
                  "onednn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
                  "train_build": None if lib is None else lib._name,
                  "units": sorted(cpu_bf16_features()),
                  "f32_choice": resolve_precision("f32").reason,
                  "auto": resolve_precision("auto").as_dict()}))
"""


def _simd_probe(forced: str) -> dict:
    """What a fresh process (FORGEBENCH_SIMD=`forced` set before it starts, or unset) computes
    with: ATen's kernels, oneDNN's bf16, the training passes' build, the bf16 units "auto" sees."""
    import os
    import subprocess
    import sys

    from lm_pretrain_support import REPO

    from engine import AVX2_LIBRARY_CAPS

    env = {k: v for k, v in os.environ.items()
           if k != "FORGEBENCH_SIMD" and k not in AVX2_LIBRARY_CAPS}
    env.update(PYTHONPATH=str(REPO), **({"FORGEBENCH_SIMD": forced} if forced else {}))
    done = subprocess.run([sys.executable, "-c", SIMD_PROBE],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_forgebench_simd_avx2_computes_as_an_avx2_cpu_would():
    """FORGEBENCH_SIMD=avx2, set before the process starts, makes the whole process compute as
    an AVX2-only CPU: torch's ATen kernels and oneDNN capped at AVX2 (so no bf16 there), the
    training passes from their x86-64-v3 build, and "auto" seeing no bf16 units, so it takes
    f32 and says why in what run.json records. bench/bench_lora.py measures an AVX2 machine's
    path on an AVX-512 one that way. The twin, the same probe without the switch, reports this
    CPU's own kernels (AVX-512 where it has them) and its native build: a different library."""
    from engine.kernels import native

    flags = _cpuinfo_flags()
    if "avx2" not in flags:
        pytest.skip("not an x86 CPU with AVX2: there is no AVX2 path to cap at")
    forced, own = _simd_probe("avx2"), _simd_probe("")
    assert forced["aten"] == "AVX2" and not forced["onednn_bf16"] and forced["units"] == []
    assert forced["auto"]["precision"] == "f32"
    assert "FORGEBENCH_SIMD=avx2" in forced["auto"]["reason"]
    assert "no AVX512-BF16 or AMX" in forced["auto"]["reason"]
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
    assert own["aten"] == ("AVX512" if avx512 else "AVX2")
    assert "FORGEBENCH_SIMD" not in own["auto"]["reason"] + own["f32_choice"]
    assert "FORGEBENCH_SIMD" in forced["f32_choice"]
    assert own["units"] == sorted({"avx512_bf16", "amx_bf16"} & flags)
    avx2_build = native.build_train_kernels("avx2")
    if avx2_build is not None and own["train_build"] is not None:
        assert forced["train_build"] == avx2_build._name != own["train_build"]


def test_the_peak_cache_keeps_capped_and_uncapped_peaks_apart(monkeypatch):
    """A peak measured under FORGEBENCH_SIMD=avx2 is an AVX2 machine's, never read back as this
    CPU's own (MFU against it would be wrong either way), and the reverse."""
    monkeypatch.delenv("FORGEBENCH_SIMD", raising=False)
    own = metrics._peak_cache_key("f32", 1)
    monkeypatch.setenv("FORGEBENCH_SIMD", "avx2")
    capped = metrics._peak_cache_key("f32", 1)
    assert capped != own and "simd avx2" in capped
    monkeypatch.setenv("FORGEBENCH_SIMD", "native")
    assert metrics._peak_cache_key("f32", 1) == own


def test_a_nanochat_run_says_how_it_computes_in_bf16():
    """run.json's reason names the scheme the model computes in: nanochat's GPT stores its
    embedding tables in bf16, so it is not the autocast's "f32 master weights" that a Llama
    lm-pretrain run (the twin) and every other recipe get."""
    import tomllib

    from engine.train.precision import (
        AUTOCAST_SCHEME,
        NANOCHAT_SCHEME,
        bf16_scheme,
        choose_precision,
    )

    configs = Path(__file__).resolve().parents[1] / "resources" / "configs"

    def scheme_of(name: str) -> str:
        data = tomllib.loads((configs / name).read_text())
        return bf16_scheme(validate_config(data, configs / name))

    assert scheme_of("lm-pretrain-nanochat-d6.toml") == NANOCHAT_SCHEME
    assert scheme_of("lm-pretrain.toml") == AUTOCAST_SCHEME
    assert scheme_of("image-classify.toml") == AUTOCAST_SCHEME
    reason = choose_precision("auto", frozenset({"avx512_bf16"}), 2.0, NANOCHAT_SCHEME).reason
    assert "nanochat's bf16" in reason and "f32 master weights" not in reason
    assert "f32 master weights" in choose_precision("auto", frozenset({"avx512_bf16"}), 2.0).reason
