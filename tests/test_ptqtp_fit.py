"""PTQTP's fit to a layer's inputs and its file-size budget (engine/ptqtp/decompose.py's error
feedback, engine/ptqtp/gguf_file.py's `max_bytes`).

The error feedback is checked against a reference written from its definition (after each
column is rounded, the columns after it move to the least-squares best compensation of that
column's output error, solved from the inputs X with numpy's lstsq, not from H⁻¹'s Cholesky),
and against the plain fit on correlated inputs; the budget against the `gguf` package's
reference quantizer and a file written and measured."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, quants

from engine.errors import ForgebenchError
from engine.ptqtp import decompose as D

torch.set_num_threads(2)


def _inputs(n, cols, seed, factors=16):
    """n input rows of `cols` columns, correlated as a layer's inputs are: independent noise
    plus a few shared factors, each column with its own scale."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, cols)) + (rng.standard_normal((n, factors))
                                          @ rng.standard_normal((factors, cols)))
    return z * rng.uniform(0.3, 2.0, cols)


def _out_err(x, w, approx):
    return float(np.linalg.norm(x @ (np.asarray(w, dtype=np.float64)
                                     - np.asarray(approx, dtype=np.float64)).T))


def _reference_feedback(w, x, group, planes=2):
    """GPTQ from its definition, without H⁻¹: per group the scales of the plain weighted fit on
    the group's current values; per column the nearest level, then the later columns W[:, >i]
    += D with D = argmin ‖X[:, >i] D − X[:, i] eᵀ‖ (lstsq), e the column's error."""
    w = np.array(w, dtype=np.float64)
    rows, cols = w.shape
    h = D.column_weights((x * x).mean(0), cols)
    out = np.zeros_like(w)
    for c0 in range(0, cols, group):
        c1 = c0 + group
        _, alpha = D.decompose_groups(torch.tensor(w[:, c0:c1]).float(), planes, h=h[c0:c1]
                                      .expand(rows, group))
        levels = alpha.double().numpy()
        for i in range(c0, c1):
            t = D.nearest_levels(torch.tensor(w[:, i]).float(), alpha).double().numpy()
            out[:, i] = (t * levels).sum(1)
            e = w[:, i] - out[:, i]
            if i + 1 < cols:
                d, *_ = np.linalg.lstsq(x[:, i + 1:], np.outer(x[:, i], e), rcond=None)
                w[:, i + 1:] += d.T
    return out


def test_error_feedback_equals_the_least_squares_compensation_reference():
    """damp 0: the Cholesky-of-H⁻¹ updates are exactly the lstsq compensation, column by
    column, across a group boundary (two groups of 16)."""
    x = _inputs(400, 32, 1)
    w = np.random.default_rng(2).standard_normal((6, 32))
    dec = D.decompose(w, planes=2, group=16, hessian=x.T @ x / len(x), damp=0.0)
    expected = _reference_feedback(w, x, 16)
    np.testing.assert_allclose(dec.dense().double().numpy(), expected, rtol=1e-4, atol=1e-5)


def test_twin_feedback_through_the_wrong_inputs_differs_from_the_reference():
    x = _inputs(400, 32, 1)
    other = _inputs(400, 32, 9)
    w = np.random.default_rng(2).standard_normal((6, 32))
    dec = D.decompose(w, planes=2, group=16, hessian=other.T @ other / len(other), damp=0.0)
    assert not np.allclose(dec.dense().double().numpy(), _reference_feedback(w, x, 16),
                           atol=1e-3)


@pytest.mark.parametrize("planes", [1, 2])
def test_error_feedback_lowers_the_output_error_on_correlated_inputs(planes):
    """On correlated inputs the feedback fit's ‖X(W − Ŵ)ᵀ‖ is well below the per-column
    weighted fit's (diag H as the importance) — while its plain ‖W − Ŵ‖ is higher: the fit
    trades weight error for output error, so a check in the weights' norm would reject it."""
    x = _inputs(2048, 512, 3)
    w = np.random.default_rng(4).standard_normal((48, 512))
    hessian = x.T @ x / len(x)
    plain = D.decompose(w, planes=planes, importance=np.diag(hessian)).dense()
    fed = D.decompose(w, planes=planes, hessian=hessian).dense()
    assert _out_err(x, w, fed) < 0.5 * _out_err(x, w, plain)
    assert D.relative_error(w, fed) > D.relative_error(w, plain)
    assert D.output_error(w, fed, hessian) == pytest.approx(
        _out_err(x, w, fed) / float(np.linalg.norm(x @ w.T)), rel=1e-6)


