"""llama.cpp's quantized matmul kernels (ggml-cpu, x86 AVX2 / AVX-512 builds) reproduced to the bit.

Why bit for bit: every matmul's f32 output is requantized to Q8 before the next one, so a
last-bit difference now and then moves an activation across a rounding step, and Gemma's large
post-norm gains carry one such step into ~1 logit. Agreeing "to f32 summation order" is not
enough; the summation order itself has to be ggml's.

What ggml does, per weight type (sources: ggml-cpu/arch/x86/quants.c, arch/x86/repack.cpp,
llamafile/sgemm.cpp, tiled/ of the ggml in llama-cpp-python 0.3.36). Which kernel runs depends on
the batch size and on the configuration llama.cpp was opened in (engine/kernels/cpu.py: repacked,
its default, or without extra buffer types as open_llama opens an AMX build); `repacked` says
which weights are repacked:
- Q8_0 / Q5_0 / Q4_0 weights, Q8_0 activations (vec_dot_q*_0_q8_0 and tinyBLAS_Q0_AVX share one
  order): per block of 32, eight exact int32 lanes of four consecutive products; per block
  acc[lane] = fma(f32(d_w·d_x), lane, acc[lane]); then the 8-lane hsum_float_8. (Repacked Q4_0,
  q4_0_8x8, is not reproduced.)
- Q4_K weights repacked (q4_K_8x8, rows % 8 == 0, extra buffer types on): one accumulator per
  output. The gemm kernel (the first rows of a batch, in multiples of 4) adds one fma per 64
  weights, the gemv kernel (the remaining rows, and every one-token step) one per 256, each with
  the exact integer dot product converted to f32; the min terms likewise; output = acc − acc_min.
- Q4_K / Q5_K weights in their GGUF layout (not repacked): with 8 or more rows ggml's tiled
  K-quant matmul: per 256 the exact dot s1 and min sum s2, res = fnmadd(dmin_w, f32(s2),
  d_w·f32(s1)), acc = fma(res, d_x, acc); with fewer, vec_dot_q4_K_q8_K / q5_K_q8_K: eight lanes
  acc = fma(d_x·d_w, f32(lane), acc) (lane l: products 4l..4l+3 of each 32-subblock times its
  scale), the min part with dmin = -(d_x·dmin_w) in four lanes (Q4_K; reduced (m0+m2) + (m1+m3))
  or one scalar fma (Q5_K); output hsum_float_8(acc) + min part.
- Q6_K weights (never repacked on x86): with 8 or more rows the tiled microtile, per 256 the exact
  integer dot, converted to f32, times d_w, then acc = fma(that, d_x, acc) (the AVX2 and the
  AVX512-VNNI microtiles alike: GCC fuses the VNNI epilogue's mul + add, engine/kernels/cpu.py).
  With fewer rows vec_dot_q6_K_q8_K: eight int32 lanes per 256 (four consecutive products from
  each 32-group, times the 16-group scale, minus 32·scale·sums for the 32-group of the lane's
  index), one fma per 256, hsum_float_8.
These orders are the same on AVX2 and AVX-512 builds (engine/kernels/cpu.py lists what differs
elsewhere). Integer parts are computed exactly (f32
or f64 matmuls of small integers); each fma is done in f64 and rounded once to f32, which is what
a fused multiply-add gives (the product of two f32 is exact in f64).

- Q4_1 / Q5_1 weights, Q8_1 activations (vec_dot_q4_1_q8_1 / q5_1_q8_1 at every batch size): the
  Q8_0 integers and scale, plus s = f16(d·Σq) with d before its rounding; per block the eight
  lanes' fma(d_w·d_x) as above, and summs = fma(m_w, s_x, summs); hsum_float_8(acc) + summs.

- TQ1_0 / TQ2_0 weights, Q8_K activations (vec_dot_tq1_0_q8_K / tq2_0_q8_K at every batch size:
  ggml has no tinyBLAS, tiled, repacked or AMX kernel for them): per 256 eight exact int32 lanes,
  lane l = the stored values (trit + 1) times the activations at positions 4l..4l+3 of each
  32-chunk, minus the activations' sum over positions 32l..32l+31; acc = fma(f32(lane),
  d_x·d_w, acc) (ggml's mul + add, fused by GCC); hsum_float_8. A PTQTP weight's two planes are
  two such weights; ggml_kernels.c can also take both in one fb_weight (plane 1 + plane 2).

f16 weights are the f16 dot products of numerics.dot_f16 (engine/models/packed.py). BF16 weights
and repacked Q4_0 use the dequantized product with the same quantized activations: right to f32
summation order, not to the bit.

The methods below are the reference, in torch; ggml_kernels.c repeats them in C (engine/kernels/
native.py builds it: fb_matmul, on torch's thread count, the output rows split across threads so
the count never changes a bit), and the tests hold the two to identical results.
"""

