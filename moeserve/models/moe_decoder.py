"""One generic MoE decoder for all supported families; ModelSpec carries the differences."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from moeserve import module_tree
from moeserve.exec_options import TORCH_CPU, ExecOptions
from moeserve.layers import cpu_linear
from moeserve.layers.attention import Attention
from moeserve.layers.backends import kernels
from moeserve.layers.moe import DenseMLP, MoEBlock
from moeserve.distributed.parallel_state import ParallelState
from moeserve.distributed.sharding import TensorSharding, rank_spec
from moeserve.layers.norm import RMSNorm
from moeserve.layers.parallel import (ExpertParallelMoEBlock, ShardedRMSNorm, vocab_parallel_embedding,
                                      vocab_parallel_logits)
from moeserve.layers.rotary import RotaryEmbedding
from moeserve.model_spec import ModelSpec
from moeserve.layers.batch import ForwardBatch
from moeserve.layers.linear import LoRALinear


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, rotary: RotaryEmbedding, options: ExecOptions = TORCH_CPU,
                 tp: ParallelState | None = None):
        """`spec`: the shapes this rank holds; `options`: backends and PDL, read by each layer (exec_options.py);
        `tp`: the parallel state under tensor parallelism (None: one rank, no collectives at all)."""
        super().__init__()
        self.tp = tp
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, options)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, options)
        # OLMoE's full-width q/k norms under TP need an all-reduce inside the norm: those keep the torch path
        sharded_qk_norm = tp is not None and spec.qk_norm == "full"
        prefix = module_tree.layer_prefix(layer_idx)  # checkpoint names: options.weight_format reads them
        self.self_attn = Attention(spec, rotary, options,
                                   fused_prologue=options.norm_backend == "triton" and not sharded_qk_norm,
                                   prefix=prefix + "self_attn")
        self.is_sparse = spec.sparse_layers[layer_idx]
        if self.is_sparse and tp is not None and tp.expert_parallel:
            self.mlp = ExpertParallelMoEBlock(spec, options, tp, prefix=prefix + "mlp")
        elif self.is_sparse:
            self.mlp = MoEBlock(spec, options, prefix=prefix + "mlp")
        else:
            self.mlp = DenseMLP(spec.hidden_size, spec.intermediate_size, options, prefix=prefix + "mlp")
        if sharded_qk_norm:  # olmoe's q/k norms span all heads, now split across ranks
            attn = self.self_attn
            attn.q_norm = ShardedRMSNorm(spec.q_size, spec.rms_norm_eps, tp)
            attn.k_norm = ShardedRMSNorm(spec.kv_size, spec.rms_norm_eps, tp)

    def forward(self, x, residual, batch: ForwardBatch, k_cache, v_cache):
        """Residual-stream form: x is the previous layer's MLP output (the embeddings for the first layer, whose
        residual is None); returns (this layer's MLP output, residual stream). Each residual add is fused into
        the norm that follows it; the model's final norm adds the last MLP output."""
        # a W8A8 consumer (q|k|v from 64 rows, the experts) reads the fp8 copy its norm writes, not a launch of its own
        quant = self.self_attn.qkv_proj.input_quant(x) if self.input_layernorm.quantizes else None
        h, residual, h_fp8 = self.input_layernorm.forward_fp8(x, residual, quant)
        attn_out = self.self_attn(h, batch, k_cache, v_cache, x_fp8=h_fp8)
        if self.tp is not None:  # attention and MLP outputs are per-rank partial sums (row-parallel)
            attn_out = self.tp.all_reduce(attn_out)
        quant = self.mlp.input_quant(attn_out) if self.is_sparse and self.post_attention_layernorm.quantizes else None
        h, residual, h_fp8 = self.post_attention_layernorm.forward_fp8(attn_out, residual, quant)
        out = self.mlp(h, batch.lora) if h_fp8 is None else self.mlp(h, batch.lora, x_fp8=h_fp8)
        if self.tp is not None:
            out = self.tp.all_reduce(out)
        return out, residual


class MoEForCausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, options: ExecOptions = TORCH_CPU, tp: ParallelState | None = None):
        """`options`: how it executes (exec_options.py: backends, PDL; built once from the engine's config), handed
        to every layer. `tp`: build this rank's shard of a tensor-parallel model (moeserve/distributed/sharding.py);
        `spec` stays the whole model's, `rank_spec` holds the shapes of this rank's layers. lm_head runs the
        linear backend's GEMV at decode sizes (kernels/gemv.py) like the dense projections."""
        super().__init__()
        self.spec = spec
        self.tp = tp if tp is not None and tp.world_size > 1 else None
        self.rank_spec, vocab_rows = spec, spec.vocab_size
        if self.tp is not None:
            sharding = TensorSharding(spec, tp.rank, tp.world_size, tp.expert_parallel)
            self.rank_spec, vocab_rows = rank_spec(spec, tp.world_size, tp.expert_parallel), sharding.vocab_per_rank
            self.vocab_start = sharding.vocab_rows()[0]
        self.options = options
        self.pdl = options.pdl
        self.gemv = kernels("linear", options.linear_backend)
        self.lora_kernels = kernels("lora", options.lora_backend)
        self.rotary = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings, spec.rope_theta)
        self.embed_tokens = nn.Parameter(torch.empty(vocab_rows, spec.hidden_size), requires_grad=False)
        self.layers = nn.ModuleList(
            DecoderLayer(self.rank_spec, i, self.rotary, options, self.tp)
            for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, options)
        self.lm_head = None if spec.tie_word_embeddings else nn.Parameter(
            torch.empty(vocab_rows, spec.hidden_size), requires_grad=False)
        self._kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []  # the runner's, see bind_kv_caches
        self._dense_lora: bool | None = None  # any dense projection with LoRA buffers: known at the first LoRA forward
        self._lora_stream: torch.cuda.Stream | None = None  # the projections' LoRA shrinks beside a GEMM (CUDA)
        self._shrinks_beside = False  # any LoRA projection shrinks beside its GEMM: known with _dense_lora
        self.packed_logits = cpu_linear.PackedWeight()  # float32 on the CPU: the output weight packed for oneDNN

    def bind_kv_caches(self, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Run on these (k, v) caches, one pair per layer in order; [] unbinds them. The model runner allocates,
        resizes and frees them (worker/model_runner.py); the model only reads and writes their blocks."""
        if caches and len(caches) != len(self.layers):  # zip would silently run fewer layers
            raise ValueError(f"KV caches given for {len(caches)} of {len(self.layers)} layers")
        self._kv_caches = list(caches)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, H] after the final norm (logits are computed outside, per selected row)."""
        if not self._kv_caches:
            raise RuntimeError("no KV caches bound (allocate the KV cache before running the model)")
        if self.tp is not None:
            x = vocab_parallel_embedding(batch.input_ids, self.embed_tokens, self.vocab_start, self.tp)
        else:
            x = F.embedding(batch.input_ids, self.embed_tokens)
        batch = self.group_lora_rows(batch)
        residual = None
        for layer, (k_cache, v_cache) in zip(self.layers, self._kv_caches):
            x, residual = layer(x, residual, batch, k_cache, v_cache)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]

    def group_lora_rows(self, batch: ForwardBatch) -> ForwardBatch:
        """The batch with its rows grouped by adapter slot for the dense LoRA kernels (one launch), which every
        projection of one forward reads; the batch as it is without LoRA, without dense LoRA targets, or on the torch
        LoRA backend."""
        if batch.lora is None or self.lora_kernels is None:
            return batch
        if self._dense_lora is None:  # the slot pool attached its buffers before any LoRA forward, never to move
            lora_linears = [m for m in self.modules() if isinstance(m, LoRALinear) and m.lora_a is not None]
            self._dense_lora = bool(lora_linears)
            self._shrinks_beside = any(m.shrink_beside for m in lora_linears)
        if not self._dense_lora:  # adapters on the experts alone: nothing reads a grouping
            return batch
        groups = self.lora_kernels.group_rows(batch.lora.token_slots, batch.lora.slot_ranks.numel(), pdl=self.pdl)
        side = None
        if batch.input_ids.is_cuda and self._shrinks_beside:
            if self._lora_stream is None:  # the first LoRA forward is an eager one (warm-up): never inside a capture
                # high priority: a shrink's programs start before the rest of the GEMM's queued ones
                self._lora_stream = torch.cuda.Stream(device=batch.input_ids.device, priority=-1)
            side = self._lora_stream
        return dataclasses.replace(batch, lora=dataclasses.replace(batch.lora, dense_groups=groups, side_stream=side))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens if self.lm_head is None else self.lm_head
        if self.tp is not None:  # every rank takes part; every rank gets the full logits
            return vocab_parallel_logits(hidden, w, self.spec.vocab_size, self.tp)
        if self.gemv is not None and self.gemv.serves(hidden.shape[0], w.shape[0], w.shape[1]):
            return self.gemv.gemv(hidden, w, pdl=self.pdl).float()  # rounded to the activation dtype as F.linear's
        return cpu_linear.linear(hidden, w, self.packed_logits.get(w)).float()
