"""Multi-LoRA delta for dense (possibly fused) projections, on rows grouped by adapter slot.

    out[t, slice i] += (x[t] @ lora_a[s, i, :r].T) @ lora_b[s, rows_i, :r].T,  s = token_slots[t]

Adapters live in a fixed slot pool: lora_a [L, S, R, in], lora_b [L, N_total, R] (scaling
folded into B, columns >= the slot's rank are zero). The rows are first grouped by slot
(`group_rows`: kernels/moe_align with the slots as the groups; one launch, no host sync, static
shapes), once per forward: every projection of the step reads the same grouping. Each program then
takes BLOCK_T rows of one slot, so it reads that slot's A or B tile once and no lane waits on
another adapter's rows; the cost no longer grows with the number of distinct adapters in a token
tile, as it did when tiles walked the slots they held (H200, q|k|v at T = 512: +22.3 µs with 4
adapters and +34.0 with 8 then, +12.4 and +13.0 grouped; BENCHMARKS.md, session 19). Two launches:
- shrink: x @ A.T into an fp32 scratch [k_splits, S, T, R], rows by token. The `in` dimension may be
  split across programs (more parallelism at small T); expand sums the partials, so no atomics
  and no zero-filled scratch are needed.
- expand: scratch @ B.T added in place into out. Where the Triton GEMV serves the base projection
  (kernels/gemv.serves: one row, or two where in > out) the layers run `dense_lora_shrink` alone and the
  expand as the GEMV's epilogue, one launch fewer per projection (the scratch is by token for it).
Rank loops stop at the slot's rank rounded up to RANK_BLOCK: a rank-8 adapter in a rank-64 pool does not
pay for 64. Rows with slot -1 are in no block; a block of a rank-0 slot exits: both are left bitwise untouched.
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moeserve.kernels import pdl as pdl_launch
from moeserve.kernels.moe_align import AlignedBlocks, moe_align

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}

RANK_BLOCK = 16  # rank columns per step (tl.dot needs K >= 16); loops run to roundup(rank, RANK_BLOCK)
MAX_SLICES = 4


class SlotGroups(NamedTuple):
    """A step's rows grouped by adapter slot: blocks of `block_t` rows of one slot (aligned.block_groups: the
    slot of each block, -1 past the end; aligned.sorted_ids: the token of each row, num_tokens for padding)."""
    aligned: AlignedBlocks
    block_t: int
    num_tokens: int


def token_block(T: int) -> int:
    """Rows per block at T tokens. H200, grouped q|k|v and o with 4 adapters (session 19): 16-row blocks best or
    within 0.5 µs up to T = 512; prefill steps hold long runs of one adapter, 64 rows as the tiles before."""
    return 16 if (_INTERPRET or T < 1024) else 64


def group_rows(token_slots: torch.Tensor, num_slots: int, block_t: int | None = None,
               pdl: bool = False) -> SlotGroups:
    """Group the rows of `token_slots` [T] (-1: no adapter) by slot; once per forward (models/moe_decoder.py)."""
    T = token_slots.shape[0]
    block_t = token_block(T) if block_t is None else block_t
    return SlotGroups(moe_align(token_slots.view(T, 1), num_slots, block_t, pdl=pdl), block_t, T)


def _compute_dtype(dtype: torch.dtype):
    # The interpreter computes bf16 arithmetic wrongly: upcast tiles to fp32 there.
    return tl.float32 if _INTERPRET else _TL_DTYPES[dtype]


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _block_rows(sorted_ids_ptr, block_slots_ptr, ranks_ptr, blk, T, BLOCK_T: tl.constexpr):
    """(slot, rank, tokens, valid rows) of block `blk`; rank 0 for a block past the end."""
    slot = tl.load(block_slots_ptr + blk)
    rank = tl.load(ranks_ptr + tl.maximum(slot, 0))
    rank = tl.where(slot >= 0, rank, 0)
    tokens = tl.load(sorted_ids_ptr + blk * BLOCK_T + tl.arange(0, BLOCK_T))
    return slot, rank, tokens, tokens < T


@triton.jit
def column_tile(nt, SIZE0, SIZE1, SIZE2, SIZE3, TILE1, TILE2, TILE3, BLOCK_N: tl.constexpr):
    """(slice, output columns, in-slice mask) of column tile `nt` of a fused projection: tiles are laid out slice by
    slice, none straddles two; TILEi is slice i's first tile (unused slices have size 0 and no tiles)."""
    sl = (nt >= TILE1).to(tl.int32) + (nt >= TILE2).to(tl.int32) + (nt >= TILE3).to(tl.int32)
    tile_base = tl.where(sl == 0, 0, tl.where(sl == 1, TILE1, tl.where(sl == 2, TILE2, TILE3)))
    col_base = tl.where(sl == 0, 0, tl.where(sl == 1, SIZE0, tl.where(sl == 2, SIZE0 + SIZE1, SIZE0 + SIZE1 + SIZE2)))
    size = tl.where(sl == 0, SIZE0, tl.where(sl == 1, SIZE1, tl.where(sl == 2, SIZE2, SIZE3)))
    c = (nt - tile_base) * BLOCK_N + tl.arange(0, BLOCK_N)  # column within the slice
    return sl, col_base + c, c < size


