"""Read a PEFT LoRA adapter folder, validate it against the base model, normalize it.

The result is one fixed layout the slot pool can copy from: dense targets as (A [r, in], B [out, r]),
routed experts as stacked [E, ...] factors with gate and up fused into one gate_up LoRA, every
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
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from moeserve.models.spec import ModelSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

SUPPORTED_DENSE_TARGETS = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj",
)

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
_MOE = r"(?:mlp|block_sparse_moe)"
_LAYER_RE = re.compile(r"(?:^|.*\.)layers\.(\d+)\.(.+)$")
_ATTN_RE = re.compile(r"self_attn\.(q_proj|k_proj|v_proj|o_proj)$")
_DENSE_MLP_RE = re.compile(r"mlp\.(gate_proj|up_proj|down_proj)$")
_SHARED_EXPERT_RE = re.compile(r"mlp\.shared_expert\.(gate_proj|up_proj|down_proj)$")
_ROUTER_RE = re.compile(rf"{_MOE}\.gate$")
_WRAPPED_EXPERTS_RE = re.compile(rf"({_MOE}\.experts)$")
_PER_EXPERT_RE = re.compile(rf"({_MOE}\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)$")
_STACKED_RE = re.compile(rf"({_MOE}\.experts)\.(gate_up_proj|down_proj|gate_proj|up_proj|w1|w3|w2)$")
_PROJ = {"gate_up_proj": "gate_up", "gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
         "down_proj": "down", "w2": "down"}


class LoRAAdapterError(ValueError):
    """The adapter cannot be served; the message names the adapter, the file or key, and the problem."""


@dataclass
class ExpertLoRA:
    """Routed-expert LoRA of one sparse layer; None where not targeted; scaling folded into B."""
    gate_up_a: Tensor | None  # [E, r_gu, H]
    gate_up_b: Tensor | None  # [E, 2I, r_gu]
    down_a: Tensor | None  # [E, r_d, I]
    down_b: Tensor | None  # [E, H, r_d]


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int  # max rank over all its tensors (gate and up stacked count as one rank r_g + r_u)
    dense: dict[tuple[int, str], tuple[Tensor, Tensor]]  # (layer, target) -> (A [r, in], B [out, r])
    experts: dict[int, ExpertLoRA]  # layer -> routed-expert LoRA
    target_modules: frozenset[str]  # e.g. {"q_proj", "v_proj", "experts"}


def load_lora_adapter(name: str, path, spec: ModelSpec, max_rank: int) -> LoRAAdapter:
    """Parse the PEFT adapter folder `path` for the base model `spec`; raise LoRAAdapterError if unservable."""
    ctx = _Ctx(name, Path(path))
    cfg = _read_config(ctx)
    scaling = _Scaling(ctx, cfg)
    tensors = _read_weights(ctx)
    pairs = _pair_lora_tensors(ctx, tensors)

    dense: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}
    projs: dict[int, dict[str, _ExpertProj]] = {}  # layer -> "gate_up"/"gate"/"up"/"down" -> factors
    for module, (key_a, a, key_b, b) in pairs.items():
        site = _classify(ctx, spec, module, key_a)
        if site.kind == "dense":
            r = scaling.rank(site.peft_key)
            _check_dense(ctx, spec, site, key_a, a, key_b, b, r)
            if (site.layer, site.target) in dense:
                raise ctx.error(f"{WEIGHTS_FILE}[{key_a}]", f"a second LoRA for layer {site.layer} {site.target}")
            dense[(site.layer, site.target)] = (a, b * scaling.scale(site.peft_key, r))
        else:
            layer_projs = projs.setdefault(site.layer, {})
            _add_expert_factors(ctx, spec, scaling, site, key_a, a, key_b, b, layer_projs)

    experts = {layer: _assemble_experts(ctx, spec, layer, p) for layer, p in sorted(projs.items())}
    if not dense and not experts:
        raise ctx.error(WEIGHTS_FILE, "no LoRA tensors found (empty adapter)")

    dense = {k: (_finish(a), _finish(b)) for k, (a, b) in sorted(dense.items())}
    rank, where = _max_rank(dense, experts)
    if rank > max_rank:
        note = " (separate gate and up LoRAs are stacked into one, so their ranks add)" if "gate_up" in where else ""
        raise ctx.error(f"{WEIGHTS_FILE} ({where})",
                        f"LoRA rank {rank} exceeds the engine's max_rank {max_rank}{note}")
    targets = {t for (_, t) in dense} | ({"experts"} if experts else set())
    return LoRAAdapter(name=name, path=str(path), rank=rank, dense=dense, experts=experts,
                       target_modules=frozenset(targets))


# ---------------------------------------------------------------------------------------------- reading


class _Ctx:
    def __init__(self, name: str, path: Path):
        self.name, self.path = name, path

    def error(self, where: str, problem: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"LoRA adapter {self.name!r} ({self.path}): {where}: {problem}")


def _read_config(ctx: _Ctx) -> dict:
    if not ctx.path.is_dir():
        raise ctx.error(str(ctx.path), "not a directory (expected a PEFT adapter folder)")
    cfg_path = ctx.path / CONFIG_FILE
    if not cfg_path.is_file():
        raise ctx.error(CONFIG_FILE, "missing (a PEFT adapter folder holds adapter_config.json)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ctx.error(CONFIG_FILE, f"invalid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise ctx.error(CONFIG_FILE, f"expected a JSON object, got {type(cfg).__name__}")

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


def _read_weights(ctx: _Ctx) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    w_path = ctx.path / WEIGHTS_FILE
    if not w_path.is_file():
        if (ctx.path / "adapter_model.bin").is_file():
            raise ctx.error("adapter_model.bin", "pickle weights are not loaded; safetensors needed "
                            "(re-save with save_pretrained(safe_serialization=True))")
        raise ctx.error(WEIGHTS_FILE, "missing")
    try:
        tensors = load_file(str(w_path), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ctx.error(WEIGHTS_FILE, f"corrupt or truncated safetensors file ({e})") from e
    for key, t in tensors.items():
        if not t.is_floating_point():
            raise ctx.error(f"{WEIGHTS_FILE}[{key}]", f"dtype {t.dtype} is not a floating-point type")
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
    """Per-module rank and scale, resolving rank_pattern / alpha_pattern the way PEFT does: the first
    pattern key (in file order) that matches the module key as a full dotted suffix or as a regex wins."""

    def __init__(self, ctx: _Ctx, cfg: dict):
        self.ctx = ctx
        self.r = cfg.get("r", 8)
        self.alpha = cfg.get("lora_alpha", 8)
        self.rslora = bool(cfg.get("use_rslora", False))
        self.rank_pattern = self._patterns(cfg, "rank_pattern")
        self.alpha_pattern = self._patterns(cfg, "alpha_pattern")
        ranks = [("r", self.r)] + [(f"rank_pattern[{p.pattern}]", v) for p, v in self.rank_pattern]
        for what, v in ranks:
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ctx.error(CONFIG_FILE, f"{what}={v!r} is not a positive integer")
        alphas = [("lora_alpha", self.alpha)] + [(f"alpha_pattern[{p.pattern}]", v) for p, v in self.alpha_pattern]
        for what, v in alphas:
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise ctx.error(CONFIG_FILE, f"{what}={v!r} is not a number")

    def _patterns(self, cfg: dict, field: str) -> list[tuple[re.Pattern, object]]:
        raw = cfg.get(field) or {}
        if not isinstance(raw, dict):
            raise self.ctx.error(CONFIG_FILE, f"{field} must be a mapping, got {type(raw).__name__}")
        out = []
        for pat, v in raw.items():
            try:
                out.append((re.compile(rf"(.*\.)?({pat})$"), v))
            except re.error as e:
                raise self.ctx.error(CONFIG_FILE, f"{field} key {pat!r} is not a valid pattern ({e})") from e
        return out

    @staticmethod
    def _lookup(patterns, key: str, default):
        for regex, value in patterns:
            if regex.match(key):
                return value
        return default

    def rank(self, peft_key: str) -> int:
        return self._lookup(self.rank_pattern, peft_key, self.r)

    def scale(self, peft_key: str, r: int) -> float:
        alpha = self._lookup(self.alpha_pattern, peft_key, self.alpha)
        return alpha / math.sqrt(r) if self.rslora else alpha / r


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
        raise ctx.error(where, f"LoRA on the MoE router ({sub}) is not supported")
    if sub == "mlp.shared_expert_gate":
        raise ctx.error(where, "LoRA on the shared-expert gate (mlp.shared_expert_gate) is not supported")

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


def _dense_dims(spec: ModelSpec, target: str) -> tuple[int, int]:
    """(in_features, out_features) of a dense target's base weight."""
    H = spec.hidden_size
    if target.startswith("shared_expert."):
        inner = spec.shared_expert_intermediate_size
    else:
        inner = spec.intermediate_size
    return {
        "q_proj": (H, spec.q_size), "k_proj": (H, spec.kv_size), "v_proj": (H, spec.kv_size),
        "o_proj": (spec.q_size, H),
        "gate_proj": (H, inner), "up_proj": (H, inner), "down_proj": (inner, H),
    }[target.rsplit(".", 1)[-1]]


