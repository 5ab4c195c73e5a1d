"""Read a PEFT LoRA adapter folder, validate it against the base model, normalize it.

The result is one fixed layout the slot pool can copy from: dense targets (attention, dense MLP, shared expert,
the MoE router and qwen2's shared-expert gate) as (A [r, in], B [out, r]),
routed experts as stacked [E, ...] factors with gate and up as one gate_up LoRA (one A for both, or a
gate A and an up A of the same rank: separate gate and up LoRAs of rank r cost rank r, not 2r), every
tensor fp32, on CPU, contiguous, with the LoRA scaling (alpha/r, or alpha/sqrt(r) with rsLoRA)
already folded into B.

Routed-expert LoRA comes in several on-disk forms, all accepted:
  * PEFT >= 0.17 `target_parameters` on the fused `mlp.experts.{gate_up_proj,down_proj}`: nested
    ParamWrappers on one module, keys `mlp.experts(.base_layer)*.lora_{A,B}.weight`. The nesting
    order does not say which parameter a pair belongs to, so pairs are mapped by shape. For a
    parameter [E, out, in], lora_A is [E*r, in] expert-major and lora_B is [out, r*E] expert-minor.
  * per-expert keys `experts.N.{gate_proj,up_proj,down_proj}` (Mixtral `experts.N.{w1,w3,w2}`,
    under `mlp.` or `block_sparse_moe.`), as written by PEFT on transformers 4.x and other trainers;
    experts without keys get zeros.
  * stacked 3-D keys `experts.{gate_up_proj,down_proj,gate_proj,up_proj,w1,w3,w2}.lora_{A,B}.weight`
    with A [E, r, in] and B [E, out, r].
  * "shared-outer": any of the fused forms where one factor has expert dim 1 (typically gate_up's A
    and down's B, which touch the hidden size); it is broadcast to all E experts.

Adapter folders may be hostile (runtime loading takes any path a client names), so parsing is bounded:
file sizes and the safetensors header are checked before anything is read or allocated, pattern keys
are matched in linear time, and factors that are not finite in the serving dtype are refused.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from moeserve import module_tree
from moeserve.errors import LoRAAdapterError, PatternKeyError
from moeserve.lora.names import CONFIG_FILE, WEIGHTS_FILE
from moeserve.lora.pattern_keys import MAX_PATTERN_KEY_LEN, MAX_PATTERN_KEYS, PatternTable
from moeserve.model_spec import ModelSpec

# attention, dense MLP, shared expert, the MoE router (`mlp.gate` / `block_sparse_moe.gate`) and qwen2's [1, H]
# shared-expert gate: the module tree's dense targets (module_tree.py)
SUPPORTED_DENSE_TARGETS = module_tree.DENSE_TARGETS
# Dense targets that are single [out, in] weights: PEFT may adapt them as modules (nn.Linear, key `…mlp.gate`) or,
# on transformers 5, as parameters (`target_parameters`, key `…mlp.gate.weight`); rank/alpha patterns match that key.
_PARAM_TARGETS = ("router", "shared_expert_gate")

# adapter_config.json fields that turn plain LoRA into something else at inference time.
_VARIANT_FIELDS = {
    "use_dora": "DoRA (use_dora)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "KaSA (kasa_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "trainable_token_indices": "trainable token embeddings (trainable_token_indices)",
    "layer_replication": "layer replication (layer_replication)",
}
# init_lora_weights values whose saved adapter only holds against a modified base model (unless converted
# at save time, which rewrites init_lora_weights to True), or that select a LoRA variant.
_BASE_MODIFYING_INITS = ("pissa", "olora", "corda", "mica")

_PREFIX = "base_model.model."
# PEFT module names, from the module tree's checkpoint names
_MOE = f"(?:{'|'.join(module_tree.MOE_BLOCKS)})"
_LAYER_RE = re.compile(r"(?:^|.*\.)layers\.(\d+)\.(.+)$")
_ATTN_RE = re.compile(rf"self_attn\.({'|'.join(module_tree.ATTN_TARGETS)})$")
_DENSE_MLP_RE = re.compile(rf"mlp\.({'|'.join(module_tree.MLP_TARGETS)})$")
_SHARED_EXPERT_RE = re.compile(rf"mlp\.shared_expert\.({'|'.join(module_tree.MLP_TARGETS)})$")
_ROUTER_RE = re.compile(rf"{_MOE}\.{module_tree.ROUTER}$")
_SHARED_EXPERT_GATE = module_tree.projection("shared_expert_gate").checkpoint
_EXPERT_NAMES = "|".join(n for names in module_tree.PER_EXPERT_NAMES.values() for n in names)
_WRAPPED_EXPERTS_RE = re.compile(rf"({_MOE}\.experts)$")
_PER_EXPERT_RE = re.compile(rf"({_MOE}\.experts)\.(\d+)\.({_EXPERT_NAMES})$")
_STACKED_RE = re.compile(rf"({_MOE}\.experts)\.({'|'.join(module_tree.EXPERT_PROJ)})$")
_PROJ = module_tree.EXPERT_PROJ  # expert projection name -> "gate_up" | "gate" | "up" | "down"

# Limits against hostile adapter folders. Real adapters are far inside every one of them.
MAX_CONFIG_BYTES = 4 << 20  # adapter_config.json
MAX_HEADER_BYTES = 16 << 20  # safetensors JSON header
MAX_TENSOR_NAME_LEN = 512  # real ones are ~100 characters; bounds pattern-matching work per name
MAX_PATTERN_STRING_LEN = 4096  # target_modules etc. given as one regex string (never matched here)
MAX_SCALING = 1e6  # |lora_alpha / r|; PEFT adapters use ~0.1..100
_WEIGHTS_SLACK = 2  # the size bound allows twice an adapter with every target at max_rank, in fp32
_DTYPE_BYTES = {"F16": 2, "BF16": 2, "F32": 4}  # safetensors dtype names accepted for LoRA factors
# adapter_config.json fields PEFT reads as module-name patterns. Only rank_pattern / alpha_pattern matter for
# serving (tensor keys say what is adapted); the others are only bounded, never matched.
_PATTERN_LIST_FIELDS = ("target_modules", "exclude_modules", "layers_pattern", "target_parameters")


@dataclass
class ExpertLoRA:
    """Routed-expert LoRA of one sparse layer; None where not targeted; scaling folded into B.
    gate_up: ΔW rows [:I] (gate) = B[:, :I] @ gate_up_a, rows [I:] (up) = B[:, I:] @ (up_a, or
    gate_up_a where up_a is None: one A shared by gate and up, as a fused gate_up LoRA has)."""
    gate_up_a: Tensor | None  # [E, r_gu, H]
    gate_up_b: Tensor | None  # [E, 2I, r_gu]
    down_a: Tensor | None  # [E, r_d, I]
    down_b: Tensor | None  # [E, H, r_d]
    up_a: Tensor | None = None  # [E, r_gu, H]: the up rows' own A (separate gate and up LoRAs)

    def stacked_gate_up(self) -> tuple[Tensor, Tensor]:
        """Separate gate and up A's as one gate_up LoRA of rank 2·r_gu (A stacked, B block-diagonal), for a
        slot pool that holds no up A (lora_separate_gate_up off)."""
        r, inter = self.gate_up_a.shape[1], self.gate_up_b.shape[1] // 2
        b = torch.zeros(*self.gate_up_b.shape[:2], 2 * r, dtype=self.gate_up_b.dtype)
        b[:, :inter, :r] = self.gate_up_b[:, :inter]
        b[:, inter:, r:] = self.gate_up_b[:, inter:]
        return torch.cat([self.gate_up_a, self.up_a], dim=1), b


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int  # max rank over all its tensors (separate gate and up LoRAs count max(r_g, r_u))
    dense: dict[tuple[int, str], tuple[Tensor, Tensor]]  # (layer, target) -> (A [r, in], B [out, r])
    experts: dict[int, ExpertLoRA]  # layer -> routed-expert LoRA
    target_modules: frozenset[str]  # e.g. {"q_proj", "v_proj", "experts"}

    @property
    def separate_gate_up(self) -> bool:
        """Some layer's routed experts have separate gate and up A's."""
        return any(ex.up_a is not None for ex in self.experts.values())

    @property
    def stacked_rank(self) -> int:
        """The slot rank it needs in a pool without an up A (its separate gate and up A's stacked)."""
        return max([self.rank] + [2 * ex.gate_up_a.shape[1] for ex in self.experts.values() if ex.up_a is not None])


def load_lora_adapter(name: str, path, spec: ModelSpec, max_rank: int, *,
                      serve_dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    """Parse the PEFT adapter folder `path` for the base model `spec`; raise LoRAAdapterError if unservable.
    `serve_dtype` is the dtype the factors will be served in: factors (and the ΔW they make) that overflow it
    are refused."""
    if not (isinstance(serve_dtype, torch.dtype) and serve_dtype.is_floating_point):
        raise TypeError(f"serve_dtype must be a floating-point torch.dtype, got {serve_dtype!r}")
    try:
        return _load(_Ctx(name, Path(path), serve_dtype), spec, max_rank)
    except LoRAAdapterError as e:
        message = str(e)
    # Raised afresh outside the except block: the original traceback, whose frames hold every tensor read so
    # far, dies here, so a caller that keeps (or logs) the error keeps no adapter memory.
    raise LoRAAdapterError(message)


def _load(ctx: _Ctx, spec: ModelSpec, max_rank: int) -> LoRAAdapter:
    cfg = _read_config(ctx)
    scaling = _Scaling(ctx, cfg)
    tensors = _read_weights(ctx, spec, max_rank)
    pairs = _pair_lora_tensors(ctx, tensors)
    del tensors

    dense: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}
    projs: dict[int, dict[str, _ExpertProj]] = {}  # layer -> "gate_up"/"gate"/"up"/"down" -> factors
    for module, (key_a, a, key_b, b) in pairs.items():
        site = _classify(ctx, spec, module, key_a)
        if site.kind == "dense":
            if site.target in _PARAM_TARGETS:
                site.peft_key = scaling.param_key(site.peft_key)
            r = scaling.rank(site.peft_key)
            _check_dense(ctx, spec, site, key_a, a, key_b, b, r)
            if (site.layer, site.target) in dense:
                raise ctx.error(f"{WEIGHTS_FILE}[{key_a}]", f"a second LoRA for layer {site.layer} {site.target}")
            b = b * scaling.scale(site.peft_key, r)
            _check_factors(ctx, key_a, a, key_b, b)
            dense[(site.layer, site.target)] = (a, b)
        else:
            layer_projs = projs.setdefault(site.layer, {})
            _add_expert_factors(ctx, spec, scaling, site, key_a, a, key_b, b, layer_projs)

    experts = {layer: _assemble_experts(ctx, spec, layer, p) for layer, p in sorted(projs.items())}
    if not dense and not experts:
        raise ctx.error(WEIGHTS_FILE, "no LoRA tensors found (empty adapter)")

    dense = {k: (_finish(a), _finish(b)) for k, (a, b) in sorted(dense.items())}
    rank, where = _max_rank(dense, experts)
    if rank > max_rank:
        raise ctx.error(f"{WEIGHTS_FILE} ({where})",
                        f"LoRA rank {rank} exceeds the engine's max_lora_rank {max_rank} (--max-lora-rank)")
    targets = {t for (_, t) in dense} | ({"experts"} if experts else set())
    return LoRAAdapter(name=ctx.name, path=str(ctx.path), rank=rank, dense=dense, experts=experts,
                       target_modules=frozenset(targets))


# ---------------------------------------------------------------------------------------------- reading


class _Ctx:
    def __init__(self, name: str, path: Path, serve_dtype: torch.dtype = torch.float32):
        self.name, self.path, self.serve_dtype = name, path, serve_dtype

    def error(self, where: str, problem: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"LoRA adapter {self.name!r} ({self.path}): {where}: {problem}")


def _read_config(ctx: _Ctx) -> dict:
    if not ctx.path.is_dir():
        raise ctx.error(str(ctx.path), "not a directory (expected a PEFT adapter folder)")
    cfg_path = ctx.path / CONFIG_FILE
    if not cfg_path.is_file():
        raise ctx.error(CONFIG_FILE, "missing (a PEFT adapter folder holds adapter_config.json)")
    with open(cfg_path, "rb") as f:
        # size from the open file, and a bounded read in case it grows meanwhile
        size = os.fstat(f.fileno()).st_size
        raw = f.read(MAX_CONFIG_BYTES + 1) if size <= MAX_CONFIG_BYTES else b""
    if size > MAX_CONFIG_BYTES or len(raw) > MAX_CONFIG_BYTES:
        raise ctx.error(CONFIG_FILE, f"{max(size, len(raw))} bytes, larger than the {MAX_CONFIG_BYTES >> 20} MiB "
                        "limit for an adapter config")
    try:
        cfg = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # ValueError covers JSONDecodeError
        raise ctx.error(CONFIG_FILE, f"invalid JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(cfg, dict):
        raise ctx.error(CONFIG_FILE, f"expected a JSON object, got {type(cfg).__name__}")
    _check_pattern_lists(ctx, cfg)

    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ctx.error(CONFIG_FILE, f"peft_type={peft_type!r} is not supported (only 'LORA')")
    for field, what in _VARIANT_FIELDS.items():
        if cfg.get(field):
            raise ctx.error(CONFIG_FILE, f"{what} is not supported (plain LoRA only)")
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_MODIFYING_INITS):
        raise ctx.error(CONFIG_FILE, f"init_lora_weights={init!r} adapters apply to a modified base model "
                        "(convert to plain LoRA when saving)")
    if cfg.get("lora_bias"):
        raise ctx.error(CONFIG_FILE, "lora_bias=true is not supported (LoRA B without bias only)")
    if cfg.get("bias") not in (None, "none"):
        raise ctx.error(CONFIG_FILE, f"bias={cfg['bias']!r} is not supported (it trains base biases; only 'none')")
    if cfg.get("modules_to_save"):
        raise ctx.error(CONFIG_FILE, f"modules_to_save={cfg['modules_to_save']!r} is not supported "
                        "(full copies of base modules)")
    return cfg


def _check_pattern_lists(ctx: _Ctx, cfg: dict) -> None:
    """Bound the pattern fields this parser does not match (see _PATTERN_LIST_FIELDS)."""
    for field in _PATTERN_LIST_FIELDS:
        value = cfg.get(field)
        if value is None:
            continue
        if isinstance(value, str):
            if len(value) > MAX_PATTERN_STRING_LEN:
                raise ctx.error(CONFIG_FILE, f"{field} is a string of {len(value)} characters (limit "
                                f"{MAX_PATTERN_STRING_LEN})")
            continue
        if not isinstance(value, list):
            raise ctx.error(CONFIG_FILE, f"{field} must be a string or a list of strings, got {type(value).__name__}")
        if len(value) > MAX_PATTERN_KEYS:
            raise ctx.error(CONFIG_FILE, f"{field} has {len(value)} entries (limit {MAX_PATTERN_KEYS})")
        for item in value:
            if not isinstance(item, str):
                raise ctx.error(CONFIG_FILE, f"{field} entry {item!r:.60} is not a string")
            if len(item) > MAX_PATTERN_KEY_LEN:
                raise ctx.error(CONFIG_FILE, f"{field} entry {item[:40]!r}... has {len(item)} characters "
                                f"(limit {MAX_PATTERN_KEY_LEN})")


def _max_weights_bytes(spec: ModelSpec, max_rank: int) -> int:
    """Bytes of an adapter with every supported target of every layer at max_rank, in fp32, times the slack:
    more tensor data than this cannot be a servable adapter for this model. Routed experts count in the
    per-expert form (separate gate, up and down per expert), the largest form."""
    elements = 0
    for layer, sparse in enumerate(spec.sparse_layers):
        # one [r, in] + one [out, r] per linear of the layer (module_tree.py), and per expert projection
        for p in module_tree.layer_projections(spec, layer):
            elements += sum(module_tree.projection_dims(spec, p.target))
        if sparse:
            elements += 3 * spec.num_experts * (spec.hidden_size + spec.moe_intermediate_size)
    return _WEIGHTS_SLACK * 4 * max_rank * elements


def _max_tensor_count(spec: ModelSpec) -> int:
    # lora_A + lora_B for every module an adapter can target in a layer (attention 4, dense MLP or shared
    # expert 3, router and shared-expert gate 2, per-expert 3 * E, fused/stacked expert forms a few), times the slack
    return _WEIGHTS_SLACK * 2 * spec.num_layers * (4 + 3 + 2 + 3 * spec.num_experts + 8)


def _check_safetensors_header(ctx: _Ctx, w_path: Path, spec: ModelSpec, max_rank: int) -> None:
    """Validate the file's layout from its 8-byte header length and JSON header alone, so that a huge or
    bogus file is refused in milliseconds, before any tensor is allocated."""
    def corrupt(problem: str) -> LoRAAdapterError:
        return ctx.error(WEIGHTS_FILE, f"corrupt or truncated safetensors file ({problem})")

    limit = _max_weights_bytes(spec, max_rank)
    with open(w_path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise corrupt(f"{size} bytes, shorter than the 8-byte header length")
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > MAX_HEADER_BYTES:
            raise corrupt(f"declared header length {header_len} bytes exceeds the {MAX_HEADER_BYTES >> 20} MiB limit")
        if 8 + header_len > size:
            raise corrupt(f"declared header length {header_len} bytes runs past the end of the {size}-byte file")
        data_size = size - 8 - header_len
        if data_size > limit:
            raise ctx.error(WEIGHTS_FILE, f"{data_size} bytes of tensor data, more than any LoRA adapter of this "
                            f"model at max_rank {max_rank} can hold ({limit} bytes)")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise corrupt(f"header is not valid JSON: {type(e).__name__}") from None
    if not isinstance(header, dict):
        raise corrupt(f"header is a JSON {type(header).__name__}, not an object")
    n_tensors = len(header) - ("__metadata__" in header)
    if n_tensors > _max_tensor_count(spec):
        raise ctx.error(WEIGHTS_FILE, f"{n_tensors} tensors, more than any LoRA adapter of this model has "
                        f"({_max_tensor_count(spec)})")

    declared, ends = 0, []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if len(key) > MAX_TENSOR_NAME_LEN:
            raise ctx.error(f"{WEIGHTS_FILE}[{key[:60]}...]", f"tensor name of {len(key)} characters "
                            f"(limit {MAX_TENSOR_NAME_LEN})")
        where = f"{WEIGHTS_FILE}[{key}]"
        if not isinstance(info, dict):
            raise corrupt(f"entry for {key!r} is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in _DTYPE_BYTES:
            raise ctx.error(where, f"dtype {dtype!r:.40} is not supported (LoRA factors must be F16, BF16 or F32)")
        if not (isinstance(shape, list) and len(shape) <= 4
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise corrupt(f"shape of {key!r} is {shape!r:.60}, not a list of at most 4 non-negative integers")
        nbytes = math.prod(shape) * _DTYPE_BYTES[dtype]
        declared += nbytes
        if declared > limit:
            raise ctx.error(where, f"shape {tuple(shape)} brings the declared tensor data to {declared} bytes, "
                            f"more than any LoRA adapter of this model at max_rank {max_rank} can hold ({limit} bytes)")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
                and 0 <= offsets[0] and offsets[1] - offsets[0] == nbytes):
            raise corrupt(f"data_offsets of {key!r} are {offsets!r:.60}; {dtype} {tuple(shape)} takes {nbytes} bytes")
        ends.append((offsets[1], key))
    end, key = max(ends, default=(0, ""))
    if end > data_size:
        raise corrupt(f"{key!r} ends at data byte {end}, past the {data_size} bytes of tensor data")


def _read_weights(ctx: _Ctx, spec: ModelSpec, max_rank: int) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    w_path = ctx.path / WEIGHTS_FILE
    if not w_path.is_file():
        if (ctx.path / "adapter_model.bin").is_file():
            raise ctx.error("adapter_model.bin", "pickle weights are not loaded; safetensors needed "
                            "(re-save with save_pretrained(safe_serialization=True))")
        raise ctx.error(WEIGHTS_FILE, "missing")
    _check_safetensors_header(ctx, w_path, spec, max_rank)
    try:
        tensors = load_file(str(w_path), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ctx.error(WEIGHTS_FILE, f"corrupt or truncated safetensors file ({e})") from None
    for key, t in tensors.items():
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):  # the header check already made sure
            raise ctx.error(f"{WEIGHTS_FILE}[{key}]", f"dtype {t.dtype} is not supported")
        if not bool(torch.isfinite(t).all()):
            raise ctx.error(f"{WEIGHTS_FILE}[{key}]", "contains NaN or Inf values")
    return tensors


def _pair_lora_tensors(ctx: _Ctx, tensors: dict[str, Tensor]) -> dict[str, tuple[str, Tensor, str, Tensor]]:
    """Module path (as stored, `base_model.model.` removed) -> (key_A, A fp32, key_B, B fp32)."""
    halves: dict[str, dict[str, tuple[str, Tensor]]] = {}
    for key, t in tensors.items():
        stem = key[len(_PREFIX):] if key.startswith(_PREFIX) else key
        m = re.fullmatch(r"(.+)\.lora_([AB])\.weight", stem)
        if m is None:
            raise ctx.error(f"{WEIGHTS_FILE}[{key}]", _unexpected_key_problem(stem))
        halves.setdefault(m.group(1), {})[m.group(2)] = (key, t.to(torch.float32))
    pairs = {}
    for module, h in sorted(halves.items()):
        if "B" not in h:
            raise ctx.error(f"{WEIGHTS_FILE}[{h['A'][0]}]", "lora_A without a matching lora_B")
        if "A" not in h:
            raise ctx.error(f"{WEIGHTS_FILE}[{h['B'][0]}]", "lora_B without a matching lora_A")
        pairs[module] = (*h["A"], *h["B"])
    return pairs


def _unexpected_key_problem(stem: str) -> str:
    if re.search(r"\.lora_[AB]\.bias$", stem):
        return "LoRA bias (lora_bias) is not supported"
    if "lora_magnitude_vector" in stem:
        return "DoRA magnitude vector found: DoRA is not supported"
    if "lora_embedding_" in stem:
        return "LoRA on embeddings is not supported"
    return "not a LoRA weight (expected '<module>.lora_A.weight' / '<module>.lora_B.weight')"


class _Scaling:
    """Per-module rank and scale from r / lora_alpha / use_rslora and rank_pattern / alpha_pattern (resolved
    as PEFT does, see PatternTable)."""

    def __init__(self, ctx: _Ctx, cfg: dict):
        self.ctx = ctx
        self.r = cfg.get("r", 8)
        self.alpha = cfg.get("lora_alpha", 8)
        self.rslora = bool(cfg.get("use_rslora", False))
        self.target_parameters = cfg.get("target_parameters") or []  # bounded by _check_pattern_lists
        if isinstance(self.target_parameters, str):
            self.target_parameters = [self.target_parameters]
        with self._refusals():
            self.rank_pattern = PatternTable("rank_pattern", cfg.get("rank_pattern"))
            self.alpha_pattern = PatternTable("alpha_pattern", cfg.get("alpha_pattern"))
        for what, v in [("r", self.r)] + self.rank_pattern.fields():
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ctx.error(CONFIG_FILE, f"{what}={v!r:.60} is not a positive integer")
        for what, v in [("lora_alpha", self.alpha)] + self.alpha_pattern.fields():
            if not _is_finite_number(v):
                raise ctx.error(CONFIG_FILE, f"{what}={v!r:.60} is not a finite number")

    def param_key(self, module_key: str) -> str:
        """The key PEFT matched patterns against for the weight of module `module_key`: `<module>.weight` where
        target_parameters named it (PEFT's rule: equal, or ending in '.' + the entry), else the module's own."""
        key = f"{module_key}.weight"
        if any(key == t or key.endswith("." + t) for t in self.target_parameters):
            return key
        return module_key

    @contextmanager
    def _refusals(self):
        """A pattern table's refusal as this adapter's error, naming the file at fault."""
        try:
            yield
        except PatternKeyError as e:
            raise self.ctx.error(WEIGHTS_FILE if e.about_names else CONFIG_FILE, str(e)) from None

    def rank(self, peft_key: str) -> int:
        with self._refusals():
            hit = self.rank_pattern.lookup(peft_key)
        return self.r if hit is None else hit[1]

    def scale(self, peft_key: str, r: int) -> float:
        with self._refusals():
            hit = self.alpha_pattern.lookup(peft_key)
        what, alpha = ("lora_alpha", self.alpha) if hit is None else (f"alpha_pattern[{hit[0]!r}]", hit[1])
        scale = alpha / math.sqrt(r) if self.rslora else alpha / r
        if not abs(scale) <= MAX_SCALING:  # also catches NaN
            rule = f"{what} / sqrt(r) (use_rslora)" if self.rslora else f"{what} / r"
            raise self.ctx.error(CONFIG_FILE, f"{what}={alpha!r} gives {peft_key} (r={r}) the LoRA scaling "
                                 f"{rule} = {scale:.3g}, beyond the limit {MAX_SCALING:g}")
        return scale


def _is_finite_number(v) -> bool:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:  # an integer beyond float range
        return False


def _check_factors(ctx: _Ctx, key_a: str, a: Tensor, key_b: str, b: Tensor) -> None:
    """A and B (scaling folded in), [r, in] / [out, r] or per expert [E|1, r, in] / [E|1, out, r], must hold
    in the serving dtype, and so must ΔW = B·A: |ΔW_ij| <= (row sum of |B|) * max|A|, a bound that needs no
    matmul. Garbage like 3e38 in a factor would otherwise serve as Inf/NaN logits (empty text)."""
    dtype = ctx.serve_dtype
    limit = torch.finfo(dtype).max
    for key, t, scaled in ((key_a, a, ""), (key_b, b, " (with the LoRA scaling)")):
        if not bool(torch.isfinite(t).all()):  # the file's values were finite: the scaling overflowed
            raise ctx.error(f"{WEIGHTS_FILE}[{key}]", "contains NaN or Inf values after applying the LoRA scaling")
        peak = t.abs().max().item() if t.numel() else 0.0
        if peak > limit:
            raise ctx.error(f"{WEIGHTS_FILE}[{key}]", f"values up to {peak:.3g}{scaled} overflow the serving dtype "
                            f"{dtype} (max {limit:.3g})")
    if a.numel() == 0 or b.numel() == 0:
        return
    a3, b3 = (a, b) if a.ndim == 3 else (a.unsqueeze(0), b.unsqueeze(0))
    a_peak = a3.abs().amax(dim=(1, 2)).double()  # [Ea]
    b_rows = b3.abs().sum(dim=2, dtype=torch.float64).amax(dim=1)  # [Eb]
    bound = (a_peak * b_rows).max().item()  # Ea, Eb broadcast (one of them may be 1)
    if not bound <= limit:
        raise ctx.error(f"{WEIGHTS_FILE}[{key_b}]", f"with {key_a} it makes a LoRA delta B·A whose entries can reach "
                        f"{bound:.3g}, beyond the serving dtype {dtype} (max {limit:.3g})")


# ---------------------------------------------------------------------------------------------- classifying


@dataclass
class _Site:
    kind: str  # "dense" | "wrapped" (target_parameters) | "per_expert" | "stacked"
    layer: int
    peft_key: str  # module key PEFT matches rank/alpha patterns against ("" where it depends on shape)
    target: str = ""  # dense target name
    proj: str = ""  # expert projection: "gate_up" | "gate" | "up" | "down" ("" for wrapped: by shape)
    expert: int = -1  # per-expert form


def _classify(ctx: _Ctx, spec: ModelSpec, module: str, key_a: str) -> _Site:
    where = f"{WEIGHTS_FILE}[{key_a}]"
    # Nested PEFT wrappers insert `.base_layer`; PEFT's own pattern keys never contain it.
    canonical = re.sub(r"(\.base_layer)+(?=\.|$)", "", module)
    m = _LAYER_RE.match(canonical)
    if m is None:
        target = canonical.rsplit(".", 1)[-1]
        raise ctx.error(where, f"LoRA target module {target!r} is not supported "
                        f"(supported: {', '.join(SUPPORTED_DENSE_TARGETS)}, routed experts)")
    layer, sub = int(m.group(1)), m.group(2)
    if layer >= spec.num_layers:
        raise ctx.error(where, f"layer index {layer} is beyond the model (it has {spec.num_layers} layers)")
    sparse = spec.sparse_layers[layer]

    if mm := _ATTN_RE.match(sub):
        return _Site("dense", layer, canonical, target=mm.group(1))
    if mm := _SHARED_EXPERT_RE.match(sub):
        if not (sparse and spec.shared_expert_intermediate_size):
            raise ctx.error(where, f"layer {layer} of the base model has no shared expert")
        return _Site("dense", layer, canonical, target="shared_expert." + mm.group(1))
    if mm := _DENSE_MLP_RE.match(sub):
        if sparse:
            raise ctx.error(where, f"layer {layer} is a sparse MoE layer; it has no dense {mm.group(1)}")
        return _Site("dense", layer, canonical, target=mm.group(1))
    if _ROUTER_RE.match(sub):
        if not sparse:
            raise ctx.error(where, f"layer {layer} is a dense MLP layer in the base model; it has no router")
        return _Site("dense", layer, canonical, target="router")
    if sub == _SHARED_EXPERT_GATE:
        if not (sparse and spec.shared_expert_intermediate_size):
            raise ctx.error(where, f"layer {layer} of the base model has no shared expert")
        return _Site("dense", layer, canonical, target="shared_expert_gate")

    expert_site = None
    if mm := _WRAPPED_EXPERTS_RE.match(sub):
        expert_site = _Site("wrapped", layer, canonical)
    elif mm := _PER_EXPERT_RE.match(sub):
        expert_site = _Site("per_expert", layer, canonical, proj=_PROJ[mm.group(3)], expert=int(mm.group(2)))
    elif mm := _STACKED_RE.match(sub):
        expert_site = _Site("stacked", layer, canonical, proj=_PROJ[mm.group(2)])
    if expert_site is None:
        raise ctx.error(where, f"LoRA target module {sub!r} is not supported "
                        f"(supported: {', '.join(SUPPORTED_DENSE_TARGETS)}, routed experts)")
    if not sparse:
        raise ctx.error(where, f"layer {layer} is a dense MLP layer in the base model; it has no routed experts")
    if expert_site.kind == "per_expert" and expert_site.expert >= spec.num_experts:
        raise ctx.error(where, f"expert index {expert_site.expert} is beyond the model "
                        f"(it has {spec.num_experts} experts)")
    return expert_site


def _shape_error(ctx: _Ctx, key: str, got, expected: str) -> LoRAAdapterError:
    return ctx.error(f"{WEIGHTS_FILE}[{key}]",
                     f"shape {tuple(got)} does not match the base model (expected {expected})")


def _check_rank(ctx: _Ctx, key: str, r_tensor: int, r_cfg: int, peft_key: str) -> None:
    if r_tensor != r_cfg:
        raise ctx.error(f"{WEIGHTS_FILE}[{key}]", f"tensor rank {r_tensor} disagrees with {CONFIG_FILE}, "
                        f"which gives r={r_cfg} for {peft_key} (r / rank_pattern)")


def _check_dense(ctx, spec, site: _Site, key_a, a: Tensor, key_b, b: Tensor, r_cfg: int) -> None:
    fan_in, fan_out = module_tree.projection_dims(spec, site.target)
    if a.ndim != 2 or a.shape[1] != fan_in:
        raise _shape_error(ctx, key_a, a.shape, f"[r, {fan_in}]")
    r = a.shape[0]
    if b.ndim != 2 or tuple(b.shape) != (fan_out, r):
        raise _shape_error(ctx, key_b, b.shape, f"[{fan_out}, {r}]")
    _check_rank(ctx, key_a, r, r_cfg, site.peft_key)


# ---------------------------------------------------------------------------------------------- experts


@dataclass
class _ExpertProj:
    """One routed-expert projection's factors, scaling folded into B, before gate/up stacking."""
    key: str  # a key it came from, for messages
    a: Tensor | None = None  # [E, r, in] (fused forms)
    b: Tensor | None = None  # [E, out, r]
    per_expert: dict[int, tuple[Tensor, Tensor]] | None = None  # expert -> (A [r, in], B [out, r])


def _add_expert_factors(ctx, spec, scaling: _Scaling, site: _Site, key_a, a, key_b, b, layer_projs) -> None:
    E = spec.num_experts
    if site.kind == "per_expert":
        fan_in, fan_out = module_tree.expert_dims(spec, site.proj)
        if a.ndim != 2 or a.shape[1] != fan_in:
            raise _shape_error(ctx, key_a, a.shape, f"[r, {fan_in}]")
        r = a.shape[0]
        if b.ndim != 2 or tuple(b.shape) != (fan_out, r):
            raise _shape_error(ctx, key_b, b.shape, f"[{fan_out}, {r}]")
        _check_rank(ctx, key_a, r, scaling.rank(site.peft_key), site.peft_key)
        proj = layer_projs.setdefault(site.proj, _ExpertProj(key_a, per_expert={}))
        if proj.per_expert is None:
            raise ctx.error(f"{WEIGHTS_FILE}[{key_a}]", f"layer {site.layer} experts' {site.proj} LoRA is given "
                            "both per expert and stacked over experts")
        if site.expert in proj.per_expert:
            raise ctx.error(f"{WEIGHTS_FILE}[{key_a}]", f"a second LoRA for layer {site.layer} expert {site.expert}")
        b = b * scaling.scale(site.peft_key, r)
        _check_factors(ctx, key_a, a, key_b, b)
        proj.per_expert[site.expert] = (a, b)
        return

    if site.kind == "wrapped":
        proj_name = _wrapped_param_by_shape(ctx, spec, key_a, a, key_b, b)
        peft_key = f"{site.peft_key}.{'gate_up_proj' if proj_name == 'gate_up' else 'down_proj'}"
        a3, b3 = _unflatten_wrapped(ctx, spec, proj_name, key_a, a, key_b, b)
    else:
        proj_name, peft_key = site.proj, site.peft_key
        a3, b3 = _stacked_factors(ctx, spec, proj_name, key_a, a, key_b, b)
    r = a3.shape[1]
    _check_rank(ctx, key_a, r, scaling.rank(peft_key), peft_key)
    if proj_name in layer_projs:
        raise ctx.error(f"{WEIGHTS_FILE}[{key_a}]", f"a second LoRA for layer {site.layer} experts' {proj_name} "
                        f"(first from {layer_projs[proj_name].key})")
    b3 = b3 * scaling.scale(peft_key, r)
    _check_factors(ctx, key_a, a3, key_b, b3)
    # a shared factor (expert dim 1) is broadcast to every expert
    layer_projs[proj_name] = _ExpertProj(key_a, a=a3.expand(E, -1, -1), b=b3.expand(E, -1, -1))


def _wrapped_param_by_shape(ctx, spec, key_a, a: Tensor, key_b, b: Tensor) -> str:
    """Which fused parameter a target_parameters pair adapts: gate_up_proj [E, 2I, H] or down_proj [E, H, I].
    A's in-dim tells (H vs I); when H == I, B's out-dim does (2I vs H)."""
    H, I = spec.hidden_size, spec.moe_intermediate_size
    if a.ndim != 2 or b.ndim != 2:
        raise _shape_error(ctx, key_a, a.shape, "2-D lora_A / lora_B for a target_parameters adapter")
    if H != I:
        by_in = {H: "gate_up", I: "down"}.get(a.shape[1])
        if by_in is None:
            raise _shape_error(ctx, key_a, a.shape, f"[E*r, {H}] for experts.gate_up_proj or [E*r, {I}] for "
                               "experts.down_proj")
        return by_in
    by_out = {2 * I: "gate_up", H: "down"}.get(b.shape[0])
    if by_out is None:
        raise _shape_error(ctx, key_b, b.shape, f"[{2 * I}, r*E] for experts.gate_up_proj or [{H}, r*E] for "
                           "experts.down_proj")
    return by_out


def _unflatten_wrapped(ctx, spec, proj, key_a, a: Tensor, key_b, b: Tensor) -> tuple[Tensor, Tensor]:
    """PEFT ParamWrapper layout -> (A [Ea, r, in], B [Eb, out, r]), Ea/Eb in {E, 1}.
    lora_A is [Ea*r, in] expert-major; lora_B is [out, r*Eb] expert-minor."""
    E = spec.num_experts
    fan_in, fan_out = module_tree.expert_dims(spec, proj)
    if a.shape[1] != fan_in:
        raise _shape_error(ctx, key_a, a.shape, f"[E*r, {fan_in}]")
    if b.shape[0] != fan_out:
        raise _shape_error(ctx, key_b, b.shape, f"[{fan_out}, r*E]")
    rows_a, cols_b = a.shape[0], b.shape[1]
    if rows_a == cols_b and rows_a % E == 0:
        ea, eb, r = E, E, rows_a // E
    elif cols_b == rows_a * E:  # A shared by all experts
        ea, eb, r = 1, E, rows_a
    elif rows_a == cols_b * E:  # B shared by all experts
        ea, eb, r = E, 1, cols_b
    else:
        raise ctx.error(f"{WEIGHTS_FILE}[{key_a}]", f"lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not "
                        f"fit {E} experts (expected [E*r, in] and [out, r*E], or one of them with E=1)")
    a3 = a.reshape(ea, r, fan_in)
    b3 = b.reshape(fan_out, r, eb).permute(2, 0, 1)
    return a3, b3


def _stacked_factors(ctx, spec, proj, key_a, a: Tensor, key_b, b: Tensor) -> tuple[Tensor, Tensor]:
    """Stacked form: A [E|1, r, in] (or [r, in], shared) and B [E|1, out, r] (or [out, r], shared)."""
    E = spec.num_experts
    fan_in, fan_out = module_tree.expert_dims(spec, proj)
    a3 = a.unsqueeze(0) if a.ndim == 2 else a
    b3 = b.unsqueeze(0) if b.ndim == 2 else b
    if a3.ndim != 3 or a3.shape[0] not in (1, E) or a3.shape[2] != fan_in:
        raise _shape_error(ctx, key_a, a.shape, f"[{E} or 1, r, {fan_in}]")
    r = a3.shape[1]
    if b3.ndim != 3 or b3.shape[0] not in (1, E) or tuple(b3.shape[1:]) != (fan_out, r):
        raise _shape_error(ctx, key_b, b.shape, f"[{E} or 1, {fan_out}, {r}]")
    return a3, b3


def _expert_stack(proj: _ExpertProj, E: int, fan_in: int, fan_out: int) -> tuple[Tensor, Tensor]:
    """[E, r, in], [E, out, r] from either form; per-expert ranks are zero-padded to the largest,
    experts without a LoRA get zeros."""
    if proj.per_expert is None:
        return proj.a, proj.b
    r = max(a.shape[0] for a, _ in proj.per_expert.values())
    a3, b3 = torch.zeros(E, r, fan_in), torch.zeros(E, fan_out, r)
    for e, (a, b) in proj.per_expert.items():
        a3[e, : a.shape[0]] = a
        b3[e, :, : b.shape[1]] = b
    return a3, b3


def _assemble_experts(ctx, spec, layer: int, projs: dict[str, _ExpertProj]) -> ExpertLoRA:
    E, H, I = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    gate_up_a = gate_up_b = down_a = down_b = up_a = None
    if "gate_up" in projs:
        for half in ("gate", "up"):
            if half in projs:
                raise ctx.error(f"{WEIGHTS_FILE}[{projs[half].key}]", f"layer {layer} experts have both a fused "
                                f"gate_up LoRA ({projs['gate_up'].key}) and a separate {half} LoRA")
        gate_up_a, gate_up_b = _expert_stack(projs["gate_up"], E, H, 2 * I)
    elif "gate" in projs and "up" in projs:
        # a gate A and an up A side by side, each zero-padded to rank max(r_g, r_u); B's halves likewise
        ga, gb = _expert_stack(projs["gate"], E, H, I)
        ua, ub = _expert_stack(projs["up"], E, H, I)
        r = max(ga.shape[1], ua.shape[1])
        gate_up_a, up_a = torch.zeros(E, r, H), torch.zeros(E, r, H)
        gate_up_a[:, :ga.shape[1]] = ga
        up_a[:, :ua.shape[1]] = ua
        gate_up_b = torch.zeros(E, 2 * I, r)
        gate_up_b[:, :I, :gb.shape[2]] = gb
        gate_up_b[:, I:, :ub.shape[2]] = ub
    elif "gate" in projs or "up" in projs:
        # only one of them: its A serves both halves (the other half's B rows are zero), one shrink
        half = "gate" if "gate" in projs else "up"
        gate_up_a, b = _expert_stack(projs[half], E, H, I)
        gate_up_b = torch.zeros(E, 2 * I, b.shape[2])
        (gate_up_b[:, :I] if half == "gate" else gate_up_b[:, I:]).copy_(b)
    if "down" in projs:
        down_a, down_b = _expert_stack(projs["down"], E, I, H)
    return ExpertLoRA(*(None if t is None else _finish(t) for t in (gate_up_a, gate_up_b, down_a, down_b, up_a)))


def _finish(t: Tensor) -> Tensor:
    return t.to(device="cpu", dtype=torch.float32).contiguous()


def _max_rank(dense, experts) -> tuple[int, str]:
    best, where = 0, ""
    for (layer, target), (a, _) in dense.items():
        if a.shape[0] > best:
            best, where = a.shape[0], f"layer {layer} {target}"
    for layer, ex in experts.items():
        for what, a in (("experts gate_up", ex.gate_up_a), ("experts down", ex.down_a)):
            if a is not None and a.shape[1] > best:
                best, where = a.shape[1], f"layer {layer} {what}"
    return best, where
