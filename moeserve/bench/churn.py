"""Adapter churn: k adapters over s LoRA slots, loaded, reloaded and unloaded while concurrent traffic runs.

Traffic: `--num-requests` greedy (temperature 0, ignore_eos) non-streaming completions, at most
`--max-concurrency` in flight, each a (prompt, model) pair drawn from `--num-prompts` random word prompts and the
base model plus every adapter (`--base-fraction` of them on the base). Churn, at the same time, cycling over the
adapters until the traffic is done: a reload of the adapter under its name (`load_inplace`, the same files: a new
version, so a new slot load) and an unload followed by a load. Traffic never names an adapter while the churn has
it unloaded: before unloading, the churn takes the name out of the pool senders wait on and waits for its requests
in flight to end (an unload drains, but a request sent after it would rightly be a 404).

Correctness: afterwards every distinct (prompt, model) pair is run again alone (one request at a time, no churn)
on the same server; a churned answer that differs from its solo run is a wrong answer. Reported: req/s over the
traffic phase, latency p50/p99 (send to answer), failed requests, wrong answers, churn operations (and failed
ones). Exit status 1 when any request failed or answered wrongly. The server needs runtime adapter loading on
(`--enable-lora-runtime-loading`); adapter paths are as the server sees them (names inside its --lora-dir too).

    moeserve bench churn --base-url http://127.0.0.1:8000 --adapters a=/ad/a b=/ad/b c=/ad/c d=/ad/d
    moeserve bench churn --adapters a=/ad/a b=/ad/b c=/ad/c d=/ad/d --launch-server -- --model /models/m \\
        --enable-lora --max-loras 2 --enable-lora-runtime-loading
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from moeserve.bench.serve import WORDS, launch_server, parse_with_server_argv, percentile, stop_server


@dataclass
class ChurnResult:
    requests: int = 0
    completed: int = 0
    failed: int = 0
    wrong: int = 0
    duration_s: float = 0.0
    request_throughput: float = 0.0
    p50_latency_ms: float = 0.0
    p99_latency_ms: float = 0.0
    reloads: int = 0
    unload_loads: int = 0
    failed_churn_ops: int = 0
    errors: list[str] = field(default_factory=list)
    answers: list[dict] = field(default_factory=list)  # per request: prompt, model, text, solo (reference) text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moeserve bench churn", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--launch-server", action="store_true",
                   help="start `moeserve serve` with the arguments after a literal `--`, on a free port")
    p.add_argument("--server-timeout", type=float, default=900.0)
    p.add_argument("--model", default=None, help="served base model name (default: first id of /v1/models)")
    p.add_argument("--adapters", nargs="+", required=True, metavar="NAME=PATH",
                   help="the k adapters churned (paths as the server sees them; loaded first if not loaded)")
    p.add_argument("--num-requests", type=int, default=400)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=8, help="distinct prompts the requests draw from")
    p.add_argument("--input-words", type=int, default=12)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--base-fraction", type=float, default=0.2, help="share of requests on the base model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--no-churn", action="store_true", help="the same traffic without churn (a baseline)")
    p.add_argument("--save-result", default=None, metavar="PATH", help="write the numbers as JSON")
    return p


def parse_adapters(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--adapters: expected NAME=PATH, got {item!r}")
        out[name] = path
    return out


async def run_churn(base_url: str, adapters: dict[str, str], *, model: str | None = None, num_requests: int = 400,
                    max_concurrency: int = 16, num_prompts: int = 8, input_words: int = 12, output_len: int = 16,
                    base_fraction: float = 0.2, seed: int = 0, timeout: float = 300.0,
                    churn: bool = True) -> ChurnResult:
    import httpx

    rng = random.Random(seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(input_words)) for _ in range(num_prompts)]
    names = list(adapters)
    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout,
                                 limits=httpx.Limits(max_connections=max_concurrency + 4)) as client:
        listed = (await client.get("/v1/models")).json()["data"]
        model = model or listed[0]["id"]
        for name in set(names) - {m["id"] for m in listed}:
            r = await client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": adapters[name]})
            if r.status_code != 200:
                raise RuntimeError(f"could not load adapter {name!r}: {r.status_code} {r.text}")
        jobs = [(rng.randrange(num_prompts), None if rng.random() < base_fraction else rng.choice(names))
                for _ in range(num_requests)]

        async def complete(prompt: int, adapter: str | None) -> tuple[bool, str]:
            body = {"model": adapter or model, "prompt": prompts[prompt], "max_tokens": output_len,
                    "temperature": 0, "ignore_eos": True}
            try:
                r = await client.post("/v1/completions", json=body)
            except httpx.HTTPError as e:
                return False, f"{type(e).__name__}: {e}"
            if r.status_code != 200:
                return False, f"HTTP {r.status_code}: {r.text[:200]}"
            return True, r.json()["choices"][0]["text"]

        available = set(names)  # adapters senders may name now
        changed = asyncio.Condition()  # availability or in-flight counts changed
        in_flight: Counter[str] = Counter()
        slots = asyncio.Semaphore(max_concurrency)
        res = ChurnResult(requests=num_requests)
        latencies, answers = [], [None] * num_requests

        async def send(i: int) -> None:
            prompt, adapter = jobs[i]
            async with slots:
                if adapter is not None:
                    async with changed:
                        await changed.wait_for(lambda: adapter in available)
                        in_flight[adapter] += 1
                t0 = time.perf_counter()
                ok, text = await complete(prompt, adapter)
                latencies.append(time.perf_counter() - t0)
                if adapter is not None:
                    async with changed:
                        in_flight[adapter] -= 1
                        changed.notify_all()
            answers[i] = (ok, text)

        async def churn_loop(done: asyncio.Event) -> None:
            for op, name in zip(itertools.cycle(("reload", "unload_load")), itertools.cycle(names)):
                if done.is_set():
                    return
                try:
                    if op == "reload":  # weight sync: same files, a new version
                        await _post(client, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": adapters[name],
                                                                      "load_inplace": True})
                        res.reloads += 1
                    else:
                        async with changed:
                            available.discard(name)
                            await changed.wait_for(lambda: in_flight[name] == 0)
                        try:
                            await _post(client, "/v1/unload_lora_adapter", {"lora_name": name})
                            await _post(client, "/v1/load_lora_adapter", {"lora_name": name,
                                                                          "lora_path": adapters[name]})
                            res.unload_loads += 1
                        finally:
                            async with changed:
                                available.add(name)
                                changed.notify_all()
                except RuntimeError as e:
                    res.failed_churn_ops += 1
                    res.errors.append(f"churn {op} {name}: {e}")
                    await asyncio.sleep(0.05)

        done = asyncio.Event()
        churner = asyncio.ensure_future(churn_loop(done) if churn else done.wait())
        t0 = time.perf_counter()
        await asyncio.gather(*(send(i) for i in range(num_requests)))
        res.duration_s = time.perf_counter() - t0
        done.set()
        await churner
        # the references: each distinct request alone on the same server, every adapter loaded, no churn
        solo = {}
        for key in sorted(set(jobs), key=lambda k: (k[0], k[1] or "")):
            ok, text = await complete(*key)
            solo[key] = text if ok else None
            if not ok:
                res.errors.append(f"solo run of {key}: {text}")
    for (prompt, adapter), (ok, text) in zip(jobs, answers):
        if not ok:
            res.failed += 1
            res.errors.append(text)
            continue
        res.completed += 1
        res.wrong += text != solo[(prompt, adapter)]
        res.answers.append({"prompt": prompts[prompt], "model": adapter or model, "text": text,
                            "solo": solo[(prompt, adapter)]})
    res.request_throughput = res.completed / res.duration_s if res.duration_s else 0.0
    ms = [x * 1000 for x in latencies]
    res.p50_latency_ms, res.p99_latency_ms = percentile(ms, 50), percentile(ms, 99)
    res.errors = res.errors[:100]
    return res


async def _post(client, path: str, body: dict) -> None:
    r = await client.post(path, json=body)
    if r.status_code != 200:
        raise RuntimeError(f"{path}: HTTP {r.status_code}: {r.text[:200]}")


def print_table(res: ChurnResult, k: int) -> None:
    print("{s:{c}^56}".format(s=" Adapter Churn Result ", c="="))
    rows = [("Adapters churned:", k), ("Requests (ok / failed):", f"{res.completed} / {res.failed}"),
            ("Wrong answers (vs solo greedy runs):", res.wrong), ("Duration (s):", f"{res.duration_s:.2f}"),
            ("Request throughput (req/s):", f"{res.request_throughput:.2f}"),
            ("Latency p50 / p99 (ms):", f"{res.p50_latency_ms:.1f} / {res.p99_latency_ms:.1f}"),
            ("Reloads (load_inplace):", res.reloads), ("Unload + load cycles:", res.unload_loads),
            ("Failed churn operations:", res.failed_churn_ops)]
    for k_, v in rows:
        print(f"{k_:<40}{v}")
    print("=" * 56)
    for e, n in list(Counter(res.errors).items())[:5]:
        print(f"error ({n}x): {e}")


def main(argv: list[str] | None = None) -> int:
    args, server_argv = parse_with_server_argv(build_parser(), argv)
    adapters = parse_adapters(args.adapters)
    proc, base = None, args.base_url
    if args.launch_server:
        proc, _, base = launch_server(server_argv, args.server_timeout)
    try:
        res = asyncio.run(run_churn(base, adapters, model=args.model, num_requests=args.num_requests,
                                    max_concurrency=args.max_concurrency, num_prompts=args.num_prompts,
                                    input_words=args.input_words, output_len=args.output_len,
                                    base_fraction=args.base_fraction, seed=args.seed, timeout=args.timeout,
                                    churn=not args.no_churn))
    finally:
        if proc is not None:
            stop_server(proc)
    print_table(res, len(adapters))
    if args.save_result:
        out = {k: v for k, v in asdict(res).items() if k != "answers"}
        with open(args.save_result, "w") as f:
            json.dump(dict(out, adapters=sorted(adapters), max_concurrency=args.max_concurrency,
                           output_len=args.output_len), f, indent=2)
    return 0 if res.failed == 0 and res.wrong == 0 and res.failed_churn_ops == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
