"""Which slice of every weight and adapter factor a tensor-parallel rank holds.

Layout (Megatron-style): q/k/v and gate/up are column-parallel (each rank a block of output rows:
its attention heads, its slice of the intermediate dim), o_proj and down are row-parallel (the
matching input columns; the partial outputs are summed by one all-reduce per block). KV heads are
split when there are at least as many as ranks, otherwise each is replicated on N / num_kv_heads
ranks. Routed experts are tensor-split: every rank holds every expert's slice of the intermediate
dim — or, with expert parallelism, E / N whole experts (every rank routes every token, computes the
pairs routed to its experts, and the MoE block's all-reduce adds the ranks' parts). Embedding and
lm_head are split by vocabulary (rows padded to a multiple of N). Norms, the router and the
shared-expert gate are replicated. A row-parallel bias lives on rank 0 only.

LoRA follows its base weight: column-parallel targets keep A whole and split B's rows,
row-parallel ones split A's columns and keep B whole; the sum over ranks of each rank's delta is
the full delta, so the all-reduce that completes the base output completes the LoRA delta too.
Under expert parallelism a rank holds its experts' factors whole.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from moeserve import module_tree
from moeserve.model_spec import ModelSpec

# checkpoint leaf names split along output rows (column-parallel) / input columns (row-parallel): module_tree.py
COLUMN = tuple(leaf for leaf, how in module_tree.SHARD_BY_LEAF.items() if how == module_tree.COLUMN)
ROW = tuple(leaf for leaf, how in module_tree.SHARD_BY_LEAF.items() if how == module_tree.ROW)


@dataclass(frozen=True)
class TensorSharding:
    """Slices of one rank among `size`, for a model `spec` (global shapes)."""
    spec: ModelSpec
    rank: int
    size: int
    expert_parallel: bool = False

    def __post_init__(self):
        check_shardable(self.spec, self.size, self.expert_parallel)

    def expert_range(self) -> tuple[int, int]:
        """[start, stop) of the routed experts this rank holds (all of them unless expert-parallel)."""
        return self.part(self.spec.num_experts) if self.expert_parallel else (0, self.spec.num_experts)

    def part(self, n: int) -> tuple[int, int]:
        """This rank's [start, stop) of a dimension of n split evenly."""
        k = n // self.size
        return self.rank * k, (self.rank + 1) * k

    def q_rows(self) -> tuple[int, int]:
        return self.part(self.spec.q_size)

    def kv_rows(self) -> tuple[int, int]:
        """Rows of k/v this rank holds: its kv heads, or the one kv head its query heads share."""
        s = self.spec
        if s.num_kv_heads >= self.size:
            return self.part(s.kv_size)
        head = self.rank // (self.size // s.num_kv_heads)
        return head * s.head_dim, (head + 1) * s.head_dim

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.spec.vocab_size // self.size)

    def vocab_rows(self) -> tuple[int, int]:
        """[start, stop) of the real vocabulary rows this rank holds (may be shorter than vocab_per_rank)."""
        v = self.vocab_per_rank
        return min(self.rank * v, self.spec.vocab_size), min((self.rank + 1) * v, self.spec.vocab_size)


def check_shardable(spec: ModelSpec, size: int, expert_parallel: bool = False) -> None:
    """Raise ValueError naming the first dimension that does not split over `size` ranks."""
    if size == 1:
        return
    dims = [("num_attention_heads", spec.num_heads)]
    if any(spec.sparse_layers):
        dims.append(("num_experts", spec.num_experts) if expert_parallel
                    else ("moe_intermediate_size", spec.moe_intermediate_size))
    if not all(spec.sparse_layers):
        dims.append(("intermediate_size", spec.intermediate_size))
    if spec.shared_expert_intermediate_size:
        dims.append(("shared_expert_intermediate_size", spec.shared_expert_intermediate_size))
    for name, n in dims:
        if n % size:
            raise ValueError(f"tensor_parallel_size (--tensor-parallel-size) {size} does not divide the model's {name} ({n})")
    nkv = spec.num_kv_heads
    if (nkv >= size and nkv % size) or (nkv < size and size % nkv):
        raise ValueError(f"tensor_parallel_size {size} and num_key_value_heads {nkv}: one must divide the other")


