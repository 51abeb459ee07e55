"""PTQTP: a weight matrix as a sum of ternary planes with real scales (arXiv 2509.16989).

    W[r, group j] ≈ α¹[r, j]·T¹[r, group j] + α²[r, j]·T²[r, group j],   T ∈ {−1, 0, +1}

Each (row, group) vector w ∈ R^g is independent, so a matrix is cut into row chunks and every
chunk is solved at once (vectorised; bounded memory: `CHUNK_ENTRIES` values at a time).

The error minimised is the weighted squared error J = Σ_i h_i (w_i − α¹t¹_i − α²t²_i)², with
h the per-input-column importance (`importance`: the mean square of that column's input
activations over calibration text, as llama-imatrix collects it, engine/ptqtp/imatrix.py), or
h = 1 without one. The error that matters for the model is ‖X(W − Ŵ)‖² over its inputs X, whose
diagonal part is exactly J with h_i = E[x_i²]; llama.cpp's K-quants weight their fits the same
way when given an imatrix.

The solver, for one group (several starts, then alternating):

1. Starts. (a) Progressive (the paper's): plane 1 is the best single ternary plane of w (below),
   plane 2 the same on the residual w − α¹T¹. (b) Ratio starts: α² = ρ·α¹ for ρ in
   `RATIO_STARTS`, α¹ set so that the largest level α¹ + α² is a fraction (`START_FRACTIONS`) of
   max |w|, the trits searched for them and `START_ROUNDS` alternating rounds run. Each group
   keeps its best start. The progressive start alone is a poor local optimum for heavy-tailed
   groups (plane 1 spends its single scale on the bulk, plane 2 cannot then reach the tails): on
   200 Student-t(3) groups of 256 it stopped at relative error 0.323 where a 40×40 grid of starts
   reached 0.278; with the ratio starts the fit is within 2% of such a grid
   (tests/test_ptqtp.py), and on gemma-3-270m's attn_output/ffn_down the mean relative error went
   from 0.187 to 0.174 (docs/ptqtp.md).
2. Alternate, for `iterations` rounds:
   - scales for fixed planes: the ridge regression α = (TᵀHT + λI)⁻¹TᵀHw, a 2×2 system per group
     (closed form, f64);
   - planes for fixed scales: per entry, the nearest of the 9 values α¹a + α²b, a, b ∈ {−1,0,1}
     (optimal entry by entry for any positive h, since J is a sum of one term per entry).
   Both steps minimise J + λ‖α‖² exactly, so it never increases for a fixed λ. The
   regularisation is adaptive: λ = `ridge`·tr(TᵀHT)/2 scales with the planes' own Gram matrix,
   so it is relatively small for every group and keeps the system solvable when the planes are
   (nearly) collinear or a plane is all zero; a round is accepted per group only where it does
   not increase J, so J never increases across rounds (`Decomposition.history` records it).
3. Stored scales are f16 (llama.cpp's TQ2_0 block scale): the scales are rounded to f16, made
   non-negative (a negative α flips its plane's signs) and the planes are searched once more
   for those exact scales, so the planes written are optimal for the scales written.

Best single plane: for k nonzeros the best choice is the k largest |w| with their signs and
α = Σ h|w| / Σ h over them (for the optimal α an entry is nonzero exactly when |w| > α/2, so
the support is a top-k set by |w| whatever h is); J = Σ h w² − (Σ h|w|)²/Σ h over the top k, so
k = argmax (Σ h|w|)²/Σ h is found exactly by a sort and two cumulative sums.

One plane (`planes=1`) is that alone (exactly optimal up to the f16 rounding), then step 3.

Error feedback (`hessian`, GPTQ: Frantar et al. 2022, arXiv 2210.17323). The diagonal weighting
above ignores that a layer's input columns are correlated: with H = XᵀX/n (the inputs' second
moments, engine/ptqtp/imatrix.py) the output error is tr((W − Ŵ) H (W − Ŵ)ᵀ), and an error
made in one column can be partly cancelled by changing the columns not yet quantized. With
`hessian`, the groups of 256 columns are quantized left to right: each group's scales are fitted
as above (weighted by diag H) on the group's current values, then its columns are rounded one
at a time to the nearest of that row's 9 levels, and each column's error e is pushed onto the
columns after it through the upper Cholesky factor U of H⁻¹ (H⁻¹ = UᵀU): W[:, j] −= e/U_ii·U_ij,
j > i, which is the least-squares optimal change of the remaining columns for the error just
made (the inverse of H restricted to the remaining columns is U's trailing block squared).
H is damped by `damp`·mean(diag H) on its diagonal (a few directions of the calibration text
are nearly unused; GPTQ's 1%). The planes written then no longer hold each entry's nearest
level of W: they are the nearest of the compensated values, which is what lowers
‖X(W − Ŵ)‖ (tests/test_ptqtp.py measures both).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.kernels.cpu import torch_threads

CHUNK_ENTRIES = 1 << 20      # values solved at once (a few f32/f64 copies of them live)
DEFAULT_ITERATIONS = 30
DEFAULT_RIDGE = 1e-6
TOLERANCE = 1e-4           # stop when a round gains less than this share of the error
RATIO_STARTS = (0.2, 0.4, 0.6, 0.8)   # α²/α¹ of the ratio starts (step 1b)
IMPORTANCE_FLOOR = 1e-2    # added to the mean-1 column weights (see `decompose`)
START_FRACTIONS = (0.5, 0.75, 1.0)   # (α¹ + α²)/max|w| of the ratio starts
START_ROUNDS = 2           # alternating rounds each ratio start runs before the best is kept
DEFAULT_DAMP = 0.01        # error feedback: H + damp·mean(diag H)·I (GPTQ's default)


@dataclass
class Decomposition:
    """planes: int8 [P, rows, cols] in {−1,0,1}; scales: f32 [P, rows, groups] (f16-exact,
    ≥ 0); `history`: the total (importance-weighted, when the decomposition had one) squared
    reconstruction error after the start and each round."""

    planes: torch.Tensor
    scales: torch.Tensor
    group: int
    history: list[float] = field(default_factory=list)

    def plane_dense(self, p: int) -> torch.Tensor:
        rows, cols = self.planes.shape[1:]
        s = self.scales[p].repeat_interleave(self.group, dim=1)
        return self.planes[p].float() * s

    def dense(self) -> torch.Tensor:
        return sum(self.plane_dense(p) for p in range(self.planes.shape[0]))


def best_single_plane(w: torch.Tensor, h: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """w [n, g], h [n, g] ≥ 0 (None: all 1) -> (t [n, g] in {−1,0,1}, α [n]): the exact
    minimiser of Σ h (w − α t)² over α ≥ 0 and ternary t (see the module docstring)."""
    a = w.abs().double()
    sorted_abs, order = torch.sort(a, dim=1, descending=True)
    if h is None:
        sums = torch.cumsum(sorted_abs, dim=1)
        mass = torch.arange(1, w.shape[1] + 1, dtype=torch.float64).expand_as(sums)
    else:
        hs = h.double().gather(1, order)
        sums = torch.cumsum(hs * sorted_abs, dim=1)
        mass = torch.cumsum(hs, dim=1)
    gain = torch.where(mass > 0, sums * sums / torch.where(mass > 0, mass, 1.0), 0.0)
    k_best = torch.argmax(gain, dim=1)                               # 0-based: k_best + 1 kept
    m = mass.gather(1, k_best[:, None])[:, 0]
    alpha = torch.where(m > 0, sums.gather(1, k_best[:, None])[:, 0] / torch.where(m > 0, m, 1.0),
                        0.0)
    keep_sorted = torch.arange(w.shape[1])[None, :] <= k_best[:, None]
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    t = torch.where(keep, torch.sign(w), torch.zeros_like(w))
    alpha = torch.where(sorted_abs[:, 0] > 0, alpha, torch.zeros_like(alpha))
    return t.float(), alpha.float()


def solve_scales(w: torch.Tensor, t: torch.Tensor, ridge: float = DEFAULT_RIDGE,
                 h: torch.Tensor | None = None) -> torch.Tensor:
    """w [n, g], t [n, P, g], h [n, g] ≥ 0 (None: all 1) -> α [n, P] minimising
    Σ h (w − Σ_p α_p t_p)² + λ‖α‖² with λ = ridge·tr(TᵀHT)/P (ridge=0: plain weighted least
    squares where TᵀHT is invertible)."""
    wd, td = w.double(), t.double()
    tw = td if h is None else td * h.double()[:, None, :]
    gram = torch.einsum("npg,nqg->npq", tw, td)
    rhs = torch.einsum("npg,ng->np", tw, wd)
    planes = t.shape[1]
    lam = ridge * torch.diagonal(gram, dim1=1, dim2=2).sum(1) / planes
    eye = torch.eye(planes, dtype=torch.float64)
    gram = gram + lam[:, None, None] * eye
    # an all-zero plane (or group) leaves a zero row: pin its scale at 0 instead of dividing
    empty = torch.diagonal(gram, dim1=1, dim2=2) <= 0
    gram = gram + empty.double().diag_embed()
    return torch.linalg.solve(gram, rhs[..., None])[..., 0].float()


def search_trits(w: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """w [n, g], α [n, 2] -> t [n, 2, g]: per entry the (a, b) ∈ {−1,0,1}² whose α¹a + α²b is
    nearest to w. For each a the best b is the rounded, clamped (w − α¹a)/α², so 3 candidates
    cover the 9 pairs. Nearest per entry minimises any positively weighted sum of squared errors
    too, so the importance-weighted fit uses the same search."""
    a1, a2 = alpha[:, 0:1], alpha[:, 1:2]
    inv2 = torch.where(a2 != 0, 1.0 / torch.where(a2 != 0, a2, torch.ones_like(a2)),
                       torch.zeros_like(a2))
    best_err = best_a = best_b = None
    for a in (0.0, -1.0, 1.0):
        r = w - a1 * a
        b = torch.clamp(torch.round(r * inv2), -1, 1)
        err = (r - a2 * b).square_()
        if best_err is None:
            best_err, best_a, best_b = err, torch.zeros_like(w), b
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_a = torch.where(better, torch.full_like(w, a), best_a)
            best_b = torch.where(better, b, best_b)
    return torch.stack([best_a, best_b], dim=1)


def _sq_error(w: torch.Tensor, t: torch.Tensor, alpha: torch.Tensor,
              h: torch.Tensor | None = None) -> torch.Tensor:
    recon = torch.einsum("npg,np->ng", t.double(), alpha.double())
    sq = (w.double() - recon).square()
    return (sq if h is None else sq * h.double()).sum(1)


def _f16_planes(w, t, alpha):
    """Scales rounded to f16 and made ≥ 0 (flipping the plane); planes re-searched for them."""
    alpha = alpha.half().float()
    t = t * torch.where(alpha < 0, -1.0, 1.0)[:, :, None]
    alpha = alpha.abs()
    if t.shape[1] == 2:
        t = search_trits(w, alpha)
    else:
        # one plane: nearest of {−α, 0, α}
        t = torch.where(w.abs() > alpha / 2, torch.sign(w), torch.zeros_like(w))[:, None, :]
    return t, alpha


def _keep_better(best, candidate):
    """Per group, the (error, t, α) of lower error (ties keep `best`)."""
    err, t, alpha = best
    new_err, new_t, new_alpha = candidate
    better = new_err < err
    return (torch.where(better, new_err, err), torch.where(better[:, None, None], new_t, t),
            torch.where(better[:, None], new_alpha, alpha))


def _two_plane_start(w, h, ridge):
    """Step 1: the progressive start and the ratio starts; per group the best -> (err, t, α)."""
    t1, a1 = best_single_plane(w, h)
    t2, a2 = best_single_plane(w - a1[:, None] * t1, h)
    t = torch.stack([t1, t2], dim=1)
    alpha = torch.stack([a1, a2], dim=1)
    best = (_sq_error(w, t, alpha, h), t, alpha)
    top = w.abs().amax(1)
    for ratio, fraction in itertools.product(RATIO_STARTS, START_FRACTIONS):
        first = top * fraction / (1.0 + ratio)
        alpha = torch.stack([first, first * ratio], dim=1)
        t = search_trits(w, alpha)
        for _ in range(START_ROUNDS):
            alpha = solve_scales(w, t, ridge, h)
            t = search_trits(w, alpha)
        best = _keep_better(best, (_sq_error(w, t, alpha, h), t, alpha))
    return best


def decompose_groups(w: torch.Tensor, planes: int = 2, iterations: int = DEFAULT_ITERATIONS,
                     ridge: float = DEFAULT_RIDGE, history: list | None = None,
                     h: torch.Tensor | None = None):
    """w [n, g] (each row one group), h [n, g] ≥ 0 its entries' importance (None: all 1) ->
    (t [n, P, g] f32 in {−1,0,1}, α [n, P] f32)."""
    w = w.float()
    if planes == 1:
        t1, a1 = best_single_plane(w, h)
        t, alpha = t1[:, None, :], a1[:, None]
        if history is not None:
            history.append(float(_sq_error(w, t, alpha, h).sum()))
    else:
        err, t, alpha = _two_plane_start(w, h, ridge)
        if history is not None:
            history.append(float(err.sum()))
        for _ in range(iterations):
            new_alpha = solve_scales(w, t, ridge, h)
            new_t = search_trits(w, new_alpha)
            new_err = _sq_error(w, new_t, new_alpha, h)
            better = new_err <= err
            t = torch.where(better[:, None, None], new_t, t)
            alpha = torch.where(better[:, None], new_alpha, alpha)
            gain = float((err - torch.minimum(new_err, err)).sum())
            err = torch.minimum(new_err, err)
            if history is not None:
                history.append(float(err.sum()))
            if gain <= TOLERANCE * float(err.sum()):
                break
    t, alpha = _f16_planes(w, t, alpha)
    if t.shape[1] == 2:
        # the larger scale first: plane 1 alone is then the better single-plane approximation
        swap = alpha[:, 1] > alpha[:, 0]
        alpha = torch.where(swap[:, None], alpha.flip(1), alpha)
        t = torch.where(swap[:, None, None], t.flip(1), t)
    return t, alpha


def decompose(weight: torch.Tensor | np.ndarray, planes: int = 2, group: int | None = 256,
              iterations: int = DEFAULT_ITERATIONS, ridge: float = DEFAULT_RIDGE,
              threads: int = 1, importance: torch.Tensor | np.ndarray | None = None,
              hessian: torch.Tensor | np.ndarray | None = None,
              damp: float = DEFAULT_DAMP) -> Decomposition:
    """A [rows, cols] matrix -> its PTQTP planes; `group` columns share a scale (None: the
    whole row). The row length must be a multiple of the group.

    `importance` [cols]: each input column's weight in the error (the mean square of its
    activations, engine/ptqtp/imatrix.py), or None for the plain Frobenius error. It is used as
    importance / its mean + `IMPORTANCE_FLOOR`, so that a column calibration never saw active
    still counts a little (the calibration text is a sample of what the model will read).

    Runs on `threads` torch threads (default 1): the work is short element-wise passes, where
    torch's thread hand-offs cost more than they gain (a 640×2048 matrix on a shared 2-core
    machine: 5.2 s at 1 thread, 51.6 s at 2).

    `hessian` [cols, cols]: the inputs' second moments XᵀX/n, for the error feedback (module
    docstring); its diagonal is then the importance (`importance` must be None)."""
    with torch_threads(threads):
        if hessian is not None:
            if importance is not None:
                raise ValueError("give the importance or the hessian (its diagonal), not both")
            return _decompose_feedback(weight, planes, group, iterations, ridge, hessian, damp)
        return _decompose(weight, planes, group, iterations, ridge, importance)


def column_weights(importance, cols: int) -> torch.Tensor:
    """The per-column weights h [cols] the solver uses for `importance` (see `decompose`)."""
    imp = torch.as_tensor(np.array(importance, dtype=np.float64)).double()
    if imp.shape != (cols,):
        raise ValueError(f"importance has shape {tuple(imp.shape)}, not ({cols},)")
    if not bool(torch.isfinite(imp).all()) or bool((imp < 0).any()):
        raise ValueError("importance must be finite and non-negative")
    mean = float(imp.mean())
    if mean <= 0:
        return torch.ones(cols, dtype=torch.float32)
    return (imp / mean + IMPORTANCE_FLOOR).float()


def _matrix(weight, planes, group, dtype) -> tuple[torch.Tensor, int, int, int]:
    """`weight` as a `dtype` matrix with its rows, columns and group, or ValueError saying
    which of the three a decomposition cannot take."""
    w = torch.as_tensor(np.asarray(weight) if isinstance(weight, np.ndarray) else weight)
    w = w.detach().to(dtype)
    if w.ndim != 2:
        raise ValueError(f"PTQTP decomposes matrices, not shape {tuple(w.shape)}")
    if planes not in (1, 2):
        raise ValueError(f"planes must be 1 or 2, not {planes}")
    rows, cols = w.shape
    group = cols if group is None else int(group)
    if group <= 0 or cols % group:
        raise ValueError(f"the row length {cols} is not a multiple of the group {group}")
    return w, rows, cols, group


def _decompose(weight, planes, group, iterations, ridge, importance) -> Decomposition:
    w, rows, cols, group = _matrix(weight, planes, group, torch.float32)
    groups = cols // group
    flat = w.reshape(rows * groups, group)
    col_h = None if importance is None else column_weights(importance, cols).reshape(groups, group)
    chunk = max(1, CHUNK_ENTRIES // group)
    chunk = max(groups, chunk - chunk % groups)      # whole rows, so a chunk's h is col_h tiled
    ts, alphas, total = [], [], None
    for start in range(0, flat.shape[0], chunk):
        hist: list[float] = []
        part = flat[start:start + chunk]
        h = None if col_h is None else col_h.repeat(part.shape[0] // groups, 1)
        t, alpha = decompose_groups(part, planes, iterations, ridge, hist, h)
        ts.append(t.to(torch.int8))
        alphas.append(alpha)
        # chunks stop at different rounds: a finished chunk's error stays at its last value
        if total is None:
            total = hist
        else:
            n = max(len(total), len(hist))
            total = [(total[min(i, len(total) - 1)] + hist[min(i, len(hist) - 1)])
                     for i in range(n)]
    t = torch.cat(ts).reshape(rows, groups, planes, group).permute(2, 0, 1, 3)
    alpha = torch.cat(alphas).reshape(rows, groups, planes).permute(2, 0, 1)
    return Decomposition(t.reshape(planes, rows, cols).contiguous(), alpha.contiguous(), group,
                         total or [])


def feedback_factor(hessian, cols: int, damp: float = DEFAULT_DAMP) -> torch.Tensor:
    """U, the upper Cholesky factor of (H + damp·mean(diag H)·I)⁻¹ (f64 [cols, cols]); a column
    no calibration input reached (H_ii = 0) gets H_ii = 1 so that H stays invertible."""
    h = torch.as_tensor(np.array(hessian, dtype=np.float64)).double().clone()
    if h.shape != (cols, cols):
        raise ValueError(f"hessian has shape {tuple(h.shape)}, not ({cols}, {cols})")
    if not bool(torch.isfinite(h).all()):
        raise ValueError("hessian must be finite")
    h = (h + h.T) / 2
    diag = torch.diagonal(h)
    dead = diag <= 0
    h[dead, dead] = 1.0
    h += damp * float(torch.diagonal(h).mean()) * torch.eye(cols, dtype=torch.float64)
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(inverse, upper=True)


def nearest_levels(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """x [n], α [n, P] -> the trits [n, P] of the nearest of each row's levels Σ_p α_p t_p."""
    if alpha.shape[1] == 2:
        return search_trits(x[:, None], alpha)[:, :, 0]
    a = alpha[:, 0]
    return torch.where(x.abs() > a / 2, torch.sign(x), torch.zeros_like(x))[:, None]


