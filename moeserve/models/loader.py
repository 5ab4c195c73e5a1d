"""Load an HF model folder (one or sharded safetensors) into MoEForCausalLM.

Checkpoint names map onto one internal layout: fused q|k|v, fused gate|up, and experts
stacked as w13 [E, 2I, H] / w2 [E, H, I] whether the files store them per expert
(`experts.N.gate_proj`, Mixtral `w1/w3/w2`) or fused (`experts.gate_up_proj`).
A missing or mis-shaped tensor is an error that names it. A quantization method moeserve does not implement is
refused before any weight file is opened, and a quantized or integer tensor in a plain checkpoint by its name
(models/quantization.py).

Block-wise FP8 (quantization_config fp8): a weight stored float8_e4m3fn comes with `<name>_scale_inv` (float32,
one per 128 x 128 block); both are read uncast and handed to the module's weight format (layers/weight_formats.py),
which keeps them (FP8 module), quantizes a plain part the same way (`--quantization fp8`), or dequantizes an FP8
part into a plain module. Under tensor parallelism a rank reads the scale blocks of its slice of the weight; a
slice that does not start and end on a 128 boundary is refused by name. Loading streams: a layer's tensors are
read, converted and written into the model before the next layer's are read.

FP8 KV cache (--kv-cache-dtype fp8): a layer's `self_attn.k_scale` / `self_attn.v_scale` (one float each, as FP8
checkpoints carry them) become its attention's K / V scales, every rank reading them whole; a layer without them
keeps 1.0. With a cache in the activation dtype they are not read (the unused-tensor warning names them).
"""
from __future__ import annotations

import json
import re
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from moeserve import module_tree
from moeserve.distributed.parallel_state import ParallelState
from moeserve.distributed.sharding import ZERO, TensorSharding, checkpoint_slices, scale_slices
from moeserve.errors import CheckpointError
from moeserve.exec_options import TORCH_CPU, ExecOptions
from moeserve.models.moe_decoder import MoEForCausalLM
from moeserve.layers.weight_formats import cast_plain_weights, dequantize_part, weight_bytes
from moeserve.models.quantization import check_tensor_dtype, checkpoint_quantization
from moeserve.model_spec import ModelSpec