def _nearest_everywhere(w, dec):
    """Whether every entry of `dec` is the nearest of its row-group's levels to W itself."""
    rows, cols = w.shape
    groups = torch.tensor(w).float().reshape(rows * cols // dec.group, dec.group)
    alpha = dec.scales.permute(1, 2, 0).reshape(-1, 2)
    t = D.search_trits(groups, alpha).reshape(rows, cols // dec.group, 2, dec.group)
    return torch.equal(t.permute(2, 0, 1, 3).reshape(2, rows, cols).to(torch.int8), dec.planes)


def test_uncorrelated_inputs_move_no_error_and_correlated_ones_do():
    """A diagonal H moves nothing onto the later columns (U is diagonal): every entry is the
    nearest level of W itself, as in the per-column weighted fit. The twin: with correlated
    inputs the entries are the nearest levels of the compensated values, not of W."""
    w = np.random.default_rng(5).standard_normal((16, 512))
    h = np.random.default_rng(6).uniform(0.1, 3.0, 512)
    assert _nearest_everywhere(w, D.decompose(w, planes=2, hessian=np.diag(h)))
    x = _inputs(2048, 512, 7)
    assert not _nearest_everywhere(w, D.decompose(w, planes=2, hessian=x.T @ x / len(x)))


def test_feedback_refuses_bad_hessians():
    w = np.ones((4, 256))
    with pytest.raises(ValueError, match="shape"):
        D.decompose(w, hessian=np.eye(128))
    with pytest.raises(ValueError, match="finite"):
        D.decompose(w, hessian=np.full((256, 256), np.nan))
    with pytest.raises(ValueError, match="not both"):
        D.decompose(w, hessian=np.eye(256), importance=np.ones(256))


# -- the size budget ---------------------------------------------------------------------------

def _budget_model(path):
    """A model whose 96-wide projections PTQTP cannot take (Q8_0, one of them heavy-tailed so
    that stepping it down costs more) beside one 256-wide matrix it decomposes."""
    import gguf

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    kept = {"blk.0.attn_q.weight": rng.standard_t(2, (64, 96)),
            "blk.0.ffn_gate.weight": rng.standard_normal((128, 96)),
            "blk.0.ffn_up.weight": rng.standard_normal((128, 96))}
    for name, values in kept.items():
        w.add_tensor(name, quants.quantize(values.astype(np.float32), T.Q8_0),
                     raw_dtype=T.Q8_0)
    w.add_tensor("blk.0.ffn_down.weight", rng.standard_normal((96, 256)).astype(np.float16))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(96, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, kept


def _reference_cost(values, kind, source=T.Q8_0):
    """Added relative squared error per byte saved of the step Q8_0 -> kind, by the `gguf`
    package's reference quantizer."""
    src = quants.dequantize(quants.quantize(values.astype(np.float32), source), source)
    approx = quants.dequantize(quants.quantize(src, kind), kind)
    err = float(np.square(src - approx).sum() / np.square(src).sum())
    bits = {T.Q8_0: 8.5, T.Q5_0: 5.5, T.Q4_0: 4.5}
    return err / (src.size * (bits[source] - bits[kind]) / 8)


def test_size_budget_steps_the_least_harmed_tensor_down_and_the_file_fits(tmp_path):
    from engine.ptqtp.gguf_file import convert_ptqtp

    src, kept = _budget_model(tmp_path / "src.gguf")
    full = convert_ptqtp(src, tmp_path / "full.gguf", iterations=2)
    size = full.path.stat().st_size
    same = convert_ptqtp(src, tmp_path / "same.gguf", iterations=2, max_bytes=size)
    assert same.report["budget"]["steps"] == [] and same.path.stat().st_size == size
    # a budget one step (Q8_0 -> Q5_0 of a 128×96 matrix saves 4608 bytes) below the full file
    budget = size - 4000
    fit = convert_ptqtp(src, tmp_path / "fit.gguf", iterations=2, max_bytes=budget)
    steps = fit.report["budget"]["steps"]
    assert fit.path.stat().st_size == fit.report["budget"]["bytes"] <= budget
    costs = {n: _reference_cost(v, T.Q5_0) for n, v in kept.items()}
    assert [s["name"] for s in steps] == [min(costs, key=costs.get)]
    assert costs["blk.0.attn_q.weight"] > max(costs["blk.0.ffn_gate.weight"],
                                              costs["blk.0.ffn_up.weight"])
    # the stepped tensor is the reference quantizer's bytes of the source's values
    name = steps[0]["name"]
    tensor = next(t for t in GGUFReader(fit.path).tensors if t.name == name)
    assert tensor.tensor_type == T.Q5_0
    src_values = quants.dequantize(quants.quantize(kept[name].astype(np.float32), T.Q8_0),
                                   T.Q8_0)
    assert bytes(tensor.data) == bytes(quants.quantize(src_values, T.Q5_0))
    row = next(r for r in fit.report["tensors"] if r["name"] == name)
    assert row["stepped_down"] == "Q8_0 -> Q5_0 (size budget)"


def test_size_budget_that_nothing_can_meet_is_refused(tmp_path):
    from engine.ptqtp.gguf_file import convert_ptqtp

    src, _ = _budget_model(tmp_path / "src.gguf")
    with pytest.raises(ForgebenchError, match="over the") as err:
        convert_ptqtp(src, tmp_path / "x.gguf", iterations=2, max_bytes=1000)
    assert err.value.where == "--max-size"
    assert not (tmp_path / "x.gguf").exists()


def test_cli_calibration_fits_with_error_feedback_unless_told_not_to(tmp_path, capsys):
    from engine.cli import main
    from tests.fixtures_gguf import write_tiny_gguf

    src = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", "F16")
    text = tmp_path / "calibration.txt"
    text.write_text("a b c d e f g h i j k l m n o p " * 8)
    out = tmp_path / "fed.gguf"
    assert main(["convert", str(src), "--dtype", "ptqtp", "--calibration", str(text),
                 "--out", str(out)]) == 0
    assert "error feedback (GPTQ)" in capsys.readouterr().out
    assert bytes(GGUFReader(out).fields["ptqtp.error_feedback"].parts[-1]).decode() == "gptq"
    report = (tmp_path / "fed.gguf.ptqtp.json").read_text()
    assert '"rel_error_output"' in report
    plain = tmp_path / "diag.gguf"
    assert main(["convert", str(src), "--dtype", "ptqtp", "--calibration", str(text),
                 "--no-error-feedback", "--out", str(plain)]) == 0
    assert bytes(GGUFReader(plain).fields["ptqtp.error_feedback"].parts[-1]).decode() == "none"
    # a size nothing can meet: one line naming --max-size, nothing written
    assert main(["convert", str(src), "--dtype", "ptqtp", "--max-size", "0.001",
                 "--out", str(tmp_path / "x.gguf")]) == 2
    assert "--max-size" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()
