"""Load an HF model folder (one or sharded safetensors) into MoEForCausalLM.

Checkpoint names map onto one internal layout: fused q|k|v, fused gate|up, and experts
stacked as w13 [E, 2I, H] / w2 [E, H, I] whether the files store them per expert
(`experts.N.gate_proj`, Mixtral `w1/w3/w2`) or fused (`experts.gate_up_proj`).
A missing or mis-shaped tensor is an error that names it. A quantized checkpoint is refused by its method before
any weight file is opened, and a quantized or integer tensor in a plain one by its name (models/quantization.py).
"""
from __future__ import annotations

import json
import re
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from moeserve.distributed.parallel_state import ParallelState
from moeserve.distributed.sharding import ZERO, TensorSharding, checkpoint_slices
from moeserve.exec_options import TORCH_CPU, ExecOptions
from moeserve.models.moe_decoder import MoEForCausalLM
from moeserve.models.quantization import check_tensor_dtype, checkpoint_quantization
from moeserve.model_spec import ModelSpec

logger = logging.getLogger("moeserve")


class CheckpointError(ValueError):
    """The checkpoint does not match its config (missing tensor, wrong shape, unreadable file)."""


class _Tensors:
    """Name -> tensor access across one or many safetensors files. `quant_method`: the checkpoint's quantization
    method (None: plain float weights, every tensor's dtype checked when its file is opened)."""

    def __init__(self, model_dir: Path, quant_method: str | None = None):
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in model_dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{model_dir}: no *.safetensors weights found")
            weight_map = None
        self.handles, self.where = {}, {}
        for f in files:
            try:
                h = safe_open(str(model_dir / f), framework="pt", device="cpu")
            except Exception as e:  # noqa: BLE001 - report any unreadable file by name
                raise CheckpointError(f"{model_dir / f}: cannot read safetensors ({e})") from e
            self.handles[f] = h
            for k in h.keys():
                check_tensor_dtype(k, h.get_slice(k).get_dtype(), quant_method)  # the header only, no data read
                self.where[k] = f
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.where:
            raise CheckpointError(f"checkpoint is missing tensor {name!r}")
        t = self.handles[self.where[name]].get_tensor(name)
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        self.used.add(name)
        return t


_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


class _ShardedTensors(_Tensors):
    """Name -> this rank's slice of the tensor (distributed/sharding.py), read with safetensors' get_slice:
    a rank reads only the bytes it holds, never a whole file. Shapes are checked against the full tensor."""

    def __init__(self, model_dir: Path, sharding: TensorSharding, quant_method: str | None = None):
        super().__init__(model_dir, quant_method)
        self.sharding = sharding
        if sharding.expert_parallel:  # other ranks' per-expert tensors are theirs to read, not unused
            e0, e1 = sharding.expert_range()
            self.used |= {n for n in self.where if (m := _EXPERT_INDEX.search(n)) and not e0 <= int(m.group(1)) < e1}

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.where:
            raise CheckpointError(f"checkpoint is missing tensor {name!r}")
        sl = self.handles[self.where[name]].get_slice(name)
        if tuple(sl.get_shape()) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(sl.get_shape())}, expected {tuple(shape)}")
        self.used.add(name)
        how = checkpoint_slices(name, tuple(shape), self.sharding)
        if how is None:
            return sl[:]
        if how == ZERO:
            return torch.zeros(shape, dtype=sl[:1].dtype)
        dim, ranges = how
        lead = (slice(None),) * dim
        t = torch.cat([sl[lead + (slice(a, b),)] for a, b in ranges], dim=dim)
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):  # the last rank's block is padded with zeros
            t = torch.cat([t, t.new_zeros(self.sharding.vocab_per_rank - t.shape[0], *t.shape[1:])])
        return t


def _first(tensors: _Tensors, names: list[str]) -> str:
    for n in names:
        if tensors.has(n):
            return n
    return names[0]  # reported as missing


def random_model(spec: ModelSpec, options: ExecOptions = TORCH_CPU, seed: int = 0,
                 tp: ParallelState | None = None) -> MoEForCausalLM:
    """Random weights in the real shapes, built directly on options.device in options.dtype (`--load-format dummy`,
    benchmarks):
    N(0, 0.02) from a seeded generator, norms 1. Under tensor parallelism each rank draws its own shard, and
    the replicated router and shared-expert gate are drawn alike on every rank (ranks must route alike)."""
    gen = torch.Generator(device=options.device).manual_seed(seed)
    with torch.device(options.device):
        model = MoEForCausalLM(spec, options, tp=tp).to(options.dtype)
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            if model.tp is not None:
                replicated = name.endswith(("router.weight", "shared_expert_gate.weight"))
                gen.manual_seed(seed + 1_000_003 * i + (0 if replicated else 7919 * (model.tp.rank + 1)))
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model


