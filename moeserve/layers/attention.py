"""Self-attention over the paged KV cache (GQA, RoPE, optional q/k RMSNorm, LoRA on q/k/v/o)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.exec_options import TORCH_CPU, ExecOptions
from moeserve.kernels.kv_fp8 import write_kv_slots
from moeserve.layers.backends import kernels
from moeserve.layers.linear import LoRALinear
from moeserve.layers.norm import RMSNorm
from moeserve.layers.rotary import RotaryEmbedding
from moeserve.model_spec import ModelSpec
from moeserve.layers.batch import AttentionMetadata, ForwardBatch


class TorchAttentionBackend:
    """Reference paged attention. Decode is sync-free (gather all blocks + length mask; SDPA on the CPU);
    prefill loops over sequences using host-side lengths (eager only). An fp8 cache's values are read as they are
    (converted exactly), k_scale folded into the softmax scale and v_scale multiplying the output, as the kernels
    do (kernels/paged_attention.py)."""

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
               v_scale: float = 1.0):
        nh = q.shape[1]
        nkv = k_cache.shape[2]
        k = k_cache[meta.block_tables].flatten(1, 2)  # [B, max_blocks*bs, nkv, d]
        v = v_cache[meta.block_tables].flatten(1, 2)
        ctx = k.shape[1]
        valid = torch.arange(ctx, device=q.device)[None, :] < meta.context_lens[:, None]  # [B, ctx]
        if q.device.type == "cpu":
            # a KV head's query heads as its queries: SDPA reads K and V in place of einsum's permuted copies
            # (half the time at batch 8); padded rows (no keys) give 0 on the CPU, nan_to_num keeps that so
            o = F.scaled_dot_product_attention(q.float().unflatten(1, (nkv, nh // nkv)), k.float().transpose(1, 2),
                                               v.float().transpose(1, 2), attn_mask=valid[:, None, None, :],
                                               scale=scale * k_scale)
            return _times(o.nan_to_num(0.0), v_scale).flatten(1, 2).to(q.dtype)
        # query heads as [kv head, head of its group]: each K/V head serves its group without being copied
        qg = q.float().unflatten(1, (nkv, nh // nkv))  # [B, nkv, g, d]
        scores = torch.einsum("bkgd,bckd->bkgc", qg, k.float()) * (scale * k_scale)
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padded rows (no keys) -> 0
        return _times(torch.einsum("bkgc,bckd->bkgd", probs, v.float()), v_scale).flatten(1, 2).to(q.dtype)

    def prefill(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                v_scale: float = 1.0):
        nh = q.shape[1]
        nkv, bs = k_cache.shape[2], k_cache.shape[1]
        out = torch.empty_like(q)
        starts = meta.query_start_loc_host
        for s, seq_len in enumerate(meta.seq_lens_host):
            q0, q1 = starts[s], starts[s + 1]
            qlen = q1 - q0
            nblocks = (seq_len + bs - 1) // bs
            blocks = meta.block_tables[s, :nblocks]
            # an fp8 cache's values converted exactly (e4m3 fits every serving dtype)
            k = k_cache[blocks].flatten(0, 1)[:seq_len].to(q.dtype).repeat_interleave(nh // nkv, dim=1)
            v = v_cache[blocks].flatten(0, 1)[:seq_len].to(q.dtype).repeat_interleave(nh // nkv, dim=1)
            qpos = torch.arange(seq_len - qlen, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= qpos[:, None]  # [qlen, seq_len]
            o = F.scaled_dot_product_attention(
                q[q0:q1].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale * k_scale
            )
            out[q0:q1] = _times(o, v_scale).transpose(0, 1)
        return out


def _times(o: torch.Tensor, v_scale: float) -> torch.Tensor:
    """The attention output times the V scale (no op for a cache stored unscaled)."""
    return o if v_scale == 1.0 else o * v_scale


class TritonAttentionBackend:
    def __init__(self, paged_attention, pdl: bool = False):
        self.k = paged_attention  # the registry's kernels module (layers/backends.py)
        self.pdl = pdl  # launches with programmatic dependent launch (kernels/pdl.py)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
               v_scale: float = 1.0):
        return self.k.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                             pdl=self.pdl, k_scale=k_scale, v_scale=v_scale)

    def prefill(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                v_scale: float = 1.0):
        # context_lens holds each sequence's length after this chunk: the kernel's seq_lens
        return self.k.paged_prefill_attention(
            q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens, scale, meta.max_query_len,
            pdl=self.pdl, k_scale=k_scale, v_scale=v_scale,
        )


def make_attention_backend(options: ExecOptions):
    """The paged-attention strategy `options.attention_backend` selects."""
    paged_attention = kernels("attention", options.attention_backend)
    return TorchAttentionBackend() if paged_attention is None else TritonAttentionBackend(paged_attention, options.pdl)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding, options: ExecOptions = TORCH_CPU,
                 fused_prologue: bool | None = None, prefix: str = "self_attn"):
        """`rotary`: the model's one cos/sin table, shared by every layer (one per layer would cost
        max_position x head_dim x 2 per layer: ~1 GiB at Qwen3-30B-A3B's 48 layers x 40k positions).
        `options`: the attention backend, the projections' linear and LoRA backends, PDL (exec_options.py).
        `fused_prologue`: q/k norm + rotary + KV write as one Triton kernel (else the torch code below); None: where
        the norm backend is Triton. `prefix`: the module's checkpoint name ("model.layers.3.self_attn"), which
        options.weight_format reads to say how each projection's base weight is stored."""
        super().__init__()
        self.pdl = options.pdl
        self.spec = spec
        self.nh, self.nkv, self.d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.scale = self.d ** -0.5
        # an fp8 KV cache holds K / k_scale and V / v_scale (kernels/kv_fp8.py): the checkpoint's self_attn.k_scale /
        # v_scale where it has them (models/loader.py), else 1.0; a cache in the activation dtype ignores them
        self.kv_cache_fp8 = options.kv_cache_fp8
        self.k_scale = self.v_scale = 1.0
        self.qkv_proj = LoRALinear(spec.hidden_size, (spec.q_size, spec.kv_size, spec.kv_size), spec.qkv_bias,
                                   options, weights=options.weight_format(*(f"{prefix}.{n}" for n in
                                                                           ("q_proj", "k_proj", "v_proj"))))
        self.o_proj = LoRALinear(spec.q_size, (spec.hidden_size,), spec.o_bias, options,
                                 weights=options.weight_format(f"{prefix}.o_proj"))
        if spec.qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(self.d, spec.rms_norm_eps), RMSNorm(self.d, spec.rms_norm_eps)
        elif spec.qk_norm == "full":
            self.q_norm, self.k_norm = RMSNorm(spec.q_size, spec.rms_norm_eps), RMSNorm(spec.kv_size, spec.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = rotary
        self.backend = make_attention_backend(options)
        if fused_prologue is None:
            fused_prologue = options.norm_backend == "triton"
        self.prologue_kernels = kernels("norm", "triton" if fused_prologue else "torch")

    def forward(self, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor, x_fp8=None):
        """`x_fp8`: x quantized as qkv_proj.input_quant says, by the norm that made x."""
        qkv = self.qkv_proj(x, batch.lora, x_fp8=x_fp8)
        q = self.qk_norm_rotary_write_kv(qkv, batch.positions, batch.attn, k_cache, v_cache)
        return self.o_proj(self.attend(q, batch.attn, k_cache, v_cache), batch.lora)

    def qk_norm_rotary_write_kv(self, qkv: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """The attention prologue: q [T, nh, d] ready to attend; this step's K/V written into the cache."""
        if self.prologue_kernels is None:
            q, k, v = self.qk_norm_rotary(qkv, positions)
            self.write_kv(k, v, meta, k_cache, v_cache)
            return q
        return self.prologue_kernels.qk_norm_rotary_write_kv(
            qkv, positions, self.rotary.cos, self.rotary.sin, self.nh, self.nkv, self.d, self.spec.qk_norm,
            None if self.q_norm is None else self.q_norm.weight, None if self.k_norm is None else self.k_norm.weight,
            self.spec.rms_norm_eps, k_cache, v_cache, meta.slot_mapping, self.spec.clip_qkv, pdl=self.pdl,
            k_scale=self.k_scale, v_scale=self.v_scale)

    def qk_norm_rotary(self, qkv: torch.Tensor, positions: torch.Tensor):
        """q [T, nh, d], k and v [T, nkv, d] from the fused projection: q/k norms, clipping, rotary."""
        T = qkv.shape[0]
        q, k, v = qkv.split((self.spec.q_size, self.spec.kv_size, self.spec.kv_size), dim=-1)
        if self.spec.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.spec.clip_qkv is not None:
            c = self.spec.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q, k, v = q.reshape(T, self.nh, self.d), k.reshape(T, self.nkv, self.d), v.reshape(T, self.nkv, self.d)
        if self.spec.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return q, k, v

    def write_kv(self, k, v, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """This step's K/V into the paged cache (before attending; quantized with their scales where it is fp8);
        padded rows write to the dummy block 0."""
        write_kv_slots(k_cache, meta.slot_mapping, k, self.k_scale)
        write_kv_slots(v_cache, meta.slot_mapping, v, self.v_scale)

    def attend(self, q, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Attention over the cache: [T, nh * d], the o_proj input."""
        if meta.is_decode:
            o = self.backend.decode(q, k_cache, v_cache, meta, self.scale, self.k_scale, self.v_scale)
        else:
            o = self.backend.prefill(q, k_cache, v_cache, meta, self.scale, self.k_scale, self.v_scale)
        return o.reshape(q.shape[0], self.nh * self.d)
