"""/v1/completions and /v1/chat/completions: OpenAI request -> engine requests -> OpenAI responses
(JSON or SSE), with logprobs in each API's own shape."""
from __future__ import annotations

import math
import random
import time

from fastapi import Request
from fastapi.responses import JSONResponse

from moeserve.frontend.core_client import ChatPrompt, EngineClient
from moeserve.outputs import RequestOutput, TokenLogprobs
from moeserve.sampling_params import SamplingParams
from moeserve.server.errors import engine_error
from moeserve.server.metrics import ServerMetrics
from moeserve.server.protocol import INT64_MAX, INT64_MIN, ChatCompletionRequest, CompletionRequest, OpenAIError
from moeserve.server.streaming import MergedStreams, collect, sse_response, submit_all

_MIN_LOGPROB = -9999.0  # JSON has no -inf


class ServerState:
    def __init__(self, engine: EngineClient, served_model_name: str, api_key: str | None):
        self.engine = engine
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.metrics = ServerMetrics()
        self.created = int(time.time())
        self.max_model_len = engine.info.max_model_len
        self.max_queue_len = engine.info.max_queue_len
        self.tokenizer = engine.tokenizer
        self._token_strs: dict[int, str] = {}
        self._ids = random.Random()  # seeded once from the OS: ids need only be unique, not secret

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{self._ids.getrandbits(128):032x}"

    def resolve_model(self, name: str) -> str | None:
        """The adapter a request's `model` selects: None for the base model; 404 if unknown."""
        loras = self.engine.lora_names
        if name == self.served_model_name:
            return None
        if name in loras:
            return name
        base, sep, adapter = name.partition(":")
        if sep and base == self.served_model_name and adapter in loras:
            return adapter
        raise OpenAIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def token_str(self, token_id: int, starts_text: bool = False) -> str:
        """A token's text after other text; `starts_text`: as the first token of a text (a SentencePiece
        decoder drops its leading space there)."""
        if starts_text and self.tokenizer is not None:
            return self.tokenizer.decode([token_id], skip_special_tokens=False)
        s = self._token_strs.get(token_id)
        if s is None:
            s = self.tokenizer.token_text(token_id) if self.tokenizer is not None else f"token_id:{token_id}"
            self._token_strs[token_id] = s
        return s

    def prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False) if self.tokenizer else ""


def _finite(x: float) -> float:
    return x if math.isfinite(x) else _MIN_LOGPROB


def _delta_logprobs(out: RequestOutput) -> list[TokenLogprobs]:
    """Logprobs of this output's new tokens (out.logprobs is the request's growing list)."""
    end = len(out.token_ids)
    return list(out.logprobs[end - len(out.delta_token_ids):end]) if out.logprobs is not None else []


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _seed(seed: int | None, i: int) -> int | None:
    if seed is None:
        return None
    s = seed + i
    return s if s <= INT64_MAX else s - INT64_MAX + INT64_MIN - 1  # wrap around int64


def _sampling_params(body, i: int, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None):
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=-1 if body.top_k is None else body.top_k,
            seed=_seed(body.seed, i), stop=body.stop, stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens, include_stop_str_in_output=body.include_stop_str_in_output)
    except ValueError as e:
        raise engine_error(e, "prompt") from e