from __future__ import annotations

import ctypes

import torch
from gguf import GGMLQuantizationType as T

from engine.gguf.dequant import dequantize_tq1_0, dequantize_tq2_0, unpack_blocks
from engine.kernels import exact_plan
from engine.kernels.cpu import plan
from engine.kernels.exact_plan import UBATCH, unpack_parts, weight_struct
from engine.kernels.native import Plan, kernels, ptr
from engine.kernels.numerics import fma_f32, hsum8, quantize_q8_0, quantize_q8_k, round_f16

TERNARY = (T.TQ1_0, T.TQ2_0)
ROW_CHUNK = 64  # rows per pass of the torch reference, to bound its integer-lane intermediates
TILED_MIN_ROWS = 8  # ggml_tiled_min_batch: K-quant matmuls of this many rows or more run tiled


# exact_plan's answers for this module's `plan` (which the tests replace to follow another
# build's orders)
def repacked(ggml_type: T, rows: int, p=None) -> bool:
    return exact_plan.repacked(ggml_type, rows, p or plan())


def supports_exact(ggml_type: T, rows: int) -> bool:
    return exact_plan.supports_exact(ggml_type, rows, plan())


def plan_struct(p=None) -> Plan:
    return exact_plan.plan_struct(p or plan())


def unpack_exact(raw: torch.Tensor, ggml_type: T, rows: int) -> dict[str, torch.Tensor]:
    """The parts the C kernels read (exact_plan.unpack_parts, on torch's thread count, as
    tensors over the same memory). Without the C build, unpack_blocks' parts for the torch
    reference."""
    ggml_type = T(ggml_type)
    raw = raw.reshape(rows, -1)
    if ggml_type == T.F16:
        return {"blocks": raw.view(torch.int16).contiguous()}
    if kernels() is None:
        return {k: v.contiguous() for k, v in unpack_blocks(raw, ggml_type).items()}
    parts = unpack_parts(raw.contiguous().numpy(), ggml_type, rows, torch.get_num_threads())
    return {name: torch.from_numpy(part) for name, part in parts.items()}


