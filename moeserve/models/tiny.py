"""Tiny random MoE checkpoints of every supported family, for tests and for users.

Dimensions are chosen so that hidden (H), expert intermediate (I) and 2·I are all distinct:
adapter tensors are mapped to expert parameters by shape, which needs them distinct.
"""
from __future__ import annotations

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