def _expert_dims(spec: ModelSpec, proj: str) -> tuple[int, int]:
    H, I = spec.hidden_size, spec.moe_intermediate_size
    return {"gate_up": (H, 2 * I), "gate": (H, I), "up": (H, I), "down": (I, H)}[proj]


def _shape_error(ctx: _Ctx, key: str, got, expected: str) -> LoRAAdapterError:
    return ctx.error(f"{WEIGHTS_FILE}[{key}]",
                     f"shape {tuple(got)} does not match the base model (expected {expected})")


def _check_rank(ctx: _Ctx, key: str, r_tensor: int, r_cfg: int, peft_key: str) -> None:
    if r_tensor != r_cfg:
        raise ctx.error(f"{WEIGHTS_FILE}[{key}]", f"tensor rank {r_tensor} disagrees with {CONFIG_FILE}, "
                        f"which gives r={r_cfg} for {peft_key} (r / rank_pattern)")


def _check_dense(ctx, spec, site: _Site, key_a, a: Tensor, key_b, b: Tensor, r_cfg: int) -> None:
    fan_in, fan_out = _dense_dims(spec, site.target)
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
        fan_in, fan_out = _expert_dims(spec, site.proj)
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
        proj.per_expert[site.expert] = (a, b * scaling.scale(site.peft_key, r))
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
    # a shared factor (expert dim 1) is broadcast to every expert
    layer_projs[proj_name] = _ExpertProj(key_a, a=a3.expand(E, -1, -1),
                                         b=b3.expand(E, -1, -1) * scaling.scale(peft_key, r))


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
    fan_in, fan_out = _expert_dims(spec, proj)
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
    fan_in, fan_out = _expert_dims(spec, proj)
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
    gate_up_a = gate_up_b = down_a = down_b = None
    if "gate_up" in projs:
        for half in ("gate", "up"):
            if half in projs:
                raise ctx.error(f"{WEIGHTS_FILE}[{projs[half].key}]", f"layer {layer} experts have both a fused "
                                f"gate_up LoRA ({projs['gate_up'].key}) and a separate {half} LoRA")
        gate_up_a, gate_up_b = _expert_stack(projs["gate_up"], E, H, 2 * I)
    elif "gate" in projs or "up" in projs:
        # gate and up as one LoRA of rank r_g + r_u: A stacked, B block-diagonal
        empty = (torch.zeros(E, 0, H), torch.zeros(E, I, 0))
        ga, gb = _expert_stack(projs["gate"], E, H, I) if "gate" in projs else empty
        ua, ub = _expert_stack(projs["up"], E, H, I) if "up" in projs else empty
        rg, ru = ga.shape[1], ua.shape[1]
        gate_up_a = torch.cat([ga, ua], dim=1)
        gate_up_b = torch.zeros(E, 2 * I, rg + ru)
        gate_up_b[:, :I, :rg] = gb
        gate_up_b[:, I:, rg:] = ub
    if "down" in projs:
        down_a, down_b = _expert_stack(projs["down"], E, I, H)
    return ExpertLoRA(*(None if t is None else _finish(t) for t in (gate_up_a, gate_up_b, down_a, down_b)))


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
