"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded RNG, logprobs.

Runs outside the captured graph on the logits of the rows that sample. Randomness comes from
an exponential race (argmax of p / Exp(1)), drawing noise from each request's own generator,
so a seeded request gives the same tokens whatever else shares its batch.
"""
from __future__ import annotations

import torch

from moeserve.sampling_params import SamplingParams


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and nucleus top-p."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    V = logits.shape[-1]
    ranks = torch.arange(V, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
    drop = ranks >= k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    cum_before = probs.cumsum(dim=-1) - probs  # mass strictly above this token
    # rows with top_p = 1 keep everything (an fp32 cumsum can reach 1.0 before the tail)
    drop |= (cum_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    drop[:, 0] = False  # always keep the best token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, sorted_idx, sorted_logits)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           default_generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [N, V] fp32 -> next token ids [N] (on the logits' device)."""
    greedy = logits.argmax(dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled_rows:
        return greedy
    rows = torch.tensor(sampled_rows, device=logits.device)
    sub = logits[rows]
    dev = logits.device
    temp = torch.tensor([params[i].temperature for i in sampled_rows], device=dev, dtype=torch.float32)
    top_k = torch.tensor([min(params[i].top_k, logits.shape[-1]) for i in sampled_rows], device=dev)
    top_p = torch.tensor([params[i].top_p for i in sampled_rows], device=dev, dtype=torch.float32)
    sub = sub / temp[:, None]
    if any(params[i].top_k > 0 or params[i].top_p < 1.0 for i in sampled_rows):
        sub = _filter_top_k_top_p(sub, top_k, top_p)
    probs = torch.softmax(sub, dim=-1)
    noise = torch.stack([
        torch.empty(sub.shape[-1], device=dev).exponential_(generator=generators[i] or default_generator)
        for i in sampled_rows
    ])
    choice = (probs / noise).argmax(dim=-1)
    return greedy.index_copy(0, rows, choice)


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_n: int):
    """Log-softmax of the raw logits: the chosen tokens' logprobs [N] and top-n (values, ids)."""
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(-1, token_ids.view(-1, 1)).squeeze(-1)
    if top_n > 0:
        top_v, top_i = logp.topk(top_n, dim=-1)
    else:
        top_v = top_i = None
    return chosen, top_v, top_i
