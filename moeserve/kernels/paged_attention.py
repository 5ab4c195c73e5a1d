"""Paged attention over the block KV cache: split-K decode and varlen causal prefill.

Cache layout (per layer): k_cache, v_cache [num_blocks, block_size, n_kv_heads, head_dim].
block_tables [B, max_blocks] int32 maps a sequence's logical block j to a physical block;
block 0 is a dummy the engine never hands out, so padded rows may point at it.
GQA: query head h reads kv head h // (n_heads // n_kv_heads).
An fp8 cache (kernels/kv_fp8.py: K / k_scale and V / v_scale stored float8_e4m3fn) is read as its e4m3 values,
converted exactly to the compute dtype; k_scale is folded into the softmax scale and v_scale multiplies the output,
so no tile is ever dequantized. Every program handles all the
query heads of one kv head (as extra rows of its tile), so each K/V tile is read once.

Decode is flash-decoding: programs (sequence, kv head, split) each reduce a contiguous range
of the sequence's KV tiles to a partial output plus its log-sum-exp, and a small second
kernel merges the splits. The split count depends on static shapes only, and each sequence's
context is divided among the splits inside the kernel, so the grid never depends on
context_lens (decode is captured in CUDA graphs) and nothing syncs with the host.
"""
from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moeserve.kernels import pdl as pdl_launch

# The interpreter computes bf16 arithmetic wrongly: there, every tile is upcast to fp32 on load.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_LOG2E = 1.4426950408889634

# Tile sizes. The interpreter pays per program and per tl.dot step, so it gets small tiles.
DECODE_BLOCK_N = 16 if _INTERPRET else 64  # KV tokens per inner step
# One-byte K/V rows want twice the tokens per step, and a deeper pipeline, for the same bytes in flight: H200, 512-token
# context, fp8 cache, us at B = 64 / 256 / 512: the bf16 tiles (64, 2 stages) 33.8 / 83.0 / 156.1, these (128, 4
# stages) 23.2 / 71.1 / 132.1; the bf16 cache on its own tiles 26.8 / 71.6 / 135.1
DECODE_FP8_TILE = (16, 2) if _INTERPRET else (128, 4)  # (KV tokens per step, stages)
PREFILL_BLOCK_M = 16 if _INTERPRET else 128  # rows (query tokens x heads of a group) per program
PREFILL_BLOCK_N = 16 if _INTERPRET else 64


class PrefillTile(NamedTuple):
    """The prefill kernel's launch: rows (query tokens x heads of a group) and KV tokens per step, warps, stages;
    split_causal: the KV steps every row of the tile sees run without the causal mask, the rest with it."""
    block_m: int = PREFILL_BLOCK_M
    block_n: int = PREFILL_BLOCK_N
    num_warps: int | None = None  # None: 8 from 128 rows, else 4
    num_stages: int = 2
    split_causal: bool = False


# The launch by the step's longest query (H200, Qwen3-30B-A3B heads: 32 q, 4 kv, 128 dims, bf16; µs per call, session 20,
# `python -m benchmarks.kernels.prefill_attention --sweep`; each of these tiles gave bitwise the 128 x 64 default's
# output). 32 prompts of 256: default 72.2, SHORT 65.6 (LONG 73.9); 4 of 2,048: 288.1 -> LONG 250.8; one of 8,192:
# 1,010 -> 852; a 2,048 chunk after 6,144 cached: 162.5 -> 135.7. Short queries leave a 128-row tile few KV steps to
# pipeline; long ones spend most steps where no row needs the causal mask.
SHORT_PREFILL_TILE = PrefillTile(64, 64, 4, 2, False)
LONG_PREFILL_TILE = PrefillTile(128, 64, 8, 3, True)
SHORT_PREFILL_MAX_QUERY = 256


def prefill_tile(max_query_len: int) -> PrefillTile:
    """The prefill launch for a step whose longest query chunk is `max_query_len` tokens (the interpreter: the
    small default tile)."""
    if _INTERPRET:
        return PrefillTile()
    return SHORT_PREFILL_TILE if max_query_len <= SHORT_PREFILL_MAX_QUERY else LONG_PREFILL_TILE


MAX_DECODE_SPLITS = 64

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _compute_dtype(dtype: torch.dtype):
    """Dtype the tiles are multiplied in: the storage dtype, fp32 under the interpreter."""
    return tl.float32 if _INTERPRET else _TL_DTYPES[dtype]


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would otherwise go through tf32 on the GPU; bf16/fp16 ignore this.
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def decode_tile(kv_element_size: int) -> tuple[int, int]:
    """(KV tokens per step, pipeline stages) of the decode kernel for a cache of this element size."""
    return DECODE_FP8_TILE if kv_element_size == 1 else (DECODE_BLOCK_N, 2)


