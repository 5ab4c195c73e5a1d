"""Dense projection y = x W^T (+ b) for one or two rows (decode at batch 1-2), optionally with the multi-LoRA
expand fused into its epilogue.

There a projection is a matrix-vector product: the time is the weight read, and cuBLAS reaches only ~40-60 %
of the H200's read bandwidth (small grids, split-K plus a reduce launch). Here each program owns BLOCK_N
output columns for all T rows and walks the whole K, so every weight byte is read once, in 16-byte loads
along the contiguous K axis, in one launch: a broadcast multiply-add in fp32 on the CUDA cores, each thread
keeping its products' running sums over the K walk and one reduction ending it. Out-of-range rows and
columns are clamped to the last valid one on load (their results are never stored), so an even K needs no
load masks at all. No atomics: deterministic.

From three rows cuBLAS won at every preset shape on the H200, also against this kernel's tensor-core variant
and K splits (BENCHMARKS.md, session 5); those variants were removed (their code is in commit 1ca294c).

LoRA epilogue: given the shrink scratch written by kernels/lora_dense.py (x A^T per row, [k_splits,
slices, T, R] fp32, written only for rows whose slot has rank > 0 and up to that rank rounded up to 16),
each program adds sum_r scratch[., slice(n), t, r] * B[slot_t, n, r] to its fp32 accumulator before the
single rounding to the output dtype. Rows without an adapter (slot -1 or rank 0) never enter that code, so
they are bitwise the plain gemv's output.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moeserve.kernels import pdl as pdl_launch
from moeserve.kernels.lora_dense import RANK_BLOCK  # the epilogue reads exactly the rank steps the shrink wrote

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

GEMV_MAX_TOKENS = 2  # rows the kernel serves (see `serves`)
MAX_SLICES = 4


class GemvConfig(NamedTuple):
    """One launch configuration: a program holds a [T, block_n, block_k] fp32 running sum
    (T*block_n*block_k/threads registers)."""
    block_n: int
    block_k: int
    num_warps: int = 4


class GemvLoRA(NamedTuple):
    """The LoRA expand the gemv epilogue adds: shrink scratch [k_splits, slices, T, R] fp32 (lora_dense's
    `dense_lora_shrink`), lora_b [S, N, R], per-row slots [T] (-1: none), per-slot ranks [S]."""
    scratch: torch.Tensor
    lora_b: torch.Tensor
    token_slots: torch.Tensor
    slot_ranks: torch.Tensor
    slice_sizes: tuple[int, ...]


@functools.lru_cache(maxsize=None)
def default_config(N: int, K: int) -> GemvConfig:
    """The H200 sweep's best at one row (`benchmarks.kernels.kernels --parts gemv --sweep`): with no software
    pipelining the bytes in flight per SM are (resident programs) x (one tile), so 4 columns per program (o_proj:
    2048 columns in 512 programs) and a wide K tile, 1024 where K or the program count is large (o_proj, lm_head);
    within 0.3 us of the best of the swept configs elsewhere."""
    block_k = 1024 if (K >= 4096 or N >= 16384) else 512
    return GemvConfig(block_n=4, block_k=min(max(16, triton.next_power_of_2(K)), block_k), num_warps=4)


def serves(T: int, N: int, K: int) -> bool:
    """Whether the layers route a T-row projection of an [N, K] weight here rather than to cuBLAS. Measured on the
    H200 (`benchmarks.kernels.kernels --parts gemv`, 2026-11-30): the GEMV wins at one row (o_proj 7.6 vs 10.0 us,
    qkv 8.4 vs 8.6, lm_head 151.6 vs 152.9; with 4 adapters 12.4 vs 17.5 and 12.7 vs 15.7 us, the expand fused) and
    at two rows where K > N (o_proj 7.9 vs 9.9 us); from two rows of qkv (11.3 vs 8.6) and from three rows of any
    shape cuBLAS wins, so the kernel is not used there."""
    return T == 1 or (T == 2 and K > N)


@triton.jit
def gemv_epilogue(acc, t, n, T, N, bias_ptr, out_ptr, stride_ot,
              scratch_ptr, b_ptr, slots_ptr, ranks_ptr, R_MAX, END0, END1, END2,
              stride_sk, stride_ss, stride_st, stride_bl, stride_bn, stride_br,
              HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, LORA_K_SPLITS: tl.constexpr,
              BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """acc [rows, BLOCK_N] fp32 (rows t, the first BLOCK_T of them the decode rows) -> + bias -> + each adapter
    row's expand -> one rounding -> out. Shared with fp8_linear's kernels, whose tiles hold more rows than the
    BLOCK_T that may carry an adapter."""
    n_mask = n < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_LORA:
        # slice of each column (q|k|v): how many slice ends lie at or before it
        sl = (n >= END0).to(tl.int32) + (n >= END1).to(tl.int32) + (n >= END2).to(tl.int32)
        for tt in tl.static_range(BLOCK_T):
            slot = tl.load(slots_ptr + tt, mask=tt < T, other=-1)
            rank = tl.load(ranks_ptr + slot, mask=slot >= 0, other=0)
            if rank > 0:  # rows without an adapter never reach the add below: they stay bitwise
                b_slot = b_ptr + slot.to(tl.int64) * stride_bl
                delta = tl.zeros([BLOCK_N], tl.float32)
                for r0 in range(0, rank, BLOCK_R):  # to the slot's rank rounded up to BLOCK_R
                    r = r0 + tl.arange(0, BLOCK_R)
                    m = n_mask[:, None] & (r < R_MAX)[None, :]
                    s_ptrs = scratch_ptr + sl[:, None] * stride_ss + tt * stride_st + r[None, :]
                    s = tl.zeros([BLOCK_N, BLOCK_R], tl.float32)
                    for ks in tl.static_range(LORA_K_SPLITS):  # the shrink's partial sums over `in`
                        s += tl.load(s_ptrs + ks * stride_sk, mask=m, other=0.0)
                    b = tl.load(b_slot + n[:, None] * stride_bn + r[None, :] * stride_br, mask=m, other=0.0)
                    delta += tl.sum(s * b.to(tl.float32), 1)
                acc = tl.where((t == tt)[:, None], acc + delta[None, :], acc)
    o_ptrs = out_ptr + t[:, None] * stride_ot + n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(t < T)[:, None] & n_mask[None, :])


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr,
                 scratch_ptr, b_ptr, slots_ptr, ranks_ptr,
                 T, N, K, R_MAX, END0, END1, END2,
                 stride_xt, stride_wn, stride_ot,
                 stride_sk, stride_ss, stride_st, stride_bl, stride_bn, stride_br,
                 BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                 EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr,
                 LORA_K_SPLITS: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_launch.enter_late(USE_PDL, HAS_LORA)  # with LoRA: the shrink just launched runs under the K walk
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.arange(0, BLOCK_T)
    # clamped rows/columns: loads need no masks; what they compute is never stored
    cols = tl.minimum(n, N - 1).to(tl.int64)
    w_rows = w_ptr + cols[:, None] * stride_wn
    # x loaded in the [T, N, K] tile's own shape (a copy per column, from the L1): no shared-memory exchange to
    # broadcast it across the warps that split the columns (sm_90: 4 STS.U16 + 2 BAR.SYNC a K step)
    x_rows = x_ptr + tl.minimum(t, T - 1).to(tl.int64)[:, None, None] * stride_xt + 0 * cols[None, :, None]
    acc3 = tl.zeros([BLOCK_T, BLOCK_N, BLOCK_K], tl.float32)  # per-thread running sums, reduced once
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(w_rows + k[None, :])
            xt = tl.load(x_rows + k[None, None, :])
        else:
            k_mask = k < K
            w = tl.load(w_rows + k[None, :], mask=k_mask[None, :], other=0.0)
            xt = tl.load(x_rows + k[None, None, :], mask=k_mask[None, None, :], other=0.0)
        acc3 += xt.to(tl.float32) * w.to(tl.float32)[None, :, :]
    pdl_launch.late(USE_PDL, HAS_LORA)
    gemv_epilogue(tl.sum(acc3, 2), t, n, T, N, bias_ptr, out_ptr, stride_ot,
              scratch_ptr, b_ptr, slots_ptr, ranks_ptr, R_MAX, END0, END1, END2,
              stride_sk, stride_ss, stride_st, stride_bl, stride_bn, stride_br,
              HAS_BIAS, HAS_LORA, LORA_K_SPLITS, BLOCK_T, BLOCK_N, BLOCK_R)


def _check_config(cfg: GemvConfig) -> None:
    pow2 = lambda v: v > 0 and v & (v - 1) == 0  # noqa: E731
    if not (pow2(cfg.block_n) and pow2(cfg.block_k) and pow2(cfg.num_warps)):
        raise ValueError(f"gemv config {cfg}: block_n, block_k and num_warps must be powers of two")


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
         lora: GemvLoRA | None = None, config: GemvConfig | None = None, pdl: bool = False) -> torch.Tensor:
    """y [T, N] = x [T, K] W[N, K]^T (+ bias) (+ the LoRA expand of `lora`), fp32 accumulation, one rounding
    to out's dtype (default x.dtype). 1 <= T <= GEMV_MAX_TOKENS; x and W contiguous along K. With `lora` and
    `pdl`, the shrink that wrote lora.scratch must be the kernel launched just before: the K walk runs under it
    and waits only for the epilogue (kernels/pdl.py, late wait)."""
    T, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError(f"gemv: x has {K} features but weight is {tuple(weight.shape)}")
    if x.dtype not in _FLOAT_DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"gemv: x and weight must share a float dtype (fp32/fp16/bf16), got {x.dtype} and "
                         f"{weight.dtype}")
    if not 1 <= T <= GEMV_MAX_TOKENS:
        raise ValueError(f"gemv: {T} rows; it serves 1..{GEMV_MAX_TOKENS} (cuBLAS is faster above)")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("gemv: x and weight must be contiguous along K (stride 1)")
    if bias is not None and (bias.shape != (N,) or bias.stride(0) != 1):
        raise ValueError(f"gemv: bias must be a contiguous [{N}] vector, got {tuple(bias.shape)}")
    if out is None:
        out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    elif out.shape != (T, N) or out.stride(1) != 1:
        raise ValueError(f"gemv: out must be [{T}, {N}] with unit column stride, got {tuple(out.shape)}")
    cfg = config if config is not None else default_config(N, K)
    _check_config(cfg)
    lora_args, lora_k_splits = lora_epilogue_args(lora, T, N, out), 1
    if lora is not None:
        lora_k_splits = lora.scratch.shape[0]
    _gemv_kernel[(triton.cdiv(N, cfg.block_n),)](
        x, weight, bias if bias is not None else out, out, *lora_args[:4],
        T, N, K, *lora_args[4:8],
        x.stride(0), weight.stride(0), out.stride(0), *lora_args[8:],
        BLOCK_T=triton.next_power_of_2(T), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_R=RANK_BLOCK,
        EVEN_K=K % cfg.block_k == 0, HAS_BIAS=bias is not None, HAS_LORA=lora is not None,
        LORA_K_SPLITS=lora_k_splits, USE_PDL=pdl, launch_pdl=pdl,
        num_warps=cfg.num_warps, num_stages=2,  # the config measured on the H200
    )
    return out


def lora_epilogue_args(lora: GemvLoRA | None, T: int, N: int, dummy: torch.Tensor) -> tuple:
    """(scratch, B, slots, ranks, R_MAX, END0..2, 6 strides) for the epilogue; placeholders without LoRA."""
    if lora is None:
        return (dummy, dummy, dummy, dummy, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    scratch, b = lora.scratch, lora.lora_b
    sizes = tuple(lora.slice_sizes)
    k_splits, num_slices, scratch_t, max_rank = scratch.shape
    if not 1 <= len(sizes) <= MAX_SLICES or sum(sizes) != N or num_slices != len(sizes):
        raise ValueError(f"gemv lora: slice sizes {sizes} do not match N={N} and scratch {tuple(scratch.shape)}")
    if scratch_t != T or scratch.dtype != torch.float32 or scratch.stride(3) != 1:
        raise ValueError(f"gemv lora: scratch must be fp32 [k_splits, {len(sizes)}, {T}, R], "
                         f"got {tuple(scratch.shape)} {scratch.dtype}")
    if b.shape[1:] != (N, max_rank):
        raise ValueError(f"gemv lora: lora_b must be [S, {N}, {max_rank}], got {tuple(b.shape)}")
    if lora.token_slots.shape != (T,) or lora.slot_ranks.shape != (b.shape[0],):
        raise ValueError(f"gemv lora: token_slots must be [{T}] and slot_ranks [{b.shape[0]}]")
    ends = [sum(sizes[:i + 1]) for i in range(len(sizes) - 1)]
    ends += [1 << 30] * (3 - len(ends))  # past every column: no further slice
    return (scratch, b, lora.token_slots, lora.slot_ranks, max_rank, *ends,
            scratch.stride(0), scratch.stride(1), scratch.stride(2), b.stride(0), b.stride(1), b.stride(2))


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The plain-torch twin: fp32 math, one rounding to x.dtype."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
