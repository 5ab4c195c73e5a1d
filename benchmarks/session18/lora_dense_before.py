"""Multi-LoRA delta for dense (possibly fused) projections, gathered by adapter slot.

    out[t, slice i] += (x[t] @ lora_a[s, i, :r].T) @ lora_b[s, rows_i, :r].T,  s = token_slots[t]

Adapters live in a fixed slot pool: lora_a [L, S, R, in], lora_b [L, N_total, R] (scaling
folded into B, columns >= the slot's rank are zero). Two launches:
- shrink: x @ A.T into an fp32 scratch [k_splits, S, T, R]. The `in` dimension may be split
  across programs (more parallelism at small T); expand sums the partials, so no atomics
  and no zero-filled scratch are needed.
- expand: scratch @ B.T added in place into out. Where the Triton GEMV serves the base projection
  (kernels/gemv.serves: one row, or two where in > out) the layers run `dense_lora_shrink` alone and the
  expand as the GEMV's epilogue, one launch fewer per projection.
Each program takes a tile of tokens and walks the distinct slots present in it, so no
sorting and no host sync. With `lanes` > 1 the distinct slots of a tile are dealt round-robin
to that many programs (each slot owns disjoint rows, so they never write the same element):
a decode tile mixing 4 adapters then costs one pass, not four in a row. Rank loops stop at the slot's
rank rounded up to RANK_BLOCK: a rank-8 adapter in a rank-64 pool does not pay for 64.
Rows with slot -1, or with a slot of rank 0, are left bitwise untouched.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from moeserve.kernels import pdl as pdl_launch

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}

RANK_BLOCK = 16  # rank columns per step (tl.dot needs K >= 16); loops run to roundup(rank, RANK_BLOCK)
MAX_SLICES = 4
_NO_SLOT = tl.constexpr(1 << 30)  # larger than any slot id


def _compute_dtype(dtype: torch.dtype):
    # The interpreter computes bf16 arithmetic wrongly: upcast tiles to fp32 there.
    return tl.float32 if _INTERPRET else _TL_DTYPES[dtype]


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _active_slots(slots_ptr, ranks_ptr, t, T):
    """Slot per token of the tile, -1 where the token has no adapter or a rank-0 one."""
    slots = tl.load(slots_ptr + t, mask=t < T, other=-1)
    ranks = tl.load(ranks_ptr + slots, mask=slots >= 0, other=0)
    return tl.where(ranks > 0, slots, -1)


@triton.jit
def _next_slot(slots, cur):
    """Smallest slot of the tile above `cur` (_NO_SLOT when none is left)."""
    return tl.min(tl.where(slots > cur, slots, _NO_SLOT), 0)


@triton.jit
def _first_slot_of_lane(slots, lane):
    cur = tl.min(tl.where(slots >= 0, slots, _NO_SLOT), 0)
    for _ in range(lane):
        cur = _next_slot(slots, cur)
    return cur


# sizes that vary with the step's token count are not specialized (Triton would compile a variant per residue of
# 16 it sees): a prefill shape the start-up warm-up did not reach then compiles nothing inside a request
@triton.jit(do_not_specialize=["T", "K_PER_SPLIT", "stride_sk", "stride_ss"])
def _shrink_kernel(
    x_ptr, a_ptr, slots_ptr, ranks_ptr, scratch_ptr,
    T, IN, R_MAX, K_PER_SPLIT,
    stride_xt,
    stride_al, stride_as, stride_ar,
    stride_sk, stride_ss, stride_st,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, LANES: tl.constexpr,
    COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_launch.enter(USE_PDL)
    tile = tl.program_id(0)
    sl = tl.program_id(1) // LANES  # slice of the fused projection
    lane = tl.program_id(1) % LANES
    ks = tl.program_id(2)  # split of the `in` dimension
    t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    slots = _active_slots(slots_ptr, ranks_ptr, t, T)
    k_lo = ks * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, IN)
    x_rows = x_ptr + t.to(tl.int64)[:, None] * stride_xt

    cur = _first_slot_of_lane(slots, lane)
    while cur < _NO_SLOT:
        rows = slots == cur
        rank = tl.load(ranks_ptr + cur)
        a_slot = a_ptr + cur.to(tl.int64) * stride_al + sl * stride_as
        for r0 in range(0, rank, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            r_mask = r < R_MAX
            acc = tl.zeros([BLOCK_T, BLOCK_R], tl.float32)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                k_mask = k < k_hi
                xt = tl.load(x_rows + k[None, :], mask=rows[:, None] & k_mask[None, :], other=0.0).to(COMPUTE)
                at = tl.load(a_slot + r[None, :] * stride_ar + k[:, None],
                             mask=k_mask[:, None] & r_mask[None, :], other=0.0).to(COMPUTE)
                acc += tl.dot(xt, at, input_precision=DOT_PRECISION)
            tl.store(scratch_ptr + ks * stride_sk + sl * stride_ss + t[:, None] * stride_st + r[None, :],
                     acc, mask=rows[:, None] & r_mask[None, :])
        for _ in tl.static_range(LANES):
            cur = _next_slot(slots, cur)


@triton.jit(do_not_specialize=["T", "K_SPLITS", "stride_sk", "stride_ss"])  # as the shrink's
def _expand_kernel(
    scratch_ptr, b_ptr, slots_ptr, ranks_ptr, out_ptr,
    T, R_MAX, K_SPLITS,  # K_SPLITS: the shrink's split count, which follows the token count: a run-time loop
    stride_sk, stride_ss, stride_st,
    stride_bl, stride_bn, stride_br,
    stride_ot, stride_on,
    SIZE0: tl.constexpr, SIZE1: tl.constexpr, SIZE2: tl.constexpr, SIZE3: tl.constexpr,
    TILE1: tl.constexpr, TILE2: tl.constexpr, TILE3: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, LANES: tl.constexpr,
    COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_launch.enter(USE_PDL)
    tile = tl.program_id(0)
    nt = tl.program_id(1)  # column tile; tiles are laid out slice by slice, none straddles two
    # TILEi: first column tile of slice i (unused slices have size 0 and no tiles).
    sl = (nt >= TILE1).to(tl.int32) + (nt >= TILE2).to(tl.int32) + (nt >= TILE3).to(tl.int32)
    tile_base = tl.where(sl == 0, 0, tl.where(sl == 1, TILE1, tl.where(sl == 2, TILE2, TILE3)))
    col_base = tl.where(sl == 0, 0, tl.where(sl == 1, SIZE0, tl.where(sl == 2, SIZE0 + SIZE1, SIZE0 + SIZE1 + SIZE2)))
    size = tl.where(sl == 0, SIZE0, tl.where(sl == 1, SIZE1, tl.where(sl == 2, SIZE2, SIZE3)))
    c = (nt - tile_base) * BLOCK_N + tl.arange(0, BLOCK_N)  # column within the slice
    n_mask = c < size
    n = col_base + c

    t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    slots = _active_slots(slots_ptr, ranks_ptr, t, T)
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    mine = tl.zeros([BLOCK_T], tl.int32)  # rows of the slots this lane handled
    cur = _first_slot_of_lane(slots, tl.program_id(2))
    while cur < _NO_SLOT:
        rows = slots == cur
        mine = tl.where(rows, 1, mine)
        rank = tl.load(ranks_ptr + cur)
        b_slot = b_ptr + cur.to(tl.int64) * stride_bl
        for r0 in range(0, rank, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            r_mask = r < R_MAX
            s_mask = rows[:, None] & r_mask[None, :]
            s_ptrs = scratch_ptr + sl * stride_ss + t[:, None] * stride_st + r[None, :]
            s = tl.zeros([BLOCK_T, BLOCK_R], tl.float32)
            for ks in range(K_SPLITS):
                s += tl.load(s_ptrs + ks * stride_sk, mask=s_mask, other=0.0)
            b = tl.load(b_slot + n[None, :] * stride_bn + r[:, None] * stride_br,
                        mask=r_mask[:, None] & n_mask[None, :], other=0.0).to(COMPUTE)
            acc += tl.dot(s.to(COMPUTE), b, input_precision=DOT_PRECISION)
        for _ in tl.static_range(LANES):
            cur = _next_slot(slots, cur)

    o_ptrs = out_ptr + t.to(tl.int64)[:, None] * stride_ot + n[None, :] * stride_on
    o_mask = (mine > 0)[:, None] & n_mask[None, :]
    o = tl.load(o_ptrs, mask=o_mask, other=0.0)
    tl.store(o_ptrs, (o.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=o_mask)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_k_splits(num_token_tiles: int, num_slices: int, in_features: int, block_k: int,
                      device: torch.device) -> int:
    """Split `in` across programs while tiles x slices alone would leave the GPU idle (decode)."""
    if device.type != "cuda":
        return 1
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    want = triton.cdiv(2 * sms, num_token_tiles * num_slices)
    return max(1, min(want, triton.cdiv(in_features, block_k), 8))


def dense_lora(x, lora_a, lora_b, token_slots, slot_ranks, slice_sizes: tuple[int, ...], out,
               pdl: bool = False) -> None:
    """Add the per-token multi-LoRA delta into out [T, N_total] in place (see module doc); `pdl`: launch
    with programmatic dependent launch (kernels/pdl.py)."""
    _dense_lora(x, lora_a, lora_b, token_slots, slot_ranks, tuple(slice_sizes), out, pdl=pdl)


def _dense_lora(x, lora_a, lora_b, token_slots, slot_ranks, slice_sizes, out, *,
                block_t=None, block_k=None, block_n=None, k_splits=None, lanes=None, num_warps=4, pdl=False):
    n_total = out.shape[1]
    num_slots, num_slices, max_rank, _ = lora_a.shape
    assert len(slice_sizes) == num_slices and sum(slice_sizes) == n_total
    assert lora_b.shape == (num_slots, n_total, max_rank) and out.shape[0] == x.shape[0]
    if x.shape[0] == 0 or max_rank == 0:
        return
    block_t, lanes = _token_tiling(x.shape[0], num_slots, block_t, lanes)
    scratch = dense_lora_shrink(x, lora_a, token_slots, slot_ranks, block_t=block_t, block_k=block_k,
                                k_splits=k_splits, lanes=lanes, num_warps=num_warps, pdl=pdl)
    _expand(scratch, lora_b, token_slots, slot_ranks, tuple(slice_sizes), out, block_t=block_t, block_n=block_n,
            lanes=lanes, num_warps=num_warps, pdl=pdl)


def _token_tiling(T: int, num_slots: int, block_t, lanes) -> tuple[int, int]:
    if block_t is None:
        block_t = 16 if (_INTERPRET or T < 1024) else 64
    if lanes is None:
        # Decode-sized batches mix adapters within a tile; large (prefill) tiles are mostly uniform.
        lanes = min(4, num_slots) if T <= 1024 else 1
    return block_t, max(1, min(lanes, num_slots, block_t))


def dense_lora_shrink(x, lora_a, token_slots, slot_ranks, *, block_t=None, block_k=None, k_splits=None,
                      lanes=None, num_warps=4, pdl=False) -> torch.Tensor:
    """x @ A[slot].T per row into a new fp32 scratch [k_splits, slices, T, R], entries written only for rows
    whose slot has rank > 0 and rank columns below that rank rounded up to RANK_BLOCK (all an expand reads);
    the k_splits partial sums over `in` are the expand's to add."""
    T, in_features = x.shape
    num_slots, num_slices, max_rank, a_in = lora_a.shape
    assert a_in == in_features and 1 <= num_slices <= MAX_SLICES
    assert token_slots.shape == (T,) and slot_ranks.shape == (num_slots,)
    assert x.stride(1) == 1 and lora_a.stride(3) == 1
    block_t, lanes = _token_tiling(T, num_slots, block_t, lanes)
    if block_k is None:
        block_k = 32 if _INTERPRET else 256
    block_k = min(block_k, max(16, triton.next_power_of_2(in_features)))
    num_token_tiles = triton.cdiv(T, block_t)
    if k_splits is None:
        k_splits = _default_k_splits(num_token_tiles, num_slices, in_features, block_k, x.device)
    k_per_split = triton.cdiv(triton.cdiv(in_features, k_splits), block_k) * block_k
    k_splits = triton.cdiv(in_features, k_per_split)
    scratch = torch.empty((k_splits, num_slices, T, max_rank), dtype=torch.float32, device=x.device)
    if T == 0 or max_rank == 0:
        return scratch
    _shrink_kernel[(num_token_tiles, num_slices * lanes, k_splits)](
        x, lora_a, token_slots, slot_ranks, scratch,
        T, in_features, max_rank, k_per_split,
        x.stride(0),
        lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        scratch.stride(0), scratch.stride(1), scratch.stride(2),
        BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_R=RANK_BLOCK, LANES=lanes,
        COMPUTE=_compute_dtype(x.dtype), DOT_PRECISION=_dot_precision(x.dtype), USE_PDL=pdl,
        num_warps=num_warps, launch_pdl=pdl,
    )
    return scratch