def default_num_splits(batch: int, n_kv_heads: int, max_blocks: int, block_size: int,
                       device: torch.device, block_n: int = DECODE_BLOCK_N) -> int:
    """Splits per (sequence, kv head), from static shapes only: about three programs per SM
    (short splits hide the latency of the block-table -> K/V gathers), never more splits than
    the longest possible context has tiles."""
    programs = max(1, batch * n_kv_heads)
    want = triton.cdiv(3 * _sm_count(device), programs)
    max_tiles = max(1, triton.cdiv(max_blocks * block_size, block_n))
    return max(1, min(want, max_tiles, MAX_DECODE_SPLITS))


# --------------------------------------------------------------------------------------
# one KV tile (decode and prefill)


@triton.jit
def _online_softmax_step(q, m, l, acc, table, pos, valid, q_pos, k_ptr, v_ptr, kv_head, d, d_mask, qk_scale,
                         stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                         BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr, COMPUTE: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    """One flash-attention step over the KV tile at positions `pos` (base-2 online softmax), K/V rows
    gathered through the block table where `valid` -> m, l, acc. CAUSAL: row i sees keys up to q_pos[i]."""
    block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slot = pos % BLOCK_SIZE
    kv_mask = valid[:, None] & d_mask[None, :]
    k_off = block * stride_kb + slot * stride_kt + kv_head * stride_kh
    k = tl.load(k_ptr + k_off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(COMPUTE)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if CAUSAL:
        s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
    else:
        s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    v_off = block * stride_vb + slot * stride_vt + kv_head * stride_vh
    v = tl.load(v_ptr + v_off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(COMPUTE)
    acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), v, input_precision=DOT_PRECISION)
    return m_new, l, acc


# --------------------------------------------------------------------------------------
# decode


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale,  # softmax scale * k_scale * log2(e): the kernel works in base 2
    v_scale,  # the fp8 cache's V scale (1.0 otherwise): the output is sum p v_fp8 / l times it
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    stride_ob, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, Q_SCALE: tl.constexpr = 1.0,
):
    """Q_SCALE: q is multiplied by it (a power of two, exact) before it is rounded to COMPUTE; qk_scale divides
    it out again (fp8_decode_compute)."""
    pdl_launch.enter(USE_PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP

    # This split's share of the sequence's KV tiles (empty for padded rows: context 0).
    ctx = tl.load(context_lens_ptr + seq)
    num_tiles = tl.cdiv(ctx, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    head = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qb + head[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if Q_SCALE != 1.0:
        q = q.to(tl.float32) * Q_SCALE
    q = q.to(COMPUTE)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        # the first tile of a split always has a valid key, so m is finite after it
        pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = pos < ctx
        m, l, acc = _online_softmax_step(q, m, l, acc, table, pos, valid, None, k_ptr, v_ptr, kv_head, d, d_mask,
                                         qk_scale, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                                         stride_vh, BLOCK_SIZE, False, COMPUTE, DOT_PRECISION)

    nonempty = l > 0
    o = acc / tl.where(nonempty, l, 1.0)[:, None] * v_scale  # empty split / padded row: acc is 0
    if NUM_SPLITS == 1:
        tl.store(out_ptr + seq * stride_ob + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        row = (seq * num_heads + head) * NUM_SPLITS + split  # [GROUP_PAD]
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM_PAD + d[None, :], o, mask=g_mask[:, None])
        lse = tl.where(nonempty, m + tl.log2(tl.where(nonempty, l, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_ob, stride_oh,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_launch.enter(USE_PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = seq * tl.num_programs(1) + head
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    sp_mask = sp < NUM_SPLITS
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + sp, mask=sp_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty (padded row): weights all 0
    w = tl.exp2(lse - m)
    o = tl.load(part_out_ptr + (row * NUM_SPLITS + sp)[:, None] * HEAD_DIM_PAD + d[None, :],
                mask=sp_mask[:, None], other=0.0)
    num = tl.sum(w[:, None] * o, 0)
    den = tl.sum(w, 0)
    res = num / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, res.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def _check_cache(q, k_cache, v_cache):
    n_heads, head_dim = q.shape[-2], q.shape[-1]
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "cache: [num_blocks, block_size, n_kv, head_dim]"
    _, block_size, n_kv, d = k_cache.shape
    assert d == head_dim and n_heads % n_kv == 0
    assert block_size & (block_size - 1) == 0, "block_size must be a power of two"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    return n_heads, head_dim, block_size, n_kv, n_heads // n_kv


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale: float,
                           num_splits: int | None = None, out=None, pdl: bool = False, k_scale: float = 1.0,
                           v_scale: float = 1.0) -> torch.Tensor:
    """One query token per sequence. q [B, n_heads, head_dim] -> [B, n_heads, head_dim] (q dtype).
    k_scale / v_scale: what the cache's values are multiplied by to be K and V (an fp8 cache's scales; 1.0 else).

    context_lens counts the sequence's tokens in the cache including the current one; rows with
    context 0 (padding) output zeros and read no cache. Launch shapes depend only on tensor
    shapes, so the call can be captured in a CUDA graph and replayed with new lengths/tables. `pdl`: both
    launches with programmatic dependent launch (kernels/pdl.py).
    """
    n_heads, head_dim, block_size, n_kv, group = _check_cache(q, k_cache, v_cache)
    batch = q.shape[0]
    if out is None:
        out = torch.empty((batch, n_heads, head_dim), dtype=q.dtype, device=q.device)
    assert out.shape == (batch, n_heads, head_dim) and out.stride(-1) == 1
    if batch == 0:
        return out
    block_n, stages = decode_tile(k_cache.dtype.itemsize)
    if num_splits is None:
        num_splits = default_num_splits(batch, n_kv, block_tables.shape[1], block_size, q.device, block_n)
    _launch_decode(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits, out,
                   block_n=block_n, num_warps=4, num_stages=stages, pdl=pdl, k_scale=k_scale, v_scale=v_scale)
    return out


# An fp8 cache's tiles are multiplied in fp16 (q too): e4m3 -> fp16 is one conversion for two values, where e4m3 ->
# bf16 went through fp32 (sm_90, Triton 3.6, the decode kernel on a 128-token step: 256 F2F + 128 PRMT a step, none in
# fp16). q enters fp16 scaled by 2^-8 (exact; qk_scale takes it back), so a bf16 q up to 2^24 stays finite; the
# scaled q loses precision only below 2^-6 in magnitude (fp16's subnormals), at most 2^-17 absolute. p in [0, 1]
# keeps two more mantissa bits in fp16 than in bf16.
FP8_DECODE_Q_SCALE = 2.0**-8


def fp8_decode_compute(q_dtype: torch.dtype, kv_element_size: int):
    """(compute dtype, q scale) of the decode kernel for a cache of this element size."""
    if kv_element_size == 1 and not _INTERPRET and q_dtype in (torch.bfloat16, torch.float16):
        return tl.float16, FP8_DECODE_Q_SCALE
    return _compute_dtype(q_dtype), 1.0


def _launch_decode(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits, out,
                   block_n, num_warps, num_stages, pdl=False, k_scale=1.0, v_scale=1.0):
    n_heads, head_dim, block_size, n_kv, group = _check_cache(q, k_cache, v_cache)
    compute, q_scale = fp8_decode_compute(q.dtype, k_cache.element_size())
    batch = q.shape[0]
    head_dim_pad = triton.next_power_of_2(head_dim)
    if num_splits > 1:
        # Partial results, laid out [B, n_heads, splits, head_dim_pad]; every entry is written.
        part_out = torch.empty((batch, n_heads, num_splits, head_dim_pad), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, n_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    _decode_split_kernel[(batch, n_kv, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens,
        out, part_out, part_lse,
        scale * k_scale * _LOG2E / q_scale, float(v_scale),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        COMPUTE=compute, DOT_PRECISION=_dot_precision(q.dtype), Q_SCALE=q_scale,
        USE_PDL=pdl, launch_pdl=pdl, num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _decode_merge_kernel[(batch, n_heads)](
            part_out, part_lse, out,
            out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            USE_PDL=pdl, launch_pdl=pdl, num_warps=1 if head_dim_pad <= 64 else 2,
        )
    return out


# --------------------------------------------------------------------------------------
# prefill


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    qk_scale, v_scale,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, TOKENS: tl.constexpr, BLOCK_N: tl.constexpr,
    COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, SPLIT_CAUSAL: tl.constexpr = False,
):
    pdl_launch.enter(USE_PDL)
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tok0 = tile * TOKENS
    if tok0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_start = seq_len - q_len  # tokens of earlier chunks, already in the cache

    # Rows are (query token, head of the group) pairs: the group's heads share every K/V tile.
    r = tl.arange(0, BLOCK_M)
    tok = tok0 + r // GROUP_PAD
    g = r % GROUP_PAD
    head = kv_head * GROUP + g
    row_mask = (tok < q_len) & (g < GROUP)
    q_pos = ctx_start + tok
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0).to(COMPUTE)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Keys up to the last query position of this tile; key 0 is visible to every row, so each
    # row's running max is finite after the first step.
    kv_end = tl.minimum(ctx_start + tok0 + TOKENS, seq_len)
    causal_start = 0
    if SPLIT_CAUSAL:  # whole KV steps at or before the tile's first query position: every row sees every key
        causal_start = (ctx_start + tok0 + 1) // BLOCK_N * BLOCK_N
        for start in range(0, causal_start, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            m, l, acc = _online_softmax_step(q, m, l, acc, table, pos, pos < kv_end, q_pos, k_ptr, v_ptr, kv_head, d,
                                             d_mask, qk_scale, stride_kb, stride_kt, stride_kh, stride_vb,
                                             stride_vt, stride_vh, BLOCK_SIZE, False, COMPUTE, DOT_PRECISION)
    for start in range(causal_start, kv_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < kv_end
        m, l, acc = _online_softmax_step(q, m, l, acc, table, pos, valid, q_pos, k_ptr, v_ptr, kv_head, d, d_mask,
                                         qk_scale, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                                         stride_vh, BLOCK_SIZE, True, COMPUTE, DOT_PRECISION)

    o = acc / tl.where(l > 0, l, 1.0)[:, None] * v_scale
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale: float,
                            max_query_len: int, pdl: bool = False, k_scale: float = 1.0,
                            v_scale: float = 1.0, tile: PrefillTile | None = None) -> torch.Tensor:
    """Causal attention for S packed query chunks. q [T, n_heads, head_dim] -> same shape, q dtype.

    Sequence s owns q rows query_start_loc[s]:query_start_loc[s+1]; seq_lens[s] counts its
    tokens in the cache after this chunk, so query i sits at position seq_lens[s] - q_len + i
    and attends to cache positions 0..itself (earlier chunks included). k_scale / v_scale: as for decode; `tile`:
    the launch (None: prefill_tile's by max_query_len; benchmarks.kernels.prefill_attention sweeps them).
    """
    n_heads, head_dim, block_size, n_kv, group = _check_cache(q, k_cache, v_cache)
    out = torch.empty((q.shape[0], n_heads, head_dim), dtype=q.dtype, device=q.device)
    num_seqs = seq_lens.shape[0]
    if q.shape[0] == 0 or num_seqs == 0 or max_query_len <= 0:
        return out
    if tile is None:
        tile = prefill_tile(max_query_len)
    group_pad = triton.next_power_of_2(group)
    block_m = max(tile.block_m, group_pad, 16)
    tokens = block_m // group_pad
    num_warps = tile.num_warps or (4 if _INTERPRET or block_m <= 64 else 8)
    grid = (triton.cdiv(max_query_len, tokens), num_seqs, n_kv)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        scale * k_scale * _LOG2E, float(v_scale),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, TOKENS=tokens, BLOCK_N=tile.block_n,
        COMPUTE=_compute_dtype(q.dtype), DOT_PRECISION=_dot_precision(q.dtype),
        USE_PDL=pdl, SPLIT_CAUSAL=tile.split_causal, launch_pdl=pdl, num_warps=num_warps, num_stages=tile.num_stages,
    )
    return out


# --------------------------------------------------------------------------------------
# plain-torch references (fp32, one sequence at a time)


def _gather_kv(k_cache, v_cache, block_table, length: int, k_scale: float = 1.0, v_scale: float = 1.0):
    """The first `length` cached tokens of one sequence: [length, n_kv, head_dim] fp32 each, times their scales."""
    block_size = k_cache.shape[1]
    blocks = block_table[: math.ceil(length / block_size)].long()
    k = k_cache[blocks].flatten(0, 1)[:length].float() * k_scale
    v = v_cache[blocks].flatten(0, 1)[:length].float() * v_scale
    return k, v


def _attend(q, k, v, scale, mask):
    """q [M, H, D], k/v [L, n_kv, D], mask [M, L] (True = visible) -> [M, H, D] fp32."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,lhd->hml", q.float(), k) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hml,lhd->mhd", torch.softmax(scores, dim=-1), v)


def paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale: float = 1.0,
                               v_scale: float = 1.0) -> torch.Tensor:
    """fp32 reference of paged_decode_attention (returns fp32): the cache dequantized (times its scales) first."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, length in enumerate(context_lens.tolist()):
        if length == 0:
            continue
        k, v = _gather_kv(k_cache, v_cache, block_tables[b], length, k_scale, v_scale)
        mask = torch.ones(1, length, dtype=torch.bool, device=q.device)
        out[b] = _attend(q[b : b + 1], k, v, scale, mask)[0]
    return out


def paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """fp32 reference of paged_prefill_attention (returns fp32): the cache dequantized (times its scales) first."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[s], starts[s + 1]
        if hi == lo:
            continue
        k, v = _gather_kv(k_cache, v_cache, block_tables[s], seq_len, k_scale, v_scale)
        q_pos = torch.arange(seq_len - (hi - lo), seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        out[lo:hi] = _attend(q[lo:hi], k, v, scale, mask)
    return out
