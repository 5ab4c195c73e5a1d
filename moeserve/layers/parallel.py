"""Tensor-parallel pieces the single-rank model does not need: vocabulary-split embedding and logits,
and an RMSNorm over a vector whose elements are split across ranks (OLMoE's full-width q/k norms)."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.distributed.parallel_state import ParallelState
from moeserve.exec_options import ExecOptions
from moeserve.layers.linear import LoRALinear
from moeserve.layers.moe import MoEBlock
from moeserve.model_spec import ModelSpec


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, vocab_start: int,
                             tp: ParallelState) -> torch.Tensor:
    """Each rank looks up the ids in its vocabulary rows (zeros for the others); the all-reduce adds the one
    real row to zeros, so the result equals the unsplit lookup exactly. Sync-free (no boolean indexing)."""
    local = ids - vocab_start
    inside = (local >= 0) & (local < weight.shape[0])
    x = F.embedding(torch.where(inside, local, torch.zeros_like(local)), weight)
    x = x * inside.unsqueeze(-1).to(x.dtype)
    return tp.all_reduce(x)


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int,
                          tp: ParallelState) -> torch.Tensor:
    """fp32 logits [T, vocab_size] on every rank: each rank's vocabulary block, all-gathered, padding cut."""
    local = F.linear(hidden, weight).float()
    return tp.all_gather(local, dim=-1)[:, :vocab_size]


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a vector split across ranks: the sum of squares is all-reduced. With replicated KV heads
    every element is counted once per replica in the sum and in the length alike, so the mean is unchanged."""

    def __init__(self, local_dim: int, eps: float, tp: ParallelState):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(local_dim), requires_grad=False)
        self.eps = eps
        self.tp = tp
        self.total_dim = local_dim * tp.world_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        sum_sq = self.tp.all_reduce(h.pow(2).sum(-1, keepdim=True))
        h = h * torch.rsqrt(sum_sq / self.total_dim + self.eps)
        return self.weight * h.to(dtype)


class ExpertParallelMoEBlock(MoEBlock):
    """A MoE block holding E / N whole experts (expert parallelism). Every rank routes every token over all E
    experts (the router is replicated) and computes the (token, expert) pairs routed to its own experts; the
    others get an expert id outside its range, which the kernels and the torch reference skip. The decoder
    layer's all-reduce after the block then adds the ranks' parts — with the token activations already on every
    rank, that is the all-gather + reduce-scatter exchange in one collective."""

    def __init__(self, spec: ModelSpec, options: ExecOptions, tp: ParallelState, prefix: str = "mlp"):
        num_local = spec.num_experts // tp.world_size
        super().__init__(dataclasses.replace(spec, num_experts=num_local), options, prefix=prefix)
        self.spec = spec  # route() takes top-k over all experts
        self.router = LoRALinear(spec.hidden_size, (spec.num_experts,), False, options, gemv=False)  # all E experts
        self.expert_start, self.num_local = tp.rank * num_local, num_local

    def route(self, *args, **kwargs):
        topk_w, topk_ids = super().route(*args, **kwargs)
        local = topk_ids - self.expert_start
        mine = (local >= 0) & (local < self.num_local)
        return topk_w, torch.where(mine, local, torch.full_like(local, self.num_local))  # sync-free
