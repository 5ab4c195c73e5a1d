"""One generic MoE decoder for all supported families; ModelSpec carries the differences."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.layers.attention import Attention, make_attention_backend
from moeserve.layers.moe import DenseMLP, MoEBlock
from moeserve.distributed.parallel_state import ParallelState
from moeserve.distributed.sharding import TensorSharding, rank_spec
from moeserve.layers.norm import RMSNorm
from moeserve.layers.parallel import (ExpertParallelMoEBlock, ShardedRMSNorm, vocab_parallel_embedding,
                                      vocab_parallel_logits)
from moeserve.layers.rotary import RotaryEmbedding
from moeserve.models.spec import ModelSpec
from moeserve.layers.batch import ForwardBatch


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, attn_backend, moe_backend: str, lora_backend: str,
                 rotary: RotaryEmbedding, tp: ParallelState | None = None):
        """`spec`: the shapes this rank holds; `tp`: the parallel state under tensor parallelism (None: one rank,
        no collectives at all)."""
        super().__init__()
        self.tp = tp
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, attn_backend, lora_backend, rotary)
        self.is_sparse = spec.sparse_layers[layer_idx]
        if self.is_sparse and tp is not None and tp.expert_parallel:
            self.mlp = ExpertParallelMoEBlock(spec, moe_backend, lora_backend, tp)
        elif self.is_sparse:
            self.mlp = MoEBlock(spec, moe_backend, lora_backend)
        else:
            self.mlp = DenseMLP(spec.hidden_size, spec.intermediate_size, lora_backend)
        if tp is not None and spec.qk_norm == "full":  # olmoe's q/k norms span all heads, now split across ranks
            attn = self.self_attn
            attn.q_norm = ShardedRMSNorm(spec.q_size, spec.rms_norm_eps, tp)
            attn.k_norm = ShardedRMSNorm(spec.kv_size, spec.rms_norm_eps, tp)

    def forward(self, x, batch: ForwardBatch, k_cache, v_cache):
        if self.tp is not None:  # attention and MLP outputs are per-rank partial sums (row-parallel)
            x = x + self.tp.all_reduce(self.self_attn(self.input_layernorm(x), batch, k_cache, v_cache))
            return x + self.tp.all_reduce(self.mlp(self.post_attention_layernorm(x), batch.lora))
        x = x + self.self_attn(self.input_layernorm(x), batch, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x), batch.lora)


class MoEForCausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, attention_backend: str = "torch", moe_backend: str = "torch",
                 lora_backend: str = "torch", tp: ParallelState | None = None):
        """`tp`: build this rank's shard of a tensor-parallel model (moeserve/distributed/sharding.py); `spec`
        stays the whole model's, `rank_spec` holds the shapes of this rank's layers."""
        super().__init__()
        self.spec = spec
        self.tp = tp if tp is not None and tp.world_size > 1 else None
        self.rank_spec, vocab_rows = spec, spec.vocab_size
        if self.tp is not None:
            sharding = TensorSharding(spec, tp.rank, tp.world_size, tp.expert_parallel)
            self.rank_spec, vocab_rows = rank_spec(spec, tp.world_size, tp.expert_parallel), sharding.vocab_per_rank
            self.vocab_start = sharding.vocab_rows()[0]
        attn = make_attention_backend(attention_backend)
        self.rotary = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings, spec.rope_theta)
        self.embed_tokens = nn.Parameter(torch.empty(vocab_rows, spec.hidden_size), requires_grad=False)
        self.layers = nn.ModuleList(
            DecoderLayer(self.rank_spec, i, attn, moe_backend, lora_backend, self.rotary, self.tp)
            for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = None if spec.tie_word_embeddings else nn.Parameter(
            torch.empty(vocab_rows, spec.hidden_size), requires_grad=False)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []  # bound by the model runner

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, H] after the final norm (logits are computed outside, per selected row)."""
        if len(self.kv_caches) != len(self.layers):  # zip would silently run fewer layers
            raise RuntimeError(f"KV caches bound for {len(self.kv_caches)} of {len(self.layers)} layers "
                               "(allocate the KV cache before running the model)")
        if self.tp is not None:
            x = vocab_parallel_embedding(batch.input_ids, self.embed_tokens, self.vocab_start, self.tp)
        else:
            x = F.embedding(batch.input_ids, self.embed_tokens)
        for layer, (k_cache, v_cache) in zip(self.layers, self.kv_caches):
            x = layer(x, batch, k_cache, v_cache)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens if self.lm_head is None else self.lm_head
        if self.tp is not None:  # every rank takes part; every rank gets the full logits
            return vocab_parallel_logits(hidden, w, self.spec.vocab_size, self.tp)
        return F.linear(hidden, w).float()
