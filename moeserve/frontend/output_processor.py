"""Token-level core outputs -> RequestOutputs with text: detokenization, stop strings, held-back
streaming text. Runs beside the caller (the offline Engine, or the server's frontend process), so
per-token Python never sits on the engine core's step loop.

A stop string ends a request here; the caller then aborts it in the core, which may meanwhile have
produced a token or two more: those arrive for a request that is gone and are dropped.
"""
from __future__ import annotations

from moeserve.frontend.detokenizer import detokenize_step
from moeserve.outputs import CoreOutput, RequestOutput, TokenLogprobs
from moeserve.sampling_params import SamplingParams

# prompt tokens the detokenizer decodes before the first output token (as vLLM does): a SentencePiece decoder
# strips the leading space of a decode's first token, which would glue the first output word to the prompt
PROMPT_DECODE_CONTEXT = 5


class RequestState:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, lora_name: str | None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.lora_name = lora_name
        self.output_token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.text = ""
        self.decode_ids = list(prompt_token_ids[-PROMPT_DECODE_CONTEXT:])  # then every output token
        self.prefix_offset = 0
        self.read_offset = len(self.decode_ids)
        self.stream_offset = 0  # chars of text already handed out (held back near stop strings)
        # held back while streaming: the start of what may become a stop string (none when the stop string is
        # kept: text before its end is output either way)
        self.hold = 0 if params.include_stop_str_in_output else max((len(s) - 1 for s in params.stop), default=0)
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.num_cached_tokens: int | None = None

    def append_token(self, token: int) -> None:
        self.output_token_ids.append(token)
        self.decode_ids.append(token)

    def output(self, delta_text: str, delta_ids: list[int]) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
            token_ids=list(self.output_token_ids), text=self.text[:self.stream_offset], delta_text=delta_text,
            delta_token_ids=delta_ids, logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs,
            finish_reason=self.finish_reason, lora_name=self.lora_name, error=self.error,
            num_cached_tokens=self.num_cached_tokens)


def find_stop(text: str, stops: list[str], text_before: int) -> int:
    """Index of the earliest stop string that ends in text[text_before:], or -1. A new match starts at
    most len(stop)-1 characters before the newly added text."""
    tail_start = max(0, text_before - max(len(s) for s in stops) + 1)
    hits = [i for s in stops if (i := text.find(s, tail_start)) >= 0]
    return min(hits) if hits else -1


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add(self, state: RequestState) -> None:
        if self.tokenizer is not None:
            # a prompt (of token ids) may end inside a character: its text ends in U+FFFD per byte, which the
            # first output token can complete into one character, leaving the window's text shorter than the
            # prompt's part of it. The window starts after the prompt's last complete character instead.
            context = state.decode_ids
            while context and self.tokenizer.decode(context, state.params.skip_special_tokens).endswith("\ufffd"):
                context.pop()
            state.read_offset = len(context)
        self.requests[state.request_id] = state

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def process(self, outputs: list[CoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """RequestOutputs for the requests that made progress, and the ids a stop string ended
        (to abort in the core)."""
        results, stopped = [], []
        for o in outputs:
            st = self.requests.get(o.request_id)
            if st is None:
                continue  # ended here already (stop string, abort)
            if o.num_cached_tokens is not None:
                st.num_cached_tokens = o.num_cached_tokens
            if o.new_prompt_logprobs:
                st.prompt_logprobs.extend(o.new_prompt_logprobs)
            delta_ids = []
            last = len(o.new_token_ids) - 1
            for i, token in enumerate(o.new_token_ids):
                delta_ids.append(token)
                if st.logprobs is not None and o.new_logprobs is not None:
                    st.logprobs.append(o.new_logprobs[i])
                if i == last and o.finish_reason == "stop" and not st.params.include_stop_str_in_output:
                    st.output_token_ids.append(token)  # EOS or a stop token id: counted, its text not shown
                    continue
                st.append_token(token)
                if self.tokenizer is None:
                    continue
                text_before = len(st.text)
                detokenize_step(self.tokenizer, st, st.params.skip_special_tokens)
                if self._stop_string(st, text_before):
                    if o.finish_reason is None:
                        stopped.append(st.request_id)
                    break
            if st.finish_reason is None and o.finish_reason is not None:
                st.finish_reason, st.error = o.finish_reason, o.error
                if self.tokenizer is not None:  # a trailing partial character is shown, not dropped
                    text_before = len(st.text)
                    detokenize_step(self.tokenizer, st, st.params.skip_special_tokens, final=True)
                    if o.finish_reason in ("stop", "length"):  # that text may hold a stop string too
                        self._stop_string(st, text_before)
            if st.finish_reason is not None:
                del self.requests[st.request_id]
                delta = self._flush(st)
            else:
                delta = self._stream(st)
            results.append(st.output(delta, delta_ids))
        return results, stopped

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request here; its final output (finish_reason 'abort'), or None if it had ended."""
        st = self.requests.pop(request_id, None)
        if st is None:
            return None
        st.finish_reason = "abort"
        return st.output("", [])

    @staticmethod
    def _stop_string(st: RequestState, text_before: int) -> bool:
        """End `st` at a stop string that ends in its text after `text_before`, cutting the text there."""
        if not st.params.stop or (cut := find_stop(st.text, st.params.stop, text_before)) < 0:
            return False
        if st.params.include_stop_str_in_output:
            cut += len(next(s for s in st.params.stop if st.text.startswith(s, cut)))
        st.text = st.text[:cut]
        st.finish_reason = "stop"
        return True

    @staticmethod
    def _stream(st: RequestState) -> str:
        """New text safe to hand out: hold back a suffix that could still become a stop string."""
        safe_end = max(st.stream_offset, len(st.text) - st.hold)
        delta = st.text[st.stream_offset:safe_end]
        st.stream_offset = safe_end
        return delta

    @staticmethod
    def _flush(st: RequestState) -> str:
        delta = st.text[st.stream_offset:]
        st.stream_offset = len(st.text)
        return delta
