"""Tiny random MoE checkpoints of every supported family, for tests and for users.

Dimensions are chosen so that hidden (H), expert intermediate (I) and 2·I are all distinct:
adapter tensors are mapped to expert parameters by shape, which needs them distinct.
"""
from __future__ import annotations

import pathlib

from moeserve import module_tree

TINY_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")

# H=64, I=48, 2I=96, dense MLP 80: all distinct.
_COMMON = dict(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    vocab_size=512,
    num_experts_per_tok=2,
)


def tiny_hf_config(family: str, **overrides):
    """A transformers config object for a tiny model of `family` (random weights are up to the caller)."""
    import transformers as tf

    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(TINY_FAMILIES)}")
    kw = dict(_COMMON)
    if family == "qwen3_moe":
        cls = tf.Qwen3MoeConfig
        # layer 1 dense via mlp_only_layers: exercises the dense-MLP path
        kw.update(num_experts=8, moe_intermediate_size=48, intermediate_size=80, norm_topk_prob=True,
                  mlp_only_layers=[1], rope_theta=10000.0)
    elif family == "qwen2_moe":
        cls = tf.Qwen2MoeConfig
        kw.update(num_experts=8, moe_intermediate_size=48, intermediate_size=80,
                  shared_expert_intermediate_size=56, norm_topk_prob=False, decoder_sparse_step=1,
                  mlp_only_layers=[2], qkv_bias=True, rope_theta=10000.0)
    elif family == "mixtral":
        cls = tf.MixtralConfig
        kw.update(num_local_experts=4, intermediate_size=48, rope_theta=10000.0, sliding_window=None)
    else:
        cls = tf.OlmoeConfig
        kw.update(num_experts=8, intermediate_size=48, norm_topk_prob=False, clip_qkv=None, rope_theta=10000.0)
        kw.pop("head_dim")
    kw.update(overrides)
    cfg = cls(**kw)
    return cfg


# ---------------------------------------------------------------------------------------------
# Tiny random checkpoints on disk
# ---------------------------------------------------------------------------------------------

EXPERT_LAYOUTS = ("per_expert", "fused")
_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def make_tiny(family: str, out_dir, *, expert_layout: str = "per_expert", seed: int = 0,
              shard_size: str | int | None = None, dtype: str = "float32", force: bool = False,
              quantization: str | None = None, **config_overrides) -> pathlib.Path:
    """Write a tiny random HF checkpoint of `family` into `out_dir` and return its path.

    The folder holds config.json, generation_config.json, safetensors weights (one file, or shards
    plus model.safetensors.index.json when `shard_size` is given, e.g. "200KB") and a trained
    byte-level BPE tokenizer with a ChatML template. `expert_layout` picks how routed experts are
    stored: "per_expert" (the HF on-disk original, one tensor per expert and projection) or
    "fused" (transformers 5.x in-memory names: experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I]). The same seed gives the same weights in either layout.

    `out_dir` may be missing or a folder without model files; an existing file or model there is
    refused (FileExistsError) unless `force`, which replaces it.

    `quantization="fp8"`: a block-wise FP8 checkpoint in the published layout (fp8_state): the weights above, in
    `dtype`, then quantized.
    """
    import torch
    import transformers as tf

    from moeserve.models.tokenizer_tiny import save_tiny_tokenizer

    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(TINY_FAMILIES)}")
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"unknown expert_layout {expert_layout!r}; choose from {', '.join(EXPERT_LAYOUTS)}")
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from float32, bfloat16, float16")
    dtype = _DTYPES[dtype]
    if quantization not in (None, "fp8"):
        raise ValueError(f"unknown quantization {quantization!r}; choose fp8 (or none)")
    shard_bytes = None if shard_size is None else _parse_size(shard_size)
    out = pathlib.Path(out_dir)
    _clear_out_dir(out, force)
    out.mkdir(parents=True, exist_ok=True)

    vocab_size = config_overrides.get("vocab_size", _COMMON["vocab_size"])
    max_len = config_overrides.get("max_position_embeddings", _COMMON["max_position_embeddings"])
    ids = save_tiny_tokenizer(out, vocab_size, model_max_length=max_len)
    special = dict(bos_token_id=ids["endoftext"], pad_token_id=ids["endoftext"],
                   eos_token_id=[ids["endoftext"], ids["im_end"]])
    cfg = tiny_hf_config(family, **{**special, **config_overrides})

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state = _redraw_weights(model, seed)
    if expert_layout == "per_expert":
        state = _to_per_expert(state, family, cfg)
    else:
        state = _to_fused_names(state)
    state = {k: v.to(getattr(torch, dtype)).contiguous() for k, v in state.items()}
    if quantization == "fp8":
        state = fp8_state(state)
    _save_safetensors(state, out, shard_bytes)

    cfg.architectures = [type(model).__name__]
    cfg.dtype = dtype
    if quantization == "fp8":
        cfg.quantization_config = dict(FP8_QUANTIZATION_CONFIG)
    cfg.save_pretrained(out)
    tf.GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                        pad_token_id=cfg.pad_token_id).save_pretrained(out)
    return out


# what make_tiny writes (and an earlier sharded write may have left): files a rewrite would overwrite
_MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "model*.safetensors", "model.safetensors.index.json")