def _check_text(text: str, param: str) -> None:
    """A JSON string may carry a lone surrogate ("\\ud800"): no tokenizer or UTF-8 encoder takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise OpenAIError(400, f"{param}: not valid Unicode (lone surrogate at index {e.start})", param=param,
                          code="invalid_value") from None


def _check_request(state: ServerState, body, max_tokens_params: tuple[str, ...]) -> None:
    """Checks that need no tokenizer, before anything is tokenized or queued."""
    for name in max_tokens_params:
        v = getattr(body, name)
        if v is not None and v > state.max_model_len:
            raise OpenAIError(400, f"{name} is {v}, more than max_model_len ({state.max_model_len})", param=name,
                              code="invalid_value")
    stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
    for s in stops:
        _check_text(s, "stop")


def _completion_prompts(prompt) -> list:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompts = [prompt]
    elif not prompt:
        raise OpenAIError(400, "prompt is empty", param="prompt", code="invalid_value")
    else:
        prompts = list(prompt)
    for p in prompts:
        if isinstance(p, str):
            _check_text(p, "prompt")
    return prompts


def _completion_logprobs(state: ServerState, token_ids: list[int], lps: list, offset: int,
                         starts_text: bool = False) -> tuple[dict, int]:
    """OpenAI legacy logprobs for `token_ids` (entries of lps may be None: the first prompt token);
    `starts_text`: the first of them begins the text (an echoed prompt)."""
    res = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for k, (tid, lp) in enumerate(zip(token_ids, lps)):
        s = state.token_str(tid, starts_text and k == 0)
        res["tokens"].append(s)
        res["text_offset"].append(offset)
        offset += len(s)
        if lp is None:
            res["token_logprobs"].append(None)
            res["top_logprobs"].append(None)
            continue
        top = {state.token_str(i): _finite(v) for i, v in lp.top}
        top.setdefault(s, _finite(lp.logprob))
        res["token_logprobs"].append(_finite(lp.logprob))
        res["top_logprobs"].append(top)
    return res, offset


def _echo_logprobs(state: ServerState, out: RequestOutput, offset: int) -> tuple[dict, int]:
    lps = list(out.prompt_logprobs or [])
    lps += [None] * (len(out.prompt_token_ids) - len(lps))
    return _completion_logprobs(state, out.prompt_token_ids, lps, offset, starts_text=True)


def _merge_logprobs(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    return {k: a[k] + b[k] for k in a}


async def create_completion(state: ServerState, body: CompletionRequest, request: Request):
    arrival = time.perf_counter()
    if (err := body.unsupported()) is not None:
        raise err
    lora = state.resolve_model(body.model)
    _check_request(state, body, ("max_tokens",))
    prompts = _completion_prompts(body.prompt)
    want_prompt_lps = body.logprobs if body.echo else None
    jobs = [(p, _sampling_params(body, j, body.max_tokens, body.logprobs, want_prompt_lps))  # null: fill the context
            for p in prompts for j in range(body.n)]
    request_id = state.new_id("cmpl")
    streams = await submit_all(state.engine, jobs, lora, request_id, "prompt")
    created = int(time.time())
    head = {"id": request_id, "object": "text_completion", "created": created, "model": body.model}
    if body.stream:
        merged = MergedStreams(streams)
        return sse_response(_completion_chunks(state, body, merged, head, arrival), merged, state.metrics,
                            "completions", "prompt")

    finals = await collect(state.metrics, request, streams, arrival)
    choices = []
    for k, out in enumerate(finals):
        text, logprobs, offset = out.text, None, 0
        if body.echo:
            text = state.prompt_text(out) + text
            if body.logprobs is not None:
                logprobs, offset = _echo_logprobs(state, out, 0)
        if body.logprobs is not None:
            logprobs = _merge_logprobs(logprobs, _completion_logprobs(state, out.token_ids,
                                                                       list(out.logprobs or []), offset)[0])
        choices.append({"index": k, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason})
    prompt_tokens = sum(len(finals[p * body.n].prompt_token_ids) for p in range(len(prompts)))
    cached_tokens = sum(finals[p * body.n].num_cached_tokens or 0 for p in range(len(prompts)))
    usage = _usage(prompt_tokens, sum(len(o.token_ids) for o in finals), cached_tokens)
    state.metrics.count_request("completions", 200)
    return JSONResponse({**head, "choices": choices, "usage": usage})


async def _completion_chunks(state: ServerState, body: CompletionRequest, merged: MergedStreams, head: dict,
                             arrival: float):
    """The chunk dicts of a streamed completion (framing, errors and counting: streaming.sse_response)."""
    n = len(merged.streams)
    started, first = [False] * n, [None] * n
    offsets, completion_tokens, prompt_tokens, cached_tokens = [0] * n, [0] * n, [0] * n, [0] * n
    extra = {"usage": None} if body.include_usage else {}
    async for i, out in merged:
        now = time.perf_counter()
        if first[i] is None and out.delta_token_ids:
            first[i] = now
        text, logprobs = out.delta_text, None
        if not started[i] and (out.delta_token_ids or out.finished):
            # not before: a prompt prefilled in chunks has outputs with part of its logprobs and no token yet
            started[i] = True
            prompt_tokens[i] = len(out.prompt_token_ids)
            if body.echo:
                text = state.prompt_text(out) + text
                if body.logprobs is not None:
                    logprobs, offsets[i] = _echo_logprobs(state, out, 0)
        if body.logprobs is not None:
            lp, offsets[i] = _completion_logprobs(state, out.delta_token_ids, _delta_logprobs(out), offsets[i])
            logprobs = _merge_logprobs(logprobs, lp)
        completion_tokens[i] = len(out.token_ids)
        cached_tokens[i] = out.num_cached_tokens or 0
        if out.finished:
            state.metrics.observe_choice(arrival, first[i], now, len(out.token_ids))
        if text or out.finished or (logprobs and logprobs["tokens"]):
            choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason}
            yield {**head, "choices": [choice], **extra}
    if body.include_usage:
        p = sum(prompt_tokens[k] for k in range(0, n, body.n))
        c = sum(cached_tokens[k] for k in range(0, n, body.n))
        yield {**head, "choices": [], "usage": _usage(p, sum(completion_tokens), c)}


def _chat_logprobs(state: ServerState, lps: list[TokenLogprobs]) -> list[dict]:
    def entry(tid: int, lp: float) -> dict:
        s = state.token_str(tid)
        return {"token": s, "logprob": _finite(lp), "bytes": list(s.encode("utf-8"))}

    return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]} for lp in lps]


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, request: Request):
    arrival = time.perf_counter()
    if (err := body.unsupported()) is not None:
        raise err
    lora = state.resolve_model(body.model)
    _check_request(state, body, ("max_tokens", "max_completion_tokens"))
    messages = body.template_messages()
    for i, m in enumerate(messages):
        _check_text(m["content"], f"messages.{i}.content")
    prompt = ChatPrompt(messages)
    max_tokens = body.max_completion_tokens or body.max_tokens  # None: what the context has room for
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    jobs = [(prompt, _sampling_params(body, j, max_tokens, logprobs)) for j in range(body.n)]
    request_id = state.new_id("chatcmpl")
    streams = await submit_all(state.engine, jobs, lora, request_id, "messages")
    head = {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": body.model}
    if body.stream:
        head["object"] = "chat.completion.chunk"
        merged = MergedStreams(streams)
        return sse_response(_chat_chunks(state, body, merged, head, arrival), merged, state.metrics,
                            "chat_completions", "messages")

    finals = await collect(state.metrics, request, streams, arrival)
    choices = [{"index": k, "message": {"role": "assistant", "content": out.text},
                "logprobs": {"content": _chat_logprobs(state, out.logprobs or [])} if body.logprobs else None,
                "finish_reason": out.finish_reason} for k, out in enumerate(finals)]
    usage = _usage(len(finals[0].prompt_token_ids), sum(len(o.token_ids) for o in finals),
                   finals[0].num_cached_tokens or 0)
    state.metrics.count_request("chat_completions", 200)
    return JSONResponse({**head, "choices": choices, "usage": usage})


async def _chat_chunks(state: ServerState, body: ChatCompletionRequest, merged: MergedStreams, head: dict,
                       arrival: float):
    """The chunk dicts of a streamed chat completion (framing, errors and counting: streaming.sse_response)."""
    n = len(merged.streams)
    first = [None] * n
    completion_tokens, prompt_tokens, cached_tokens = [0] * n, 0, 0
    extra = {"usage": None} if body.include_usage else {}
    for i in range(n):  # the role first, as OpenAI does, before any token exists
        choice = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        yield {**head, "choices": [choice], **extra}
    async for i, out in merged:
        now = time.perf_counter()
        if first[i] is None and out.delta_token_ids:
            first[i] = now
        prompt_tokens = len(out.prompt_token_ids)
        completion_tokens[i] = len(out.token_ids)
        if i == 0:
            cached_tokens = out.num_cached_tokens or 0
        logprobs = {"content": _chat_logprobs(state, _delta_logprobs(out))} if body.logprobs else None
        if out.finished:
            state.metrics.observe_choice(arrival, first[i], now, len(out.token_ids))
        if out.delta_text or out.finished or (logprobs and logprobs["content"]):
            delta = {"content": out.delta_text} if out.delta_text or not out.finished else {}
            choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": out.finish_reason}
            yield {**head, "choices": [choice], **extra}
    if body.include_usage:
        yield {**head, "choices": [], "usage": _usage(prompt_tokens, sum(completion_tokens), cached_tokens)}
