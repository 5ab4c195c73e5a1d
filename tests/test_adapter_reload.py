"""Adapters as users manage them (issue 10 items 6-7, issue 15 item 3): reload under the same name
(`load_inplace` / `Engine.load_lora(..., replace=True)`), loading from --lora-dir at first use, and adapter files
read off the engine-core step loop. References: an offline engine with each adapter loaded at start, greedy."""
from __future__ import annotations

import asyncio
import json
import os
import tempfile
import threading

import httpx
import pytest

pytest.importorskip("uvicorn")

from moeserve import Engine, EngineConfig, SamplingParams  # noqa: E402
from moeserve.models.tiny import make_tiny  # noqa: E402
from moeserve.frontend.core_client import EngineClient  # noqa: E402
from moeserve.messages import HoldLoRAReads  # noqa: E402
from server_harness import RunningServer, wait_until  # noqa: E402

MODEL = "tiny-moe"
KW = dict(max_model_len=128, num_kv_blocks=256, max_num_seqs=16, block_size=16, enable_lora=True, max_loras=2,
          max_lora_rank=8)
PROMPTS = ["hello world", "the quick brown fox", "numbers 1 2 3"]
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny("qwen3_moe", tmp_path_factory.mktemp("tiny_reload"))


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    """Adapters a, a2 (a's shapes, other weights), b, c; `bad` has a broken config; `outside` lies beside it."""
    from peft_fixtures import make_peft_adapter

    root = tmp_path_factory.mktemp("reload_root")
    d = root / "adapters"
    d.mkdir()
    for i, (name, kind) in enumerate({"a": "attn+experts", "a2": "attn+experts", "b": "experts",
                                      "c": "attn"}.items()):
        make_peft_adapter("qwen3_moe", d / name, kind=kind, rank=4, seed=i + 1)
    make_peft_adapter("qwen3_moe", root / "outside", kind="attn", rank=4, seed=9)
    (d / "bad").mkdir()
    (d / "bad" / "adapter_config.json").write_text("{not json")
    return d


@pytest.fixture(scope="module")
def ref(model_dir, lora_dir):
    mods = {n: str(lora_dir / n) for n in ("a", "a2", "b", "c")}
    return Engine(EngineConfig(model=str(model_dir), lora_modules=mods, **dict(KW, max_loras=4)))


def ref_texts(ref: Engine, lora: str | None, max_tokens: int = 6) -> list[str]:
    return [o.text for o in ref.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, **GREEDY), lora=lora)]


@pytest.fixture(scope="module")
def server(model_dir, lora_dir):
    s = RunningServer(EngineConfig(model=str(model_dir), lora_modules={"a": str(lora_dir / "a")},
                                   enable_lora_runtime_loading=True, lora_dir=str(lora_dir), **KW), MODEL)
    yield s
    s.close()


def complete(s: RunningServer, model: str, max_tokens: int = 6) -> list[str]:
    out = []
    for p in PROMPTS:
        r = s.http.post("/v1/completions", json={"model": model, "prompt": p, "max_tokens": max_tokens, **GREEDY})
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


def versions(s: RunningServer) -> dict[str, int]:
    data = s.http.get("/v1/models").json()["data"]
    assert data[0]["id"] == MODEL and "version" not in data[0]
    assert all(m["object"] == "model" and m["parent"] == MODEL for m in data[1:])
    return {m["id"]: m["version"] for m in data[1:]}


# ---------------------------------------------------------------------------------------------
# reload under the same name
# ---------------------------------------------------------------------------------------------

def test_offline_replace_mid_request_finishes_on_the_old_version(model_dir, lora_dir, ref):
    """A request started on version 1 finishes on it although a replace lands between its steps; a request
    added after the replace runs on version 2 (the same weights as adapter a2 loaded at start)."""
    eng = Engine(EngineConfig(model=str(model_dir), lora_modules={"a": str(lora_dir / "a")}, **KW))
    params = SamplingParams(max_tokens=12, **GREEDY)
    old = eng.add_request(PROMPTS[0], params, lora="a")
    outs = {}
    while len(eng.core.seqs[old].output_token_ids) < 4:  # version 1 is in use
        outs.update({o.request_id: o for o in eng.step()})
    eng.load_lora("a", str(lora_dir / "a2"), replace=True)
    assert eng.lora_version("a") == 2 and eng.list_loras() == ["a"]
    new = eng.add_request(PROMPTS[0], params, lora="a")
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step()})
    want = {n: ref.generate([PROMPTS[0]], params, lora=n)[0].token_ids for n in ("a", "a2")}
    assert want["a"] != want["a2"]
    assert outs[old].token_ids == want["a"] and outs[new].token_ids == want["a2"]
    with pytest.raises(ValueError, match="already loaded"):
        eng.load_lora("a", str(lora_dir / "a2"))  # without replace: an error, as before


