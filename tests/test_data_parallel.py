"""Data parallelism (--data-parallel-size 2): two engine cores behind one `moeserve serve`, on CPU with the tiny
model. Greedy outputs equal the one-core engine's for mixed adapter traffic, both cores get requests, an abort
reaches the core serving the request, adapters are loaded, reloaded and unloaded on both cores (a load that fails
on one lands on neither), /metrics sums the cores, a killed core fails only its own requests while /health says
so, and SIGTERM stops both cores with nothing left behind."""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import re
import signal
import sys

import pytest

openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from moeserve import Engine, EngineConfig, SamplingParams  # noqa: E402
from moeserve.errors import EngineDeadError, LoRAAdapterError  # noqa: E402
from moeserve.frontend.dp_client import DataParallelClient, core_environments, core_gpus  # noqa: E402
from moeserve.models.tiny import make_tiny  # noqa: E402
from server_harness import RunningServer  # noqa: E402
from test_service_lifecycle import _serve_fails, _start_server, leftovers  # noqa: E402,F401 - the fixture

MODEL = "tiny-moe"
ENGINE_KW = dict(max_model_len=128, num_kv_blocks=128, max_num_seqs=16, enable_lora=True, max_loras=4,
                 max_lora_rank=8, device="cpu")
PROMPTS = ["hello world", "the quick brown fox", "a b c", "moe", "numbers 1 2 3", "small models say odd things"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny("qwen3_moe", tmp_path_factory.mktemp("dp_tiny"))


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    """Adapters a, b (loaded at start) and d (loaded from the folder at its first request)."""
    from peft_fixtures import make_peft_adapter

    root = tmp_path_factory.mktemp("dp_adapters")
    for i, (name, kind) in enumerate({"a": "attn+experts", "b": "experts", "d": "attn"}.items()):
        make_peft_adapter("qwen3_moe", root / name, kind=kind, rank=4, seed=i + 1)
    return root


@pytest.fixture(scope="module")
def config(model_dir, lora_dir):
    return EngineConfig(model=str(model_dir), lora_modules={n: str(lora_dir / n) for n in "ab"},
                        enable_lora_runtime_loading=True, lora_dir=str(lora_dir), **ENGINE_KW)


@pytest.fixture(scope="module")
def server(config):
    s = RunningServer(dataclasses.replace(config, data_parallel_size=2), MODEL)
    yield s
    s.close()


@pytest.fixture(scope="module")
def ref(config, lora_dir):
    """The one-core engine on the same model and adapters (d and a copy of a as c loaded too): the reference."""
    engine = Engine(config)
    engine.load_lora("c", str(lora_dir / "a"))
    engine.load_lora("d", str(lora_dir / "d"))
    return engine


def greedy(ref: Engine, prompt: str, lora: str | None, max_tokens: int = 8) -> str:
    return ref.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0), lora=[lora])[0].text


def complete_all(server, jobs: list[tuple[str, str]], max_tokens: int = 8) -> list[str]:
    """(model, prompt) jobs sent at once; their greedy texts."""
    def one(job):
        model, prompt = job
        r = server.client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
        return r.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(one, jobs))


def per_core(server):
    return server.run(server.engine.stats_per_core())


def metrics(server) -> dict:
    samples = {}
    for fam in text_string_to_metric_families(server.http.get("/metrics").text):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_outputs_equal_one_core_for_mixed_adapter_traffic_and_both_cores_serve(server, ref):
    assert isinstance(server.engine, DataParallelClient) and len(server.engine.clients) == 2
    before = [s.requests_total for s in per_core(server)]
    jobs = [(model, p) for p in PROMPTS for model in (MODEL, "a", "b")]
    got = complete_all(server, jobs)
    assert got == [greedy(ref, p, None if model == MODEL else model) for model, p in jobs]
    after = per_core(server)
    served = [s.requests_total - b for s, b in zip(after, before)]
    assert sum(served) == len(jobs) and min(served) > 0, served
    # chat, on an adapter: the same text as the one-core engine
    messages = [{"role": "user", "content": "what is a mixture of experts?"}]
    r = server.client.chat.completions.create(model="a", messages=messages, max_tokens=8, temperature=0)
    want = ref.generate([ref.chat_prompt(messages)], SamplingParams(max_tokens=8, temperature=0), lora=["a"])[0]
    assert r.choices[0].message.content == want.text
    after = per_core(server)
    # one request at a time: equally idle cores take turns
    for p in PROMPTS[:4]:
        complete_all(server, [(MODEL, p)])
    turns = [s.requests_total - a.requests_total for s, a in zip(per_core(server), after)]
    assert turns == [2, 2], turns
    # /metrics: counters summed over the cores, ratios per core
    server.wait_idle()
    cores, m = per_core(server), metrics(server)
    assert m[("moeserve_engine_requests_total", ())] == sum(s.requests_total for s in cores)
    assert m[("moeserve_generation_tokens_total", ())] == sum(s.generation_tokens_total for s in cores)
    assert m[("moeserve_kv_blocks_total", ())] == sum(s.kv_blocks_total for s in cores)
    assert {k for k in m if k[0] == "moeserve_kv_cache_usage_ratio"} == {
        ("moeserve_kv_cache_usage_ratio", (("engine", "0"),)), ("moeserve_kv_cache_usage_ratio", (("engine", "1"),))}
    assert m[("moeserve_lora_adapters", (("engine", "1"),))] == cores[1].lora_adapters_known