class ExactWeight:
    """A packed weight's integer parts, for the C kernels or laid out for the torch reference."""

    def __init__(self, raw: torch.Tensor, ggml_type: T, rows: int, cols: int, native: bool = True):
        self.ggml_type, self.rows, self.cols = ggml_type, rows, cols
        self.native = kernels() if native else None
        if self.native is not None:
            self.parts = unpack_exact(raw, ggml_type, rows)
            self.struct = weight_struct(self.parts, ggml_type, rows, cols)
            return
        if T(ggml_type) in TERNARY:
            self._ternary_parts(raw.reshape(rows, -1))
            return
        parts = {k: v.contiguous() for k, v in unpack_blocks(raw, ggml_type).items()}
        self.d = parts["d"]  # [N, nb] f32
        nb = self.d.shape[1]
        if ggml_type in (T.Q8_0, T.Q5_0, T.Q4_0, T.Q4_1, T.Q5_1):
            # [nb·8, 4, N]: lane k of block b holds weights 4k..4k+3
            self.lanes = parts["q"].reshape(rows, nb * 8, 4).permute(1, 2, 0).float().contiguous()
            self.dmin = parts.get("dmin")  # Q4_1 / Q5_1: the block's min
        elif ggml_type in (T.Q4_K, T.Q5_K):
            scaled = parts["q"].float() * parts["scales"].float()[..., None]  # [N, nb, 8, 32]
            # not repacked: [nb, 256, N] scaled weights (tiled); [nb·8, 32, N] by vec_dot lane
            # (lane l of a 256: positions 4l..4l+3 of each 32-subblock)
            self.scaled = scaled.reshape(rows, nb, 256).permute(1, 2, 0).double().contiguous()
            self.by_lane = (scaled.reshape(rows, nb, 8, 8, 4).permute(1, 3, 2, 4, 0)
                            .reshape(nb * 8, 32, rows).double().contiguous())
            self.sub_mins = parts["mins"].double().permute(1, 2, 0).contiguous()  # [nb, 8, N]
            self.chunks = (
                scaled.reshape(rows, nb * 4, 64).permute(1, 2, 0).contiguous()
            )  # [nb·4, 64, N]
            self.mins = parts["mins"].float().reshape(rows, nb * 4, 2).permute(1, 2, 0).contiguous()
            self.dmin = parts["dmin"]
        else:  # Q6_K
            sc16 = (
                parts["scales"].float().repeat_interleave(16, dim=-1)
            )  # [N, nb, 256] scale per weight
            by_lane = (parts["q"].float() * sc16).reshape(
                rows, nb, 8, 8, 4
            )  # [N, nb, group c, lane k, i]
            self.lanes = by_lane.permute(1, 3, 2, 4, 0).reshape(nb * 8, 32, rows).contiguous()
            self.group_scales = (
                sc16.reshape(rows, nb * 8, 32).permute(1, 2, 0).contiguous()
            )  # [nb·8, 32, N]
            self.signed = (
                ((parts["q"].float() - 32) * sc16).permute(1, 2, 0).contiguous()
            )  # [nb, 256, N]

    def _ternary_parts(self, raw: torch.Tensor) -> None:
        """TQ1_0 / TQ2_0: the stored values (trit + 1; TQ2_0's 2-bit fields as they are) by
        vec_dot lane, [nb·8, 32, N] (lane l of a 256: positions 4l..4l+3 of each 32-chunk), and
        the f16 scales [N, nb]."""
        nbytes = 54 if self.ggml_type == T.TQ1_0 else 66
        blocks = raw.reshape(-1, nbytes).clone()
        self.d = blocks[:, -2:].contiguous().view(torch.float16).float().view(self.rows, -1)
        blocks[:, -2:] = torch.tensor([0x00, 0x3C], dtype=torch.uint8)  # scale 1.0: the trits
        dequantize = dequantize_tq1_0 if self.ggml_type == T.TQ1_0 else dequantize_tq2_0
        trits = dequantize(blocks).round().to(torch.int64) + 1
        nb = self.d.shape[1]
        self.by_lane = (trits.reshape(self.rows, nb, 8, 8, 4).permute(1, 3, 2, 4, 0)
                        .reshape(nb * 8, 32, self.rows).double().contiguous())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [R, cols] f32 -> [R, rows], as llama.cpp's mul_mat with these R rows, in ubatches."""
        outs = []
        for start in range(0, x.shape[0], UBATCH):
            batch = x[start : start + UBATCH]
            n = batch.shape[0]
            if self.native is not None:
                outs.append(self._native(batch))
                continue
            gemm_rows = n - n % 4 if n > 3 else 0  # repacked Q4_K: gemm rows, then gemv
            tiled = n >= TILED_MIN_ROWS  # K-quants in their GGUF layout: tiled, else vec_dot
            plain = self.ggml_type == T.Q5_K or (
                self.ggml_type == T.Q4_K and not repacked(T.Q4_K, self.rows))
            for r0 in range(0, n, ROW_CHUNK):
                rows = batch[r0 : r0 + ROW_CHUNK]
                if plain:
                    outs.append(self._k_plain(rows, tiled))
                elif self.ggml_type == T.Q4_K:
                    g = max(0, min(rows.shape[0], gemm_rows - r0))
                    if g:
                        outs.append(self._q4_k(rows[:g], per_superblock=False))
                    if g < rows.shape[0]:
                        outs.append(self._q4_k(rows[g:], per_superblock=True))
                elif self.ggml_type == T.Q6_K:
                    outs.append(self._q6_k_tiled(rows) if tiled else self._q6_k(rows))
                elif self.ggml_type in (T.Q4_1, T.Q5_1):
                    outs.append(self._q1(rows))
                elif self.ggml_type in TERNARY:
                    outs.append(self._tq(rows))
                else:
                    outs.append(self._q0(rows))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _native(self, x: torch.Tensor) -> torch.Tensor:
        """The same kernels in C (ggml_kernels.c fb_matmul), on torch's thread count."""
        x = x.float().contiguous()
        out = torch.empty(x.shape[0], self.rows)
        status = self.native.fb_matmul(ctypes.byref(self.struct), x.shape[0], ptr(x),
                                       ctypes.byref(plan_struct()), torch.get_num_threads(),
                                       ptr(out))
        if status != 0:
            raise MemoryError(f"fb_matmul: no memory for {x.shape[0]} x {self.cols} activations")
        return out

    def _q0(self, x: torch.Tensor) -> torch.Tensor:
        q, xd = quantize_q8_0(x)  # [R, nb, 32], [R, nb]
        R, nb = xd.shape
        lanes = torch.bmm(q.reshape(R, nb * 8, 4).transpose(0, 1), self.lanes).view(
            nb, 8, R, self.rows
        )
        acc = torch.zeros(8, R, self.rows, dtype=torch.float32)
        for b in range(nb):
            scale = self.d[:, b][None, :] * xd[:, b][:, None]  # f32 [R, N]
            acc = fma_f32(scale, lanes[b], acc)
        return hsum8(acc.movedim(0, -1))

    def _q1(self, x: torch.Tensor) -> torch.Tensor:
        """Q4_1 / Q5_1 x Q8_1 (ggml_kernels.c q1_rows): the Q8_0 ints and scale, s = f16(d·Σq)
        with d = amax/127 before rounding; lanes fma(d_w·d_x), the min part fma(m_w, s_x)."""
        q, xd = quantize_q8_0(x)  # [R, nb, 32], [R, nb]
        R, nb = xd.shape
        amax = x.float().reshape(R, nb, 32).abs().amax(-1)
        s = round_f16((amax / 127.0) * q.sum(-1))
        lanes = torch.bmm(q.reshape(R, nb * 8, 4).transpose(0, 1), self.lanes).view(
            nb, 8, R, self.rows
        )
        acc = torch.zeros(8, R, self.rows, dtype=torch.float32)
        summs = torch.zeros(R, self.rows)
        for b in range(nb):
            summs = fma_f32(self.dmin[:, b][None, :].expand_as(summs), s[:, b][:, None], summs)
            acc = fma_f32(self.d[:, b][None, :] * xd[:, b][:, None], lanes[b], acc)
        return hsum8(acc.movedim(0, -1)) + summs

    def _q4_k(self, x: torch.Tensor, per_superblock: bool) -> torch.Tensor:
        q, xd = quantize_q8_k(x)  # [R, nb, 256], [R, nb]
        R, nb = xd.shape
        dots = torch.bmm(
            q.reshape(R, nb * 4, 64).transpose(0, 1), self.chunks
        )  # [nb·4, R, N] exact
        sums = q.reshape(R, nb * 4, 2, 32).sum(-1).transpose(0, 1)  # [nb·4, R, 2] block sums
        mins = torch.bmm(sums, self.mins)  # [nb·4, R, N]
        dots, mins = dots.view(nb, 4, R, self.rows), mins.view(nb, 4, R, self.rows)
        if per_superblock:  # gemv: the whole 256's integer, then one f32 rounding
            dots = dots.double().sum(1, keepdim=True).float()
            mins = mins.double().sum(1, keepdim=True).float()
        acc = torch.zeros(R, self.rows)
        acc_min = torch.zeros(R, self.rows)
        for b in range(nb):
            scale = self.d[:, b][None, :] * xd[:, b][:, None]
            scale_min = self.dmin[:, b][None, :] * xd[:, b][:, None]
            for c in range(dots.shape[1]):
                acc = fma_f32(dots[b, c], scale, acc)
                acc_min = fma_f32(mins[b, c], scale_min, acc_min)
        return acc - acc_min

    def _k_plain(self, x: torch.Tensor, tiled: bool) -> torch.Tensor:
        """Q4_K / Q5_K in their GGUF layout (ggml_kernels.c k_plain_rows says the orders)."""
        q, xd = quantize_q8_k(x)  # [R, nb, 256], [R, nb]
        R, nb = xd.shape
        qd = q.double()
        sums32 = qd.reshape(R, nb, 8, 32).sum(-1).transpose(0, 1)  # [nb, R, 8] exact
        acc = torch.zeros(R, self.rows)
        if tiled:
            s1 = torch.bmm(qd.transpose(0, 1), self.scaled).float()  # [nb, R, N]: int -> f32
            s2 = torch.bmm(sums32, self.sub_mins).float()
            for b in range(nb):
                res = fma_f32(-self.dmin[:, b][None, :].expand_as(s2[b]), s2[b],
                              self.d[:, b][None, :] * s1[b])
                acc = fma_f32(res, xd[:, b][:, None], acc)
            return acc
        by_lane = qd.reshape(R, nb, 8, 8, 4).permute(1, 3, 0, 2, 4).reshape(nb * 8, R, 32)
        lanes = torch.bmm(by_lane, self.by_lane).float().view(nb, 8, R, self.rows)
        # lane l of the min part: subblocks 2l and 2l+1
        mins = torch.einsum("brls,bnls->blrn", sums32.view(nb, R, 4, 2),
                            self.sub_mins.permute(0, 2, 1).reshape(nb, self.rows, 4, 2)).float()
        acc8 = torch.zeros(8, R, self.rows)
        acc_m = torch.zeros(4, R, self.rows)
        summs = torch.zeros(R, self.rows)
        for b in range(nb):
            d = xd[:, b][:, None] * self.d[:, b][None, :]
            dmin = -xd[:, b][:, None] * self.dmin[:, b][None, :]
            acc8 = fma_f32(d, lanes[b], acc8)
            if self.ggml_type == T.Q4_K:
                acc_m = fma_f32(dmin, mins[b], acc_m)
            else:
                summs = fma_f32(dmin, mins[b].double().sum(0).float(), summs)
        total = hsum8(acc8.movedim(0, -1))
        if self.ggml_type == T.Q5_K:
            return total + summs
        return total + ((acc_m[0] + acc_m[2]) + (acc_m[1] + acc_m[3]))

    def _tq(self, x: torch.Tensor) -> torch.Tensor:
        """TQ1_0 / TQ2_0 x Q8_K (ggml_kernels.c tq_rows): per 256 eight exact lanes, lane l the
        products of positions 4l..4l+3 of every 32-chunk minus the activations' sum over
        positions 32l..32l+31; acc = fma(f32(lane), d_x·d_w, acc); hsum_float_8."""
        q, xd = quantize_q8_k(x)  # [R, nb, 256], [R, nb]
        R, nb = xd.shape
        qd = q.double()
        by_lane = qd.reshape(R, nb, 8, 8, 4).permute(1, 3, 0, 2, 4).reshape(nb * 8, R, 32)
        sums = qd.reshape(R, nb, 8, 32).sum(-1).permute(1, 2, 0).reshape(nb * 8, R, 1)
        lanes = (torch.bmm(by_lane, self.by_lane) - sums).float().view(nb, 8, R, self.rows)
        acc = torch.zeros(8, R, self.rows)
        for b in range(nb):
            acc = fma_f32(lanes[b], xd[:, b][:, None] * self.d[:, b][None, :], acc)
        return hsum8(acc.movedim(0, -1))

    def _q6_k(self, x: torch.Tensor) -> torch.Tensor:
        q, xd = quantize_q8_k(x)  # [R, nb, 256], [R, nb]
        R, nb = xd.shape
        by_lane = q.reshape(R, nb, 8, 8, 4).permute(1, 3, 0, 2, 4).reshape(nb * 8, R, 32)
        positive = torch.bmm(by_lane.double(), self.lanes.double())  # [nb·8, R, N]
        groups = q.reshape(R, nb * 8, 32).transpose(0, 1)  # lane k's 32-group
        offset = torch.bmm(groups, self.group_scales).double()  # exact: |.| < 2^24
        lanes = (positive - 32.0 * offset).float().view(nb, 8, R, self.rows)  # cvtepi32_ps rounding
        acc = torch.zeros(8, R, self.rows, dtype=torch.float32)
        for b in range(nb):
            acc = fma_f32((xd[:, b][:, None] * self.d[:, b][None, :]), lanes[b], acc)
        return hsum8(acc.movedim(0, -1))

    def _q6_k_tiled(self, x: torch.Tensor) -> torch.Tensor:
        q, xd = quantize_q8_k(x)  # [R, nb, 256], [R, nb]
        dots = torch.bmm(q.transpose(0, 1).double(), self.signed.double()).float()  # [nb, R, N]
        acc = torch.zeros(x.shape[0], self.rows)
        for b in range(xd.shape[1]):
            scaled = self.d[:, b][None, :] * dots[b]
            acc = fma_f32(scaled, xd[:, b][:, None], acc)
        return acc


__all__ = [
    "ExactWeight",
    "UBATCH",
    "plan_struct",
    "repacked",
    "supports_exact",
    "unpack_exact",
    "weight_struct",
]
