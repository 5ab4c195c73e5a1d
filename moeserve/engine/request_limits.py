"""RequestLimits: what the engine core checks a request against. The frontend checks with the same values (the
core's, from CoreInfo) before sending, in the HTTP process, which imports neither the core nor torch."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moeserve.errors import RequestError
from moeserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int  # usable blocks

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Raise RequestError / ValueError naming the problem; returns params with max_tokens set (None:
        what the context has room for). A max_tokens the context cannot hold is refused, as OpenAI and vLLM
        do, not silently shortened."""
        params.validate()
        ids = prompt_token_ids
        if not ids:
            raise RequestError("prompt is empty")
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise RequestError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise RequestError(f"stop_token_ids {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})",
                               param="stop_token_ids")
        if len(ids) >= self.max_model_len:
            raise RequestError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                               "(the prompt plus at least one generated token must fit)")
        room = self.max_model_len - len(ids)
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=room)
        elif params.max_tokens > room:
            raise RequestError(f"max_tokens {params.max_tokens} does not fit: this model's maximum context length "
                               f"is {self.max_model_len} tokens and the prompt has {len(ids)}, which leaves "
                               f"{room}; lower max_tokens or shorten the prompt", param="max_tokens")
        need_blocks = -(-(len(ids) + params.max_tokens) // self.block_size)
        if need_blocks > self.num_kv_blocks:
            raise RequestError(f"request needs {need_blocks} KV blocks but the cache has only "
                               f"{self.num_kv_blocks}; lower max_tokens or the prompt length")
        return params
