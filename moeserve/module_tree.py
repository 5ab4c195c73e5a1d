"""The module tree of a supported MoE decoder, described once: which modules a layer has, the names an HF checkpoint
and a PEFT adapter give them, which moeserve module holds each (fused q|k|v and gate|up), which ones carry LoRA, and
how tensor parallelism splits them.

Every family (qwen3_moe, qwen2_moe, mixtral, olmoe) has the same tree; ModelSpec says which optional parts a layer
has (a dense MLP or a MoE block, a shared expert, biases, q/k norms). Routed experts are stored in one of two
layouts: per expert (`experts.N.gate_proj`, Mixtral `experts.N.w1/w3/w2`, under `mlp.` or Mixtral's
`block_sparse_moe.`) or fused 3-D (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]). The loader,
the sharding rules, the LoRA slot pool and the adapter parser read it from here.
"""
from __future__ import annotations

from dataclasses import dataclass

from moeserve.model_spec import ModelSpec

# how tensor parallelism splits a weight (distributed/sharding.py): column = a block of output rows per rank,
# row = a block of input columns (partial outputs summed by the all-reduce), replicated = whole on every rank
COLUMN, ROW, REPLICATED = "column", "row", "replicated"

MOE_BLOCKS = ("mlp", "block_sparse_moe")  # the MoE block's checkpoint name: Mixtral on transformers 4 uses the second
ROUTER = "gate"  # the router's checkpoint name inside the MoE block
# routed-expert projections: per-expert checkpoint names (HF, then Mixtral's) and the fused 3-D names
PER_EXPERT_NAMES = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}
FUSED_EXPERT_NAMES = {"gate_up": "gate_up_proj", "down": "down_proj"}
# every name a routed-expert projection goes by -> the projection ("gate_up" | "gate" | "up" | "down")
EXPERT_PROJ = {FUSED_EXPERT_NAMES["gate_up"]: "gate_up",
               **{name: proj for proj, names in PER_EXPERT_NAMES.items() for name in names}}
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")
QK_NORMS = ("q_norm", "k_norm")  # under self_attn., where the spec has them


@dataclass(frozen=True)
class Projection:
    """One linear of a decoder layer (the routed experts aside)."""
    target: str  # its LoRA target name: in lora_target_modules, and in a parsed adapter's (layer, target) keys
    checkpoint: str  # its name under `model.layers.N.` in a checkpoint and a PEFT adapter ("" for the router:
    # `<MoE block>.gate`, see checkpoint_name)
    module: str  # the moeserve module holding it, relative to the decoder layer (a fused one holds several)
    slice: int  # which output slice of that module
    shard: str  # COLUMN | ROW | REPLICATED
    pool_group: str  # the LoRA slot pool's size group (one line of its memory report)
    enabled_by: tuple[str, ...]  # lora_target_modules entries that make the pool hold buffers for its module