def _decompose_feedback(weight, planes, group, iterations, ridge, hessian, damp
                        ) -> Decomposition:
    """The error-feedback fit (module docstring): group by group, left to right."""
    w, rows, cols, group = _matrix(weight, planes, group, torch.float64)
    u = feedback_factor(hessian, cols, damp)
    col_h = column_weights(np.diag(np.asarray(hessian, dtype=np.float64)), cols)
    work = w.clone()
    trits = torch.zeros(planes, rows, cols, dtype=torch.int8)
    scales = torch.zeros(planes, rows, cols // group)
    for j, c0 in enumerate(range(0, cols, group)):
        c1 = c0 + group
        h = col_h[c0:c1].expand(rows, group)
        _, alpha = decompose_groups(work[:, c0:c1].float(), planes, iterations, ridge, None, h)
        alpha_d = alpha.double()
        errors = torch.zeros(rows, group, dtype=torch.float64)
        for i in range(c0, c1):
            t = nearest_levels(work[:, i].float(), alpha).double()
            trits[:, :, i] = t.T.to(torch.int8)
            err = (work[:, i] - (t * alpha_d).sum(1)) / u[i, i]
            work[:, i + 1:c1] -= err[:, None] * u[i, i + 1:c1][None, :]
            errors[:, i - c0] = err
        work[:, c1:] -= errors @ u[c0:c1, c1:]
        scales[:, :, j] = alpha.T
    dec = Decomposition(trits, scales, group)
    h_full = torch.as_tensor(np.array(hessian, dtype=np.float64))
    diff = w - dec.dense().double()
    dec.history = [float(torch.einsum("rc,cd,rd->", diff, h_full, diff))]
    return dec


def output_error(weight, approx, hessian) -> float:
    """‖X(W − Ŵ)ᵀ‖ / ‖XWᵀ‖ over the inputs whose second moments are `hessian` (XᵀX/n): the
    relative error of the layer's outputs, correlations between input columns included."""
    h = torch.as_tensor(np.array(hessian, dtype=np.float64))
    w = torch.as_tensor(np.asarray(weight)).double()
    diff = w - torch.as_tensor(np.asarray(approx)).double()
    num = float(torch.einsum("rc,cd,rd->", diff, h, diff))
    den = float(torch.einsum("rc,cd,rd->", w, h, w))
    return (max(num, 0.0) / den) ** 0.5 if den > 0 else max(num, 0.0) ** 0.5


def absmean_ternary(weight: torch.Tensor, group: int | None = 256) -> Decomposition:
    """Plain round-to-nearest ternary, as BitNet b1.58 quantizes: per group α = mean |w|,
    t = clamp(round(w/α), −1, 1) — the baseline PTQTP's single plane is measured against."""
    w = torch.as_tensor(weight).detach().float()
    rows, cols = w.shape
    group = cols if group is None else group
    g = w.reshape(rows, cols // group, group)
    alpha = g.abs().mean(2).half().float()
    safe = torch.where(alpha > 0, alpha, torch.ones_like(alpha))
    t = torch.clamp(torch.round(g / safe[..., None]), -1, 1)
    t = torch.where(alpha[..., None] > 0, t, torch.zeros_like(t))
    return Decomposition(t.reshape(1, rows, cols).to(torch.int8), alpha[None], group)


def relative_error(weight: torch.Tensor, approx: torch.Tensor,
                   importance: torch.Tensor | np.ndarray | None = None) -> float:
    """‖W − Ŵ‖_F / ‖W‖_F (0 for an all-zero W reproduced exactly); with `importance` [cols] the
    same with every column weighted by it, ‖(W − Ŵ)·diag(√h)‖ / ‖W·diag(√h)‖ (the relative
    error of the layer's outputs when its inputs are uncorrelated with those mean squares)."""
    w = torch.as_tensor(weight).double()
    diff = w - torch.as_tensor(approx).double()
    if importance is not None:
        root = torch.as_tensor(np.asarray(importance, dtype=np.float64)).sqrt()
        w, diff = w * root, diff * root
    norm = float(w.norm())
    d = float(diff.norm())
    return d / norm if norm > 0 else d
