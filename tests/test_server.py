"""The OpenAI-compatible server, end to end: the engine core in its own process, a real uvicorn server on
127.0.0.1 (random port, own thread), driven by the official `openai` client (and httpx for raw HTTP),
checked against an offline Engine built on the same checkpoint."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import threading
import time
from contextlib import contextmanager

import httpx
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from moeserve import Engine, EngineConfig, SamplingParams  # noqa: E402
from moeserve.engine_args import add_engine_args, engine_config_from_args  # noqa: E402
from moeserve.models.tiny import make_tiny  # noqa: E402
from moeserve.server.app import add_serve_args  # noqa: E402
from moeserve.server.metrics import parse_graph_key  # noqa: E402
from server_harness import RunningServer, wait_until  # noqa: E402

MODEL = "tiny-moe"
MAX_MODEL_LEN = 128
ENGINE_KW = dict(max_model_len=MAX_MODEL_LEN, num_kv_blocks=320, max_num_seqs=64, block_size=16)
PROMPTS = ["hello world", "the quick brown fox", "a", "small models say odd things", "numbers 1 2 3"]


# ---------------------------------------------------------------------------------------------
# fixtures: a model folder, a running server, an offline reference engine
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny("qwen3_moe", tmp_path_factory.mktemp("tiny_qwen3_moe"))


@pytest.fixture(scope="module")
def server(model_dir):
    # runtime loading on: the load endpoint's refusals are among the bad requests checked below
    s = RunningServer(EngineConfig(model=str(model_dir), enable_lora_runtime_loading=True, **ENGINE_KW), MODEL)
    yield s
    s.close()


@pytest.fixture(scope="module")
def ref(model_dir):
    """Offline engine on the same folder: the reference for everything the server returns."""
    return Engine(EngineConfig(model=str(model_dir), **ENGINE_KW))


def ref_one(ref: Engine, prompt, **kw):
    return ref.generate([prompt] if isinstance(prompt, str) else [list(prompt)], SamplingParams(**kw))[0]


def chat_ids(ref: Engine, content: str) -> list[int]:
    return ref.chat_prompt([{"role": "user", "content": content}])


def sse_events(text: str) -> list:
    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# ---------------------------------------------------------------------------------------------
# completions and chat against the offline engine
# ---------------------------------------------------------------------------------------------

def test_completions_greedy_match_offline(server, ref):
    for prompt in PROMPTS:
        r = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        want = ref_one(ref, prompt, max_tokens=8, temperature=0)
        assert r.choices[0].text == want.text
        assert r.choices[0].finish_reason == want.finish_reason
        assert r.usage.prompt_tokens == len(want.prompt_token_ids)
        assert r.usage.completion_tokens == len(want.token_ids)
        assert r.usage.total_tokens == len(want.prompt_token_ids) + len(want.token_ids)
        assert r.model == MODEL and r.object == "text_completion"


def test_completions_token_id_prompt_and_batch_of_prompts(server, ref):
    ids = [ref.tokenizer.encode(p) for p in PROMPTS[:2]]
    want = [ref_one(ref, p, max_tokens=6, temperature=0) for p in PROMPTS[:2]]
    for prompt in (ids[0], ids, PROMPTS[:2]):
        r = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
        n = 1 if prompt is ids[0] else 2
        assert [c.index for c in r.choices] == list(range(n))
        assert [c.text for c in r.choices] == [w.text for w in want[:n]]
        assert r.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want[:n])
        assert r.usage.completion_tokens == sum(len(w.token_ids) for w in want[:n])


def test_completions_stream_matches_offline(server, ref):
    want = ref_one(ref, "the quick brown fox", max_tokens=10, temperature=0)
    chunks = list(server.client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=10,
                                                   temperature=0, stream=True,
                                                   stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [want.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert chunks[-1].usage.prompt_tokens == len(want.prompt_token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_matches_offline(server, ref):
    content = "what is a mixture of experts?"
    want = ref_one(ref, chat_ids(ref, content), max_tokens=12, temperature=0)
    r = server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                              max_tokens=12, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want.prompt_token_ids), len(want.token_ids))
    # max_completion_tokens takes the place of max_tokens; content parts are joined
    r2 = server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "what is a mixture "},
                                                            {"type": "text", "text": "of experts?"}]}],
        max_completion_tokens=12, temperature=0)
    assert r2.choices[0].message.content == want.text


def test_chat_stream_matches_offline(server, ref):
    content = "tell me a story"
    want = ref_one(ref, chat_ids(ref, content), max_tokens=10, temperature=0)
    chunks = list(server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [want.finish_reason]
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert chunks[-1].usage.prompt_tokens == len(want.prompt_token_ids)


def test_seeded_sampling_and_n(server, ref):
    kw = dict(max_tokens=8, temperature=0.9, top_p=0.95)
    r = server.client.completions.create(model=MODEL, prompt="hello world", n=2, seed=1234, **kw)
    want = [ref_one(ref, "hello world", seed=1234 + i, **kw) for i in range(2)]
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [w.text for w in want]
    assert want[0].token_ids != want[1].token_ids  # the two choices really are independent draws
    assert r.usage.prompt_tokens == len(want[0].prompt_token_ids)
    assert r.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    # top_k (an extension, via extra_body) and chat with n=2, streamed
    r = server.client.completions.create(model=MODEL, prompt="a", seed=7, extra_body={"top_k": 5}, **kw)
    assert r.choices[0].text == ref_one(ref, "a", seed=7, top_k=5, **kw).text
    ids = chat_ids(ref, "hi")
    chunks = list(server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                        n=2, seed=99, stream=True, **kw))
    texts = ["", ""]
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts == [ref_one(ref, ids, seed=99 + i, **kw).text for i in range(2)]


def test_completion_logprobs_and_echo(server, ref):
    want = ref_one(ref, "hello world", max_tokens=6, temperature=0, logprobs=3, prompt_logprobs=3)
    r = server.client.completions.create(model=MODEL, prompt="hello world", max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(want.token_ids)
    assert lp.tokens == [ref.tokenizer.decode([t], skip_special_tokens=False) for t in want.token_ids]
    assert lp.token_logprobs == pytest.approx([x.logprob for x in want.logprobs], abs=1e-4)
    for top, w in zip(lp.top_logprobs, want.logprobs):
        assert max(top.values()) == pytest.approx(w.logprob, abs=1e-4)  # greedy: the chosen token is the best
        assert 1 <= len(top) <= 4
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0

    r = server.client.completions.create(model=MODEL, prompt="hello world", max_tokens=6, temperature=0, logprobs=3,
                                         echo=True)
    c = r.choices[0]
    assert c.text == "hello world" + want.text
    n_prompt = len(want.prompt_token_ids)
    assert len(c.logprobs.tokens) == n_prompt + len(want.token_ids)
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert c.logprobs.token_logprobs[1:n_prompt] == pytest.approx([x.logprob for x in want.prompt_logprobs[1:]],
                                                                   abs=1e-4)
    assert c.logprobs.token_logprobs[n_prompt:] == pytest.approx([x.logprob for x in want.logprobs], abs=1e-4)

    # streamed echo + logprobs carries the same content
    chunks = list(server.client.completions.create(model=MODEL, prompt="hello world", max_tokens=6, temperature=0,
                                                   logprobs=3, echo=True, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    streamed = [x for ch in chunks if ch.choices[0].logprobs for x in ch.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(c.logprobs.token_logprobs[1:], abs=1e-4)


def test_chat_logprobs(server, ref):
    ids = chat_ids(ref, "hi")
    want = ref_one(ref, ids, max_tokens=5, temperature=0, logprobs=2)
    r = server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [x.logprob for x in content] == pytest.approx([x.logprob for x in want.logprobs], abs=1e-4)
    assert [x.token for x in content] == [ref.tokenizer.decode([t], skip_special_tokens=False)
                                          for t in want.token_ids]
    for x, w in zip(content, want.logprobs):
        assert len(x.top_logprobs) == 2
        assert [t.logprob for t in x.top_logprobs] == pytest.approx([v for _, v in w.top], abs=1e-4)
        assert x.bytes == list(x.token.encode("utf-8"))
    r = server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=5, temperature=0)
    assert r.choices[0].logprobs is None


def test_stop_strings(server, ref):
    full = ref_one(ref, "the quick brown fox", max_tokens=16, temperature=0, ignore_eos=True)
    # a stop string taken from the middle of the reference text: the answer must end right before it
    start = next(i for i in range(2, len(full.text) - 2) if full.text[i:i + 2].isprintable()
                 and full.text[i:i + 2].strip())
    stop = full.text[start:start + 2]
    expected = full.text[:full.text.find(stop)]
    for stream in (False, True):
        r = server.client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=16, temperature=0,
                                             stop=[stop, "\x00never"], stream=stream,
                                             extra_body={"ignore_eos": True})
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].text for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            text, finish = r.choices[0].text, r.choices[0].finish_reason
        assert (text, finish) == (expected, "stop")
    r = server.client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=16, temperature=0,
                                         stop=stop, extra_body={"ignore_eos": True})
    assert r.choices[0].text == expected


def test_raw_sse_wire_format(server, ref):
    want = ref_one(ref, chat_ids(ref, "hi"), max_tokens=4, temperature=0)
    r = server.http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 4, "temperature": 0, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert {e["object"] for e in events} == {"chat.completion.chunk"} and len({e["id"] for e in events}) == 1
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == want.text
    assert events[-1]["choices"][0]["finish_reason"] == want.finish_reason


def test_engine_fault_is_reported_and_server_keeps_serving(server):
    server.fail_next_steps(1, "simulated device fault")
    r = server.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4})
    assert r.status_code == 500 and "simulated device fault" in r.json()["error"]["message"]
    server.fail_next_steps(1, "simulated device fault")
    r = server.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True})
    assert r.status_code == 200  # the fault comes after the response started: reported in-band
    events = sse_events(r.text)
    assert "simulated device fault" in events[-1]["error"]["message"]
    s = server.wait_idle()
    assert s.kv_blocks_free == s.kv_blocks_total
    assert server.client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices


def test_models_and_health(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["parent"] is None
    assert server.http.get("/health").status_code == 200


# ---------------------------------------------------------------------------------------------
# concurrency
# ---------------------------------------------------------------------------------------------

def test_64_concurrent_clients_match_offline(server, ref):
    jobs = []
    for i in range(64):
        prompt = f"{PROMPTS[i % len(PROMPTS)]} {i}"
        seed = None if i % 3 == 0 else 1000 + i
        temperature = 0.0 if seed is None else 0.8
        jobs.append(dict(prompt=prompt, chat=i % 4 == 1, stream=i % 2 == 0, seed=seed, temperature=temperature))
    params = [SamplingParams(max_tokens=8, temperature=j["temperature"], seed=j["seed"]) for j in jobs]
    prompts = [chat_ids(ref, j["prompt"]) if j["chat"] else j["prompt"] for j in jobs]
    want = ref.generate(prompts, params)

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)

    async def one(j):
        kw = dict(model=MODEL, max_tokens=8, temperature=j["temperature"], seed=j["seed"], stream=j["stream"])
        if j["chat"]:
            r = await client.chat.completions.create(messages=[{"role": "user", "content": j["prompt"]}], **kw)
            if j["stream"]:
                return "".join([c.choices[0].delta.content or "" async for c in r if c.choices])
            return r.choices[0].message.content
        r = await client.completions.create(prompt=j["prompt"], **kw)
        if j["stream"]:
            return "".join([c.choices[0].text async for c in r if c.choices])
        return r.choices[0].text

    async def main():
        try:
            return await asyncio.gather(*(one(j) for j in jobs))
        finally:
            await client.close()

    got = asyncio.run(main())
    assert got == [w.text for w in want]
    s = server.wait_idle()
    assert s.kv_blocks_free == s.kv_blocks_total


# ---------------------------------------------------------------------------------------------
# bad requests: the right error, and the server keeps serving
# ---------------------------------------------------------------------------------------------

BAD_REQUESTS = [
    # (endpoint, body, status, param)
    ("/v1/completions", {"model": "no-such-model", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"model": f"{MODEL}:no-such-adapter", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 1000}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": True, "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 99999]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "word " * 200}, 400, "prompt"),  # > max_model_len
    ("/v1/completions", {"model": MODEL, "prompt": list(range(1, MAX_MODEL_LEN + 1))}, 400, "prompt"),
    ("/v1/completions", [1, 2, 3], 400, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "word " * 200}]}, 400,
     "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     400, "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, None),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}], "stream": True},
     404, "model"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/adapter/dir"}, 404, "lora_path"),
    ("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "lora_path"),
    ("/v1/unload_lora_adapter", {"lora_name": "never-loaded"}, 404, "lora_name"),
]


@pytest.mark.parametrize("endpoint,body,status,param", BAD_REQUESTS,
                         ids=[f"{i}-{b[0].rsplit('/', 1)[1]}-{b[2]}" for i, b in enumerate(BAD_REQUESTS)])
def test_bad_requests(server, endpoint, body, status, param):
    r = server.http.post(endpoint, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] is not None and err["param"].split(".")[0] == param, err
    ok = server.client.completions.create(model=MODEL, prompt="still alive?", max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_malformed_json_and_wrong_routes(server):
    for content in (b"{not json", b"", b"\xff\xfe", b'{"model": "x", "prompt": '):
        r = server.http.post("/v1/completions", content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400, (content, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert server.http.get("/v1/nothing-here").json()["error"]["code"] == "not_found"
    assert server.http.get("/v1/completions").status_code == 405
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    assert server.http.get("/health").status_code == 200


def test_queue_full_is_503(server):
    """With the engine core held between steps, submissions pile up: those past max_queue_len are
    refused at once with 503 (by the frontend, without a round trip), the others complete."""
    info = server.engine.info
    old = info.max_queue_len
    info.max_queue_len = 2
    results = []

    def post():
        results.append(server.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}))

    try:
        with server.engine_paused():
            threads = [threading.Thread(target=post) for _ in range(5)]
            for t in threads:
                t.start()
            wait_until(lambda: len(results) == 3)  # refused while the engine is held
            assert sorted(r.status_code for r in results) == [503, 503, 503]
        for t in threads:
            t.join(30)
    finally:
        info.max_queue_len = old
    codes = sorted(r.status_code for r in results)
    assert codes == [200, 200, 503, 503, 503]
    err = next(r for r in results if r.status_code == 503).json()["error"]
    assert err["code"] == "queue_full"
    assert server.wait_idle().kv_blocks_free == server.stats().kv_blocks_total


# ---------------------------------------------------------------------------------------------
# disconnects free KV blocks
# ---------------------------------------------------------------------------------------------

def test_stream_disconnect_aborts_and_frees_kv(server):
    before = server.wait_idle()
    max_tokens = 100
    body = {"model": MODEL, "prompt": "the quick brown fox " * 3, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: "):
                    got += 1
                    if got == 3:
                        break
            assert server.stats().kv_blocks_free < before.kv_blocks_total  # it holds blocks now
            with server.engine_paused():  # no progress until the server has seen the disconnect
                r.close()
                wait_until(lambda: not server.engine.streams)  # the frontend aborted it
    after = server.wait_idle()
    assert after.kv_blocks_free == after.kv_blocks_total
    assert after.aborted_total == before.aborted_total + 1
    assert after.generation_tokens_total - before.generation_tokens_total < max_tokens


def test_non_stream_disconnect_aborts_and_frees_kv(server):
    before = server.wait_idle()
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 100, "temperature": 0, "ignore_eos": True}
    with server.engine_paused():  # the request cannot finish before the client gives up
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server.url + "/v1/completions", json=body, timeout=0.3)
        time.sleep(0.1)
    after = server.wait_idle()
    assert after.kv_blocks_free == after.kv_blocks_total
    assert after.aborted_total == before.aborted_total + 1
    assert after.generation_tokens_total - before.generation_tokens_total < 100


# ---------------------------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------------------------

def _metrics(server) -> dict:
    text = server.http.get("/metrics").text
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_metrics(server):
    server.wait_idle()
    m0 = _metrics(server)
    usages = []
    for prompt in PROMPTS[:3]:
        usages.append(server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                                                       temperature=0).usage)
    chunks = list(server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                        max_tokens=4, stream=True,
                                                        stream_options={"include_usage": True}))
    usages.append(chunks[-1].usage)
    server.http.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    server.http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1})
    server.wait_idle()
    m1 = _metrics(server)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return m1.get(key, 0.0) - m0.get(key, 0.0)

    assert delta("moeserve_requests_total", endpoint="completions", status="200") == 3
    assert delta("moeserve_requests_total", endpoint="chat_completions", status="200") == 1
    assert delta("moeserve_requests_total", endpoint="completions", status="404") == 1
    assert delta("moeserve_requests_total", endpoint="completions", status="400") == 1
    assert delta("moeserve_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("moeserve_generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("moeserve_time_to_first_token_seconds_count") == 4
    assert delta("moeserve_e2e_request_latency_seconds_count") == 4
    assert delta("moeserve_time_per_output_token_seconds_count") == sum(u.completion_tokens > 1 for u in usages)
    assert m1[("moeserve_num_requests_waiting", ())] == 0
    assert m1[("moeserve_num_requests_running", ())] == 0
    assert m1[("moeserve_kv_cache_usage_ratio", ())] == 0.0


def test_graph_replay_metric_labels():
    assert parse_graph_key("bs8-nolora") == ("8", "nolora")
    assert parse_graph_key("bs16-lora") == ("16", "lora")
    assert parse_graph_key((4, "lora")) == ("4", "lora")
    from moeserve.messages import EngineStats
    from moeserve.server.metrics import EngineStatsCollector

    col = EngineStatsCollector()
    assert list(col.collect()) == []  # no stats (the engine is not running): no engine metrics
    required = {f.name: 0 for f in dataclasses.fields(EngineStats) if f.default is dataclasses.MISSING}
    col.per_core = [EngineStats(**dict(required, num_waiting=1), graph_replays={"bs8-nolora": 5, "bs8-lora": 2},
                                lora_loads_total=3)]
    fams = {f.name: f for f in col.collect()}
    replays = {(s.labels["batch_size"], s.labels["variant"]): s.value for s in fams["moeserve_graph_replays"].samples}
    assert replays == {("8", "nolora"): 5.0, ("8", "lora"): 2.0}
    assert fams["moeserve_lora_loads"].type == "counter" and fams["moeserve_lora_loads"].samples[0].value == 3
    assert fams["moeserve_num_requests_waiting"].samples[0].value == 1
    assert "moeserve_lora_evictions" not in fams and "moeserve_kernel_compiles_after_start" not in fams  # None: off


# ---------------------------------------------------------------------------------------------
# API key, CLI flags, `serve` entry point
# ---------------------------------------------------------------------------------------------

KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def keyed_server(model_dir):
    """A server with an API key, a KV cache of 6 blocks (5 usable) and no max_model_len, and a queue of 4: the
    tests of each of these settings share its start."""
    s = RunningServer(EngineConfig(model=str(model_dir), num_kv_blocks=6, block_size=16, max_queue_len=4), MODEL,
                      api_key=KEY)
    yield s
    s.close()


def test_api_key(keyed_server):
    s = keyed_server
    assert s.client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices
    r = s.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = s.http.get("/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert s.http.get("/health").status_code == 200


def test_engine_args_cover_every_config_field():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    dests = {a.dest for a in parser._actions}
    from moeserve.config import EngineConfig as EC

    assert set(EC.field_names()) <= dests
    assert all(a.help for a in parser._actions if a.dest in EC.field_names())
    default = engine_config_from_args(parser.parse_args([]))
    assert {k: getattr(default, k) for k in EC.field_names()} == {k: getattr(EC(), k) for k in EC.field_names()}
    cfg = engine_config_from_args(parser.parse_args([
        "--model", "/m", "--dtype", "bfloat16", "--device", "cpu", "--max-model-len", "512", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "256", "--block-size", "32", "--gpu-memory-utilization", "0.5",
        "--kv-cache-memory-bytes", "2GiB", "--num-kv-blocks", "77", "--moe-backend", "torch",
        "--attention-backend", "triton", "--enable-lora", "--max-loras", "4", "--max-lora-rank", "16",
        "--max-cpu-loras", "9", "--lora-modules", "a=/p/a", "b=/p/b", "--lora-target-modules", "q_proj", "v_proj",
        "--disable-cuda-graph", "--cuda-graph-max-bs", "64", "--cuda-graph-bs", "1", "2", "4",
        "--no-record-nolora-graph", "--max-queue-len", "5", "--seed", "3", "--no-enable-chunked-prefill"]))
    assert cfg.model == "/m" and cfg.dtype == "bfloat16" and cfg.device == "cpu" and cfg.max_model_len == 512
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.block_size) == (8, 256, 32)
    assert cfg.gpu_memory_utilization == 0.5 and cfg.kv_cache_memory_bytes == 2 * 2**30 and cfg.num_kv_blocks == 77
    assert (cfg.moe_backend, cfg.attention_backend) == ("torch", "triton")
    assert cfg.enable_lora and (cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras) == (4, 16, 9)
    assert cfg.lora_modules == {"a": "/p/a", "b": "/p/b"} and cfg.lora_target_modules == ["q_proj", "v_proj"]
    assert cfg.enforce_eager and cfg.cuda_graph_max_bs == 64 and cfg.cuda_graph_bs == [1, 2, 4]
    assert cfg.record_nolora_graph is False and cfg.max_queue_len == 5 and cfg.seed == 3
    assert cfg.enable_chunked_prefill is False
    assert engine_config_from_args(parser.parse_args(["--enforce-eager"])).enforce_eager
    with pytest.raises(SystemExit):
        parser.parse_args(["--lora-modules", "no-equals-sign"])


def test_serve_args_defaults():
    """The serve flags' defaults. `moeserve serve` itself (flags to an engine, where it listens, serving the model
    under --served-model-name) runs as a process in test_service_lifecycle.py and test_first_hour.py."""
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--model", "/m", "--port", "1"])
    assert (args.host, args.served_model_name) == ("127.0.0.1", None)


# ---------------------------------------------------------------------------------------------
# many adapters: routing by `model`, hot load/unload while traffic runs
# ---------------------------------------------------------------------------------------------

# 2 slots for 3+ adapters: evictions; adapters are loaded at runtime too
LORA_KW = dict(ENGINE_KW, enable_lora=True, max_loras=2, max_lora_rank=8, enable_lora_runtime_loading=True)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    from peft_fixtures import make_peft_adapter

    root = tmp_path_factory.mktemp("adapters")
    kinds = {"a": "attn+experts", "b": "experts", "c": "attn"}
    return {name: str(make_peft_adapter("qwen3_moe", root / name, kind=kind, rank=4, seed=i + 1)[0])
            for i, (name, kind) in enumerate(kinds.items())}


@pytest.fixture(scope="module")
def lora_ref(model_dir, adapters):
    return Engine(EngineConfig(model=str(model_dir), lora_modules=dict(adapters), **LORA_KW))


@pytest.fixture(scope="module")
def lora_server(model_dir, adapters):
    """Shared by the two tests below: the first unloads the adapter it loads (c), so the second finds a and b."""
    s = RunningServer(EngineConfig(model=str(model_dir), lora_modules={"a": adapters["a"], "b": adapters["b"]},
                                   **LORA_KW), MODEL)
    yield s
    s.close()


def test_lora_64_clients_mixing_three_adapters(lora_server, lora_ref, adapters):
    s = lora_server
    r = s.http.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": adapters["c"]})
    assert r.status_code == 200, r.text
    models = {m.id: m.model_extra["parent"] for m in s.client.models.list().data}
    assert models == {MODEL: None, "a": MODEL, "b": MODEL, "c": MODEL}

    # `model` picks the adapter: its name, or base:name; the base name means no adapter
    names = [MODEL, "a", "b", "c", f"{MODEL}:a", f"{MODEL}:c"]
    jobs = [(f"{PROMPTS[i % len(PROMPTS)]} {i}", names[i % len(names)], i % 2 == 0) for i in range(64)]
    adapter_of = {MODEL: None, "a": "a", "b": "b", "c": "c", f"{MODEL}:a": "a", f"{MODEL}:c": "c"}
    want = lora_ref.generate([p for p, _, _ in jobs], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                             lora=[adapter_of[m] for _, m, _ in jobs])
    base = lora_ref.generate([p for p, _, _ in jobs], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    for name in ("a", "b", "c"):  # each adapter really changes what the model says
        assert any(w.token_ids != b.token_ids for (_, m, _), w, b in zip(jobs, want, base) if adapter_of[m] == name)

    client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)

    async def one(prompt, model, stream):
        r = await client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, stream=stream,
                                            extra_body={"ignore_eos": True})
        if stream:
            return "".join([c.choices[0].text async for c in r])
        return r.choices[0].text

    async def main():
        try:
            return await asyncio.gather(*(one(*j) for j in jobs))
        finally:
            await client.close()

    assert asyncio.run(main()) == [w.text for w in want]
    st = s.wait_idle()
    assert st.kv_blocks_free == st.kv_blocks_total
    m = _metrics(s)
    assert m[("moeserve_lora_loads_total", ())] >= 3 and m[("moeserve_lora_evictions_total", ())] >= 1
    assert m[("moeserve_lora_adapters", ())] == 3
    assert s.http.post("/v1/unload_lora_adapter", json={"lora_name": "c"}).status_code == 200


def test_lora_load_unload_while_traffic_runs(lora_server, lora_ref, adapters):
    s = lora_server
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    base_want = lora_ref.generate(PROMPTS, params)
    b_want = lora_ref.generate(PROMPTS, params, lora="b")
    c_want = lora_ref.generate(PROMPTS, params, lora="c")
    stop = threading.Event()
    errors, done = [], []

    def traffic(model, want):
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
        i = 0
        while not stop.is_set():
            k = i % len(PROMPTS)
            try:
                r = client.completions.create(model=model, prompt=PROMPTS[k], max_tokens=5, temperature=0,
                                              extra_body={"ignore_eos": True})
                if r.choices[0].text != want[k].text:
                    errors.append((model, k, r.choices[0].text, want[k].text))
                done.append(model)
            except Exception as e:  # noqa: BLE001
                errors.append((model, repr(e)))
            i += 1

    threads = [threading.Thread(target=traffic, args=a) for a in ((MODEL, base_want), ("b", b_want))]
    for t in threads:
        t.start()
    try:
        # hot-load under traffic: the new name serves at once, with the adapter's own outputs
        r = s.http.post("/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": adapters["c"]})
        assert r.status_code == 200, r.text
        for k, prompt in enumerate(PROMPTS):
            got = s.client.completions.create(model="d", prompt=prompt, max_tokens=5, temperature=0,
                                              extra_body={"ignore_eos": True})
            assert got.choices[0].text == c_want[k].text
        # a duplicate name is refused
        r = s.http.post("/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": adapters["c"]})
        assert r.status_code == 400

        # unloading an adapter a running request uses drains it: 200 at once, new requests for it are 404 from
        # then on, the running one finishes
        with httpx.Client(base_url=s.url, timeout=60) as c:
            body = {"model": "a", "prompt": "hello", "max_tokens": 100, "stream": True, "ignore_eos": True}
            with c.stream("POST", "/v1/completions", json=body) as stream:
                assert stream.status_code == 200
                lines = stream.iter_lines()  # held: dropping a half-read iterator closes the connection
                first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
                assert first["choices"][0]["finish_reason"] is None, first
                r = s.http.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
                assert r.status_code == 200, r.text
                with pytest.raises(openai.NotFoundError):
                    s.client.completions.create(model="a", prompt="x", max_tokens=2)
                events = [line for line in lines if line]
                assert events[-1] == "data: [DONE]"
                assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
        with pytest.raises(openai.NotFoundError):
            s.client.completions.create(model="a", prompt="x", max_tokens=2)
        r = s.http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": adapters["a"]})
        assert r.status_code == 200  # the name is free again
        r = s.http.post("/v1/unload_lora_adapter", json={"lora_name": "d"})
        assert r.status_code == 200
        assert {m.id for m in s.client.models.list().data} == {MODEL, "a", "b"}
        time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors, errors[:3]
    assert done.count(MODEL) >= 1 and done.count("b") >= 1
    st = s.wait_idle()
    assert st.kv_blocks_free == st.kv_blocks_total


# ---------------------------------------------------------------------------------------------
# review regressions: each of these used to answer wrongly, hang or stall
# ---------------------------------------------------------------------------------------------

def test_small_kv_cache_lowers_an_automatic_max_model_len(keyed_server, model_dir):
    s = keyed_server  # 5 usable blocks of 16
    assert s.engine.info.max_model_len == 80
    # no max_tokens: "as many as fit", not a refusal
    r = s.http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                    headers=AUTH)
    assert r.status_code == 200, r.text
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        Engine(EngineConfig(model=str(model_dir), num_kv_blocks=6, block_size=16, max_model_len=128))


def test_more_choices_than_the_queue_holds_is_400_not_503(keyed_server):
    s = keyed_server  # max_queue_len 4
    r = s.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": 8}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert s.wait_idle().kv_blocks_free == s.stats().kv_blocks_total


def test_request_failing_in_the_engine_is_an_error_not_an_empty_200(model_dir, adapters, tmp_path):
    import shutil

    s = RunningServer(EngineConfig(model=str(model_dir), **dict(LORA_KW, max_loras=1, max_cpu_loras=1)), MODEL)
    try:
        gone = tmp_path / "gone"
        shutil.copytree(adapters["a"], gone)
        for name, path in (("gone", str(gone)), ("b", adapters["b"])):  # b pushes gone out of the host cache
            assert s.http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}).status_code == 200
        shutil.rmtree(gone)
        r = s.http.post("/v1/completions", json={"model": "gone", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 500 and "request failed" in r.json()["error"]["message"], r.text
        assert str(tmp_path) not in r.text  # the server logs the adapter's path; the client is not told it
        ok = s.http.post("/v1/completions", json={"model": "b", "prompt": "hi", "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    finally:
        s.close()


def test_pinning_and_unloading_with_every_slot_pinned(model_dir, adapters):
    s = RunningServer(EngineConfig(model=str(model_dir), **dict(LORA_KW, max_loras=1)), MODEL)
    try:
        assert s.http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": adapters["a"]}).status_code == 200
        results = {}

        def post(key, path, body):
            results[key] = s.http.post(path, json=body)

        with s.engine_paused():  # the request for "a" is queued before the pin is handled
            ta = threading.Thread(target=post, args=("a", "/v1/completions",
                                                     {"model": "a", "prompt": "hi", "max_tokens": 2}), daemon=True)
            ta.start()
            wait_until(lambda: len(s.engine.pending_adds) >= 1)  # sent, not yet taken by the held core
            tp = threading.Thread(target=post, args=("pin", "/v1/load_lora_adapter",
                                                     {"lora_name": "c", "lora_path": adapters["c"], "pinned": True}),
                                  daemon=True)
            tp.start()
            wait_until(lambda: len(s.engine.calls) >= 2)  # the hold and the pin
        ta.join(20)
        tp.join(20)
        assert results["pin"].status_code == 409, results["pin"].text
        assert results["a"].status_code == 200, results["a"].text  # the queued request was served
        r = s.http.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": adapters["c"], "pinned": True})
        assert r.status_code == 200, r.text
        # every slot pinned: "a" is refused by name, and can still be unloaded
        r = s.http.post("/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
        assert s.http.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 200
    finally:
        s.close()


def test_prompts_are_tokenized_off_the_event_loop(server, monkeypatch):
    threads = []
    encode = server.engine.tokenizer.encode

    def spy(text):
        threads.append(threading.current_thread().name)
        return encode(text)

    monkeypatch.setattr(server.engine.tokenizer, "encode", spy)
    r = server.http.post("/v1/completions", json={"model": MODEL, "prompt": "hello there", "max_tokens": 2})
    assert r.status_code == 200
    assert threads and all(name.startswith("moeserve-tokenize") for name in threads)
