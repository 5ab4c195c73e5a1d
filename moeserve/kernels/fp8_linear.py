"""Dense linear on a block-wise FP8 weight (attention and dense / shared-expert MLP projections).

    y = x @ (w_fp8 * scale_inv per 128 x 128 block).T (+ bias)

Backends:
- "triton" (default on CUDA and under the interpreter): one GEMM kernel with the block scales applied per K step,
  weight-only (fp8 tile dequantized to x's dtype in the K loop) or W8A8 (x quantized per token-group of 128,
  fp8 x fp8 dots scaled by x_scale[row, k-group] x scale_inv[n-block, k-group]), on 16 x 32 tiles at decode sizes
  (a qkv or o projection in 160 or 64 tiles), each tile's K walk split over 2-8 programs where it is long
  (linear_split: the last program of a tile adds the fp32 partials in split order, so every launch gives the same
  bits); at one row of a short-K projection with K > N (gemv_serves) a GEMV on the CUDA cores instead, in fp32 on
  the dequantized weight.
- "scaled_mm" (W8A8 on CUDA): torch._scaled_mm with (BlockWise1x128, BlockWise128x128) scales, which torch 2.13
  accepts on sm_90 (cuBLAS); its layout needs: the weight column-major (w_fp8.t() of the [N, K] weight), the
  activation scales M-major (the quantization kernel writes them so), rows padded to a multiple of 4, a count of K
  blocks that is a multiple of 4 (scaled_mm_serves; other K take the Triton W8A8 kernel). Checked against the twin by
  the GPU tests.
- "torch": dequantize the weight and F.linear (CPU without the interpreter, and the twin).

`act_quant=None` (what the engine runs) picks per call by row count, from the H200 sweep at Qwen3-30B-A3B's qkv and
o shapes (benchmarks/kernels/fp8_moe.py --parts dense --sweep; BENCHMARKS.md, sessions 13 and 21): below
AUTO_W8A8_MIN_ROWS weight-only (a decode row reads weights; quantizing it adds a launch) on the GEMV where
gemv_serves, else the Triton GEMM (8 rows, 16 x 64 tiles: 9.8 / 16.8 us weight-only, 11.0 / 16.1 W8A8), from there W8A8 through scaled_mm on CUDA where
it takes the K (scaled_mm_serves) and linear_split does not split it (o_proj at 64 rows stays on the split Triton
kernel; 64 rows: 16.4 / 21.7 us against 17.1 / 22.5 weight-only; 256: 17.4 / 23.1 against
31.7 / 43.5; 2,048: 52.8 / 45.2 against 128.2 / 103.4), through the Triton W8A8 GEMM elsewhere. A row's numerics
therefore depend on the batch size it runs in, as in any engine whose kernels are chosen by shape; a given batch
size always runs the same kernels.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moeserve.kernels import pdl as pdl_launch
from moeserve.kernels.fp8 import (
    FP8_DTYPE,
    WEIGHT_BLOCK,
    dequantize_block_fp8,
    fp8_scaled_dot,
    quantize_groups_fp8,
    quantize_groups_fp8_ref,
)
from moeserve.kernels.gemv import GEMV_MAX_TOKENS, GemvLoRA, gemv_epilogue, lora_epilogue_args
from moeserve.kernels.lora_dense import RANK_BLOCK
from moeserve.kernels.moe_plan import GemmTile

BACKENDS = ("triton", "scaled_mm", "torch")


@triton.jit(do_not_specialize=["M"])  # sizes that vary by step: one compile
def _fp8_linear_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr,
    scratch_ptr, b_ptr, slots_ptr, ranks_ptr, partial_ptr, counters_ptr,
    M, N, K, R_MAX, END0, END1, END2,
    stride_a, stride_as, stride_w, stride_ws, stride_out,
    stride_sk, stride_ss, stride_st, stride_bl, stride_bn, stride_br,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, ACT_FP8: tl.constexpr, HAS_BIAS: tl.constexpr,
    USE_PDL: tl.constexpr, SCALE_PRODUCT: tl.constexpr = False, HAS_LORA: tl.constexpr = False,
    LORA_K_SPLITS: tl.constexpr = 1, LORA_ROWS: tl.constexpr = 1, BLOCK_R: tl.constexpr = 16,
    SPLIT_K: tl.constexpr = 1,
):
    """out[rows, cols] = a[rows] @ dequant(w)[cols].T (+ bias) (+ the LoRA expand of the first LORA_ROWS rows,
    gemv.gemv_epilogue) for one (BLOCK_M, BLOCK_N) tile. HAS_LORA (weight-only, one row tile): the shrink just
    launched runs under the K walk, which waits for it only before the epilogue. SPLIT_K > 1: SPLIT_K programs
    share a tile's K steps, each stores its fp32 partial (partial_ptr [SPLIT_K, M, N]) and bumps the tile's arrival
    counter; the last to arrive adds the partials in split order (the same sum whichever program arrives last),
    resets the counter to 0 for the next launch and runs the epilogue."""
    pdl_launch.enter_late(USE_PDL, HAS_LORA)
    num_n = tl.cdiv(N, BLOCK_N)
    tile = tl.program_id(0) // SPLIT_K  # a tile's splits are neighbours: they start, and finish, together
    split = tl.program_id(0) % SPLIT_K
    pid_m, pid_n = tile // num_n, tile % num_n
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    k_steps = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)  # this program's K steps: [k_begin, k_end)
    k_begin = split * k_steps * BLOCK_K
    k_end = tl.minimum(K, k_begin + k_steps * BLOCK_K)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_a + (k_begin + offs_k)[None, :]
    b_ptrs = w_ptr + cols.to(tl.int64)[None, :] * stride_w + (k_begin + offs_k)[:, None]
    b_scale_ptrs = w_scale_ptr + (cols // SCALE_N) * stride_ws
    a_scale_ptrs = a_scale_ptr + rows.to(tl.int64) * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_scale = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        group = k0 // SCALE_K
        b_scale = tl.load(b_scale_ptrs + group)
        if ACT_FP8:
            a_scale = tl.load(a_scale_ptrs + group, mask=row_ok, other=0.0)
        acc = fp8_scaled_dot(acc, a, b, a_scale, b_scale, ACT_FP8, SCALE_PRODUCT)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    pdl_launch.late(USE_PDL, HAS_LORA)
    if SPLIT_K == 1:
        gemv_epilogue(acc, rows.to(tl.int64), offs_n, M, N, bias_ptr, out_ptr, stride_out,
                      scratch_ptr, b_ptr, slots_ptr, ranks_ptr, R_MAX, END0, END1, END2,
                      stride_sk, stride_ss, stride_st, stride_bl, stride_bn, stride_br,
                      HAS_BIAS, HAS_LORA, LORA_K_SPLITS, LORA_ROWS, BLOCK_N, BLOCK_R)
    else:
        p_ptrs = partial_ptr + rows.to(tl.int64)[:, None] * N + offs_n[None, :]
        p_mask = row_ok[:, None] & (offs_n < N)[None, :]
        plane = M.to(tl.int64) * N  # one split's partials
        tl.store(p_ptrs + split * plane, acc, mask=p_mask)
        tl.debug_barrier()  # every thread's partial stores precede the release below
        arrived = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            tl.debug_barrier()
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # in split order, past the L1 (the other programs' stores)
                acc += tl.load(p_ptrs + s * plane, mask=p_mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(counters_ptr + tile, 0)
            gemv_epilogue(acc, rows.to(tl.int64), offs_n, M, N, bias_ptr, out_ptr, stride_out,
                          scratch_ptr, b_ptr, slots_ptr, ranks_ptr, R_MAX, END0, END1, END2,
                          stride_sk, stride_ss, stride_st, stride_bl, stride_bn, stride_br,
                          HAS_BIAS, HAS_LORA, LORA_K_SPLITS, LORA_ROWS, BLOCK_N, BLOCK_R)


@triton.jit
def _fp8_gemv_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr,
    scratch_ptr, b_ptr, slots_ptr, ranks_ptr,
    M, N, K, R_MAX, END0, END1, END2,
    stride_a, stride_as, stride_w, stride_ws, stride_out,
    stride_sk, stride_ss, stride_st, stride_bl, stride_bn, stride_br,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, SUB_K: tl.constexpr,
    EVEN_K: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, ACT_FP8: tl.constexpr,
    HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr, HAS_LORA: tl.constexpr = False,
    LORA_K_SPLITS: tl.constexpr = 1, BLOCK_R: tl.constexpr = 16,
):
    """Decode rows (BLOCK_T: 1 or 2): out[:M, cols] = a[:M] @ dequant(w)[cols].T (+ bias) in fp32 on the CUDA
    cores, every row of the BLOCK_N columns' weights read once for all M rows (gemv.py's layout with FP8 rows: half
    the bytes). A K step is a [BLOCK_N, GROUPS, SUB_K] weight tile, SUB_K inside one scale group, so a step may span
    several groups (the bytes in flight of a wide bf16 step), held as runs of 8 columns; each row's activations are
    loaded in that tile's shape (a copy per column, from the L1) and summed in it. So both operands have one layout
    and the K loop exchanges nothing through shared memory (sm_90, benchmarks/kernels/sass.py fp8_gemv: a tile with
    a row axis beside it, or fp8 runs of 16 beside bf16 runs of 8, sent an operand through shared memory between
    two barriers every step). Out-of-range rows and columns are clamped on load and never stored. ACT_FP8: a is
    fp8 with per-(row, group) scales, dequantized in fp32 (the W8A8 numerics). HAS_LORA (weight-only): each adapter
    row's expand in the epilogue (gemv.gemv_epilogue), the K walk under the shrink."""
    pdl_launch.enter_late(USE_PDL, HAS_LORA)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.minimum(n, N - 1).to(tl.int64)
    t = tl.arange(0, BLOCK_T)
    row1 = tl.minimum(1, M - 1).to(tl.int64)  # the second row (BLOCK_T == 2), clamped
    sub = tl.arange(0, GROUPS) * SUB_K
    # [GROUPS, SUB_K // 8, 8]: runs of 8 columns, so the fp8 weights load 8 to a thread as the bf16 activations do
    offs_k = (sub[:, None, None] + (tl.arange(0, SUB_K // 8) * 8)[None, :, None]
              + tl.arange(0, 8)[None, None, :])
    w_ptrs = w_ptr + cols[:, None, None, None] * stride_w + offs_k[None, :, :, :]
    # each row's activations loaded in the weight tile's own shape (every column's copy from the L1): the tile's
    # layout then needs no shared-memory exchange to broadcast them across the warps that split the columns
    a0_ptrs = a_ptr + offs_k[None, :, :, :] + 0 * cols[:, None, None, None]
    a1_ptrs = a_ptr + row1 * stride_a + offs_k[None, :, :, :] + 0 * cols[:, None, None, None]
    w_scale_ptrs = w_scale_ptr + (cols // SCALE_N) * stride_ws
    acc0 = tl.zeros((BLOCK_N, GROUPS, SUB_K // 8, 8), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, GROUPS, SUB_K // 8, 8), dtype=tl.float32)
    for k0 in range(0, K, GROUPS * SUB_K):
        groups = (k0 + sub) // SCALE_K  # [GROUPS]
        if EVEN_K:
            w = tl.load(w_ptrs)
            w_scale = tl.load(w_scale_ptrs[:, None] + groups[None, :])
        else:
            k_ok = offs_k < K - k0
            g_ok = sub < K - k0
            w = tl.load(w_ptrs, mask=k_ok[None, :, :, :], other=0.0)
            w_scale = tl.load(w_scale_ptrs[:, None] + groups[None, :], mask=g_ok[None, :], other=0.0)
        wf = w.to(tl.float32) * w_scale[:, :, None, None]
        acc0 += _gemv_row(a0_ptrs, a_scale_ptr, groups, offs_k, sub, K - k0, EVEN_K, ACT_FP8) * wf
        if BLOCK_T == 2:
            acc1 += _gemv_row(a1_ptrs, a_scale_ptr + row1 * stride_as, groups, offs_k, sub, K - k0, EVEN_K,
                              ACT_FP8) * wf
        w_ptrs += GROUPS * SUB_K
        a0_ptrs += GROUPS * SUB_K
        a1_ptrs += GROUPS * SUB_K
    acc = tl.sum(tl.sum(tl.sum(acc0, 3), 2), 1)[None, :]
    if BLOCK_T == 2:
        acc = tl.where((t == 0)[:, None], acc, tl.sum(tl.sum(tl.sum(acc1, 3), 2), 1)[None, :])
    pdl_launch.late(USE_PDL, HAS_LORA)
    gemv_epilogue(acc, t.to(tl.int64), n, M, N, bias_ptr, out_ptr, stride_out,
                  scratch_ptr, b_ptr, slots_ptr, ranks_ptr, R_MAX, END0, END1, END2,
                  stride_sk, stride_ss, stride_st, stride_bl, stride_bn, stride_br,
                  HAS_BIAS, HAS_LORA, LORA_K_SPLITS, BLOCK_T, BLOCK_N, BLOCK_R)


@triton.jit
def _gemv_row(a_ptrs, a_scale_ptr, groups, offs_k, sub, k_left, EVEN_K: tl.constexpr, ACT_FP8: tl.constexpr):
    """One row's activations of a GEMV K step ([BLOCK_N, GROUPS, SUB_K] pointers) in fp32, dequantized by their
    group scales under ACT_FP8; zeros past K."""
    if EVEN_K:
        a = tl.load(a_ptrs).to(tl.float32)
        if ACT_FP8:
            a = a * tl.load(a_scale_ptr + groups)[None, :, None, None]
    else:
        a = tl.load(a_ptrs, mask=(offs_k < k_left)[None, :, :, :], other=0.0).to(tl.float32)
        if ACT_FP8:
            a = a * tl.load(a_scale_ptr + groups, mask=sub < k_left, other=0.0)[None, :, None, None]
    return a


# Rows the FP8 GEMV can take (gemv_serves says where it does); more go to the tensor-core kernel.
GEMV_MAX_ROWS = 2


def gemv_serves(num_rows: int, n: int, k: int) -> bool:
    """Whether a weight-only projection of `num_rows` rows runs the CUDA-core GEMV rather than the tensor-core
    kernel on 16 x 32 tiles. H200, weight-only, us (session 21 call 3, `benchmarks.kernels.fp8_moe --parts dense
    --sweep`): qkv 2048 -> 5120 at 1 / 2 rows GEMV 12.7 / 19.6 against 8.9 / 8.9 (bf16 cuBLAS 8.4 / 8.2); o 4096 ->
    2048 GEMV 8.3 / 13.3 against 11.5 / 11.3 (bf16 9.7 / 9.7). The GEMV keeps one row where K > N (its programs then
    walk long rows: 512 programs of 4 columns for o), as the bf16 GEMV does (gemv.serves), unless the tensor-core
    kernel splits K (linear_split: o 7.4 us against the GEMV's 8.3, session 22)."""
    return num_rows == 1 and k > n and linear_split(num_rows, n, k) is None
AUTO_W8A8_MIN_ROWS = 64  # act_quant=None: W8A8 from this many rows (module docstring)


def resolve_act_quant(act_quant: bool | None, num_rows: int) -> bool:
    """`act_quant`, or for None the per-row-count pick of the module docstring."""
    return act_quant if act_quant is not None else num_rows >= AUTO_W8A8_MIN_ROWS


GEMV_BLOCK_N = 4  # columns per program: a projection of a few thousand columns in hundreds of programs (gemv.py's)
GEMV_BLOCK_K = 1024  # columns per K step: fp32 running sums of 32-64 registers a thread at 1-2 rows


def _operands(x2, w_fp8, scale_inv, act_quant, block, pdl, x_fp8=None):
    """(a, a_scale, w, s, out) of either Triton kernel: x2 quantized per token-group under W8A8 (`x_fp8` where the
    producer made it; else a_scale is an unread placeholder), the weight and its scales contiguous, the output in
    x2's dtype."""
    if act_quant:
        a, a_scale = x_fp8 if x_fp8 is not None else quantize_groups_fp8(x2, block[1], pdl=pdl)
    else:
        a, a_scale = x2, scale_inv
    out = torch.empty(x2.shape[0], w_fp8.shape[0], dtype=x2.dtype, device=x2.device)
    return a, a_scale, w_fp8.contiguous(), scale_inv.contiguous(), out


class GemvTile(NamedTuple):
    """A launch of the FP8 GEMV: columns and K columns per program step, warps, software-pipelining stages."""
    block_n: int = GEMV_BLOCK_N
    block_k: int = GEMV_BLOCK_K
    num_warps: int = 4
    num_stages: int = 2


def _lora_launch(lora: GemvLoRA | None, m: int, n: int, out: torch.Tensor) -> tuple[tuple, tuple, dict]:
    """(pointer args, size args, stride args) of the kernels' LoRA epilogue and its constexprs; placeholders
    without LoRA."""
    args = lora_epilogue_args(lora, m, n, out)
    meta = dict(HAS_LORA=lora is not None, LORA_K_SPLITS=lora.scratch.shape[0] if lora is not None else 1,
                BLOCK_R=RANK_BLOCK)
    return args[:4], args[4:8], args[8:], meta


def _gemv_linear(x2, w_fp8, scale_inv, bias, act_quant, block, pdl, tile: GemvTile | None = None, lora=None,
                 x_fp8=None):
    m, k = x2.shape
    n = w_fp8.shape[0]
    tile = tile or GemvTile()
    a, a_scale, w, s, out = _operands(x2, w_fp8, scale_inv, act_quant, block, pdl, x_fp8)
    block_k = min(tile.block_k, max(128, triton.next_power_of_2(k)))
    sub_k = min(block_k, block[1])
    lora_ptrs, lora_sizes, lora_strides, lora_meta = _lora_launch(lora, m, n, out)
    _fp8_gemv_kernel[(triton.cdiv(n, tile.block_n),)](
        a, a_scale, w, s, bias if bias is not None else s, out, *lora_ptrs, m, n, k, *lora_sizes,
        a.stride(0), a_scale.stride(0), w.stride(0), s.stride(0), out.stride(0), *lora_strides,
        BLOCK_T=triton.next_power_of_2(m), BLOCK_N=tile.block_n, GROUPS=block_k // sub_k, SUB_K=sub_k,
        EVEN_K=k % block_k == 0, SCALE_N=block[0], SCALE_K=block[1], ACT_FP8=act_quant, HAS_BIAS=bias is not None,
        USE_PDL=pdl, launch_pdl=pdl, num_warps=tile.num_warps, num_stages=tile.num_stages, **lora_meta)
    return out


SPLIT_MIN_STEPS = 8  # K steps of 128 a split-K program walks at least
SPLIT_MAX = 8
SPLIT_LONG_K_STEPS = 32  # K steps from which 17..SPLIT_MAX_ROWS rows split too (o_proj's 4096)
SPLIT_MAX_ROWS = 64
SPLIT_MAX_PROGRAMS = 512  # a projection with this many tiles already fills the GPU: no split (wide MLPs)
SPLIT_TILES = {16: GemmTile(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=4),
               SPLIT_MAX_ROWS: GemmTile(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4)}


def linear_split(num_rows: int, n: int, k: int) -> tuple[GemmTile, int] | None:
    """(tile, split_k) where the default Triton GEMM splits each tile's K walk, else None. A decode projection
    has a few dozen column tiles of one row tile: each program walking all of K leaves most SMs idle (H200,
    session 22, `benchmarks.kernels.fp8_moe --parts dense --sweep`, us, weight-only): o 4096 -> 2048 at 1 / 2 / 8
    rows 7.4 / 7.3 / 7.4 on 16 x 32 tiles in 4 splits against 8.3 (GEMV) / 11.2 / 11.2 unsplit (bf16 cuBLAS 9.7);
    q|k|v 2048 -> 5120 8.3 / 8.3 / 8.5 in 2 splits against 8.9 / 8.9 / 8.7. A long K (o_proj) splits up to
    SPLIT_MAX_ROWS rows on 64 x 64 tiles, W8A8 there rather than scaled_mm: 12.8 us at 64 rows against 17.1
    (q|k|v: 11.6 against 12.0, left to scaled_mm); decode step at B = 64 11.53 -> 11.30 ms. At 128 rows the
    kernel alone won (15.7 against 17.4 us) but the step did not (12.74 -> 12.78 ms): scaled_mm keeps it. A split
    walks about SPLIT_MIN_STEPS K steps or more (the last may walk fewer); the splits of a projection stop at
    SPLIT_MAX_PROGRAMS programs (a wide MLP's tiles fill the GPU unsplit; such shapes were not measured)."""
    steps = triton.cdiv(k, 128)
    if num_rows < 1:
        return None
    if num_rows <= 16:
        tile = SPLIT_TILES[16]
    elif num_rows <= SPLIT_MAX_ROWS and steps >= SPLIT_LONG_K_STEPS:
        tile = SPLIT_TILES[SPLIT_MAX_ROWS]
    else:
        return None
    split = min(SPLIT_MAX, steps // SPLIT_MIN_STEPS, SPLIT_MAX_PROGRAMS // split_counters(num_rows, n, tile))
    return (tile, split) if split >= 2 else None


def split_counter_slots(n: int) -> int:
    """Arrival counters the default split-K launches of a projection with `n` output columns need at most."""
    return max(split_counters(rows, n, tile) for rows, tile in SPLIT_TILES.items())


def linear_tile(num_rows: int) -> GemmTile:
    """A start, not tuned (benchmarks/kernels/fp8_moe.py --dense times it): short row tiles and narrow column
    tiles at decode sizes, so a projection of a few thousand columns still fills the GPU."""
    if num_rows <= 16:  # 16 x 32: at 1-2 rows 8.9 / 11.3 us for qkv / o against 9.7 / 16.9 at 16 x 64 (gemv_serves)
        return GemmTile(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=4)
    if num_rows <= 64:
        return GemmTile(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=4)
    if num_rows <= 256:
        return GemmTile(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=3)
    return GemmTile(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3)


def _check(x, w_fp8, scale_inv, bias, block):
    n, k = w_fp8.shape
    want = (triton.cdiv(n, block[0]), triton.cdiv(k, block[1]))
    if x.shape[-1] != k:
        raise ValueError(f"fp8_linear: x has {x.shape[-1]} features, the weight {tuple(w_fp8.shape)} takes {k}")
    if w_fp8.dtype != FP8_DTYPE:
        raise ValueError(f"fp8_linear: weight must be {FP8_DTYPE}, got {w_fp8.dtype}")
    if tuple(scale_inv.shape) != want or scale_inv.dtype != torch.float32:
        raise ValueError(f"fp8_linear: scale_inv must be float32 {want} for blocks of {block}, got "
                         f"{scale_inv.dtype} {tuple(scale_inv.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"fp8_linear: bias must be ({n},), got {tuple(bias.shape)}")


def split_counters(num_rows: int, n: int, tile: GemmTile) -> int:
    """Arrival counters a split-K launch of `num_rows` rows and `n` columns on `tile` needs (one per tile)."""
    return triton.cdiv(num_rows, tile.block_m) * triton.cdiv(n, tile.block_n)


def _triton_linear(x2, w_fp8, scale_inv, bias, act_quant, block, tile, scale_product, pdl, lora=None, x_fp8=None,
                   split_k=None, counters=None):
    m, k = x2.shape
    n = w_fp8.shape[0]
    if tile is None and split_k is None:
        tile, split_k = linear_split(m, n, k) or (linear_tile(m), 1)
    tile = tile or linear_tile(m)
    split_k = split_k or 1
    if block[1] % tile.block_k:
        raise ValueError(f"fp8_linear: block_k {tile.block_k} must divide the scale block {block[1]}")
    if lora is not None and m > tile.block_m:
        raise ValueError(f"fp8_linear: a LoRA epilogue needs the {m} rows in one tile of {tile.block_m}")
    if m == 0:
        return torch.empty(0, n, dtype=x2.dtype, device=x2.device)
    a, a_scale, w, s, out = _operands(x2, w_fp8, scale_inv, act_quant, block, pdl, x_fp8)
    tiles = split_counters(m, n, tile)
    if split_k > 1:
        partial = torch.empty(split_k, m, n, dtype=torch.float32, device=x2.device)
        if counters is None:
            counters = torch.zeros(tiles, dtype=torch.int32, device=x2.device)
        if counters.dtype != torch.int32 or counters.numel() < tiles:
            raise ValueError(f"fp8_linear: counters: need >= {tiles} int32 zeros, got {counters.numel()} "
                             f"{counters.dtype}")
    else:
        partial = counters = out  # unread placeholders
    grid = (tiles * split_k,)
    lora_ptrs, lora_sizes, lora_strides, lora_meta = _lora_launch(lora, m, n, out)
    _fp8_linear_kernel[grid](
        a, a_scale, w, s, bias if bias is not None else s, out, *lora_ptrs, partial, counters, m, n, k, *lora_sizes,
        a.stride(0), a_scale.stride(0), w.stride(0), s.stride(0), out.stride(0), *lora_strides,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, EVEN_K=k % tile.block_k == 0,
        SCALE_N=block[0], SCALE_K=block[1], ACT_FP8=act_quant, HAS_BIAS=bias is not None,
        SCALE_PRODUCT=scale_product, USE_PDL=pdl, launch_pdl=pdl, num_warps=tile.num_warps,
        num_stages=tile.num_stages, LORA_ROWS=triton.next_power_of_2(m) if lora is not None else 1,
        SPLIT_K=split_k, **lora_meta)
    return out


def _takes_scaled_mm(x2: torch.Tensor, n: int, block, act_quant: bool | None, backend: str, tile) -> bool:
    """The engine's pick (act_quant None) hands a W8A8 call on CUDA to scaled_mm where its K suits it."""
    return (act_quant is None and resolve_act_quant(None, x2.shape[0]) and backend == "triton" and x2.is_cuda
            and tile is None and scaled_mm_serves(x2.shape[1], block)
            and linear_split(x2.shape[0], n, x2.shape[1]) is None)


def input_quant(x: torch.Tensor, w_fp8: torch.Tensor, act_quant: bool | None,
                block: tuple[int, int] = WEIGHT_BLOCK) -> tuple[int, bool] | None:
    """(group, scale_m_major) in which fp8_linear(x, w_fp8, act_quant=...) on the triton backend reads x quantized
    (W8A8), so the kernel that writes x can write that copy too (`x_fp8`: fp8.quantize_groups_fp8's layout,
    M-major scales for scaled_mm); None where it reads x as it is, or pads its rows first (scaled_mm's multiple of
    4)."""
    x2 = x.reshape(-1, x.shape[-1])
    if not resolve_act_quant(act_quant, x2.shape[0]):
        return None
    if _takes_scaled_mm(x2, w_fp8.shape[0], block, act_quant, "triton", None):
        return (block[1], True) if x2.shape[0] % 4 == 0 else None
    return block[1], False


def fuses_lora(num_rows: int, act_quant: bool | None) -> bool:
    """Whether fp8_linear adds a LoRA expand in its own epilogue (`lora`) for this call: weight-only decode rows
    (1..GEMV_MAX_TOKENS, as the bf16 GEMV), whose K walk reads only the activations written before the shrink (a
    W8A8 call quantizes them in the launch just before, where the shrink would have to be). Elsewhere the layer
    adds the delta by the dense LoRA kernels after the product."""
    return 1 <= num_rows <= GEMV_MAX_TOKENS and not resolve_act_quant(act_quant, num_rows)


def scaled_mm_serves(k: int, block: tuple[int, int]) -> bool:
    """Whether the scaled_mm backend takes a K of `k` columns: 128 x 128 blocks, and a count of K blocks that is a
    multiple of 4 (cuBLAS's blockwise scales; padding the scales alone was refused by torch on the H200: a scale_a of
    [M, 4] for one K block)."""
    return block == (128, 128) and k % (4 * block[1]) == 0


def _scaled_mm_linear(x2, w_fp8, scale_inv, bias, block, pdl, x_fp8=None):
    if not scaled_mm_serves(x2.shape[1], block):
        raise ValueError(f"fp8_linear: the scaled_mm backend takes 128 x 128 blocks and K a multiple of 512, got "
                         f"blocks {block}, K {x2.shape[1]}")
    m = x2.shape[0]
    pad_m = -m % 4
    if x_fp8 is not None:  # the producer's copy: rows a multiple of 4, scales M-major (input_quant)
        a, a_scale = x_fp8
    else:
        a, a_scale = quantize_groups_fp8(F.pad(x2, (0, 0, 0, pad_m)) if pad_m else x2, pdl=pdl, scale_m_major=True)
    w_scale = scale_inv.t()  # [K blocks, N blocks], column-major view of the [N, K] layout
    out = F.scaled_mm(a, w_fp8.t(), a_scale, F.ScalingType.BlockWise1x128, w_scale,
                      F.ScalingType.BlockWise128x128, output_dtype=x2.dtype)[:m]
    return out + bias if bias is not None else out


def fp8_linear(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    act_quant: bool | None,
    block: tuple[int, int] = WEIGHT_BLOCK,
    backend: str | None = None,
    tile: GemmTile | None = None,
    weight_scale: str = "tile",
    pdl: bool = False,
    gemv_tile: GemvTile | None = None,
    lora: GemvLoRA | None = None,
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
    split_k: int | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] (bf16 / fp16 / fp32), w_fp8 [N, K] float8_e4m3fn, scale_inv [ceil(N/128), ceil(K/128)]
    float32, bias [N] -> [..., N] in x.dtype. `act_quant`: W8A8 (x quantized per token-group of 128 at run time),
    False weight-only, None picked by row count (module docstring; where that picks W8A8 on CUDA, with no `tile`
    and a K scaled_mm takes, the triton backend hands the call to scaled_mm). `backend`: "triton", "scaled_mm" (W8A8
    only) or "torch"; default: triton on CUDA and under the interpreter, else torch. `tile` overrides the Triton
    tile (linear_tile); `weight_scale` (weight-only Triton): "tile" or "product", as fused_moe_fp8's; `gemv_tile`
    runs the GEMV at 1-2 rows with that launch (where gemv_serves would not: tests, benchmarks). `lora`
    (gemv.GemvLoRA: the shrink's partials, launched just before with the same `pdl`): each adapter row's expand
    added in the epilogue before the one rounding, where fuses_lora says the call can (else ValueError). `x_fp8`:
    x already quantized as input_quant says this call reads it (the producer wrote it), in place of a
    quantization launch here. `split_k` (Triton GEMM): programs sharing each tile's K steps, the last to finish
    adding their fp32 partials in a fixed order (default: linear_split's, with no `tile` given; else 1);
    `counters`: int32 zeros, at least split_counters(...) of them (split_counter_slots(N) covers the defaults),
    owned by the caller and left zero after every launch (allocated here when None, which costs a memset)."""
    _check(x, w_fp8, scale_inv, bias, block)
    if split_k is not None and split_k < 1:
        raise ValueError(f"fp8_linear: split_k must be >= 1, got {split_k}")
    if weight_scale not in ("tile", "product"):
        raise ValueError(f"fp8_linear: weight_scale {weight_scale!r}: choose 'tile' or 'product'")
    if backend is None:
        backend = "triton" if x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1" else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"fp8_linear: unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if lora is not None and (backend != "triton" or not fuses_lora(x2.shape[0], act_quant) or tile is not None):
        raise ValueError(f"fp8_linear: a LoRA epilogue runs on the triton backend, weight-only, at 1.."
                         f"{GEMV_MAX_TOKENS} rows with the default tiles (got {x2.shape[0]} rows, act_quant "
                         f"{act_quant}, backend {backend})")
    if x_fp8 is not None:
        want = input_quant(x2, w_fp8, act_quant, block) if backend == "triton" and tile is None else None
        q, scale = x_fp8
        layout_ok = want is not None and (scale.stride(0) == 1 if want[1] else scale.stride(1) == 1)
        if (not layout_ok or q.shape != x2.shape or q.dtype != FP8_DTYPE
                or scale.shape != (x2.shape[0], triton.cdiv(x2.shape[1], block[1]))):
            raise ValueError(f"fp8_linear: x_fp8 must be x quantized as this call reads it ({want}: group, M-major "
                             f"scale), got {tuple(q.shape)} {q.dtype} scale {tuple(scale.shape)} {scale.stride()}")
    if _takes_scaled_mm(x2, w_fp8.shape[0], block, act_quant, backend, tile):
        backend = "scaled_mm"
    if act_quant is None:
        act_quant = resolve_act_quant(None, x2.shape[0])
    gemv = (backend == "triton" and 1 <= x2.shape[0] <= GEMV_MAX_ROWS and tile is None
            and block[1] >= 8 and block[1] & (block[1] - 1) == 0
            and (gemv_tile is not None or gemv_serves(x2.shape[0], *w_fp8.shape)))
    if split_k not in (None, 1) and (backend != "triton" or gemv):
        raise ValueError(f"fp8_linear: split_k {split_k} splits the Triton GEMM; this call runs "
                         f"{'the GEMV' if gemv else backend}")
    if backend == "torch":
        out = fp8_linear_ref(x2, w_fp8, scale_inv, bias, act_quant=act_quant, block=block).to(x.dtype)
    elif backend == "scaled_mm":
        if not act_quant:
            raise ValueError("fp8_linear: the scaled_mm backend multiplies fp8 by fp8: it needs act_quant=True")
        out = _scaled_mm_linear(x2, w_fp8, scale_inv, bias, block, pdl, x_fp8)
    elif gemv:
        out = _gemv_linear(x2, w_fp8, scale_inv, bias, act_quant, block, pdl, gemv_tile, lora, x_fp8)
    else:
        out = _triton_linear(x2, w_fp8, scale_inv, bias, act_quant, block, tile, weight_scale == "product", pdl,
                             lora, x_fp8, split_k, counters)
    return out.reshape(*lead, w_fp8.shape[0])


def fp8_linear_ref(x, w_fp8, scale_inv, bias=None, *, act_quant: bool, block=WEIGHT_BLOCK) -> torch.Tensor:
    """fp32 torch on the dequantized weight; `act_quant` quantizes x per token-group with the kernel's twin first.
    Returns fp32."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    if act_quant:
        x2 = dequantize_block_fp8(*quantize_groups_fp8_ref(x2, block[1]), (1, block[1]))
    out = x2 @ dequantize_block_fp8(w_fp8, scale_inv, block).T
    if bias is not None:
        out = out + bias.float()
    return out.reshape(*x.shape[:-1], w_fp8.shape[0])