def test_abort_reaches_the_core_serving_the_request(server):
    dp = server.engine
    server.wait_idle()
    before = [s.aborted_total for s in per_core(server)]

    async def main():
        stream = await dp.submit("hello", SamplingParams(max_tokens=100, ignore_eos=True), request_id="long")
        owner = next(i for i, c in enumerate(dp.clients) if "long" in c.streams)
        await stream.__anext__()
        dp.abort("long")
        return owner, [o async for o in stream]

    owner, rest = server.run(main())
    assert rest[-1].finish_reason == "abort"
    server.wait_idle()
    aborted = [s.aborted_total - b for s, b in zip(per_core(server), before)]
    assert aborted == [int(i == owner) for i in range(2)], (owner, aborted)


def _load(server, name: str, path, inplace: bool = False):
    return server.http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path),
                                                           "load_inplace": inplace})


def _models(server) -> dict:
    return {m["id"]: m.get("version") for m in server.http.get("/v1/models").json()["data"]}


def test_adapters_load_reload_and_unload_on_every_core(server, ref, lora_dir):
    dp = server.engine
    assert _load(server, "c", lora_dir / "b").status_code == 200
    assert _models(server)["c"] == 1 and all("c" in c.lora_names for c in dp.clients)
    # reloaded as a new version on both cores: every request after it gets a's weights, whichever core runs it
    assert _load(server, "c", lora_dir / "a", inplace=True).status_code == 200
    assert _models(server)["c"] == 2
    jobs = [("c", p) for p in PROMPTS[:4]]
    assert complete_all(server, jobs) == [greedy(ref, p, "c") for _, p in jobs]
    assert server.http.post("/v1/unload_lora_adapter", json={"lora_name": "c"}).status_code == 200
    assert "c" not in _models(server) and not any("c" in c.lora_names for c in dp.clients)
    assert server.http.post("/v1/completions", json={"model": "c", "prompt": "x"}).status_code == 404
    # from --lora-dir at the first request naming it: on both cores
    jobs = [("d", p) for p in PROMPTS[:4]]
    assert complete_all(server, jobs) == [greedy(ref, p, "d") for _, p in jobs]
    assert _models(server)["d"] == 1 and all("d" in c.lora_names for c in dp.clients)


def test_a_load_that_fails_on_one_core_lands_on_none(server, ref, lora_dir, monkeypatch):
    dp = server.engine
    second = dp.clients[1]
    real_load = second.load_lora

    def broken(name, path, pinned=False, replace=False):  # this core alone reads a path that is not an adapter
        return real_load(name, "/does/not/exist", pinned, replace)

    monkeypatch.setattr(second, "load_lora", broken)
    r = _load(server, "e", lora_dir / "a")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_adapter", r.text  # the core's error
    assert "e" not in _models(server) and not any("e" in c.lora_names for c in dp.clients)
    with pytest.raises(LoRAAdapterError, match="not a directory"):
        server.run(dp.load_lora("e", str(lora_dir / "a")))
    # a reload failing on one core leaves the version before it on both
    monkeypatch.setattr(second, "load_lora", real_load)
    assert _load(server, "e", lora_dir / "a").status_code == 200
    monkeypatch.setattr(second, "load_lora", broken)
    assert _load(server, "e", lora_dir / "b", inplace=True).status_code == 400
    monkeypatch.setattr(second, "load_lora", real_load)
    assert _models(server)["e"] == 1 and all("e" in c.lora_names for c in dp.clients)
    jobs = [("e", p) for p in PROMPTS[:4]]
    assert complete_all(server, jobs) == [greedy(ref, p, "a") for _, p in jobs]  # a's weights, on both cores