def rank_spec(spec: ModelSpec, size: int, expert_parallel: bool = False) -> ModelSpec:
    """The shapes one rank's layers hold (heads, kv heads and intermediate dims divided; vocabulary and
    num_experts unchanged: the embedding, lm_head and expert-parallel MoE block split those themselves)."""
    if size == 1:
        return spec
    check_shardable(spec, size, expert_parallel)
    return dataclasses.replace(
        spec, num_heads=spec.num_heads // size, num_kv_heads=max(1, spec.num_kv_heads // size),
        moe_intermediate_size=spec.moe_intermediate_size // (1 if expert_parallel else size),
        intermediate_size=spec.intermediate_size // size,
        shared_expert_intermediate_size=spec.shared_expert_intermediate_size // size)


# ---- checkpoint tensors -------------------------------------------------------------------------------

ZERO = "zero"  # this rank holds zeros (a row-parallel bias, kept on rank 0)


def checkpoint_slices(name: str, shape: tuple[int, ...], sh: TensorSharding):
    """How rank `sh.rank` reads checkpoint tensor `name` of full `shape`: None (whole, replicated), ZERO, or
    (dim, [(start, stop), ...]) — the pieces to read along dim and concatenate."""
    parts = name.split(".")
    leaf = parts[-1]
    module = parts[-2] if leaf in ("weight", "bias") else leaf  # fused experts have no .weight suffix
    if sh.expert_parallel and "experts" in parts:  # whole experts: stacked ones split along E
        return (0, [sh.expert_range()]) if parts[-2] == "experts" else None
    if module in ("embed_tokens", "lm_head"):
        return 0, [sh.vocab_rows()]
    full_norm = sh.spec.qk_norm == "full"  # olmoe: q/k norms span all heads, so they split with the heads
    if module == "q_proj" or (module == "q_norm" and full_norm):
        return 0, [sh.q_rows()]
    if module in ("k_proj", "v_proj") or (module == "k_norm" and full_norm):
        return 0, [sh.kv_rows()]
    if module == "o_proj":
        return (1, [sh.q_rows()]) if leaf == "weight" else (None if sh.rank == 0 else ZERO)
    # fused experts: gate_up [E, 2I, H] (this rank's rows of gate and of up), down [E, H, I]
    if module == module_tree.FUSED_EXPERT_NAMES["gate_up"] and parts[-2] == "experts":
        inter = shape[1] // 2
        a, b = sh.part(inter)
        return 1, [(a, b), (inter + a, inter + b)]
    if module == module_tree.FUSED_EXPERT_NAMES["down"] and parts[-2] == "experts":
        return 2, [sh.part(shape[2])]
    if module in COLUMN:
        return 0, [sh.part(shape[0])]
    if module in ROW:
        return 1, [sh.part(shape[1])]
    return None  # norms, router, shared-expert gate


def scale_slices(name: str, shape: tuple[int, ...], how, block: tuple[int, int], size: int, halves: bool = False):
    """How a rank reads the block scales (scale_inv) of weight `name` of full `shape` that it reads by `how`
    (checkpoint_slices): the same pieces in block units. A piece of the last two dims must start and end on a block
    boundary (or at the end of the dim, or of its half): else its blocks would be shared with another rank's piece,
    and a ValueError names the weight and the boundary. `halves`: the out rows are two parts blocked apart (a fused
    gate_up: its scale rows gate's, then up's). The expert dim of a 3-D weight (expert parallelism) maps one to one."""
    if how is None:
        return None
    dim, ranges = how
    ndim = len(shape)
    if dim < ndim - 2:
        return how
    bs = block[dim - (ndim - 2)]
    n = shape[dim]
    part = n // 2 if halves and dim == ndim - 2 else n  # rows of one separately blocked part
    blocks_per_part = -(-part // bs)
    out = []
    for a, b in ranges:
        first = a // part if part < n else 0
        a, b = a - first * part, b - first * part
        for edge in (a, b):
            if edge % bs and edge != part:
                raise ValueError(f"FP8 weight {name!r}: tensor_parallel_size {size} splits its dim {dim} (size {n}) at "
                                 f"{edge + first * part}, not on a multiple of the {bs}-wide scale block; serve it "
                                 "with a tensor_parallel_size that splits every projection on 128 boundaries (or "
                                 "unquantized)")
        out.append((first * blocks_per_part + a // bs, first * blocks_per_part + -(-b // bs)))
    return dim, out


# ---- LoRA adapters --------------------------------------------------------------------------------------

def shard_adapter(adapter, sh: TensorSharding):
    """The part of a parsed adapter (global shapes) that rank `sh.rank` holds (see the module docstring)."""
    dense = {}
    for (layer, target), (a, b) in adapter.dense.items():
        shard = module_tree.projection(target).shard
        if target == "q_proj":
            b = _rows(b, sh.q_rows())
        elif target in ("k_proj", "v_proj"):
            b = _rows(b, sh.kv_rows())
        elif shard == module_tree.ROW:
            a = _cols(a, sh.part(a.shape[1]))
        elif shard == module_tree.COLUMN:
            b = _rows(b, sh.part(b.shape[0]))
        # anything else sits on a replicated weight (the router, the shared-expert gate): held whole
        dense[(layer, target)] = (a, b)
    experts = {}
    if sh.expert_parallel:
        e0, e1 = sh.expert_range()
        def own(t):  # this rank's experts of a factor (every factor leads with the expert dim)
            return None if t is None else t[e0:e1].contiguous()

        for layer, ex in adapter.experts.items():
            experts[layer] = dataclasses.replace(ex, **{f.name: own(getattr(ex, f.name)) for f in dataclasses.fields(ex)})
        return dataclasses.replace(adapter, dense=dense, experts=experts)
    for layer, ex in adapter.experts.items():
        gate_up_b = down_a = None
        if ex.gate_up_b is not None:
            inter = ex.gate_up_b.shape[1] // 2
            lo, hi = sh.part(inter)
            gate_up_b = torch.cat([ex.gate_up_b[:, lo:hi], ex.gate_up_b[:, inter + lo:inter + hi]], dim=1)
        if ex.down_a is not None:
            lo, hi = sh.part(ex.down_a.shape[2])
            down_a = ex.down_a[:, :, lo:hi].contiguous()
        # the A's of gate_up (gate_up_a, and up_a where gate and up have their own) stay whole
        experts[layer] = dataclasses.replace(ex, gate_up_b=gate_up_b, down_a=down_a)
    return dataclasses.replace(adapter, dense=dense, experts=experts)


def _rows(t: torch.Tensor, r: tuple[int, int]) -> torch.Tensor:
    return t[r[0]:r[1]].contiguous()


def _cols(t: torch.Tensor, r: tuple[int, int]) -> torch.Tensor:
    return t[:, r[0]:r[1]].contiguous()