_QKV = ("q_proj", "k_proj", "v_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
ATTENTION = tuple(Projection(t, f"self_attn.{t}", "self_attn.qkv_proj", i, COLUMN, "q_proj/k_proj/v_proj", _QKV)
                  for i, t in enumerate(_QKV)) + (
    Projection("o_proj", "self_attn.o_proj", "self_attn.o_proj", 0, ROW, "o_proj", ("o_proj",)),)
ATTN_TARGETS = tuple(p.target for p in ATTENTION)


def _mlp(prefix: str, target_prefix: str, group: str, enabled_by: tuple[str, ...]) -> tuple[Projection, ...]:
    """gate/up (one fused gate_up_proj) and down of a SiLU-gated MLP at `prefix` (the dense MLP, the shared expert)."""
    return (Projection(target_prefix + "gate_proj", prefix + "gate_proj", prefix + "gate_up_proj", 0, COLUMN, group,
                       enabled_by),
            Projection(target_prefix + "up_proj", prefix + "up_proj", prefix + "gate_up_proj", 1, COLUMN, group,
                       enabled_by),
            Projection(target_prefix + "down_proj", prefix + "down_proj", prefix + "down_proj", 0, ROW, group,
                       enabled_by))


DENSE_MLP = _mlp("mlp.", "", "gate_proj/up_proj/down_proj", MLP_TARGETS)
ROUTER_PROJ = Projection("router", "", "mlp.router", 0, REPLICATED, "router", ("router",))
SHARED_EXPERT = _mlp("mlp.shared_expert.", "shared_expert.", "shared_expert", ("shared_expert",)) + (
    Projection("shared_expert_gate", "mlp.shared_expert_gate", "mlp.shared_expert_gate", 0, REPLICATED,
               "shared_expert_gate", ("shared_expert_gate",)),)
EXPERTS_TARGET = "experts"  # the routed experts' LoRA target (their buffers are the MoE block's, not a linear's)
# every lora_target_modules entry the engine accepts
ALL_TARGETS = ATTN_TARGETS + MLP_TARGETS + ("shared_expert", "shared_expert_gate", EXPERTS_TARGET, "router")
# every dense LoRA target an adapter may name (its parsed (layer, target) keys)
DENSE_TARGETS = tuple(p.target for p in ATTENTION + DENSE_MLP + SHARED_EXPERT[:3]) + ("router", "shared_expert_gate")
_BY_TARGET = {p.target: p for p in ATTENTION + DENSE_MLP + SHARED_EXPERT + (ROUTER_PROJ,)}
# moeserve modules (relative to a decoder layer) whose weights every tensor-parallel rank holds whole
REPLICATED_MODULES = tuple(p.module for p in _BY_TARGET.values() if p.shard == REPLICATED)

# checkpoint leaf name -> how tensor parallelism splits it (q/k/v follow the heads: sharding.py's q_rows / kv_rows)
SHARD_BY_LEAF = {**{p.checkpoint.rsplit(".", 1)[-1]: p.shard for p in ATTENTION + DENSE_MLP},
                 **{names[1]: (ROW if proj == "down" else COLUMN) for proj, names in PER_EXPERT_NAMES.items()}}


def projection(target: str) -> Projection:
    """The projection a LoRA target names ("q_proj", "shared_expert.down_proj", "router", ...)."""
    try:
        return _BY_TARGET[target]
    except KeyError:
        raise KeyError(f"no projection is LoRA target {target!r} (dense targets: {', '.join(DENSE_TARGETS)})") from None


def target_module(target: str) -> str:
    """The lora_target_modules entry that holds an adapter's dense target ("shared_expert.up_proj" ->
    "shared_expert"; the others are their own)."""
    return "shared_expert" if target.startswith("shared_expert.") else target


def layer_projections(spec: ModelSpec, layer: int) -> tuple[Projection, ...]:
    """The projections decoder layer `layer` has: attention, then its dense MLP, or its router and shared expert."""
    if not spec.sparse_layers[layer]:
        return ATTENTION + DENSE_MLP
    return ATTENTION + (ROUTER_PROJ,) + (SHARED_EXPERT if spec.shared_expert_intermediate_size else ())


def submodule(layer, path: str):
    """The module at `path` ("self_attn.qkv_proj", a Projection's module) under a decoder layer."""
    for name in path.split("."):
        layer = getattr(layer, name)
    return layer


def projection_dims(spec: ModelSpec, target: str) -> tuple[int, int]:
    """(in_features, out_features) of a dense target's base weight, whole (unsharded)."""
    H = spec.hidden_size
    if target == "router":
        return H, spec.num_experts
    if target == "shared_expert_gate":
        return H, 1
    inner = spec.shared_expert_intermediate_size if target.startswith("shared_expert.") else spec.intermediate_size
    return {"q_proj": (H, spec.q_size), "k_proj": (H, spec.kv_size), "v_proj": (H, spec.kv_size),
            "o_proj": (spec.q_size, H), "gate_proj": (H, inner), "up_proj": (H, inner),
            "down_proj": (inner, H)}[target.rsplit(".", 1)[-1]]


def expert_dims(spec: ModelSpec, proj: str) -> tuple[int, int]:
    """(in, out) of one routed expert's projection ("gate_up" | "gate" | "up" | "down")."""
    H, inter = spec.hidden_size, spec.moe_intermediate_size
    return {"gate_up": (H, 2 * inter), "gate": (H, inter), "up": (H, inter), "down": (inter, H)}[proj]


# ---- checkpoint names -----------------------------------------------------------------------------------------

def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def checkpoint_name(layer: int, p: Projection, moe_block: str = "mlp") -> str:
    """A projection's checkpoint name, without the .weight / .bias suffix."""
    return layer_prefix(layer) + (f"{moe_block}.{ROUTER}" if p is ROUTER_PROJ else p.checkpoint)


def per_expert_names(layer: int, expert: int, moe_block: str = "mlp", mixtral: bool = False) -> tuple[str, str, str]:
    """(gate, up, down) weight names of one expert in the per-expert layout (HF names, or Mixtral's w1/w3/w2)."""
    q = f"{layer_prefix(layer)}{moe_block}.experts.{expert}."
    return tuple(q + names[int(mixtral)] + ".weight" for names in PER_EXPERT_NAMES.values())


def fused_expert_names(layer: int, moe_block: str = "mlp") -> tuple[str, str]:
    """(gate_up [E, 2I, H], down [E, H, I]) names of the fused 3-D layout (no .weight suffix)."""
    return tuple(f"{layer_prefix(layer)}{moe_block}.experts.{n}" for n in FUSED_EXPERT_NAMES.values())


def checkpoint_tensor_names(spec: ModelSpec, expert_layout: str = "fused", moe_block: str = "mlp",
                            mixtral_names: bool = False) -> set[str]:
    """Every tensor name a checkpoint of `spec` holds, its routed experts in `expert_layout` ("fused" |
    "per_expert") under `moe_block`."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not spec.tie_word_embeddings:
        names.add("lm_head.weight")
    for i, sparse in enumerate(spec.sparse_layers):
        names |= {layer_prefix(i) + n + ".weight" for n in LAYER_NORMS}
        if spec.qk_norm != "none":
            names |= {layer_prefix(i) + f"self_attn.{n}.weight" for n in QK_NORMS}
        for p in layer_projections(spec, i):
            name = checkpoint_name(i, p, moe_block)
            names.add(name + ".weight")
            if (p.target in _QKV and spec.qkv_bias) or (p.target == "o_proj" and spec.o_bias):
                names.add(name + ".bias")
        if sparse and expert_layout == "fused":
            names |= set(fused_expert_names(i, moe_block))
        elif sparse:
            names |= {n for e in range(spec.num_experts) for n in per_expert_names(i, e, moe_block, mixtral_names)}
    return names