# sizes that vary with the step's token count are not specialized (Triton would compile a variant per residue of
# 16 it sees): a prefill shape the start-up warm-up did not reach then compiles nothing inside a request
@triton.jit(do_not_specialize=["T", "STEPS_PER_SPLIT", "stride_sk", "stride_ss"])
def _dense_lora_shrink_kernel(
    x_ptr, a_ptr, sorted_ids_ptr, block_slots_ptr, ranks_ptr, scratch_ptr,
    T, IN, R_MAX, STEPS_PER_SPLIT,  # BLOCK_K steps of `in` per split: a split starts on a BLOCK_K boundary
    stride_xt,
    stride_al, stride_as, stride_ar,
    stride_sk, stride_ss, stride_st,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
    EVEN_K: tl.constexpr = False, EVEN_R: tl.constexpr = False,
):
    """scratch[split, slice, token, :rank] for the BLOCK_T rows of one block (one slot). EVEN_K (IN a multiple of
    BLOCK_K), EVEN_R (R_MAX a multiple of BLOCK_R): those masks are dropped, so no mask varies along a contiguous
    dimension. With a split's start a multiple of BLOCK_K (STEPS_PER_SPLIT) the x and A loads are 16-byte vectors;
    a start the compiler could not prove aligned made them one bf16 at a time."""
    pdl_launch.enter(USE_PDL)
    slot, rank, tokens, rows = _block_rows(sorted_ids_ptr, block_slots_ptr, ranks_ptr, tl.program_id(0), T,
                                           BLOCK_T)
    if rank == 0:
        return
    sl = tl.program_id(1)  # slice of the fused projection
    ks = tl.program_id(2)  # split of the `in` dimension
    k_lo = ks * STEPS_PER_SPLIT * BLOCK_K  # provably a multiple of BLOCK_K: the x and A loads vectorize
    k_hi = tl.minimum(k_lo + STEPS_PER_SPLIT * BLOCK_K, IN)
    x_rows = x_ptr + tokens.to(tl.int64)[:, None] * stride_xt
    a_slot = a_ptr + slot.to(tl.int64) * stride_al + sl * stride_as
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_mask = (r < R_MAX) | EVEN_R
        acc = tl.zeros([BLOCK_T, BLOCK_R], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_mask = (k < k_hi) | EVEN_K
            xt = tl.load(x_rows + k[None, :], mask=rows[:, None] & k_mask[None, :], other=0.0).to(COMPUTE)
            at = tl.load(a_slot + r[None, :] * stride_ar + k[:, None],
                         mask=k_mask[:, None] & r_mask[None, :], other=0.0).to(COMPUTE)
            acc += tl.dot(xt, at, input_precision=DOT_PRECISION)
        # scratch strides in rows of stride_st (stride_sk / stride_ss vary with T and are not specialized):
        # offsets provably multiples of stride_st, so rank runs are vectors
        tl.store(scratch_ptr + ((ks * stride_sk + sl * stride_ss) + tokens[:, None]) * stride_st + r[None, :],
                 acc, mask=rows[:, None] & r_mask[None, :])


@triton.jit(do_not_specialize=["T", "K_SPLITS", "stride_sk", "stride_ss"])  # as the shrink's
def _dense_lora_expand_kernel(
    scratch_ptr, b_ptr, sorted_ids_ptr, block_slots_ptr, ranks_ptr, out_ptr,
    T, R_MAX, K_SPLITS,  # K_SPLITS: the shrink's split count, which follows the token count: a run-time loop
    stride_sk, stride_ss, stride_st,
    stride_bl, stride_bn, stride_br,
    stride_ot, stride_on,
    SIZE0: tl.constexpr, SIZE1: tl.constexpr, SIZE2: tl.constexpr, SIZE3: tl.constexpr,
    TILE1: tl.constexpr, TILE2: tl.constexpr, TILE3: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
    EVEN_N: tl.constexpr = False, EVEN_R: tl.constexpr = False,
):
    """out[token, tile] += the block's scratch rows (its splits summed) @ B[slot, tile, :rank]^T. EVEN_N (every
    slice a multiple of BLOCK_N), EVEN_R (R_MAX a multiple of BLOCK_R): as the shrink's flags."""
    pdl_launch.enter(USE_PDL)
    slot, rank, tokens, rows = _block_rows(sorted_ids_ptr, block_slots_ptr, ranks_ptr, tl.program_id(0), T,
                                           BLOCK_T)
    if rank == 0:
        return
    sl, n, n_ok = column_tile(tl.program_id(1), SIZE0, SIZE1, SIZE2, SIZE3, TILE1, TILE2, TILE3, BLOCK_N)
    n_mask = n_ok | EVEN_N

    b_slot = b_ptr + slot.to(tl.int64) * stride_bl
    s_rows = scratch_ptr + (sl * stride_ss + tokens[:, None]) * stride_st  # strides as the shrink's
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_mask = (r < R_MAX) | EVEN_R
        s_mask = rows[:, None] & r_mask[None, :]
        s = tl.zeros([BLOCK_T, BLOCK_R], tl.float32)
        for ks in range(K_SPLITS):
            s += tl.load(s_rows + ks * stride_sk * stride_st + r[None, :], mask=s_mask, other=0.0)
        b = tl.load(b_slot + n[None, :] * stride_bn + r[:, None] * stride_br,
                    mask=r_mask[:, None] & n_mask[None, :], other=0.0).to(COMPUTE)
        acc += tl.dot(s.to(COMPUTE), b, input_precision=DOT_PRECISION)

    o_ptrs = out_ptr + tokens.to(tl.int64)[:, None] * stride_ot + n[None, :] * stride_on
    o_mask = rows[:, None] & n_mask[None, :]
    o = tl.load(o_ptrs, mask=o_mask, other=0.0)
    tl.store(o_ptrs, (o.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=o_mask)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_k_splits(num_blocks: int, num_slices: int, in_features: int, block_k: int,
                      device: torch.device) -> int:
    """Split `in` across programs while blocks x slices alone would leave the GPU idle (decode)."""
    if device.type != "cuda":
        return 1
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    want = triton.cdiv(2 * sms, num_blocks * num_slices)
    return max(1, min(want, triton.cdiv(in_features, block_k), 8))


def dense_lora(x, lora_a, lora_b, token_slots, slot_ranks, slice_sizes: tuple[int, ...], out,
               groups: SlotGroups | None = None, pdl: bool = False) -> None:
    """Add the per-token multi-LoRA delta into out [T, N_total] in place (see module doc). `groups`: the step's
    rows grouped by slot (`group_rows`), made here when not given; `pdl`: launch with programmatic dependent
    launch (kernels/pdl.py)."""
    _dense_lora(x, lora_a, lora_b, token_slots, slot_ranks, tuple(slice_sizes), out, groups=groups, pdl=pdl)


def _dense_lora(x, lora_a, lora_b, token_slots, slot_ranks, slice_sizes, out, *, groups=None,
                block_t=None, block_k=None, block_n=None, k_splits=None, num_warps=4, pdl=False):
    n_total = out.shape[1]
    num_slots, num_slices, max_rank, _ = lora_a.shape
    assert len(slice_sizes) == num_slices and sum(slice_sizes) == n_total
    assert lora_b.shape == (num_slots, n_total, max_rank) and out.shape[0] == x.shape[0]
    if x.shape[0] == 0 or max_rank == 0:
        return
    if groups is None:
        groups = group_rows(token_slots, num_slots, block_t, pdl=pdl)
    scratch = dense_lora_shrink(x, lora_a, token_slots, slot_ranks, groups, block_k=block_k, k_splits=k_splits,
                                num_warps=num_warps, pdl=pdl)
    _expand(scratch, lora_b, slot_ranks, groups, tuple(slice_sizes), out, block_n=block_n, num_warps=num_warps,
            pdl=pdl)


def dense_lora_shrink(x, lora_a, token_slots, slot_ranks, groups: SlotGroups | None = None, *, block_k=None,
                      k_splits=None, num_warps=4, pdl=False, stream=None) -> torch.Tensor:
    """x @ A[slot].T per row into a new fp32 scratch [k_splits, slices, T, R], entries written only for rows
    whose slot has rank > 0 and rank columns below that rank rounded up to RANK_BLOCK (all an expand reads);
    the k_splits partial sums over `in` are the expand's to add. `groups` as dense_lora's. `stream`: the kernel
    runs there, the scratch is allocated on the current stream (whose later work must wait for `stream`)."""
    T, in_features = x.shape
    num_slots, num_slices, max_rank, a_in = lora_a.shape
    assert a_in == in_features and 1 <= num_slices <= MAX_SLICES
    assert token_slots.shape == (T,) and slot_ranks.shape == (num_slots,)
    assert x.stride(1) == 1 and lora_a.stride(3) == 1
    if groups is None:
        groups = group_rows(token_slots, num_slots, pdl=pdl)
    if groups.num_tokens != T:
        raise ValueError(f"dense LoRA: rows grouped for {groups.num_tokens} tokens, x has {T}")
    if block_k is None:
        block_k = 32 if _INTERPRET else 256
    block_k = min(block_k, max(16, triton.next_power_of_2(in_features)))
    num_blocks = groups.aligned.block_groups.numel()
    if k_splits is None:
        k_splits = _default_k_splits(num_blocks, num_slices, in_features, block_k, x.device)
    k_per_split = triton.cdiv(triton.cdiv(in_features, k_splits), block_k) * block_k
    k_splits = triton.cdiv(in_features, k_per_split)
    scratch = torch.empty((k_splits, num_slices, T, max_rank), dtype=torch.float32, device=x.device)
    if T == 0 or max_rank == 0:
        return scratch
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        _dense_lora_shrink_kernel[(num_blocks, num_slices, k_splits)](
            x, lora_a, groups.aligned.sorted_ids, groups.aligned.block_groups, slot_ranks, scratch,
            T, in_features, max_rank, k_per_split // block_k,
            x.stride(0),
            lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
            *_scratch_strides(scratch),
            BLOCK_T=groups.block_t, BLOCK_K=block_k, BLOCK_R=RANK_BLOCK,
            COMPUTE=_compute_dtype(x.dtype), DOT_PRECISION=_dot_precision(x.dtype), USE_PDL=pdl,
            EVEN_K=in_features % block_k == 0, EVEN_R=max_rank % RANK_BLOCK == 0,
            num_warps=num_warps, launch_pdl=pdl,
        )
    return scratch


def _scratch_strides(scratch: torch.Tensor) -> tuple[int, int, int]:
    """(split, slice strides in rows, row stride) of a contiguous [k_splits, slices, T, R] scratch: the kernels
    multiply the first two by the row stride."""
    return scratch.stride(0) // scratch.stride(2), scratch.stride(1) // scratch.stride(2), scratch.stride(2)


def dense_lora_expand(scratch, lora_b, slot_ranks, groups: SlotGroups, slice_sizes: tuple[int, ...], out,
                      pdl: bool = False) -> None:
    """out += each row's scratch @ B[slot].T in place (rows without an adapter untouched): the second launch of
    dense_lora, for a shrink made apart (dense_lora_shrink; `groups` the same)."""
    num_slots, n_total, max_rank = lora_b.shape
    if len(slice_sizes) != scratch.shape[1] or sum(slice_sizes) != n_total or out.shape != (scratch.shape[2], n_total):
        raise ValueError(f"dense LoRA expand: slices {tuple(slice_sizes)}, scratch {tuple(scratch.shape)}, "
                         f"lora_b {tuple(lora_b.shape)} and out {tuple(out.shape)} do not match")
    if out.shape[0] == 0 or max_rank == 0:
        return
    _expand(scratch, lora_b, slot_ranks, groups, tuple(slice_sizes), out, block_n=None, num_warps=4, pdl=pdl)


def _expand(scratch, lora_b, slot_ranks, groups, slice_sizes, out, *, block_n, num_warps, pdl=False):
    """out += scratch @ B[slot].T per row (rows without an adapter untouched); the two-launch path's second."""
    k_splits, num_slices, T, max_rank = scratch.shape
    if block_n is None:
        block_n = 16 if _INTERPRET else 128
    sizes = tuple(slice_sizes) + (0,) * (MAX_SLICES - num_slices)
    tile_starts = [0]
    for size in sizes:
        tile_starts.append(tile_starts[-1] + triton.cdiv(size, block_n))
    num_col_tiles = tile_starts[num_slices]
    _dense_lora_expand_kernel[(groups.aligned.block_groups.numel(), num_col_tiles)](
        scratch, lora_b, groups.aligned.sorted_ids, groups.aligned.block_groups, slot_ranks, out,
        T, max_rank, k_splits,
        *_scratch_strides(scratch),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        out.stride(0), out.stride(1),
        SIZE0=sizes[0], SIZE1=sizes[1], SIZE2=sizes[2], SIZE3=sizes[3],
        TILE1=tile_starts[1], TILE2=tile_starts[2], TILE3=tile_starts[3],
        BLOCK_T=groups.block_t, BLOCK_N=block_n, BLOCK_R=RANK_BLOCK,
        COMPUTE=_compute_dtype(lora_b.dtype), DOT_PRECISION=_dot_precision(lora_b.dtype), USE_PDL=pdl,
        EVEN_N=all(size % block_n == 0 for size in slice_sizes), EVEN_R=max_rank % RANK_BLOCK == 0,
        num_warps=num_warps, launch_pdl=pdl,
    )


def dense_lora_ref(x, lora_a, lora_b, token_slots, slot_ranks, slice_sizes, out) -> None:
    """fp32 reference of dense_lora, one adapter slot at a time (in place into out)."""
    slots = token_slots.tolist()
    ranks = slot_ranks.tolist()
    starts = [sum(slice_sizes[:i]) for i in range(len(slice_sizes))]
    for s in sorted(set(slots)):
        if s < 0 or ranks[s] == 0:
            continue  # no adapter: row untouched
        r = ranks[s]
        rows = torch.tensor([t for t, slot in enumerate(slots) if slot == s], device=x.device)
        xs = x[rows].float()
        delta = torch.cat([
            (xs @ lora_a[s, i, :r].float().T) @ lora_b[s, start : start + size, :r].float().T
            for i, (start, size) in enumerate(zip(starts, slice_sizes))
        ], dim=1)
        out[rows] = (out[rows].float() + delta).to(out.dtype)
