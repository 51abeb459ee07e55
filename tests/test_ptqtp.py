"""PTQTP (engine/ptqtp): the decomposition against brute force on small matrices, the TQ2_0
packing against the `gguf` package's reference dequantizer, the convert round trip (file ->
`gguf` package -> engine logits equal the in-memory decomposition's), and llama.cpp running the
single-plane file (marker llamacpp)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, quants

from engine.errors import ForgebenchError
from engine.kernels.cpu import torch_threads
from engine.ptqtp import decompose as D
from engine.ptqtp.gguf_file import PLANE2_SUFFIX, convert_ptqtp, pack_tq1_0, pack_tq2_0
from tests.fixtures_gguf import write_tiny_gguf

torch.set_num_threads(2)
TRITS = (-1.0, 0.0, 1.0)


def _err(w, t, alpha):
    return float((w.double() - torch.einsum("npg,np->ng", t.double(), alpha.double()))
                 .square().sum())


# -- the decomposition against brute force ---------------------------------------------------

def test_single_plane_is_the_exact_optimum():
    """Over all 3^6 ternary vectors, each with its least-squares α: the closed form matches."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(12, 6, generator=gen)
    t, alpha = D.best_single_plane(w)
    for i in range(w.shape[0]):
        best = min(float((w[i].double() - (torch.tensor(c).double() @ w[i].double()) /
                          max(1.0, sum(x * x for x in c)) * torch.tensor(c).double())
                         .square().sum())
                   for c in itertools.product(TRITS, repeat=6))
        ours = float((w[i] - alpha[i] * t[i]).double().square().sum())
        assert ours == pytest.approx(best, rel=1e-5, abs=1e-9)


def _assert_scales_minimise(solve, ridge: float = 0.0):
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(20, 16, generator=gen)
    t = torch.randint(-1, 2, (20, 2, 16), generator=gen).float()
    alpha = solve(w, t, ridge)
    for i in range(w.shape[0]):
        a = t[i].double().T.numpy()                                     # [16, 2]
        lam = ridge * np.trace(a.T @ a) / 2
        aug = np.vstack([a, np.sqrt(lam) * np.eye(2)])
        ref = np.linalg.lstsq(aug, np.concatenate([w[i].double().numpy(), [0, 0]]), rcond=None)[0]
        np.testing.assert_allclose(alpha[i].numpy(), ref, rtol=1e-4, atol=1e-6)


def test_closed_form_scales_minimise_the_error_for_fixed_planes():
    _assert_scales_minimise(D.solve_scales, ridge=0.0)
    _assert_scales_minimise(D.solve_scales, ridge=1e-3)     # the ridge objective


def _assert_trits_optimal(search):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(10, 32, generator=gen)
    alpha = torch.rand(10, 2, generator=gen) * torch.tensor([1.0, 0.5])
    t = search(w, alpha)
    assert set(t.unique().tolist()) <= set(TRITS)
    combos = torch.tensor(list(itertools.product(TRITS, repeat=2)))        # [9, 2]
    values = alpha @ combos.T                                               # [n, 9]
    brute = (w[:, :, None] - values[:, None, :]).square().min(2).values     # [n, g]
    ours = (w - (t * alpha[:, :, None]).sum(1)).square()
    torch.testing.assert_close(ours, brute, rtol=1e-6, atol=1e-7)


def test_trit_search_is_optimal_per_entry_for_fixed_scales():
    _assert_trits_optimal(D.search_trits)


def test_twin_a_wrong_trit_search_fails_the_brute_force_check():
    """Rounding each plane alone (plane 1 to w, plane 2 to the residual) is not the joint optimum:
    the same check must reject it."""
    def greedy(w, alpha):
        t1 = torch.clamp(torch.round(w / alpha[:, :1]), -1, 1)
        t2 = torch.clamp(torch.round((w - alpha[:, :1] * t1) / alpha[:, 1:]), -1, 1)
        return torch.stack([t1, t2], 1)
    with pytest.raises(AssertionError):
        _assert_trits_optimal(greedy)


def test_twin_scales_without_the_cross_term_fail():
    def diagonal_only(w, t, ridge):
        return (t * w[:, None, :]).sum(2) / t.square().sum(2).clamp_min(1)
    with pytest.raises(AssertionError):
        _assert_scales_minimise(diagonal_only)


