"""Build LoRA adapters with PEFT on tiny transformers MoE models, plus a corpus of malformed adapters.

Every adapter comes with the PeftModel that applies exactly its ΔW, the oracle for parser, layer and
engine tests. Adapters in forms PEFT cannot load on transformers 5.x (per-expert keys, stacked 3-D
keys, shared-outer) are written from the factors of a PEFT `target_parameters` adapter, so that same
PeftModel is their oracle too.

Base models are deterministic in (family, seed, config overrides): `tiny_base_model` re-draws every
weight from a seeded generator, so a test can rebuild the exact base that an adapter's oracle wraps.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moeserve.model_spec import ModelSpec
from moeserve.models.tiny import tiny_hf_config

WEIGHT_STD = 0.02  # base weights ~ N(0, 0.02)
LORA_STD = 0.05  # LoRA factors ~ N(0, 0.05): ΔW comparable to W, so a wrong ΔW changes logits visibly
ATTN_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ROUTER_PARAMS = ["mlp.gate.weight"]  # the MoE router's weight (transformers 5 routers are not nn.Linear)
KINDS = ("attn", "experts", "attn+experts", "dense-mlp", "shared-expert", "all-linear", "router", "all-linear+router")
EXPERT_FORMATS = ("target_parameters", "per-expert", "stacked")
GATE_UP_PATTERN = r"experts\.gate_up_proj"  # PEFT pattern key of the routed experts' fused gate_up parameter
MALFORMED_MAX_RANK = 16  # the max_rank make_malformed_adapters' expectations assume
_PREFIX = "base_model.model."


def tiny_spec(family: str, **config_overrides) -> ModelSpec:
    return ModelSpec.from_hf_config(tiny_hf_config(family, **config_overrides).to_dict())


def tiny_base_model(family: str, seed: int = 0, **config_overrides):
    """fp32 transformers model of the tiny `family` config, eval mode, weights drawn from `seed`:
    norms 1, everything else N(0, WEIGHT_STD), in named_parameters order (independent of transformers' init)."""
    import transformers as tf

    # eager experts and attention: the plain reference paths, and far faster on CPU than grouped_mm / sdpa here
    model = tf.AutoModelForCausalLM.from_config(tiny_hf_config(family, **config_overrides), dtype=torch.float32,
                                                attn_implementation="eager", experts_implementation="eager")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * WEIGHT_STD)
    return model.eval()


# Config overrides of a Qwen-family tiny model for the tests that run the Triton kernels in Triton's interpreter, where
# each layer costs seconds: two layers, a sparse one then a dense one. The tiny models' third layer is one more sparse
# layer (the same kernels on that layer's own buffers), not another path.
INTERPRETED_LAYERS = dict(num_hidden_layers=2, mlp_only_layers=[1])


def save_base_checkpoint(family: str, out_dir, seed: int = 0, **config_overrides) -> Path:
    """Write `tiny_base_model(family, seed)` as an HF checkpoint folder (config.json + safetensors)."""
    out_dir = Path(out_dir)
    tiny_base_model(family, seed, **config_overrides).save_pretrained(out_dir)
    return out_dir


