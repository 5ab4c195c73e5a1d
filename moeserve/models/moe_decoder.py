"""One generic MoE decoder for all supported families; ModelSpec carries the differences."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.layers.attention import Attention, make_attention_backend
from moeserve.layers.moe import DenseMLP, MoEBlock
from moeserve.layers.norm import RMSNorm
from moeserve.layers.rotary import RotaryEmbedding
from moeserve.models.spec import ModelSpec
from moeserve.layers.batch import ForwardBatch


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, attn_backend, moe_backend: str, lora_backend: str,
                 rotary: RotaryEmbedding):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, attn_backend, lora_backend, rotary)
        self.is_sparse = spec.sparse_layers[layer_idx]
        if self.is_sparse:
            self.mlp = MoEBlock(spec, moe_backend, lora_backend)
        else:
            self.mlp = DenseMLP(spec.hidden_size, spec.intermediate_size, lora_backend)

    def forward(self, x, batch: ForwardBatch, k_cache, v_cache):
        x = x + self.self_attn(self.input_layernorm(x), batch, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x), batch.lora)


class MoEForCausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, attention_backend: str = "torch", moe_backend: str = "torch",
                 lora_backend: str = "torch"):
        super().__init__()
        self.spec = spec
        attn = make_attention_backend(attention_backend)
        self.rotary = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings, spec.rope_theta)
        self.embed_tokens = nn.Parameter(torch.empty(spec.vocab_size, spec.hidden_size), requires_grad=False)
        self.layers = nn.ModuleList(
            DecoderLayer(spec, i, attn, moe_backend, lora_backend, self.rotary) for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = None if spec.tie_word_embeddings else nn.Parameter(
            torch.empty(spec.vocab_size, spec.hidden_size), requires_grad=False)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []  # bound by the model runner

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, H] after the final norm (logits are computed outside, per selected row)."""
        if len(self.kv_caches) != len(self.layers):  # zip would silently run fewer layers
            raise RuntimeError(f"KV caches bound for {len(self.kv_caches)} of {len(self.layers)} layers "
                               "(allocate the KV cache before running the model)")
        x = F.embedding(batch.input_ids, self.embed_tokens)
        for layer, (k_cache, v_cache) in zip(self.layers, self.kv_caches):
            x = layer(x, batch, k_cache, v_cache)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(hidden, w).float()