def test_error_never_increases_and_two_planes_beat_one():
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(48, 512, generator=gen) * torch.linspace(0.1, 2, 512)
    dec2 = D.decompose(w, planes=2, group=256)
    assert len(dec2.history) > 2
    assert all(b <= a for a, b in zip(dec2.history, dec2.history[1:]))
    assert dec2.history[-1] < dec2.history[0]
    dec1 = D.decompose(w, planes=1, group=256)
    rtn = D.absmean_ternary(w, group=256)
    e1, e2 = D.relative_error(w, dec1.dense()), D.relative_error(w, dec2.dense())
    er = D.relative_error(w, rtn.dense())
    assert e2 < 0.6 * e1 and e1 < er
    # stored form: f16-exact, non-negative scales; ternary planes
    assert torch.equal(dec2.scales, dec2.scales.half().float()) and (dec2.scales >= 0).all()
    assert set(dec2.planes.unique().tolist()) <= {-1, 0, 1}
    # the planes are optimal for the stored scales (the final search used them)
    g = w.reshape(48 * 2, 256)
    alpha = dec2.scales.permute(1, 2, 0).reshape(-1, 2)
    t = dec2.planes.reshape(2, 48, 2, 256).permute(1, 2, 0, 3).reshape(-1, 2, 256).float()
    assert _err(g, t, alpha) == pytest.approx(_err(g, D.search_trits(g, alpha), alpha), rel=1e-9)


def test_per_row_group_and_bad_shapes():
    w = torch.randn(4, 512)
    dec = D.decompose(w, planes=2, group=None)
    assert dec.scales.shape == (2, 4, 1)
    with pytest.raises(ValueError):
        D.decompose(torch.randn(4, 300), group=256)


# -- the activation-aware (importance-weighted) fit against brute force ------------------------

def _weighted_err(w, t, alpha, h):
    recon = torch.einsum("npg,np->ng", t.double(), alpha.double())
    return float(((w.double() - recon).square() * h.double()).sum())


