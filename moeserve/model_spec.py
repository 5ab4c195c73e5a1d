"""ModelSpec: one normalized description of a MoE decoder, built from an HF config.json.

Every family (qwen3_moe, qwen2_moe, mixtral, olmoe) maps onto the same fields, so the
model, the loader, the LoRA parser and the kernels read one shape vocabulary. Anything
in the config that would change the math and that we do not implement is refused by name.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moeserve.errors import UnsupportedModelError

SUPPORTED_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")


@dataclass(frozen=True)
class ModelSpec:
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    intermediate_size: int  # dense-layer MLP width (layers that are not sparse)
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]  # per layer: routed-expert MLP (True) or dense MLP
    shared_expert_intermediate_size: int = 0  # qwen2_moe; 0 = no shared expert
    qk_norm: str = "none"  # "none" | "head" (qwen3: RMSNorm over head_dim) | "full" (olmoe: over all heads)
    qkv_bias: bool = False
    o_bias: bool = False
    clip_qkv: float | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    router_weights_fp32: bool = False  # mixtral keeps top-k weights in fp32; qwen/olmoe cast to activations
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_model_dir(cls, path: str | Path) -> "ModelSpec":
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{path}: no config.json (expected an HF model folder)")
        try:
            cfg = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise UnsupportedModelError(f"{cfg_path}: invalid JSON ({e})") from e
        return cls.from_hf_config(cfg)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelSpec":
        family = cfg.get("model_type")
        if family not in SUPPORTED_FAMILIES:
            raise UnsupportedModelError(
                f"unknown architecture model_type={family!r} (architectures={cfg.get('architectures')}); "
                f"supported: {', '.join(SUPPORTED_FAMILIES)}"
            )
        _check_rope(cfg)
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act={cfg.get('hidden_act')!r} is not supported (only 'silu')")
        if cfg.get("use_sliding_window") or (family == "mixtral" and cfg.get("sliding_window")):
            raise UnsupportedModelError(
                f"sliding-window attention (sliding_window={cfg.get('sliding_window')}) is not supported"
            )
        H = _req(cfg, "hidden_size")
        n_layers = _req(cfg, "num_hidden_layers")
        n_heads = _req(cfg, "num_attention_heads")
        n_kv = cfg.get("num_key_value_heads") or n_heads
        head_dim = cfg.get("head_dim") or H // n_heads
        if family == "mixtral":
            E, k = _req(cfg, "num_local_experts"), _req(cfg, "num_experts_per_tok")
            inter = moe_inter = _req(cfg, "intermediate_size")
            sparse = tuple(True for _ in range(n_layers))
            norm_topk = True
        else:
            E = cfg.get("num_experts", cfg.get("num_local_experts"))
            if E is None:
                raise UnsupportedModelError(f"config.json is missing num_experts for model_type={family!r}")
            k = _req(cfg, "num_experts_per_tok")
            inter = _req(cfg, "intermediate_size")
            moe_inter = cfg.get("moe_intermediate_size") or inter
            norm_topk = bool(cfg.get("norm_topk_prob", False))
            if family == "olmoe":
                sparse = tuple(True for _ in range(n_layers))
            else:
                step = cfg.get("decoder_sparse_step", 1) or 1
                mlp_only = set(cfg.get("mlp_only_layers") or [])
                sparse = tuple(
                    (i not in mlp_only) and E > 0 and (i + 1) % step == 0 for i in range(n_layers)
                )
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:
            rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            family=family,
            vocab_size=_req(cfg, "vocab_size"),
            hidden_size=H,
            num_layers=n_layers,
            num_heads=n_heads,
            num_kv_heads=n_kv,
            head_dim=head_dim,
            num_experts=E,
            top_k=k,
            moe_intermediate_size=moe_inter,
            intermediate_size=inter,
            norm_topk_prob=norm_topk,
            sparse_layers=sparse,
            shared_expert_intermediate_size=(
                cfg.get("shared_expert_intermediate_size", 0) if family == "qwen2_moe" else 0
            ),
            qk_norm={"qwen3_moe": "head", "olmoe": "full"}.get(family, "none"),
            qkv_bias=bool(cfg.get("qkv_bias", True)) if family == "qwen2_moe"
            else bool(cfg.get("attention_bias", False)),
            o_bias=bool(cfg.get("attention_bias", False)) if family in ("olmoe", "qwen3_moe") else False,
            clip_qkv=cfg.get("clip_qkv") if family == "olmoe" else None,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            router_weights_fp32=family == "mixtral",
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )


def _req(cfg: dict, key: str):
    if key not in cfg or cfg[key] is None:
        raise UnsupportedModelError(f"config.json is missing required field {key!r} for model_type={cfg.get('model_type')!r}")
    return cfg[key]


def _check_rope(cfg: dict) -> None:
    """Only plain RoPE is implemented; any scaling type would silently change positions."""
    for key in ("rope_scaling", "rope_parameters"):
        rs = cfg.get(key)
        if not rs:
            continue
        rtype = rs.get("rope_type", rs.get("type", "default"))
        if rtype not in (None, "default"):
            raise UnsupportedModelError(f"{key}.rope_type={rtype!r} is not supported (only plain RoPE)")
    if cfg.get("partial_rotary_factor", 1.0) not in (1, 1.0):
        raise UnsupportedModelError(f"partial_rotary_factor={cfg['partial_rotary_factor']} is not supported")
