"""Launch plans of the fused MoE: which path (GEMV decode or sorted GEMMs) and which tiles.

The sorted path's base tiles come from a table of tuned tiles shipped as data (`moe_tiles.json`), keyed by
GPU name, dtype and problem shape (experts, hidden, intermediate, top-k), one entry per token count tuned
(`python -m benchmarks.kernels.kernels --tune` regenerates it for another GPU or shape; `MOESERVE_MOE_TILES=PATH`
adds a table of one's own in front of the shipped one). Problems the table does not hold take the heuristic
of `heuristic_plan`. Calls with LoRA run the no-LoRA call's tiles and options (either source), so their rows without
an adapter get the no-LoRA call's values; the LoRA's own options are its shrinks' (the expands ride in the GEMM
epilogues, one way at every size: moe_lora.lora_block_expand): the heuristic's, or a table row's (LORA_OPTIONS; the
H200 bf16 rows at 256 and 512 tokens carry the best of a `--lora-sweep` on the tuned tiles, each measured through
the whole decode step; `--tune` writes tiles only, so a regenerated table drops them).

Every plan is fitted to the dtype it runs in and the device's shared memory before use (`fit_tile`): a tile
chosen for bf16 would ask fp32 for more than the GPU has.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

TABLE_PATH = Path(__file__).with_name("moe_tiles.json")
TABLE_ENV = "MOESERVE_MOE_TILES"


@dataclass(frozen=True)
class GemmTile:
    block_m: int = 16  # sorted path only
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 1  # sorted path only: expert blocks walked per N tile (fused_moe._block_tile)

    def as_list(self) -> list[int]:
        return [self.block_m, self.block_n, self.block_k, self.num_warps, self.num_stages, self.group_m]


@dataclass(frozen=True)
class MoEPlan:
    decode: bool
    gate_up: GemmTile
    down: GemmTile
    # sorted-path LoRA shrinks (lora_block_shrink; LoRA calls run them unsplit, LORA_SHRINKS_UNSPLIT); the expands
    # ride on the GEMM tiles above, in their epilogues (moe_lora.lora_block_expand)
    lora_shrink_block_k: int = 128  # reduction columns per shrink step
    lora_gate_up_splits: int = 4  # programs sharing one block's shrink over H
    lora_down_splits: int = 2  # programs sharing one block's shrink over I
    lora_shrink_lanes: int = 4  # programs sharing the distinct slots of one block
    lora_shrink_warps: int = 4
    lora_shrink_stages: int = 3  # software-pipelining depth of a shrink's K loop
    # sorted path: the per-pair outputs summed over top-k kept in fp32 (else in the activations' dtype: half the
    # bytes written and read again at large T); SiLU*up applied as the down GEMM loads its A tile (else by its
    # own kernel into [pairs, I], which the down GEMM then reads as a plain operand)
    y_fp32: bool = True
    fused_act: bool = True
    # sorted path: the GEMMs read their weight tiles through TMA descriptors (Hopper and later) instead of pointers
    weights_tma: bool = False


@dataclass(frozen=True)
class MoEProblem:
    """What a tile choice depends on besides the token count."""
    num_experts: int
    hidden: int
    inter: int  # per-expert intermediate size I (w13 has 2I rows)
    top_k: int
    dtype: torch.dtype
    device: torch.device

    def key(self) -> tuple:
        return (self.num_experts, self.hidden, self.inter, self.top_k, str(self.dtype).removeprefix("torch."))


# Pairs at or below this run the alignment-free GEMV path (H200, Qwen3-30B-A3B shapes:
# GEMV wins up to T=8 at top-8, the sorted path from T=16).
DECODE_MAX_PAIRS = 64


# LoRA calls on the sorted path run the no-LoRA call's tiles and options (the table's or the heuristic's), so a row
# without an adapter gets the no-LoRA call's values, with the shrinks unsplit (LORA_SHRINKS_UNSPLIT), at every size.
# Their expands run one way: in the GEMM epilogues, accumulating into the GEMM's own accumulator, walking the block's
# (slot, rank step) items one at a time with the next one's loads in flight (moe_lora.lora_block_expand). What it
# was measured against, H200, 4 rank-16 adapters on every row in a rank-16 pool, (MoE + LoRA) / MoE:
# - walk / one item a dot from a scalar base, no loads in flight (session 17 call 3): T=64 1.07 / 1.07, 256
#   1.13 / 1.13, 512 1.19 / 1.20, 1,024 1.27 / 1.34, 2,048 1.32 / 1.38, 4,096 1.33 / 1.45, 8,192 1.36 / 1.39;
# - groups of (slot, rank step) items loaded at once and added in one dot (session 15): 2 items a dot 1.21-1.39,
#   4 items 1.46-2.35, 8 spill; the rows without an adapter kept in a copy of the accumulator (in place of adding
#   exact zeros to it) left no registers for the 128-row prefill tiles;
# - the expands apart after plain GEMMs, by two memory-bound kernels that read and write gu and y again: lost by
#   0.2-0.35 (session 16; FP8 numbers in fused_moe_fp8.lora_options);
# - the expands before the main loop: lost to the epilogue (kept in commit 2c25622); the epilogue's slots loaded
#   before the main loop: no gain (session 16 call 6, kept in commit 7778e2a).
# The apart expands, the grouped and kept-rows epilogues, and their plan fields (lora_epilogue, lora_epilogue_items,
# lora_in_place, lora_apart_tile, lora_apart_warps; LORA_IN_PLACE, LORA_APART) were removed after f6bc547.
LORA_SHRINKS_UNSPLIT = dict(lora_gate_up_splits=1, lora_down_splits=1)


def heuristic_plan(num_tokens: int, top_k: int, decode: bool | None = None, lora: bool = False) -> MoEPlan:
    """Block sizes by problem size, from the H200 sweeps at Qwen3-30B-A3B shapes. `decode` forces a path; `lora`:
    the plan of a call with adapters: the same tiles (its rows without an adapter are then the no-LoRA call's,
    bitwise, in any mixed batch), with the sorted path's shrinks unsplit (LORA_SHRINKS_UNSPLIT)."""
    num_pairs = num_tokens * top_k
    if decode is None:
        decode = num_pairs <= DECODE_MAX_PAIRS
    if decode:
        tile = (GemmTile(block_n=16, block_k=256, num_warps=4, num_stages=1) if num_pairs <= 16
                else GemmTile(block_n=32, block_k=128, num_warps=4, num_stages=1))
        return MoEPlan(True, tile, tile)
    if num_pairs <= 2048:  # few rows per expert: short blocks, wide N tiles
        # H200 (top-8): above 512 pairs the K step 64 in 4 stages is faster (T=256 366.7 / 368.2 us vs 383-390);
        # 32-row blocks were slower at every T (431-600 us)
        tile = (GemmTile(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=3) if num_pairs <= 512
                else GemmTile(block_m=16, block_n=128, block_k=64, num_warps=4, num_stages=4))
        plan = MoEPlan(False, tile, tile)
    else:
        plan = MoEPlan(False, GemmTile(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3),
                       GemmTile(block_m=64, block_n=256, block_k=64, num_warps=8, num_stages=3))
    return replace(plan, **LORA_SHRINKS_UNSPLIT) if lora else plan