def make_peft_adapter(family: str, out_dir, *, kind: str = "attn+experts", rank: int = 4, alpha: float = 8,
                      seed: int = 0, base_seed: int = 0, expert_format: str = "target_parameters",
                      shared_outer: bool = False, drop_experts=(), mixtral_prefix: str = "block_sparse_moe",
                      config_overrides: dict | None = None, router_b_scale: float = 1.0,
                      separate_gate_up: bool = False, **lora_kw):
    """Build a LoRA adapter with PEFT on `tiny_base_model(family, base_seed)`, re-draw every LoRA factor
    from `seed` (PEFT inits B to zero), save it to `out_dir`, and return (path, peft_model).

    kind: which modules carry LoRA (see KINDS). "all-linear" is PEFT's own choice: on transformers 5 it adds the
    router (`mlp.gate.weight`) and the routed experts for Mixtral, Qwen3-MoE and OLMoE, but neither for Qwen2-MoE
    (whose shared-expert gate it does adapt); "all-linear+router" adds the router for every family; "router" adapts
    the router alone. router_b_scale multiplies the router's lora_B after the re-draw (a larger router ΔW changes
    which experts tokens pick). lora_kw go to peft.LoraConfig (rank_pattern, alpha_pattern,
    use_rslora, target_modules, target_parameters, ...).
    Routed-expert LoRA is written in `expert_format`:
      "target_parameters": PEFT's own file (nested ParamWrapper keys on mlp.experts);
      "per-expert": `mlp.experts.N.{gate_proj,up_proj,down_proj}` keys (Mixtral: `<mixtral_prefix>.experts.N.
      {w1,w3,w2}`), as written by PEFT on transformers 4.x; experts in `drop_experts` are left out (and zeroed
      in the returned PeftModel, so it stays the oracle);
      "stacked": `mlp.experts.{gate_up_proj,down_proj}.lora_{A,B}.weight` with A [E, r, in], B [E, out, r].
    shared_outer: gate_up's A and down's B are one matrix for all experts; the file stores them once
    (expert dim 1), the PeftModel holds them repeated.
    separate_gate_up (per-expert only, not with rsLoRA): gate_proj and up_proj get their own A's of rank `rank`
    (otherwise both files carry gate_up's one A). The PeftModel holds the pair as one gate_up LoRA of rank
    2·rank and alpha 2·alpha (the same scaling) whose B is block-diagonal: gate rows use A's first `rank` rows,
    up rows the rest.

    Use the returned PeftModel as the oracle. `PeftModel.from_pretrained` on the folder reproduces it for the
    target_parameters form, but on transformers 5 it rewrites dense-MLP and shared-expert targets into expert
    LoRA, and it cannot read the stacked or shared-outer forms.
    """
    import peft

    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; choose from {KINDS}")
    if expert_format not in EXPERT_FORMATS:
        raise ValueError(f"unknown expert_format {expert_format!r}; choose from {EXPERT_FORMATS}")
    if drop_experts and expert_format != "per-expert":
        raise ValueError("drop_experts needs expert_format='per-expert'")
    if separate_gate_up:
        if expert_format != "per-expert" or lora_kw.get("use_rslora"):
            raise ValueError("separate_gate_up needs expert_format='per-expert' and no rsLoRA")
        lora_kw["rank_pattern"] = {**(lora_kw.get("rank_pattern") or {}), GATE_UP_PATTERN: 2 * rank}
        lora_kw["alpha_pattern"] = {**(lora_kw.get("alpha_pattern") or {}), GATE_UP_PATTERN: 2 * alpha}
    out_dir = Path(out_dir)
    config_overrides = config_overrides or {}
    model = tiny_base_model(family, base_seed, **config_overrides)
    targets = {
        "attn": (ATTN_TARGETS, None),
        "experts": ([], EXPERT_PARAMS),
        "attn+experts": (ATTN_TARGETS, EXPERT_PARAMS),
        "dense-mlp": (r".*\.layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj)", None),
        "shared-expert": (["shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"], None),
        "all-linear": ("all-linear", None),
        "router": ([], ROUTER_PARAMS),
        "all-linear+router": ("all-linear", ROUTER_PARAMS),
    }[kind]
    lora_kw.setdefault("target_modules", targets[0])
    lora_kw.setdefault("target_parameters", targets[1])
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, **lora_kw)
    keep_targets = _keep_mlp_targets() if kind in ("dense-mlp", "shared-expert") else contextlib.nullcontext()
    with keep_targets:
        pm = peft.get_peft_model(model, config)

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * LORA_STD)
                if ".mlp.gate.lora_B." in name:
                    p.mul_(router_b_scale)
        wrappers = _expert_wrappers(pm)
        if shared_outer:
            for w in wrappers:
                r, E = w.r["default"], w.num_experts
                if w.parameter_name == "gate_up_proj":  # A [E*r, H], expert-major: repeat expert 0's block
                    a = w.lora_A["default"].weight.view(E, r, -1)
                    a.copy_(a[:1].expand_as(a).clone())
                else:  # down_proj: B [H, r*E], expert-minor: repeat expert 0's columns
                    b = w.lora_B["default"].weight.view(-1, r, E)
                    b.copy_(b[:, :, :1].expand_as(b).clone())
        if separate_gate_up:  # block-diagonal gate_up B: [2I, 2r*E] expert-minor -> [2I, 2r, E]
            for w in wrappers:
                if w.parameter_name == "gate_up_proj":
                    assert w.r["default"] == 2 * rank, "the gate_up rank_pattern did not apply"
                    b = w.lora_B["default"].weight.view(-1, 2 * rank, w.num_experts)
                    inter = b.shape[0] // 2
                    b[:inter, rank:] = 0
                    b[inter:, :rank] = 0
        for w in wrappers:
            for e in drop_experts:
                w.lora_B["default"].weight.view(w.lora_B["default"].weight.shape[0], -1, w.num_experts)[:, :, e] = 0
    pm.eval()
    pm.save_pretrained(out_dir)

    if wrappers and (expert_format != "target_parameters" or shared_outer):
        _rewrite_expert_keys(pm, out_dir, family, expert_format, shared_outer, set(drop_experts), mixtral_prefix,
                             separate_gate_up)
    return out_dir, pm