def _expand(scratch, lora_b, token_slots, slot_ranks, slice_sizes, out, *, block_t, block_n, lanes, num_warps,
            pdl=False):
    """out += scratch @ B[slot].T per row (rows without an adapter untouched); the two-launch path's second."""
    k_splits, num_slices, T, max_rank = scratch.shape
    if block_n is None:
        block_n = 16 if _INTERPRET else 128
    sizes = tuple(slice_sizes) + (0,) * (MAX_SLICES - num_slices)
    tile_starts = [0]
    for size in sizes:
        tile_starts.append(tile_starts[-1] + triton.cdiv(size, block_n))
    num_col_tiles = tile_starts[num_slices]
    _expand_kernel[(triton.cdiv(T, block_t), num_col_tiles, lanes)](
        scratch, lora_b, token_slots, slot_ranks, out,
        T, max_rank, k_splits,
        scratch.stride(0), scratch.stride(1), scratch.stride(2),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        out.stride(0), out.stride(1),
        SIZE0=sizes[0], SIZE1=sizes[1], SIZE2=sizes[2], SIZE3=sizes[3],
        TILE1=tile_starts[1], TILE2=tile_starts[2], TILE3=tile_starts[3],
        BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_R=RANK_BLOCK, LANES=lanes,
        COMPUTE=_compute_dtype(lora_b.dtype), DOT_PRECISION=_dot_precision(lora_b.dtype), USE_PDL=pdl,
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