# ---------------------------------------------------------------------------------------------
# fitting a tile to the dtype and the device

SMEM_MARGIN = 16 << 10  # what Triton keeps beside the pipelined operand buffers (seen: 16 KiB, fp32 tiles)


@functools.lru_cache(maxsize=None)
def smem_limit(device: torch.device) -> int | None:
    """Shared memory one program may use on `device` (None: no limit known, e.g. the CPU interpreter)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", None) or props.shared_memory_per_block


def tile_smem(tile: GemmTile, elt_bytes: int, a_loads: int) -> int:
    """Bytes of a sorted-path GEMM's pipelined operands: num_stages buffers of the A tile(s) and the B tile
    (`a_loads`: A tiles per K step, 2 for a down GEMM that loads gate and up, MoEPlan.fused_act)."""
    return tile.num_stages * (a_loads * tile.block_m + tile.block_n) * tile.block_k * elt_bytes


def fit_tile(tile: GemmTile, elt_bytes: int, a_loads: int, limit: int | None) -> GemmTile:
    """`tile` shrunk until its operands fit `limit` with the margin: fewer stages (down to 2), then a shorter
    K step (down to 32), then a narrower N tile."""
    if limit is None:
        return tile
    while tile_smem(tile, elt_bytes, a_loads) > limit - SMEM_MARGIN:
        if tile.num_stages > 2:
            tile = replace(tile, num_stages=tile.num_stages - 1)
        elif tile.block_k > 32:
            tile = replace(tile, block_k=tile.block_k // 2)
        elif tile.block_n > 16:
            tile = replace(tile, block_n=tile.block_n // 2)
        else:
            break
    return tile


def fit_plan(plan: MoEPlan, dtype: torch.dtype, device: torch.device, limit: int | None = None) -> MoEPlan:
    """The sorted-path tiles fitted to `dtype` on `device`, or to `limit` bytes of shared memory (the GEMV path
    keeps no pipelined operands)."""
    limit = smem_limit(device) if limit is None else limit
    if plan.decode or limit is None:
        return plan
    elt = dtype.itemsize
    down_loads = 2 if plan.fused_act else 1  # gate and up tiles, or the activation's one
    return replace(plan, gate_up=fit_tile(plan.gate_up, elt, 1, limit),
                   down=fit_tile(plan.down, elt, down_loads, limit))


# ---------------------------------------------------------------------------------------------
# the tuned table


@functools.lru_cache(maxsize=None)
def gpu_name(device: torch.device) -> str | None:
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return torch.cuda.get_device_name(device)


PLAN_OPTIONS = ("y_fp32", "fused_act", "weights_tma")  # MoEPlan fields a table row may set besides the tiles
# and the LoRA shrinks' options (integers), read by calls with adapters: the expands ride on the tiles themselves
LORA_OPTIONS = ("lora_shrink_block_k", "lora_gate_up_splits", "lora_down_splits", "lora_shrink_lanes",
                "lora_shrink_warps", "lora_shrink_stages")


def _read_table(path: Path) -> dict:
    """{(device name, problem key): [(max_tokens, gate_up tile, down tile, plan options), ...] ascending}."""
    table = {}
    for entry in json.loads(path.read_text())["entries"]:
        key = (entry["device"], (entry["experts"], entry["hidden"], entry["inter"], entry["top_k"], entry["dtype"]))
        rows = [(row["max_tokens"], GemmTile(*row["gate_up"]), GemmTile(*row["down"]),
                 {**{k: bool(row[k]) for k in PLAN_OPTIONS if k in row},
                  **{k: int(row[k]) for k in LORA_OPTIONS if k in row}}) for row in entry["tiles"]]
        table[key] = sorted(rows, key=lambda r: r[0])
    return table


@functools.lru_cache(maxsize=None)
def tile_table(extra: str | None = None) -> dict:
    """The shipped table, with the entries of the file `extra` (if any) taking precedence."""
    table = _read_table(TABLE_PATH) if TABLE_PATH.exists() else {}
    if extra:
        table.update(_read_table(Path(extra)))
    return table


def tuned_tiles(num_tokens: int, problem: MoEProblem, device_name: str | None,
                table: dict | None = None, dtype_label: str | None = None) -> tuple[GemmTile, GemmTile, dict] | None:
    """The table's (gate_up tile, down tile, plan options) for the smallest tuned token count >= num_tokens (the
    largest one beyond the table), or None where the table (default: tile_table()) has no entry for this GPU and
    problem. `dtype_label`: the table's dtype column in place of the problem's dtype (FP8 weights: "fp8_w8a8",
    "fp8_w")."""
    if device_name is None:
        return None
    if table is None:
        table = tile_table(os.environ.get(TABLE_ENV))
    key = problem.key()
    if dtype_label is not None:
        key = (*key[:-1], dtype_label)
    rows = table.get((device_name, key))
    if not rows:
        return None
    for max_tokens, gate_up, down, options in rows:
        if num_tokens <= max_tokens:
            return gate_up, down, options
    return rows[-1][1:]


@functools.lru_cache(maxsize=4096)  # called per MoE layer per eager step: the lookups and fitting once per shape
def default_plan(num_tokens: int, top_k: int, decode: bool | None = None, lora: bool = False,
                 problem: MoEProblem | None = None) -> MoEPlan:
    """The plan a call runs: the heuristic's path and LoRA options, the tuned tiles and options where the table has
    this problem (the sorted path, with LoRA or without), fitted to the problem's dtype and device."""
    plan = heuristic_plan(num_tokens, top_k, decode, lora)
    if problem is None:
        return plan
    if not plan.decode:
        tuned = tuned_tiles(num_tokens, problem, gpu_name(problem.device))
        if tuned is not None and tuned[0].block_m == tuned[1].block_m:
            plan = replace(plan, gate_up=tuned[0], down=tuned[1], **tuned[2])
    return fit_plan(plan, problem.dtype, problem.device)