@contextlib.contextmanager
def _keep_mlp_targets():
    """On transformers 5, PEFT (0.21) rewrites gate_proj/up_proj/down_proj targets into routed-expert
    target_parameters, taking them for transformers-4 per-expert modules; that would drop the LoRA meant for
    dense MLP layers and the shared expert. Keep the targets as given while the adapter is built."""
    try:
        import peft.utils.transformers_weight_conversion as conversion
    except ImportError:  # older PEFT: no rewriting
        yield
        return
    saved = conversion.convert_peft_config_for_transformers
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = saved


def _expert_wrappers(pm) -> list:
    """PEFT ParamWrappers (all nesting levels) on routed-expert parameters."""
    from peft.tuners.lora.layer import ParamWrapper

    return [m for m in pm.modules() if isinstance(m, ParamWrapper) and m.parameter_name != "weight"]  # not routers


def _module_path(pm, module) -> str:
    for name, m in pm.named_modules():
        if m is module:
            return name
    raise KeyError(module)


def _rewrite_expert_keys(pm, out_dir: Path, family, expert_format, shared_outer, drop, mixtral_prefix,
                         separate_gate_up=False) -> None:
    """Replace PEFT's ParamWrapper keys by `expert_format` keys carrying the same ΔW (factors from PEFT's
    own get_delta_factors, so the file does not rely on our reading of its layout)."""
    weights_path = out_dir / "adapter_model.safetensors"
    tensors = load_file(str(weights_path))
    cfg = json.loads((out_dir / "adapter_config.json").read_text())
    rank_pattern, alpha_pattern = dict(cfg.get("rank_pattern") or {}), dict(cfg.get("alpha_pattern") or {})
    if separate_gate_up:  # the per-expert files say gate's and up's own rank and alpha
        rank_pattern.pop(GATE_UP_PATTERN)
        alpha_pattern.pop(GATE_UP_PATTERN)
    new_rank_pattern, new_alpha_pattern = {}, {}
    new_targets = set()
    for w in _expert_wrappers(pm):
        path = _module_path(pm, w)  # base_model.model.model.layers.L.mlp.experts(.base_layer)*
        for suffix in ("lora_A.weight", "lora_B.weight"):
            del tensors[f"{path}.{suffix}"]
        experts_path = path.replace(".base_layer", "")
        B, A, _ = w.get_delta_factors("default")  # B [E, out, r], A [E, r, in]; ΔW_e = s · B_e A_e
        B, A = B.detach().clone(), A.detach().clone()
        r, alpha, E = w.r["default"], w.lora_alpha["default"], w.num_experts
        gate_up = w.parameter_name == "gate_up_proj"

        if expert_format == "per-expert":
            I = B.shape[1] // 2 if gate_up else A.shape[2]
            names, base = _PER_EXPERT_NAMES["default"], experts_path
            if family == "mixtral":  # transformers 4.x Mixtral: block_sparse_moe.experts.N.{w1,w3,w2}
                names, base = _PER_EXPERT_NAMES["mixtral"], experts_path.replace("mlp.", f"{mixtral_prefix}.")
            ranks = slice(None)
            if gate_up and separate_gate_up:  # B block-diagonal: each half of the rank is one projection's
                r, alpha = r // 2, alpha / 2
                projs = [(names["gate"], slice(0, I), slice(0, r)), (names["up"], slice(I, 2 * I), slice(r, 2 * r))]
            elif gate_up:
                projs = [(names["gate"], slice(0, I), ranks), (names["up"], slice(I, 2 * I), ranks)]
            else:
                projs = [(names["down"], slice(None), ranks)]
            for e in range(E):
                if e in drop:
                    continue
                for proj, rows, cols in projs:
                    tensors[f"{base}.{e}.{proj}.lora_A.weight"] = A[e, cols].clone()
                    tensors[f"{base}.{e}.{proj}.lora_B.weight"] = B[e, rows][:, cols].clone()
            # PEFT resolved its patterns for `…experts.gate_up_proj`; where that changed r or alpha, say it per expert
            layer = int(experts_path.split(".layers.")[1].split(".")[0])
            for proj, _, _ in projs:
                pattern = rf"model\.layers\.{layer}\.(mlp|block_sparse_moe)\.experts\.\d+\.{proj}"
                if r != cfg["r"]:
                    new_rank_pattern[pattern] = r
                if alpha != cfg["lora_alpha"]:
                    new_alpha_pattern[pattern] = alpha
                new_targets.add(proj)
        else:
            param_key = f"{experts_path}.{w.parameter_name}"
            if expert_format == "stacked":
                if shared_outer:
                    A, B = (A[:1], B) if gate_up else (A, B[:1])
                tensors[f"{param_key}.lora_A.weight"] = A.contiguous()
                tensors[f"{param_key}.lora_B.weight"] = B.contiguous()
            else:  # target_parameters layout, shared factor stored once
                a_flat = (A[:1] if gate_up else A).reshape(-1, A.shape[2])  # [Ea*r, in], expert-major
                b_src = B if gate_up else B[:1]
                b_flat = b_src.permute(1, 2, 0).reshape(B.shape[1], -1)  # [out, r*Eb], expert-minor
                tensors[f"{path}.lora_A.weight"] = a_flat.contiguous()
                tensors[f"{path}.lora_B.weight"] = b_flat.contiguous()
    save_file(tensors, str(weights_path))
    if expert_format == "per-expert":
        cfg["rank_pattern"] = {**new_rank_pattern, **rank_pattern}
        cfg["alpha_pattern"] = {**new_alpha_pattern, **alpha_pattern}
        cfg["target_parameters"] = None
        tm = cfg.get("target_modules") or []
        cfg["target_modules"] = sorted(set(tm if isinstance(tm, list) else [tm]) | new_targets)
    (out_dir / "adapter_config.json").write_text(json.dumps(cfg, indent=2))