def test_weighted_single_plane_is_the_exact_optimum():
    """Over all 3^6 ternary vectors, each with its weighted least-squares α ≥ 0: the sort and
    cumulative sums find the minimum of Σ h (w − α t)², also with some weights 0."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(12, 6, generator=gen)
    h = torch.rand(12, 6, generator=gen) * 4
    h[0, :3] = 0
    t, alpha = D.best_single_plane(w, h)
    for i in range(w.shape[0]):
        wi, hi = w[i].double(), h[i].double()
        best = float("inf")
        for c in itertools.product(TRITS, repeat=6):
            c = torch.tensor(c).double()
            den = float((hi * c * c).sum())
            a = max(0.0, float((hi * c * wi).sum()) / den) if den > 0 else 0.0
            best = min(best, float((hi * (wi - a * c).square()).sum()))
        ours = float((hi * (wi - alpha[i].double() * t[i].double()).square()).sum())
        assert ours == pytest.approx(best, rel=1e-5, abs=1e-9)


def test_twin_unweighted_single_plane_is_not_the_weighted_optimum():
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(12, 6, generator=gen)
    h = torch.rand(12, 6, generator=gen) * 4
    t, alpha = D.best_single_plane(w)
    tw, aw = D.best_single_plane(w, h)
    plain = _weighted_err(w, t[:, None], alpha[:, None], h)
    weighted = _weighted_err(w, tw[:, None], aw[:, None], h)
    assert weighted < 0.99 * plain


def test_weighted_closed_form_scales_minimise_the_weighted_error():
    gen = torch.Generator().manual_seed(12)
    w = torch.randn(20, 16, generator=gen)
    t = torch.randint(-1, 2, (20, 2, 16), generator=gen).float()
    h = torch.rand(20, 16, generator=gen) * 3
    for ridge in (0.0, 1e-3):
        alpha = D.solve_scales(w, t, ridge, h)
        for i in range(w.shape[0]):
            root = np.sqrt(h[i].double().numpy())
            a = t[i].double().T.numpy()                                      # [16, 2]
            lam = ridge * np.trace(a.T @ (a * h[i].double().numpy()[:, None])) / 2
            aug = np.vstack([a * root[:, None], np.sqrt(lam) * np.eye(2)])
            rhs = np.concatenate([w[i].double().numpy() * root, [0, 0]])
            ref = np.linalg.lstsq(aug, rhs, rcond=None)[0]
            np.testing.assert_allclose(alpha[i].numpy(), ref, rtol=1e-4, atol=1e-6)
    # twin: the unweighted solution is not the weighted optimum
    plain = D.solve_scales(w, t, 0.0)
    assert not torch.allclose(plain, D.solve_scales(w, t, 0.0, h), rtol=1e-3)


def test_trit_search_is_optimal_for_the_weighted_error_over_whole_vectors():
    """Brute force over all 9^4 plane pairs of a 4-entry group, weighted: the per-entry nearest
    level (what search_trits returns, with no weights) is the joint weighted optimum."""
    gen = torch.Generator().manual_seed(13)
    w = torch.randn(6, 4, generator=gen)
    h = torch.rand(6, 4, generator=gen) * 5
    alpha = torch.rand(6, 2, generator=gen) * torch.tensor([1.0, 0.5])
    t = D.search_trits(w, alpha)
    pairs = list(itertools.product(TRITS, repeat=2))
    for i in range(w.shape[0]):
        best = float("inf")
        for combo in itertools.product(pairs, repeat=4):
            c = torch.tensor(combo).double().T                            # [2, 4]
            best = min(best, _weighted_err(w[i:i + 1], c[None], alpha[i:i + 1], h[i:i + 1]))
        ours = _weighted_err(w[i:i + 1], t[i:i + 1], alpha[i:i + 1], h[i:i + 1])
        assert ours == pytest.approx(best, rel=1e-9, abs=1e-12)


def _grid_reference(w, h=None):
    """An independent search: a 30×30 grid of (α¹, α²/α¹) starts, each refined by 3 alternating
    rounds, the best kept per group (the total weighted squared error)."""
    best = torch.full((w.shape[0],), float("inf"), dtype=torch.float64)
    rms = w.square().mean(1).sqrt()
    for ratio in torch.linspace(0.05, 1.0, 30):
        for size in torch.linspace(0.3, 3.0, 30):
            alpha = torch.stack([rms * size, rms * size * ratio], 1)
            t = D.search_trits(w, alpha)
            for _ in range(3):
                alpha = D.solve_scales(w, t, 1e-9, h)
                t = D.search_trits(w, alpha)
            best = torch.minimum(best, D._sq_error(w, t, alpha, h))
    return float(best.sum())


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
def test_two_plane_fit_reaches_a_dense_grid_search_on_heavy_tailed_groups(weighted, monkeypatch):
    """Student-t(3) groups (real weight rows are heavier-tailed than a Gaussian): the solver's
    error is within 2% of a dense grid search; the paper's progressive start alone (the twin)
    stops more than 10% above it."""
    torch.manual_seed(14)
    w = torch.distributions.StudentT(3.0).sample((32, 256)) * 0.02
    h = (torch.rand(32, 256) * 4).square() if weighted else None
    ones = torch.ones_like(w)
    with torch_threads(1):       # short element-wise passes: one thread is the fast way
        reference = _grid_reference(w, h)
        t, alpha = D.decompose_groups(w, 2, h=h)
        assert _weighted_err(w, t, alpha, ones if h is None else h) <= 1.02 * reference
        monkeypatch.setattr(D, "RATIO_STARTS", ())
        t, alpha = D.decompose_groups(w, 2, h=h)
        assert _weighted_err(w, t, alpha, ones if h is None else h) > 1.1 * reference


def test_importance_lowers_the_weighted_error_and_is_checked():
    gen = torch.Generator().manual_seed(15)
    w = torch.randn(32, 512, generator=gen)
    imp = torch.rand(512, generator=gen).pow(4) * 10
    plain = D.decompose(w, planes=2)
    aware = D.decompose(w, planes=2, importance=imp)
    assert all(b <= a for a, b in zip(aware.history, aware.history[1:]))
    e_plain = D.relative_error(w, plain.dense(), imp)
    e_aware = D.relative_error(w, aware.dense(), imp)
    assert e_aware < 0.97 * e_plain                                 # what the option is for
    assert D.relative_error(w, aware.dense()) > D.relative_error(w, plain.dense())
    for bad in (torch.ones(511), -imp, imp * float("nan")):
        with pytest.raises(ValueError):
            D.decompose(w, importance=bad)
    # an all-zero importance is no information: the plain fit
    assert torch.equal(D.decompose(w, importance=torch.zeros(512)).planes, plain.planes)


# -- TQ2_0 packing ----------------------------------------------------------------------------

def test_tq2_0_packing_matches_the_gguf_reference_dequantizer():
    dec = D.decompose(torch.randn(6, 512), planes=2, group=256)
    for p in range(2):
        raw = pack_tq2_0(dec.planes[p].numpy(), dec.scales[p].numpy())
        assert raw.shape == (6, 2 * 66)
        ref = quants.dequantize(raw, T.TQ2_0)
        np.testing.assert_array_equal(ref, dec.plane_dense(p).numpy())
        # and the engine's own kernel agrees bit for bit
        from engine.gguf.dequant import dequantize
        ours = dequantize(torch.from_numpy(raw), T.TQ2_0, (6, 512))
        np.testing.assert_array_equal(ours.numpy(), ref)


def _absmax_trits(rows: int, cols: int, seed: int):
    """Random trits with every 256-block holding a ±1 (so its absolute maximum is its scale, as
    ggml's reference quantizer sets it) and f16 scales."""
    gen = np.random.default_rng(seed)
    trits = gen.integers(-1, 2, (rows, cols)).astype(np.int8)
    trits[:, ::256] = 1
    scales = gen.uniform(0.01, 2.0, (rows, cols // 256)).astype(np.float16).astype(np.float32)
    return trits, scales


@pytest.mark.parametrize("kind, pack", [(T.TQ1_0, pack_tq1_0), (T.TQ2_0, pack_tq2_0)],
                         ids=["TQ1_0", "TQ2_0"])
def test_ternary_packing_is_byte_identical_to_the_gguf_reference_quantizer(kind, pack):
    """The planes' bytes equal what ggml's reference quantizer (the `gguf` package's
    quantize_row_tq1_0/tq2_0 port) writes for the same values; and the engine's dequantizer reads
    them back exactly."""
    from engine.gguf.dequant import dequantize

    trits, scales = _absmax_trits(5, 768, seed=3)
    values = trits.astype(np.float32) * np.repeat(scales, 256, axis=1)
    ours = pack(trits, scales)
    np.testing.assert_array_equal(ours, quants.quantize(values, kind))
    back = dequantize(torch.from_numpy(ours), kind, values.shape)
    np.testing.assert_array_equal(back.numpy(), values)


def test_twin_tq1_0_packing_with_the_trits_out_of_order_differs():
    """Twin: the 160-value first part packed byte-major (n·5 + k instead of k·32 + n) is a valid
    TQ1_0 block of other values, and the reference quantizer's bytes tell it apart."""
    trits, scales = _absmax_trits(2, 256, seed=4)
    values = trits.astype(np.float32) * np.repeat(scales, 256, axis=1)
    shuffled = trits.copy()
    shuffled[:, :160] = trits[:, :160].reshape(2, 5, 32).transpose(0, 2, 1).reshape(2, 160)
    assert not np.array_equal(pack_tq1_0(shuffled, scales), quants.quantize(values, T.TQ1_0))


# -- the file --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_f16(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("ptqtp") / "tiny.gguf", "llama", "F16")


def _tensor(reader, name):
    t = next(t for t in reader.tensors if t.name == name)
    return t


@pytest.mark.parametrize("kind", [T.TQ2_0, T.TQ1_0], ids=["TQ2_0", "TQ1_0"])
def test_convert_round_trip_through_the_gguf_package_and_the_engine(tiny_f16, tmp_path, kind):
    from engine.gguf.convert import _to_f32
    from engine.gguf.writer import read_gguf_content
    from engine.models.gguf_model import load_gguf_model
    from engine.ptqtp.weight import PlaneSumLinear

    out = tmp_path / "tiny-ptqtp.gguf"
    result = convert_ptqtp(tiny_f16, out, planes=2, iterations=4,  # few rounds: a fast test
                           plane_type=kind)
    report = json.loads(result.report_path.read_text())
    assert report["decomposed"] == 14 and report["planes"] == 2           # 2 layers × 7
    kept = {r["name"] for r in report["tensors"] if "kept" in r}
    assert {"token_embd.weight", "output_norm.weight"} <= kept

    reader = GGUFReader(out)
    assert int(reader.fields["ptqtp.planes"].parts[-1][0]) == 2
    src = {t.name: t for t in read_gguf_content(tiny_f16).tensors}
    name = "blk.1.ffn_down.weight"
    w = torch.from_numpy(_to_f32(src[name]))
    dec = D.decompose(w, planes=2, group=256, iterations=4)
    p1, p2 = _tensor(reader, name), _tensor(reader, name + PLANE2_SUFFIX)
    assert p1.tensor_type == kind and p2.tensor_type == kind
    from_file = quants.dequantize(p1.data, kind) + quants.dequantize(p2.data, kind)
    np.testing.assert_array_equal(from_file, (dec.plane_dense(0) + dec.plane_dense(1)).numpy())
    row = next(r for r in report["tensors"] if r["name"] == name)
    assert row["rel_error"] == pytest.approx(D.relative_error(w, dec.dense()), rel=1e-9)

    # engine logits on the file = a dense model holding the in-memory decomposition
    model, _ = load_gguf_model(out, tokenizer=False)
    ref, _ = load_gguf_model(tiny_f16, tokenizer=False)
    for layer in ref.layers:
        for path in ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down"):
            parent, _, attr = path.rpartition(".")
            base = getattr(layer.get_submodule(parent), attr)
            dense = torch.nn.Linear(base.in_features, base.out_features, bias=False)
            dense.weight.data = D.decompose(base.dense_weight(), planes=2, iterations=4).dense()
            setattr(layer.get_submodule(parent), attr, dense)
    assert isinstance(model.layers[0].attn.q, PlaneSumLinear)
    ids = torch.tensor([[1, 40, 7, 200, 12, 99, 5]])
    with torch.no_grad():
        ours, theirs = model(ids), ref(ids)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_dense_convert_of_a_two_plane_file_sums_the_planes(tiny_f16, tmp_path):
    """`convert --dtype f32` of a 2-plane file writes each weight as plane 1 + plane 2 (no
    `.plane2` tensors left), marked as dequantized from the PTQTP file, and the engine's logits on
    it equal those on the 2-plane file; the twin, plane 1 alone, is another model."""
    from engine.fsutil import sha256_file
    from engine.gguf.constants import DEQUANTIZED_FROM_KEY
    from engine.gguf.convert import convert_gguf
    from engine.models.gguf_model import load_gguf_model

    planes = convert_ptqtp(tiny_f16, tmp_path / "two.gguf", planes=2, iterations=4).path
    dense = convert_gguf(planes, tmp_path / "dense.gguf", "f32").path
    reader, source = GGUFReader(dense), GGUFReader(planes)
    assert not any(t.name.endswith(PLANE2_SUFFIX) for t in reader.tensors)
    assert str(reader.fields[DEQUANTIZED_FROM_KEY].contents()) == sha256_file(planes)
    name = "blk.0.attn_q.weight"
    p1, p2 = _tensor(source, name), _tensor(source, name + PLANE2_SUFFIX)
    summed = quants.dequantize(p1.data, p1.tensor_type) + quants.dequantize(p2.data,
                                                                            p2.tensor_type)
    stored = np.asarray(_tensor(reader, name).data).reshape(summed.shape)
    np.testing.assert_array_equal(stored, summed)
    assert not np.allclose(stored, quants.dequantize(p1.data, p1.tensor_type), atol=1e-3)
    ids = torch.tensor([[1, 40, 7, 200, 12, 99, 5]])
    with torch.no_grad():
        ours = load_gguf_model(dense, tokenizer=False)[0](ids)
        theirs = load_gguf_model(planes, tokenizer=False)[0](ids)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_convert_refuses_bad_input(tiny_f16, tmp_path):
    out = tmp_path / "one.gguf"
    convert_ptqtp(tiny_f16, out, planes=1)
    with pytest.raises(ForgebenchError, match="already exists"):
        convert_ptqtp(tiny_f16, out, planes=1)
    with pytest.raises(ForgebenchError, match="ternary"):
        convert_ptqtp(out, tmp_path / "again.gguf")
    with pytest.raises(ForgebenchError, match="--group"):
        convert_ptqtp(tiny_f16, tmp_path / "g.gguf", group=128)
    assert not (tmp_path / "again.gguf").exists() and not (tmp_path / "g.gguf").exists()


def test_cli_convert_ptqtp(tiny_f16, tmp_path, capsys):
    from engine.cli import main

    out = tmp_path / "cli.gguf"
    assert main(["convert", str(tiny_f16), "--dtype", "ptqtp", "--planes", "1",
                 "--out", str(out)]) == 0
    assert "ternary plane" in capsys.readouterr().out
    assert (tmp_path / "cli.gguf.ptqtp.json").exists()
    reader = GGUFReader(out)
    assert not any(t.name.endswith(PLANE2_SUFFIX) for t in reader.tensors)


def test_cli_convert_ptqtp_with_a_calibration_text(tiny_f16, tmp_path, capsys):
    from engine.cli import main

    text = tmp_path / "calibration.txt"
    text.write_text("a b c d e f g h i j k l m n o p " * 8)
    out = tmp_path / "aware.gguf"
    assert main(["convert", str(tiny_f16), "--dtype", "ptqtp", "--calibration", str(text),
                 "--out", str(out)]) == 0
    assert "importance matrix over" in capsys.readouterr().out
    reader = GGUFReader(out)
    assert bytes(reader.fields["ptqtp.importance"].parts[-1]).decode() == "imatrix"
    assert bytes(reader.fields["ptqtp.imatrix.dataset"].parts[-1]).decode() == "calibration.txt"
    # twin: without it the fit is the plain one
    plain = tmp_path / "plain.gguf"
    assert main(["convert", str(tiny_f16), "--dtype", "ptqtp", "--out", str(plain)]) == 0
    assert bytes(GGUFReader(plain).fields["ptqtp.importance"].parts[-1]).decode() == "none"
    # a calibration file that is not there: one line naming it, nothing written
    assert main(["convert", str(tiny_f16), "--dtype", "ptqtp", "--calibration",
                 str(tmp_path / "missing.txt"), "--out", str(tmp_path / "x.gguf")]) == 2
    assert "--calibration" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()


def _engine_logits(path, ids, numerics="llamacpp", native=True):
    from engine.models.gguf_model import load_gguf_model

    model, _ = load_gguf_model(path, tokenizer=False, numerics=numerics)
    model.native = native
    with torch.no_grad():
        cache = model.new_cache(1, len(ids))
        return model.logits(model.hidden(torch.tensor([ids]), 0, cache))[0].numpy()


@pytest.mark.llamacpp
@pytest.mark.parametrize("kind", [T.TQ2_0, T.TQ1_0], ids=["TQ2_0", "TQ1_0"])
def test_llamacpp_runs_the_single_plane_file(tiny_f16, tmp_path, kind, monkeypatch):
    """Stock llama.cpp loads the 1-plane file and the engine's llamacpp numerics give its logits
    bit for bit, at any torch thread count: ggml_kernels.c runs vec_dot_tq1_0 / tq2_0_q8_K's
    order (the kernel llama.cpp runs for TQ weights at every batch size, repacked or not, AMX or
    not; engine/kernels/cpu.py). Its f32 numerics do not quantize the activations and agree to
    2% (measured 1.25%), the same top-1 token everywhere.
    The twin: the TQ products as the engine ran them before that kernel (llama.cpp's Q8_K
    activations, then f32 sums in torch's order: activation_matmul) miss llama.cpp's bits."""
    from engine.export.llamacpp import open_llama
    from engine.kernels import ggml_matmul
    from engine.models import native_forward, packed

    out = tmp_path / "one.gguf"
    convert_ptqtp(tiny_f16, out, planes=1, plane_type=kind)
    ids = [1, 40, 7, 200, 12, 99, 5, 261, 33, 18]
    llm = open_llama(str(out), logits_all=True, n_ctx=64, n_threads=2, verbose=False)
    llm.eval(ids)
    theirs = np.array(llm.scores[: len(ids)])
    llm.close()
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            ours = _engine_logits(out, ids)
            assert np.array_equal(ours, theirs), (threads, float(np.abs(ours - theirs).max()))
    finally:
        torch.set_num_threads(before)
    ours = _engine_logits(out, ids, numerics="f32")
    assert np.abs(ours - theirs).max() <= 0.02 * np.abs(theirs).max()
    assert (ours.argmax(1) == theirs.argmax(1)).all()

    def no_ternary(ggml_type, rows):
        return T(ggml_type) not in (T.TQ1_0, T.TQ2_0) and ggml_matmul.supports_exact(ggml_type,
                                                                                      rows)

    monkeypatch.setattr(packed, "supports_exact", no_ternary)
    monkeypatch.setattr(native_forward, "supports_exact", no_ternary)
    summed = _engine_logits(out, ids)
    assert np.abs(summed - theirs).max() <= 1e-2 * np.abs(theirs).max()
    assert not np.array_equal(summed, theirs)


def test_two_plane_c_forward_equals_the_sum_of_plane_matmuls(tmp_path, monkeypatch):
    """The C decoder serves a 2-plane file (each TQ weight = plane 1 + plane 2 in one kernel)
    and gives the torch path's logits bit for bit, whose PlaneSumLinear adds two separate plane
    matmuls (two f32 terms: the same sum in either order). The twin: the C weights without their
    second plane give other logits."""
    from engine.kernels.native import kernels
    from engine.llm.native_lm import load_native_lm
    from engine.models import native_forward

    if kernels() is None:
        pytest.skip("no C compiler to build ggml_kernels.c")
    src = write_tiny_gguf(tmp_path / "tiny.gguf", "gemma3", "F16", n_layers=2)
    ids = [1, 40, 7, 200, 12, 99, 5, 261, 33, 18]
    for kind in (T.TQ2_0, T.TQ1_0):
        out = convert_ptqtp(src, tmp_path / f"two-{kind.name}.gguf", planes=2, iterations=4,
                            plane_type=kind).path
        c_forward = _engine_logits(out, ids)
        assert np.array_equal(c_forward, _engine_logits(out, ids, native=False)), kind.name
        lm, _ = load_native_lm(out)       # the torch-free decoder of generate / chat
        assert np.array_equal(lm.last_logits(ids, 0, lm.new_cache(len(ids))), c_forward[-1])
    real = native_forward._plane_sum_weight

    def first_plane_only(linear):
        weight = real(linear)
        weight.struct.q2 = None
        return weight

    monkeypatch.setattr(native_forward, "_plane_sum_weight", first_plane_only)
    assert not np.array_equal(_engine_logits(out, ids), c_forward)


# -- serving and training over a 2-plane file (subprocess jobs) --------------------------------

@pytest.mark.slow
def test_generate_verify_grads_and_a_lora_run_over_a_two_plane_base(tmp_path):
    """`generate --model` runs the 2-plane file; verify-grads passes with it as the frozen base;
    a short LoRA SFT run on the pirate pairs trains over it (loss falls) and leaves it intact."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from lm_pretrain_support import forgebench
    from lm_sft_support import write_config

    from engine.fsutil import sha256_file

    src = write_tiny_gguf(tmp_path / "tiny.gguf", arch="gemma3", qtype="F16", n_layers=2)
    base = convert_ptqtp(src, tmp_path / "tiny-ptqtp2.gguf", planes=2).path
    before = sha256_file(base)
    out = forgebench("generate", "--model", str(base), "--prompt", "hello world",
                     "--max-tokens", "4")
    assert out.stdout.strip()
    config = write_config(tmp_path, base, steps=6)
    checks = {r["check"]: r for r in json.loads(
        forgebench("verify-grads", str(config), "--samples", "8", "--json").stdout)}
    assert all(r["passed"] for r in checks.values()), checks
    assert checks["frozen-base"]["base_bytes_unchanged"]
    forgebench("run", str(config), "--out", str(tmp_path / "run"))
    losses = [m["loss"] for m in map(json.loads, (tmp_path / "run" / "metrics.jsonl")
                                     .read_text().splitlines()) if m.get("split") == "train"]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert sha256_file(base) == before

    # the export: merged into the dense weights (convert sums the planes), then like any other
    # run; or the adapter alone, as a GGUF LoRA against the 2-plane file
    dense = tmp_path / "dense.gguf"
    forgebench("convert", str(base), "--dtype", "f32", "--out", str(dense))
    forgebench("export", str(tmp_path / "run"), "--dtype", "f16", "--base", str(dense),
               "--out", str(tmp_path / "merged"), "--no-report")
    forgebench("export", str(tmp_path / "run"), "--dtype", "adapter",
               "--out", str(tmp_path / "adapter"), "--no-report")
    assert (tmp_path / "adapter" / "adapter.gguf").is_file()
    from engine.export.equivalence import _load_engine

    adapter = next((tmp_path / "run" / "checkpoints").glob("*/adapters.safetensors"))
    trained = _load_engine({"kind": "gguf", "path": str(base), "lora": str(adapter)})[0]
    merged = _load_engine({"kind": "gguf", "path": str(tmp_path / "merged" / "model.gguf")})[0]
    ids = torch.tensor([[1, 40, 7, 200, 12, 99, 5]])
    with torch.no_grad():
        ours, theirs = merged(ids), trained(ids)
    # the merged weights stored as f16: rounding of 2^-11 of each weight
    assert float((ours - theirs).abs().max()) <= 1e-2 * float(theirs.abs().max())


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max(1, keepdims=True)
    return x - np.log(np.exp(x).sum(1, keepdims=True))


def _mean_kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    p, q = _log_softmax(p_logits), _log_softmax(q_logits)
    return float((np.exp(p) * (p - q)).sum(1).mean())


@pytest.mark.realmodel
@pytest.mark.llamacpp
def test_gemma_single_plane_file_runs_in_llamacpp_and_agrees_with_the_engine(gemma_gguf,
                                                                          tmp_path):
    """gemma-3-270m (from its Q4_K_M, dequantized per tensor) as a 1-plane PTQTP file: the
    decomposable projections (attn_output, ffn_down: 640-wide rows do not fill TQ2_0 blocks)
    become TQ2_0 and llama.cpp loads and runs the file.

    The engine's llamacpp numerics give llama.cpp's logits on the file bit for bit (every
    weight type in it, TQ2_0 included, has its llama.cpp kernel in ggml_kernels.c). One ternary
    plane damages this model so much that its logits are chaotic, so the twin is far from
    subtle: llama.cpp on the same weights stored as F16 (its activations then rounded to f16, not
    Q8_K) differs from itself on TQ2_0 by a mean KL of 0.85 over 12 tokens, and the engine's
    logits are not those."""
    from engine.export.llamacpp import open_llama
    from engine.gguf.writer import TensorEntry, read_gguf_content, write_gguf
    from engine.models.gguf_model import load_gguf_model

    result = convert_ptqtp(gemma_gguf, tmp_path / "gemma-ptqtp1.gguf", planes=1)
    report = result.report
    assert report["dequantized_source"] and report["decomposed"] == 36
    assert {r["name"].split(".")[2] for r in report["tensors"] if "rel_error" in r} \
        == {"attn_output", "ffn_down"}
    assert all(0 < r["rel_error"] < 0.6 for r in report["tensors"] if "rel_error" in r)
    content = read_gguf_content(result.path)
    expanded = [TensorEntry(t.name, T.F16, t.shape, quants.dequantize(
        np.asarray(t.data, dtype=np.uint8), T.TQ2_0).reshape(t.shape).astype(np.float16))
        if t.ggml_type == T.TQ2_0 else t for t in content.tensors]
    f16 = write_gguf(tmp_path / "gemma-ptqtp1-f16.gguf", content.metadata, expanded,
                     version=content.version)
    ids = [2, 818, 5279, 529, 7001, 563, 496, 236764, 506, 1304, 13550, 236761]
    theirs = {}
    for name, path in (("tq2_0", result.path), ("f16", f16)):
        llm = open_llama(str(path), logits_all=True, n_ctx=64, n_threads=2, verbose=False)
        llm.eval(ids)
        theirs[name] = np.array(llm.scores[: len(ids)])
        llm.close()
    assert np.isfinite(theirs["tq2_0"]).all()
    model, _ = load_gguf_model(result.path, tokenizer=False, numerics="llamacpp")
    with torch.no_grad():
        cache = model.new_cache(1, len(ids))
        ours = model.logits(model.hidden(torch.tensor([ids]), 0, cache))[0].numpy()
    assert np.array_equal(ours, theirs["tq2_0"]), float(np.abs(ours - theirs["tq2_0"]).max())
    assert _mean_kl(theirs["tq2_0"], theirs["f16"]) > 0.1
    assert not np.array_equal(ours, theirs["f16"])


# -- the importance (imatrix) from calibration text --------------------------------------------

def test_importance_is_the_mean_square_of_each_projection_input(tiny_f16):
    """Layer 0's q/k/v read RMSNorm(embedding) of every token of every chunk (each chunk BOS +
    ctx − 1 tokens): the recorded mean squares equal that computed by hand from the file's
    embedding and norm tensors; the twin without the norm weight does not."""
    from engine.gguf.writer import read_gguf_content
    from engine.models.gguf_model import load_gguf_model
    from engine.ptqtp.imatrix import collect_importance

    text = "the quick brown fox jumps over the lazy dog " * 4
    imp = collect_importance(tiny_f16, text, dataset="fox", ctx=8, threads=1)
    _, tok = load_gguf_model(tiny_f16)
    ids = tok.encode(text, add_special=False)
    chunks = [[tok.bos_id] + ids[i:i + 7] for i in range(0, len(ids), 7)]
    chunks = [c for c in chunks if len(c) > 2]
    assert (imp.chunks, imp.tokens, imp.dataset) == (len(chunks), sum(map(len, chunks)), "fox")
    tensors = {t.name: t for t in read_gguf_content(tiny_f16).tensors}
    from engine.gguf.convert import _to_f32
    emb = torch.tensor(np.array(_to_f32(tensors["token_embd.weight"])), dtype=torch.float64)
    norm = torch.tensor(np.array(_to_f32(tensors["blk.0.attn_norm.weight"])), dtype=torch.float64)
    x = emb[[i for c in chunks for i in c]]
    normed = x / torch.sqrt(x.square().mean(1, keepdim=True) + 1e-5)
    expected = (normed * norm).square().mean(0).numpy()
    for name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"):
        np.testing.assert_allclose(imp.values[name], expected, rtol=1e-4)
    assert not np.allclose(imp.values["blk.0.attn_q.weight"], normed.square().mean(0).numpy(),
                           rtol=1e-2)
    assert len(imp.values) == 14 and imp.values["blk.1.ffn_down.weight"].shape == (512,)


def test_convert_with_an_importance_records_it_and_refuses_a_wrong_one(tiny_f16, tmp_path):
    from dataclasses import replace

    from engine.ptqtp.imatrix import collect_importance

    imp = collect_importance(tiny_f16, "a b c d e f g h i j k l m n o p " * 8, dataset="abc",
                             ctx=32, threads=1)
    out = tmp_path / "aware.gguf"
    result = convert_ptqtp(tiny_f16, out, planes=2, iterations=2, importance=imp)
    reader = GGUFReader(out)
    field = reader.fields["ptqtp.imatrix.dataset"]
    assert bytes(field.parts[-1]).decode() == "abc"
    assert bytes(reader.fields["ptqtp.importance"].parts[-1]).decode() == "imatrix"
    assert int(reader.fields["ptqtp.imatrix.chunks_count"].parts[-1][0]) == imp.chunks
    row = next(r for r in result.report["tensors"] if r["name"] == "blk.0.ffn_down.weight")
    assert 0 < row["rel_error_weighted"] < 1
    assert result.report["importance"]["tokens"] == imp.tokens
    values = dict(imp.values)
    values.pop("blk.1.ffn_up.weight")
    with pytest.raises(ForgebenchError, match="no entry") as err:
        convert_ptqtp(tiny_f16, tmp_path / "x.gguf", importance=replace(imp, values=values))
    assert err.value.where == "blk.1.ffn_up.weight"
    values["blk.1.ffn_up.weight"] = np.ones(3)
    with pytest.raises(ForgebenchError, match="holds"):
        convert_ptqtp(tiny_f16, tmp_path / "y.gguf", importance=replace(imp, values=values))