logger = logging.getLogger("moeserve")


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
        self.handles, self.where, self.dtypes = {}, {}, {}
        for f in files:
            try:
                h = safe_open(str(model_dir / f), framework="pt", device="cpu")
            except Exception as e:  # noqa: BLE001 - report any unreadable file by name
                raise CheckpointError(f"{model_dir / f}: cannot read safetensors ({e})") from e
            self.handles[f] = h
            for k in h.keys():
                dtype = h.get_slice(k).get_dtype()  # the header only, no data read
                check_tensor_dtype(k, dtype, quant_method)
                self.where[k] = f
                self.dtypes[k] = dtype
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

    def weight(self, name: str, shape: tuple[int, ...], blocked: bool = False):
        """(tensor, its float32 scale_inv) of a weight stored FP8, (tensor, None) of a plain one; uncast. `blocked`:
        the module it goes to holds FP8 blocks (a sharded read must then fall on block boundaries). A fused
        gate_up's scale rows are gate's blocks, then up's."""
        halves = _two_parts(name)
        fp8 = name in self.where and self.dtypes[name] == FP8_SAFETENSORS_DTYPE
        if fp8 or blocked:
            self.check_blocks(name, shape, halves)
        t = self.get(name, shape)
        if not fp8:
            return t, None
        scale_name = name + SCALE_SUFFIX
        if scale_name not in self.where:
            raise CheckpointError(f"FP8 tensor {name!r} has no {scale_name!r} in the checkpoint")
        return t, self.get(scale_name, scale_shape(shape, halves))

    def check_blocks(self, name: str, shape: tuple[int, ...], halves: bool) -> None:
        """Raise where this reader's slice of weight `name` would cut a 128 x 128 scale block (a whole read never
        does)."""

    def scalar(self, name: str) -> float:
        """A tensor holding one positive finite value (shape [] or [1]), whole on every rank, as a float."""
        if name not in self.where:
            raise CheckpointError(f"checkpoint is missing tensor {name!r}")
        t = self.handles[self.where[name]].get_tensor(name)
        if t.numel() != 1 or not t.is_floating_point():
            raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)} {t.dtype}, expected one float")
        v = t.float().item()
        if not 0.0 < v < float("inf"):
            raise CheckpointError(f"tensor {name!r} is {v}, expected a positive finite scale")
        self.used.add(name)
        return v

    def plain(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor in `dtype`: cast, or dequantized where the checkpoint stores it FP8."""
        return dequantize_part(*self.weight(name, shape), dtype)


FP8_SAFETENSORS_DTYPE = "F8_E4M3"
FP8_BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"  # an FP8 weight's scales: `<weight name>_scale_inv` (`...weight_scale_inv`)


def _two_parts(name: str) -> bool:
    """A fused gate_up [E, 2I, H]: its out rows are gate's and up's, blocked apart."""
    return name.endswith(".experts." + module_tree.FUSED_EXPERT_NAMES["gate_up"])


def scale_shape(shape: tuple[int, ...], halves: bool = False) -> tuple[int, ...]:
    """The scale_inv shape of an FP8 weight of `shape` [..., out, in]: one per 128 x 128 block (of each half where
    the out rows are two parts blocked apart)."""
    *lead, n, k = shape
    rows = 2 * -(-(n // 2) // FP8_BLOCK[0]) if halves else -(-n // FP8_BLOCK[0])
    return (*lead, rows, -(-k // FP8_BLOCK[1]))


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
        how = self._slicing(name, tuple(shape))
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

    def _slicing(self, name: str, shape: tuple[int, ...]):
        """checkpoint_slices of a tensor; a scale_inv follows its weight's slice in block units."""
        if not name.endswith(SCALE_SUFFIX):
            return checkpoint_slices(name, shape, self.sharding)
        weight = name[:-len(SCALE_SUFFIX)]
        if weight not in self.where:
            return None
        full = tuple(self.handles[self.where[weight]].get_slice(weight).get_shape())
        return scale_slices(weight, full, checkpoint_slices(weight, full, self.sharding), FP8_BLOCK,
                            self.sharding.size, _two_parts(weight))

    def check_blocks(self, name: str, shape: tuple[int, ...], halves: bool) -> None:
        scale_slices(name, tuple(shape), checkpoint_slices(name, tuple(shape), self.sharding), FP8_BLOCK,
                     self.sharding.size, halves)


def random_model(spec: ModelSpec, options: ExecOptions = TORCH_CPU, seed: int = 0,
                 tp: ParallelState | None = None) -> MoEForCausalLM:
    """Random weights in the real shapes, built directly on options.device in options.dtype (`--load-format dummy`,
    benchmarks): N(0, 0.02) from a seeded generator, norms 1. Under tensor parallelism each rank draws its own
    shard, and the replicated router and shared-expert gate are drawn alike on every rank (ranks must route
    alike). FP8 weights (options.weight_format) are drawn in float32 and quantized as a checkpoint's are, one
    expert at a time."""
    gen = torch.Generator(device=options.device).manual_seed(seed)
    with torch.device(options.device):
        model = cast_plain_weights(MoEForCausalLM(spec, options, tp=tp), options.dtype)
    quantized = {}  # FP8 parameter -> (its module, attribute): drawn plain, then quantized through the module
    for module in model.modules():
        method = getattr(module, "weights", None)
        if getattr(method, "quantized", False):
            for attr in ("weight", "w13", "w2"):
                if hasattr(module, attr + "_scale_inv"):
                    quantized[id(getattr(module, attr))] = (module, attr)
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            if name.endswith("_scale_inv"):
                continue
            if model.tp is not None:
                replicated = name.endswith(tuple(m + ".weight" for m in module_tree.REPLICATED_MODULES))
                gen.manual_seed(seed + 1_000_003 * i + (0 if replicated else 7919 * (model.tp.rank + 1)))
            if id(p) in quantized:
                _random_fp8(*quantized[id(p)], gen)
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    _log_weights(model, "drawn at random")
    return model


def _random_fp8(module, attr: str, gen: torch.Generator) -> None:
    """N(0, 0.02) for an FP8 weight, quantized part by part (one expert at a time for a 3-D one)."""
    p = getattr(module, attr)
    parts = getattr(module, attr + "_parts")

    def draw():
        w = torch.empty(p.shape[-2:], dtype=torch.float32, device=p.device).normal_(0.0, 0.02, generator=gen)
        return [(part, None) for part in w.split(parts, dim=0)]

    if p.dim() == 2:
        module.weights.load(module, attr, draw())
    else:
        for e in range(p.shape[0]):
            module.weights.load(module, attr, draw(), e)


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
        model = cast_plain_weights(MoEForCausalLM(spec, options, tp=tp), dtype)
    H = spec.hidden_size

    def put(param: torch.Tensor, name: str, shape: tuple[int, ...]):
        param.data.copy_(tensors.plain(name, shape, dtype))

    put(model.embed_tokens, "model.embed_tokens.weight", (spec.vocab_size, H))
    put(model.norm.weight, "model.norm.weight", (H,))
    if model.lm_head is not None:
        put(model.lm_head, "lm_head.weight", (spec.vocab_size, H))

    layers = model.layers
    if progress:
        from tqdm import tqdm

        layers = tqdm(layers, desc="loading layers", unit="layer")
    for layer in layers:
        i = layer.layer_idx
        p = module_tree.layer_prefix(i)
        for norm in module_tree.LAYER_NORMS:
            put(getattr(layer, norm).weight, p + norm + ".weight", (H,))
        attn = layer.self_attn
        if attn.q_norm is not None:
            full = spec.qk_norm == "full"  # the checkpoint's shapes (a rank's norm may hold a slice)
            q_name, k_name = (f"{p}self_attn.{n}.weight" for n in module_tree.QK_NORMS)
            put(attn.q_norm.weight, q_name, (spec.q_size if full else spec.head_dim,))
            put(attn.k_norm.weight, k_name, (spec.kv_size if full else spec.head_dim,))
        if attn.kv_cache_fp8:
            for kind in ("k_scale", "v_scale"):
                if tensors.has(f"{p}self_attn.{kind}"):
                    setattr(attn, kind, tensors.scalar(f"{p}self_attn.{kind}"))
        _load_projections(layer, tensors, spec, put)
        if layer.is_sparse:
            _load_experts(layer.mlp, tensors, spec, i)

    unused = set(tensors.where) - tensors.used
    if unused:
        logger.warning("checkpoint has %d tensors moeserve does not use, e.g. %s", len(unused), sorted(unused)[:3])
    _log_weights(model, "loaded")
    return model


def _log_weights(model: MoEForCausalLM, how: str) -> None:
    """The start-up log's line on weight memory (FP8 halves the quantized weights' bytes)."""
    fmt = model.options.weights
    n = weight_bytes(model)
    shown = f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"
    logger.info("weights %s: %s on %s (%s)", how, shown, model.options.device,
                f"{fmt.method} base weights, {fmt.multiplication}" if fmt.quantized
                else f"{str(model.options.dtype).removeprefix('torch.')} base weights")


def _load_projections(layer, tensors: _Tensors, spec: ModelSpec, put):
    """Every linear of a decoder layer (attention; the dense MLP, or the router and the shared expert), read by
    its checkpoint names; the slices of a fused module (q|k|v, gate|up) concatenated in order."""
    i = layer.layer_idx
    router = module_tree.ROUTER_PROJ
    moe_block = next((b for b in module_tree.MOE_BLOCKS  # where the router is (reported missing under the first)
                      if tensors.has(module_tree.checkpoint_name(i, router, b) + ".weight")), module_tree.MOE_BLOCKS[0])
    slices: dict[str, list[module_tree.Projection]] = {}
    for proj in module_tree.layer_projections(spec, i):
        slices.setdefault(proj.module, []).append(proj)
    for path, projs in slices.items():
        linear = module_tree.submodule(layer, path)
        names = [module_tree.checkpoint_name(i, q, moe_block) for q in projs]
        outs = [module_tree.projection_dims(spec, q.target) for q in projs]
        blocked = linear.weights.quantized
        linear.weights.load(linear, "weight", [tensors.weight(n + ".weight", (out, fan_in), blocked)
                                               for n, (fan_in, out) in zip(names, outs)])
        if linear.bias is not None:
            linear.bias.data.copy_(torch.cat([tensors.plain(n + ".bias", (out,), linear.bias.dtype)
                                              for n, (_, out) in zip(names, outs)]))


def _per_expert_names(tensors: _Tensors, layer: int, expert: int) -> tuple[str, str, str]:
    """(gate, up, down) names of one expert in the per-expert layout: Mixtral's w1/w3/w2 or HF's, under either MoE
    block name; the first candidate (reported missing) where there are none."""
    for block in module_tree.MOE_BLOCKS:
        for mixtral in (True, False):
            names = module_tree.per_expert_names(layer, expert, block, mixtral)
            if tensors.has(names[0]):
                return names
    return module_tree.per_expert_names(layer, expert, module_tree.MOE_BLOCKS[0])


def _load_experts(moe, tensors: _Tensors, spec: ModelSpec, layer: int):
    """The routed experts into w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I] through their weight format
    (an FP8 one keeps gate's and up's scale blocks apart, as the checkpoint stores them)."""
    H, E, inter = spec.hidden_size, spec.num_experts, spec.moe_intermediate_size
    fmt, blocked = moe.weights, moe.weights.quantized
    fused = [module_tree.fused_expert_names(layer, b) for b in module_tree.MOE_BLOCKS]
    fused = [names for names in fused if tensors.has(names[0])]
    if fused:
        gate_up, down = fused[0]
        w, s = tensors.weight(gate_up, (E, 2 * inter, H), blocked)
        held = w.shape[1] // 2
        if s is None:
            parts = [(w[:, :held], None), (w[:, held:], None)]
        else:  # the scale rows of gate, then of up
            parts = [(w[:, :held], s[:, :s.shape[1] // 2]), (w[:, held:], s[:, s.shape[1] // 2:])]
        fmt.load(moe, "w13", parts)
        fmt.load(moe, "w2", [tensors.weight(down, (E, H, inter), blocked)])
        return
    e0 = getattr(moe, "expert_start", 0)  # expert parallelism: this rank holds experts e0 .. e0 + E_local - 1
    for e in range(e0, e0 + moe.w13.shape[0]):
        g, u, d = _per_expert_names(tensors, layer, e)
        fmt.load(moe, "w13", [tensors.weight(g, (inter, H), blocked), tensors.weight(u, (inter, H), blocked)], e - e0)
        fmt.load(moe, "w2", [tensors.weight(d, (H, inter), blocked)], e - e0)