_PER_EXPERT_NAMES = {
    "default": {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
    "mixtral": {"gate": "w1", "up": "w3", "down": "w2"},
}


def reference_deltas(peft_model, base_model) -> dict[str, torch.Tensor]:
    """ΔW that PEFT applies, by transformers parameter name: merged weights minus base weights."""
    import copy

    merged = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    base = base_model.state_dict()
    return {k: merged[k] - base[k] for k in base if not torch.equal(merged[k], base[k])}


# ------------------------------------------------------------------------------------------ malformed corpus


def make_malformed_adapters(base_adapter_dir, out_root) -> dict[str, tuple[Path, str]]:
    """Copies of a valid attention+experts adapter (target_parameters form, r < MALFORMED_MAX_RANK), each
    broken in one way. Returns case -> (path, a substring the LoRAAdapterError message must contain) when
    loaded with max_rank=MALFORMED_MAX_RANK."""
    base, out_root = Path(base_adapter_dir), Path(out_root)
    cfg0 = json.loads((base / "adapter_config.json").read_text())
    t0 = load_file(str(base / "adapter_model.safetensors"))
    r = cfg0["r"]
    q_a = _find_key(t0, "layers.0.self_attn.q_proj.lora_A.weight")
    q_b = q_a.replace("lora_A", "lora_B")
    v_b = _find_key(t0, "layers.0.self_attn.v_proj.lora_B.weight")
    ex_a = _find_key(t0, "layers.0.mlp.experts.lora_A.weight")
    ex_b = ex_a.replace("lora_A", "lora_B")
    H = t0[q_a].shape[1]
    E = t0[ex_a].shape[0] // r
    cases: dict[str, tuple[Path, str]] = {}

    def case(name: str, expected: str, config=None, tensors=None, edit=None):
        d = out_root / name
        shutil.copytree(base, d)
        if config is not None:
            (d / "adapter_config.json").write_text(json.dumps(config(dict(cfg0))))
        if tensors is not None:
            t = {k: v.clone() for k, v in t0.items()}
            tensors(t)
            save_file(t, str(d / "adapter_model.safetensors"))
        if edit is not None:
            edit(d)
        cases[name] = (d, expected)

    def cfg(**changes):
        return lambda c: {**c, **changes}

    case("missing_config", "adapter_config.json: missing", edit=lambda d: os.remove(d / "adapter_config.json"))
    case("missing_weights", "adapter_model.safetensors: missing",
         edit=lambda d: os.remove(d / "adapter_model.safetensors"))

    def to_bin(d):
        torch.save(load_file(str(d / "adapter_model.safetensors")), d / "adapter_model.bin")
        os.remove(d / "adapter_model.safetensors")
    case("bin_weights", "safetensors needed", edit=to_bin)

    def corrupt_json(d):
        text = (d / "adapter_config.json").read_text()
        (d / "adapter_config.json").write_text(text[: len(text) // 2])
    case("corrupt_json", "adapter_config.json: invalid JSON", edit=corrupt_json)

    def truncate(d):
        data = (d / "adapter_model.safetensors").read_bytes()
        (d / "adapter_model.safetensors").write_bytes(data[: int(len(data) * 0.6)])
    case("truncated_weights", "corrupt or truncated", edit=truncate)
    case("garbage_weights", "corrupt or truncated",
         edit=lambda d: (d / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 8))

    def put(key, index, value):
        def f(t):
            t[key].view(-1)[index] = value
        return f
    case("nan_weight", f"{q_a}]: contains NaN", tensors=put(q_a, 3, float("nan")))
    case("inf_weight", f"{ex_b}]: contains NaN or Inf", tensors=put(ex_b, 5, float("-inf")))

    case("dora", "DoRA", config=cfg(use_dora=True))
    case("lora_bias", "lora_bias", config=cfg(lora_bias=True))
    case("bias_all", "bias='all'", config=cfg(bias="all"))
    case("modules_to_save", "modules_to_save", config=cfg(modules_to_save=["lm_head"]))
    case("peft_type", "peft_type='LOHA'", config=cfg(peft_type="LOHA"))
    case("pissa_init", "init_lora_weights='pissa'", config=cfg(init_lora_weights="pissa"))
    case("config_rank_disagrees", "disagrees with adapter_config.json", config=cfg(r=2 * r))

    big = 2 * MALFORMED_MAX_RANK

    def widen_q(t):
        a, b = t[q_a], t[q_b]
        t[q_a] = torch.cat([a, torch.randn(big - r, a.shape[1]) * 0.01])
        t[q_b] = torch.cat([b, torch.randn(b.shape[0], big - r) * 0.01], dim=1)
    case("rank_too_high", f"rank {big} exceeds the engine's max_lora_rank {MALFORMED_MAX_RANK}",
         tensors=widen_q, config=lambda c: {**c, "rank_pattern": {"model.layers.0.self_attn.q_proj": big}})

    def wrong_shape(t):
        t[q_b] = torch.randn(t[q_b].shape[0] + 1, r)
    case("shape_mismatch", f"{q_b}]: shape ({t0[q_b].shape[0] + 1}, {r}) does not match the base model",
         tensors=wrong_shape)

    def move_layer(t):
        for k in (q_a, q_b):
            t[k.replace("layers.0.", "layers.99.")] = t.pop(k)
    case("layer_out_of_range", "layer index 99 is beyond the model", tensors=move_layer)
    case("lora_A_without_B", "lora_A without a matching lora_B", tensors=lambda t: t.pop(v_b))
    case("empty", "no LoRA tensors", tensors=lambda t: t.clear())

    def add(module, a_shape, b_shape):
        def f(t):
            t[f"{_PREFIX}{module}.lora_A.weight"] = torch.randn(a_shape)
            t[f"{_PREFIX}{module}.lora_B.weight"] = torch.randn(b_shape)
        return f
    case("router_shape", f"mlp.gate.lora_B.weight]: shape ({E + 1}, {r}) does not match the base model",
         tensors=add("model.layers.0.mlp.gate", (r, H), (E + 1, r)))
    case("lm_head", "'lm_head' is not supported", tensors=add("lm_head", (r, H), (64, r)))

    def bad_expert_rows(t):
        t[ex_a] = t[ex_a][:-1].clone()
    case("experts_rows_do_not_fit", "do not fit", tensors=bad_expert_rows)
    case("expert_index_out_of_range", f"expert index {E} is beyond the model",
         tensors=add(f"model.layers.0.mlp.experts.{E}.gate_proj", (r, H), (8, r)))
    return cases


def _find_key(tensors: dict, suffix: str) -> str:
    hits = [k for k in tensors if k.endswith(suffix) and ".base_layer." not in k]
    if len(hits) != 1:
        raise KeyError(f"expected one key ending in {suffix!r}, found {hits}")
    return hits[0]