def load_model(model_dir: str | Path, spec: ModelSpec, options: ExecOptions = TORCH_CPU, progress: bool = False,
               load_format: str = "auto", seed: int = 0, tp: ParallelState | None = None) -> MoEForCausalLM:
    """The model built with `options` (device, dtype, backends: exec_options.py), its weights read from the
    checkpoint at model_dir. `tp`: load this rank's shard of a tensor-parallel model (each rank reads only its
    slices)."""
    quant_method = checkpoint_quantization(model_dir)  # refuses what is not implemented, before any weight file opens
    if load_format == "dummy":
        logger.info("random weights (--load-format dummy): outputs are meaningless; for benchmarks")
        return random_model(spec, options, seed, tp=tp)
    model_dir = Path(model_dir)
    sharded = tp is not None and tp.world_size > 1
    tensors = _ShardedTensors(model_dir, TensorSharding(spec, tp.rank, tp.world_size, tp.expert_parallel),
                              quant_method) if sharded else _Tensors(model_dir, quant_method)
    dtype = options.dtype
    with torch.device(options.device):
        model = MoEForCausalLM(spec, options, tp=tp).to(dtype)
    H = spec.hidden_size

    def put(param: torch.Tensor, value: torch.Tensor):
        param.data.copy_(value.to(dtype))

    put(model.embed_tokens, tensors.get("model.embed_tokens.weight", (spec.vocab_size, H)))
    put(model.norm.weight, tensors.get("model.norm.weight", (H,)))
    if model.lm_head is not None:
        put(model.lm_head, tensors.get("lm_head.weight", (spec.vocab_size, H)))

    layers = model.layers
    if progress:
        from tqdm import tqdm

        layers = tqdm(layers, desc="loading layers", unit="layer")
    for layer in layers:
        i = layer.layer_idx
        p = f"model.layers.{i}."
        put(layer.input_layernorm.weight, tensors.get(p + "input_layernorm.weight", (H,)))
        put(layer.post_attention_layernorm.weight, tensors.get(p + "post_attention_layernorm.weight", (H,)))
        attn = layer.self_attn
        a = p + "self_attn."
        put(attn.qkv_proj.weight, torch.cat([
            tensors.get(a + "q_proj.weight", (spec.q_size, H)),
            tensors.get(a + "k_proj.weight", (spec.kv_size, H)),
            tensors.get(a + "v_proj.weight", (spec.kv_size, H)),
        ]))
        if attn.qkv_proj.bias is not None:
            put(attn.qkv_proj.bias, torch.cat([
                tensors.get(a + "q_proj.bias", (spec.q_size,)),
                tensors.get(a + "k_proj.bias", (spec.kv_size,)),
                tensors.get(a + "v_proj.bias", (spec.kv_size,)),
            ]))
        put(attn.o_proj.weight, tensors.get(a + "o_proj.weight", (H, spec.q_size)))
        if attn.o_proj.bias is not None:
            put(attn.o_proj.bias, tensors.get(a + "o_proj.bias", (H,)))
        if attn.q_norm is not None:
            full = spec.qk_norm == "full"  # the checkpoint's shapes (a rank's norm may hold a slice)
            put(attn.q_norm.weight, tensors.get(a + "q_norm.weight", (spec.q_size if full else spec.head_dim,)))
            put(attn.k_norm.weight, tensors.get(a + "k_norm.weight", (spec.kv_size if full else spec.head_dim,)))
        if layer.is_sparse:
            _load_moe(layer.mlp, tensors, p, spec, put)
        else:
            _load_dense(layer.mlp, tensors, p + "mlp.", H, spec.intermediate_size, put)

    unused = set(tensors.where) - tensors.used
    if unused:
        logger.warning("checkpoint has %d tensors moeserve does not use, e.g. %s", len(unused), sorted(unused)[:3])
    return model


def _load_dense(mlp, tensors: _Tensors, p: str, H: int, inter: int, put):
    put(mlp.gate_up_proj.weight, torch.cat([
        tensors.get(p + "gate_proj.weight", (inter, H)), tensors.get(p + "up_proj.weight", (inter, H))]))
    put(mlp.down_proj.weight, tensors.get(p + "down_proj.weight", (H, inter)))


def _load_moe(moe, tensors: _Tensors, p: str, spec: ModelSpec, put):
    H, E, inter = spec.hidden_size, spec.num_experts, spec.moe_intermediate_size
    prefixes = [p + "mlp.", p + "block_sparse_moe."]
    put(moe.router.weight, tensors.get(_first(tensors, [q + "gate.weight" for q in prefixes]), (E, H)))
    fused = [q for q in prefixes if tensors.has(q + "experts.gate_up_proj")]
    if fused:
        q = fused[0]
        put(moe.w13, tensors.get(q + "experts.gate_up_proj", (E, 2 * inter, H)))
        put(moe.w2, tensors.get(q + "experts.down_proj", (E, H, inter)))
    else:
        e0 = getattr(moe, "expert_start", 0)  # expert parallelism: this rank holds experts e0 .. e0 + E_local - 1
        for e in range(e0, e0 + moe.w13.shape[0]):
            for prefix in prefixes:  # Mixtral names its experts w1/w3/w2 (gate/up/down), under either prefix
                q = prefix + f"experts.{e}."
                if tensors.has(q + "w1.weight"):
                    g, u, d = q + "w1.weight", q + "w3.weight", q + "w2.weight"
                    break
                if tensors.has(q + "gate_proj.weight"):
                    g, u, d = q + "gate_proj.weight", q + "up_proj.weight", q + "down_proj.weight"
                    break
            else:
                q = prefixes[0] + f"experts.{e}."
                g, u, d = q + "gate_proj.weight", q + "up_proj.weight", q + "down_proj.weight"  # reported missing
            held = moe.w13.shape[1] // 2  # this rank's rows of gate (and of up): inter / tensor_parallel_size
            moe.w13.data[e - e0, :held].copy_(tensors.get(g, (inter, H)))
            moe.w13.data[e - e0, held:].copy_(tensors.get(u, (inter, H)))
            moe.w2.data[e - e0].copy_(tensors.get(d, (H, inter)))
    if moe.shared_expert is not None:
        _load_dense(moe.shared_expert, tensors, p + "mlp.shared_expert.", H, spec.shared_expert_intermediate_size, put)
        put(moe.shared_expert_gate.weight, tensors.get(p + "mlp.shared_expert_gate.weight", (1, H)))