def test_config_mistakes_are_named(model_dir, monkeypatch):
    with pytest.raises(ValueError, match=r"data_parallel_size \(--data-parallel-size\) must be a positive integer"):
        DataParallelClient(EngineConfig(model=str(model_dir), device="cpu", data_parallel_size=0))
    with pytest.raises(ValueError, match="--data-parallel-size"):
        EngineConfig(model=str(model_dir), device="cpu", data_parallel_size=-1).resolve()
    with pytest.raises(ValueError, match="runs one copy of the model"):  # the offline engine (`generate`)
        Engine(EngineConfig(model=str(model_dir), device="cpu", data_parallel_size=2))
    assert core_gpus(["0", "1", "2", "3"], 2, 2) == ["0,1", "2,3"]  # DP x TP: each core its own ranks' GPUs
    assert core_gpus(["GPU-x", "GPU-y"], 2, 1) == ["GPU-x", "GPU-y"]
    with pytest.raises(ValueError, match=r"--data-parallel-size 2 x --tensor-parallel-size 2 needs 4 GPUs.*3 visible"):
        core_gpus(["0", "1", "2"], 2, 2)
    # on a machine with one visible GPU, refused before any process starts
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(ValueError, match="needs 2 GPUs, one per rank of every core; 1 visible"):
        asyncio.run(DataParallelClient.start(EngineConfig(model=str(model_dir), data_parallel_size=2)))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert core_environments(EngineConfig(device="cuda", data_parallel_size=2)) == [
        {"CUDA_VISIBLE_DEVICES": "3"}, {"CUDA_VISIBLE_DEVICES": "5"}]
    with pytest.raises(ValueError, match="--device cuda:1 names one GPU"):
        core_environments(EngineConfig(device="cuda:1", data_parallel_size=2))


def test_a_core_failing_to_start_or_a_stop_while_starting_stops_every_core(config):
    two = dataclasses.replace(config, data_parallel_size=2)

    async def one_fails():
        dp = DataParallelClient(two)
        dp.clients[1].config = dataclasses.replace(dp.clients[1].config, block_size=12)  # this core alone refuses
        with pytest.raises(ValueError, match="--block-size"):
            await dp._start()
        return dp

    async def stopped():
        dp = DataParallelClient(two)
        start = asyncio.ensure_future(dp._start())
        while not all(getattr(c, "proc", None) is not None for c in dp.clients):
            await asyncio.sleep(0.01)
        start.cancel()  # what the server does at a stop signal
        with pytest.raises(asyncio.CancelledError):
            await start
        return dp

    for run in (one_fails, stopped):
        dp = asyncio.run(run())
        assert [c.proc.exitcode is not None for c in dp.clients] == [True, True]  # both ended and reaped


def test_a_killed_core_fails_only_its_requests_and_health_says_so(server, ref):
    """Last in this file: it leaves the shared server with one core."""
    dp = server.engine
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)

    async def main():
        first = await dp.submit("hello world", params)
        second = await dp.submit("hello world", params)  # the other core: the first is in flight
        owners = [next(i for i, c in enumerate(dp.clients) if s.request_id in c.streams) for s in (first, second)]
        await first.__anext__()
        os.kill(dp.clients[owners[0]].proc.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="died"):
            async for _ in first:
                pass
        return owners, [o async for o in second][-1]

    owners, last = server.run(main())
    assert sorted(owners) == [0, 1]
    want = ref.generate(["hello world"], params)[0]
    assert last.finish_reason == "length" and last.token_ids == want.token_ids
    r = server.http.get("/health")
    assert r.status_code == 503 and f"engine core {owners[0]}" in r.json()["error"]["message"], r.text
    # the live core keeps serving: new requests go to it, /metrics shows it
    assert complete_all(server, [(MODEL, "moe"), ("a", "moe")]) == [greedy(ref, "moe", None), greedy(ref, "moe", "a")]
    assert ("moeserve_engine_requests_total", ()) in metrics(server)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="child subreaper and /proc: Linux")
def test_sigterm_stops_every_core_and_a_failed_start_is_one_error_line(model_dir, tmp_path, leftovers):  # noqa: F811
    import httpx

    log = tmp_path / "server.log"
    proc, url = _start_server(leftovers, model_dir, log, "--data-parallel-size", "2", "--shutdown-timeout", "60")
    line = next(line for line in log.read_text().splitlines() if "engine cores (data parallel)" in line)
    cores = [int(p) for p in line.split("pids ")[1].split(", cpu")[0].split(", ")]
    assert len(cores) == 2
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 60, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=60) as http, http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # running
        os.killpg(proc.pid, signal.SIGTERM)  # systemd: every process of the service
        events = [line for line in lines if line.startswith("data: ")]
    assert proc.wait(90) == 0, log.read_text()
    assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2].replace(" ", "")
    text = log.read_text()
    assert "ERROR" not in text and "Traceback" not in text, text
    assert {"[core 0]", "[core 1]"} <= set(re.findall(r"\[core \d\]", text)), text  # each core's lines named
    assert not leftovers() and not any(os.path.exists(f"/proc/{pid}") for pid in cores), (leftovers(), text)
    # a mistake every core finds: one line, both cores stopped
    err = _serve_fails(leftovers, "--model", str(model_dir), "--data-parallel-size", "2", "--lora-modules",
                       f"a={tmp_path / 'nope'}")
    assert "LoRA adapter 'a'" in err, err