def _clear_out_dir(out: pathlib.Path, force: bool) -> None:
    """Refuse to write over a file or a model folder unless `force`; with it, remove what is in the way
    (old shards would otherwise sit beside the new weights and be loaded with them)."""
    if out.exists() and not out.is_dir():
        if not force:
            raise FileExistsError(f"{out} exists and is not a folder (pass --force / force=True to replace it)")
        out.unlink()
        return
    existing = sorted({p for pattern in _MODEL_FILES for p in out.glob(pattern)}) if out.is_dir() else []
    if existing and not force:
        raise FileExistsError(f"{out} already holds a model ({', '.join(p.name for p in existing[:3])}"
                              f"{', ...' if len(existing) > 3 else ''}); pass --force / force=True to overwrite it")
    for p in existing:
        p.unlink()


def _redraw_weights(model, seed: int) -> dict:
    """Draw every parameter of `model` afresh from a seeded generator in name order, independent of
    how the installed transformers initializes: N(0, 0.02) for matrices and biases, 1 + N(0, 0.1) for norm
    weights (so q/k norms are not identities), N(0, 0.1) for routers (so routing spreads)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in sorted(model.named_parameters()):
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            w = 1.0 + 0.1 * noise
        elif name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight")):
            w = 0.1 * noise
        else:
            w = 0.02 * noise
        state[name] = w
    return state


FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": [128, 128]}


def fp8_quantized(name: str) -> bool:
    """Whether a block-wise FP8 checkpoint stores tensor `name` in FP8: the attention projections, dense and
    shared-expert MLPs and the routed experts (per-expert and fused); not the embeddings, lm_head, norms, router
    or shared-expert gate."""
    if _fused_expert_tensor(name) is not None:
        return True
    leaf = name.rsplit(".", 2)
    return name.endswith(".weight") and (leaf[-2].endswith("_proj") or leaf[-2] in ("w1", "w2", "w3"))


def fp8_state(state: dict) -> dict:
    """A state dict in the published block-wise FP8 layout: each quantized weight float8_e4m3fn with its float32
    `<name>_scale_inv` per 128 x 128 block (a fused gate_up [E, 2I, H] blocked as gate and up apart, its scale rows
    gate's then up's, as the loader reads them)."""
    import torch

    from moeserve.kernels.fp8 import quantize_block_fp8

    out = {}
    for name, w in state.items():
        if not fp8_quantized(name):
            out[name] = w
            continue
        hit = _fused_expert_tensor(name)
        if hit is not None and hit[1] == "gate_up_proj":
            inter = w.shape[1] // 2
            (qg, sg), (qu, su) = quantize_block_fp8(w[:, :inter]), quantize_block_fp8(w[:, inter:])
            q, s = torch.cat([qg, qu], 1), torch.cat([sg, su], 1)
        else:
            q, s = quantize_block_fp8(w)
        out[name], out[name + "_scale_inv"] = q.contiguous(), s.contiguous()
    return out


def _fused_expert_tensor(name: str) -> tuple[str, str] | None:
    """'model.layers.3.mlp.experts.gate_up_proj' -> ('model.layers.3', 'gate_up_proj')."""
    for block in (".mlp.experts.", ".block_sparse_moe.experts."):
        if block in name:
            prefix, rest = name.split(block)
            if rest in ("gate_up_proj", "down_proj"):
                return prefix, rest
    return None


def _to_fused_names(state: dict) -> dict:
    # Mixtral's in-memory block is `mlp` in transformers 5.x; keep one spelling on disk for all families.
    return {k.replace(".block_sparse_moe.", ".mlp."): v for k, v in state.items()}


def _to_per_expert(state: dict, family: str, cfg) -> dict:
    """Split fused expert tensors into the HF on-disk per-expert layout (gate_up rows [:I] are gate)."""
    mixtral = family == "mixtral"  # on disk: block_sparse_moe, experts w1/w3/w2 (module_tree.per_expert_names)
    block = "block_sparse_moe" if mixtral else "mlp"
    out = {}
    for name, w in state.items():
        hit = _fused_expert_tensor(name)
        if hit is None:
            if mixtral:  # router and any other MoE-block tensor live under block_sparse_moe on disk
                name = name.replace(".mlp.", f".{block}.")
            out[name] = w
            continue
        prefix, which = hit
        layer = int(prefix.rsplit(".", 1)[1])
        for e in range(w.shape[0]):
            gate, up, down = module_tree.per_expert_names(layer, e, block, mixtral)
            if which == "gate_up_proj":
                inter = w.shape[1] // 2
                out[gate] = w[e, :inter]
                out[up] = w[e, inter:]
            else:
                out[down] = w[e]
    return out


def _parse_size(size: str | int) -> int:
    """Bytes from an int or a string like "200KB" (decimal units, as HF uses) or "1GiB"."""
    import re

    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", str(size).upper())
    if m is None:
        raise ValueError(f"cannot parse shard size {size!r} (examples: 200KB, 5MB, 1GiB, 123456)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2) or ""])


def _save_safetensors(state: dict, out: pathlib.Path, shard_bytes: int | None) -> None:
    """One model.safetensors, or shards of at most `shard_bytes` bytes (a larger tensor gets its own
    shard) named model-0000i-of-0000n.safetensors, with the HF index file."""
    import json

    from safetensors.torch import save_file

    meta = {"format": "pt"}
    if shard_bytes is None:
        save_file(state, str(out / "model.safetensors"), metadata=meta)
        return
    limit = shard_bytes
    shards, current, current_bytes = [], {}, 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if current and current_bytes + nbytes > limit:
            shards.append(current)
            current, current_bytes = {}, 0
        current[name] = t
        current_bytes += nbytes
    shards.append(current)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata=meta)
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
