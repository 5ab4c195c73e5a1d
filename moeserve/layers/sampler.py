"""Token sampling for a whole batch at once: greedy, temperature, top-k, top-p, seeded noise, logprobs.

Runs outside the captured graph on the logits of the rows that sample, with a fixed number of
kernels whatever the batch holds (no per-row launches). Randomness is an exponential race
(argmax of p / Exp(1)) whose noise is a counter-based hash of (request key, vocabulary index):
each row's key mixes its request's seed with the position of the token being drawn, so a seeded
request gives the same tokens whatever else shares its batch, and no generator state is kept.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.sampling_params import SamplingParams

_M32 = 0xFFFFFFFF


def hash32(x: int) -> int:
    """Host twin of `_hash32` (a 32-bit integer mixer) for building row keys."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    # int64 holding values < 2^32; constants < 2^31 keep every product below 2^63 (no overflow)
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)


def request_key(seed: int) -> int:
    """The seed's part of every row key of a request (seed: any int64/uint64), computed once per request. The
    halves are mixed one after the other, not hashed apart and XORed: XOR is symmetric, so seeds (hi, lo) and
    (lo - c, hi + c) shared every key, and the 2^32 seeds with lo = hi + c had keys of the position alone."""
    s = seed & 0xFFFFFFFFFFFFFFFF
    return hash32(hash32(s & _M32) ^ (s >> 32))


def row_key(request: int, position: int) -> int:
    """Key of the draw for output token `position` of a request whose request_key is `request`."""
    return hash32(request ^ hash32(position + 0x632BE5AB))


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [N, V] determined by keys [N] (int64 < 2^32) and the vocabulary index."""
    v = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    x = _hash32((keys[:, None] + v * 0x9E3779B1) & _M32)
    u = ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # uniform in (0, 1), never 0
    return -torch.log(u)


@dataclass
class SamplingTensors:
    """Per-row sampling parameters on the device; None for a batch where every row is greedy."""
    temperature: torch.Tensor  # [N] fp32 (1 on greedy rows)
    top_k: torch.Tensor  # [N] int64 (<= 0: off)
    top_p: torch.Tensor  # [N] fp32
    keys: torch.Tensor  # [N] int64 row keys (see row_key)
    greedy: torch.Tensor  # [N] bool
    filtered: bool  # host fact: some row uses top-k or top-p

    @classmethod
    def build(cls, params: list[SamplingParams], keys: list[int], vocab: int, device,
              pin: bool = False) -> "SamplingTensors | None":
        if all(p.greedy for p in params):
            return None

        def t(values, dtype):
            return torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=True)

        return cls(
            temperature=t([1.0 if p.greedy else p.temperature for p in params], torch.float32),
            top_k=t([min(p.top_k, vocab) for p in params], torch.int64),
            top_p=t([p.top_p for p in params], torch.float32),
            keys=t(keys, torch.int64),
            greedy=t([p.greedy for p in params], torch.bool),
            filtered=any(not p.greedy and (p.top_k > 0 or p.top_p < 1.0) for p in params),
        )


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and nucleus top-p."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    V = logits.shape[-1]
    ranks = torch.arange(V, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))  # <= 0: off
    drop = ranks >= k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    cum_before = probs.cumsum(dim=-1) - probs  # mass strictly above this token
    # rows with top_p = 1 keep everything (an fp32 cumsum can reach 1.0 before the tail)
    drop |= (cum_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    drop[:, 0] = False  # always keep the best token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, sorted_idx, sorted_logits)


def sample(logits: torch.Tensor, st: SamplingTensors | None) -> torch.Tensor:
    """logits [N, V] fp32 -> next token ids [N] (on the logits' device)."""
    greedy = logits.argmax(dim=-1)
    if st is None:
        return greedy
    x = logits / st.temperature[:, None]
    if st.filtered:
        x = _filter_top_k_top_p(x, st.top_k, st.top_p)
    probs = torch.softmax(x, dim=-1)
    choice = (probs / exponential_noise(st.keys, logits.shape[-1])).argmax(dim=-1)
    return torch.where(st.greedy, greedy, choice)


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_n: int):
    """Log-softmax of the raw logits: the chosen tokens' logprobs [N] and top-n (values, ids)."""
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(-1, token_ids.view(-1, 1)).squeeze(-1)
    if top_n > 0:
        top_v, top_i = logp.topk(top_n, dim=-1)
    else:
        top_v = top_i = None
    return chosen, top_v, top_i