def test_load_inplace_swaps_weights_and_bumps_the_version(server, ref):
    s = server
    assert versions(s) == {"a": 1}
    r = s.http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "a2"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "adapter_exists", r.text  # load_inplace not set
    r = s.http.post("/v1/load_lora_adapter", json={"lora_name": MODEL, "lora_path": "a2", "load_inplace": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name" and "base model" in r.text, r.text
    want_a, want_a2 = ref_texts(ref, "a"), ref_texts(ref, "a2")
    assert want_a != want_a2
    assert complete(s, "a") == want_a
    # a request streaming on version 1 while the reload lands finishes on version 1
    long = SamplingParams(max_tokens=60, **GREEDY)
    want_long = ref.generate([PROMPTS[1]], long, lora="a")[0].text
    with s.http.stream("POST", "/v1/completions", json={"model": "a", "prompt": PROMPTS[1], "max_tokens": 60,
                                                         "stream": True, **GREEDY}) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        r = s.http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "a2", "load_inplace": True})
        assert r.status_code == 200, r.text
        rest = [line for line in lines if line.startswith("data: ")]
    chunks = [json.loads(x[6:]) for x in [first, *rest] if x != "data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == want_long
    assert versions(s) == {"a": 2}
    assert complete(s, "a") == want_a2 and complete(s, f"{MODEL}:a") == want_a2
    r = s.http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "a", "load_inplace": True})
    assert r.status_code == 200, r.text
    assert versions(s) == {"a": 3} and complete(s, "a") == want_a
    # a bad reload changes nothing
    r = s.http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "bad", "load_inplace": True})
    assert r.status_code == 400, r.text
    assert versions(s) == {"a": 3} and complete(s, "a") == want_a


# ---------------------------------------------------------------------------------------------
# adapters loaded from --lora-dir at first use
# ---------------------------------------------------------------------------------------------

def test_first_requests_for_an_adapter_in_lora_dir_load_it_once(server, ref):
    s = server
    assert "b" not in versions(s)
    calls = []
    real = s.engine.load_lora

    async def counted(*args, **kw):
        calls.append(args)
        return await real(*args, **kw)

    s.engine.load_lora = counted
    try:
        client = httpx.AsyncClient(base_url=s.url, timeout=60)

        async def one(prompt, model):
            r = await client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 6,
                                                           **GREEDY})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        async def main():
            try:  # eight first requests at once, by name and by base:name
                return await asyncio.gather(*(one(PROMPTS[i % 3], "b" if i % 2 else f"{MODEL}:b") for i in range(8)))
            finally:
                await client.aclose()

        got = asyncio.run(main())
    finally:
        del s.engine.load_lora
    want = ref_texts(ref, "b")
    assert got == [want[i % 3] for i in range(8)]
    assert [c[0] for c in calls] == ["b"]
    assert versions(s)["b"] == 1
    # chat too, and a loaded-on-demand adapter is an ordinary one: unload works
    r = s.http.post("/v1/chat/completions", json={"model": "c", "messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 4, **GREEDY})
    assert r.status_code == 200, r.text
    assert complete(s, "c") == ref_texts(ref, "c")
    for name in ("b", "c"):
        assert s.http.post("/v1/unload_lora_adapter", json={"lora_name": name}).status_code == 200


@pytest.mark.parametrize("model", ["nope", "bad", "../outside", "outside", "a/../../outside", "%2e%2e", "b:c",
                                   f"{MODEL}:bad", "x" * 200])
def test_a_name_that_cannot_be_loaded_is_404_and_says_nothing_of_the_folder(server, model):
    r = server.http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert err["message"] == f"The model `{model}` does not exist."  # the same words, present folder or not
    assert "outside" not in versions(server) and "bad" not in versions(server)


def test_no_loading_at_first_use_without_runtime_loading(model_dir, lora_dir):
    for extra in (dict(), dict(enable_lora_runtime_loading=True), dict(lora_dir=str(lora_dir))):
        assert not EngineClient(EngineConfig(model=str(model_dir), **KW, **extra)).loads_on_demand
    on = EngineConfig(model=str(model_dir), enable_lora_runtime_loading=True, lora_dir=str(lora_dir), **KW)
    assert EngineClient(on).loads_on_demand


# ---------------------------------------------------------------------------------------------
# adapter files are read off the step loop
# ---------------------------------------------------------------------------------------------

def test_generation_continues_while_an_adapter_file_is_read(server, ref):
    """The core's adapter reads are held (test hook): while a load waits on its file, whole requests — for the
    base model and for a resident adapter — are served; then the load finishes and its adapter serves right."""
    s = server
    flag = tempfile.mktemp(prefix="moeserve-reads-")
    open(flag, "w").close()
    s.run(s.engine.call(HoldLoRAReads(flag)))
    answer = {}

    def load():
        answer["r"] = httpx.post(s.url + "/v1/load_lora_adapter", json={"lora_name": "cc", "lora_path": "c"},
                                 timeout=60)

    t = threading.Thread(target=load)
    t.start()
    try:
        wait_until(lambda: os.path.exists(flag + ".reading"))
        served = complete(s, MODEL, max_tokens=8) + complete(s, "a", max_tokens=8)
        assert "r" not in answer and t.is_alive()  # everything above ran while the file was still being read
    finally:
        os.remove(flag)
        t.join(60)
    os.remove(flag + ".reading")
    assert served == ref_texts(ref, None, 8) + ref_texts(ref, "a", 8)
    assert answer["r"].status_code == 200, answer["r"].text
    assert complete(s, "cc") == ref_texts(ref, "c")
    assert s.http.post("/v1/unload_lora_adapter", json={"lora_name": "cc"}).status_code == 200
