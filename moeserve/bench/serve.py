"""Serving benchmark: many concurrent clients against a running OpenAI-compatible server (as `vllm bench serve`).

Protocol (docs/benchmarks.md, "Serving"): `--num-prompts` requests are sent to `--endpoint`
(/v1/completions or /v1/chat/completions), arriving at `--request-rate` per second (Poisson, or gamma
with `--burstiness`; inf = all at once), at most `--max-concurrency` in flight. Random prompts are
lists of random token ids sent as the token-id `prompt` of /v1/completions, so input lengths are exact; the ids
are drawn below the `vocab_size` GET /v1/models reports for the model (or --vocab-size), and input and output
lengths are scaled down together, keeping their ratio, when the longest request would not fit its
`max_model_len`. `--ignore-eos` (default for random data) makes every request produce exactly its output length.
Streaming (default) asks for `stream_options.include_usage`; per request:
  TTFT = first chunk carrying text or logprobs, ITL = gaps between later such chunks,
  E2EL = whole request, TPOT = (E2EL - TTFT) / (output tokens - 1), output tokens from usage.
A request with HTTP status != 200, an in-band `error` event, a connection error or a timeout counts
as failed and keeps its error text. Throughputs divide by the wall time from the first send to the
last answer. A progress bar counts answered and failed requests (--disable-tqdm: none). Prints a table and the
most frequent errors with their counts; `--save-result` writes vLLM's JSON field names (`errors`: the first
100; `error_counts`: every distinct error and how often). Exit status 1 when no request completed. The defaults
(512 requests at once, 256 tokens in, 128 out) are sized for a GPU server; on CPU ask for less:

    moeserve bench serve --num-prompts 32 --max-concurrency 8 --random-input-len 64 --random-output-len 32
    moeserve bench serve --base-url http://127.0.0.1:8000 --num-prompts 512 --max-concurrency 256 \\
        --random-input-len 256 --random-output-len 128 --logprobs 0 --save-result
    moeserve bench serve --launch-server --max-concurrency 256 -- --model /models/Qwen3-30B-A3B --load-format dummy
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

METRICS = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had by "
         "word but not what all were we when your can said there use an each which she do how their if will up "
         "other about out many then them these so some her would make like him into time has look two more").split()
MAX_ERRORS = 100  # error strings kept in the JSON


@dataclass
class Request:
    prompt: list[int] | str
    input_len: int
    output_len: int
    model: str


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    input_len: int = 0
    output_len: int = 0
    ttft: float | None = None  # seconds; None when not streamed
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moeserve bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000 (default: http://HOST:PORT)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    g.add_argument("--model", default=None, help="served model name (default: first id of GET /v1/models)")
    g.add_argument("--launch-server", action="store_true",
                   help="start `moeserve serve` with the arguments after a literal `--`, on a free port")
    g.add_argument("--quantization", default=None, choices=("fp8",),
                   help="with --launch-server: the server's --quantization (its base weights in block-wise FP8)")
    g.add_argument("--server-timeout", type=float, default=900.0, help="seconds to wait for its /health")
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", default="random", choices=("random", "jsonl"))
    g.add_argument("--dataset-path", default=None,
                   help='JSONL: {"prompt": str | [token ids], "output_len": int (default --random-output-len)}')
    g.add_argument("--random-input-len", type=int, default=256)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]")
    g.add_argument("--random-prefix-len", type=int, default=0,
                   help="shared prefix of this many tokens before every random prompt (prefix caching)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="random token ids in [min(1000, V/2), V) (default: V = the vocab_size GET /v1/models "
                        "reports; [1000, 30000) when it reports none)")
    g.add_argument("--num-prompts", type=int, default=512)
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("traffic")
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (default: inf)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals; 1 = Poisson")
    g.add_argument("--num-warmups", type=int, default=0, help="requests sent before timing")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    g.add_argument("--disable-stream", action="store_true")
    g = p.add_argument_group("sampling")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="default: on for random data, off for jsonl")
    g.add_argument("--logprobs", type=int, default=None)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME", help="served adapter names")
    g.add_argument("--lora-fraction", type=float, default=None,
                   help="fraction of requests using an adapter (default: 1 with --lora-modules)")
    g = p.add_argument_group("results")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    g.add_argument("--metric-percentiles", default="50,90,99")
    g.add_argument("--save-result", action="store_true")
    g.add_argument("--save-detailed", action="store_true", help="also per-request input_lens, output_lens, ...")
    g.add_argument("--result-dir", default=".")
    g.add_argument("--result-filename", default=None)
    g.add_argument("--label", default=None)
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return p


def _lens(rng: random.Random, n: int, length: int, ratio: float, low: int) -> list[int]:
    lo, hi = max(low, int(length * (1 - ratio))), max(low, int(length * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def fit_lengths(args, max_model_len: int | None) -> tuple[int, int, int]:
    """(prefix, input, output) lengths of random requests: the flags', or all three scaled down by one factor
    when the longest request they allow (lengths at their range's top) would not fit max_model_len tokens."""
    lens = (args.random_prefix_len, args.random_input_len, args.random_output_len)
    grow = 1 + args.random_range_ratio
    if max_model_len is None or lens[0] + int(lens[1] * grow) + int(lens[2] * grow) <= max_model_len:
        return lens
    f = max_model_len / (lens[0] + (lens[1] + lens[2]) * grow)  # the scaled lengths' top is at most max_model_len
    prefix, inp, out = (int(n * f) for n in lens)
    return prefix, max(inp, 0 if prefix else 1), max(out, 1)


def make_requests(args, model: str, chat: bool, vocab_size: int | None = None,
                  max_model_len: int | None = None) -> list[Request]:
    """`vocab_size`, `max_model_len`: the server's, for random token-id prompts (--vocab-size wins)."""
    rng = random.Random(args.seed)
    n = args.num_prompts
    if args.dataset_name == "jsonl":
        if not args.dataset_path:
            raise ValueError("--dataset-name jsonl needs --dataset-path")
        rows = [json.loads(line) for line in Path(args.dataset_path).read_text().splitlines() if line.strip()]
        if not rows:
            raise ValueError(f"{args.dataset_path} holds no requests")
        reqs = []
        for i in range(n):  # cycle when asked for more requests than lines
            row = rows[i % len(rows)]
            prompt = row["prompt"]
            if chat and not isinstance(prompt, str):
                raise ValueError("/v1/chat/completions needs text prompts, not token ids")
            in_len = len(prompt) if isinstance(prompt, list) else 0  # 0: taken from usage later
            reqs.append(Request(prompt, in_len, int(row.get("output_len", args.random_output_len)), model))
    else:
        vocab = args.vocab_size or vocab_size
        lo, hi = (1000, 30000) if vocab is None else (min(1000, vocab // 2), vocab)
        # chat prompts are text, whose token count only the server knows: their lengths are the flags'
        prefix_len, input_len, output_len = fit_lengths(args, None if chat else max_model_len)
        in_lens = _lens(rng, n, input_len, args.random_range_ratio, 0 if prefix_len else 1)
        out_lens = _lens(rng, n, output_len, args.random_range_ratio, 1)
        if chat:  # chat templates take text: one random word is about one token
            prefix = " ".join(rng.choice(WORDS) for _ in range(prefix_len))
            texts = [" ".join(rng.choice(WORDS) for _ in range(k)) for k in in_lens]
            reqs = [Request((prefix + " " + t).strip(), 0, o, model) for t, o in zip(texts, out_lens)]
        else:
            prefix = [rng.randrange(lo, hi) for _ in range(prefix_len)]
            reqs = [Request(prefix + [rng.randrange(lo, hi) for _ in range(k)], len(prefix) + k, o, model)
                    for k, o in zip(in_lens, out_lens)]
    if args.lora_modules:  # which requests use an adapter: seeded; which adapter: round-robin
        frac = 1.0 if args.lora_fraction is None else args.lora_fraction
        chosen = sorted(rng.sample(range(n), round(n * frac)))
        for j, i in enumerate(chosen):
            reqs[i].model = args.lora_modules[j % len(args.lora_modules)]
    return reqs


def payload(args, req: Request, chat: bool, ignore_eos: bool) -> dict:
    body = {"model": req.model, "temperature": args.temperature, "ignore_eos": ignore_eos,
            "stream": not args.disable_stream}
    if not args.disable_stream:
        body["stream_options"] = {"include_usage": True}
    if chat:
        body.update(messages=[{"role": "user", "content": req.prompt}], max_completion_tokens=req.output_len)
        if args.logprobs is not None:
            body.update(logprobs=True, top_logprobs=args.logprobs)
    else:
        body.update(prompt=req.prompt, max_tokens=req.output_len)
        if args.logprobs is not None:
            body["logprobs"] = args.logprobs
    return body


def _error_text(status: int, text: str) -> str:
    try:
        text = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        pass
    return f"HTTP {status}: {str(text)[:300]}"


async def send(session, url: str, headers: dict, body: dict, req: Request, timeout: float) -> Result:
    import aiohttp

    res = Result(input_len=req.input_len)
    start = last = time.perf_counter()
    chunks, done = 0, False
    try:
        async with session.post(url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            if r.status != 200:
                res.error = _error_text(r.status, await r.text())
                return res
            if not body["stream"]:
                usage = (await r.json()).get("usage") or {}
                res.output_len = usage.get("completion_tokens", 0)
                res.input_len = usage.get("prompt_tokens", res.input_len)
                res.ok, res.latency = True, time.perf_counter() - start
                return res
            buf = b""
            async for data in r.content.iter_any():
                now = time.perf_counter()
                buf += data
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue  # blank separators, comments
                    line = line[5:].strip()
                    if line == b"[DONE]":
                        done = True
                        continue
                    event = json.loads(line)
                    if event.get("error"):
                        err = event["error"]
                        res.error = "in-band error: " + str(err.get("message", err) if isinstance(err, dict) else err)
                        return res
                    if event.get("usage"):
                        res.output_len = event["usage"].get("completion_tokens", 0)
                        res.input_len = event["usage"].get("prompt_tokens", res.input_len)
                    c = (event.get("choices") or [{}])[0]
                    lp = c.get("logprobs") or {}
                    text = (c.get("delta") or {}).get("content") if "delta" in c else c.get("text")
                    if text or lp.get("tokens") or lp.get("content"):  # a chunk that carries tokens
                        if res.ttft is None:
                            res.ttft = now - start
                        else:
                            res.itls.append(now - last)
                        last, chunks = now, chunks + 1
            if not done:
                res.error = "stream ended before [DONE]"
                return res
    except asyncio.TimeoutError:
        res.error = f"timeout after {timeout:g} s"
        return res
    except (aiohttp.ClientError, OSError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - start
    res.output_len = res.output_len or chunks  # no usage chunk: one token per chunk
    res.ttft = res.latency if res.ttft is None else res.ttft
    res.ok = True
    return res


async def run(args, url: str, headers: dict, reqs: list[Request], chat: bool, ignore_eos: bool):
    import aiohttp
    from tqdm import tqdm

    failed = [0]  # shown beside the progress bar
    limit = args.max_concurrency or 0  # 0 = unlimited connections
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit)) as session:
        async def one(req: Request, bar=None) -> Result:
            call = send(session, url, headers, payload(args, req, chat, ignore_eos), req, args.timeout)
            if sem is None:
                res = await call
            else:
                async with sem:
                    res = await call
            if bar is not None:
                failed[0] += not res.ok
                if not res.ok:
                    bar.set_postfix(failed=failed[0], refresh=False)
                bar.update(1)
            return res

        if args.num_warmups:
            warm = await asyncio.gather(*(one(reqs[i % len(reqs)]) for i in range(args.num_warmups)))
            bad = [w.error for w in warm if not w.ok]
            if bad:
                print(f"warning: {len(bad)} of {len(warm)} warm-up requests failed: {bad[0]}", file=sys.stderr)
        arrivals = random.Random(args.seed + 1)  # separate stream: the same prompts at any rate
        tasks = []
        bar = tqdm(total=len(reqs), desc="requests", unit="req", disable=args.disable_tqdm, dynamic_ncols=True)
        start = time.perf_counter()
        with bar:
            for i, req in enumerate(reqs):
                if i and math.isfinite(args.request_rate):  # gamma(k, 1/(rate k)) gaps: mean 1/rate, k=1 Poisson
                    k = args.burstiness
                    await asyncio.sleep(arrivals.gammavariate(k, 1.0 / (args.request_rate * k)))
                tasks.append(asyncio.create_task(one(req, bar)))
            results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def percentile(xs: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not xs:
        return 0.0
    xs = sorted(xs)
    pos = (len(xs) - 1) * p / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _percentiles(args) -> list[float]:
    return [float(p) for p in args.metric_percentiles.split(",") if p.strip()]


def metrics(args, results: list[Result], duration: float, endpoint: str, model: str) -> dict:
    ok = [r for r in results if r.ok]
    tin, tout = sum(r.input_len for r in ok), sum(r.output_len for r in ok)
    streamed = [r for r in ok if not args.disable_stream]
    series = {"ttft": [r.ttft for r in streamed],
              "tpot": [(r.latency - r.ttft) / (r.output_len - 1) for r in streamed if r.output_len > 1],
              "itl": [x for r in streamed for x in r.itls],
              "e2el": [r.latency for r in ok]}
    rate = args.request_rate if math.isfinite(args.request_rate) else "inf"  # JSON has no Infinity
    out = {"date": time.strftime("%Y%m%d-%H%M%S"), "label": args.label, "endpoint": endpoint, "model": model,
           "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
           "num_prompts": len(results), "max_concurrency": args.max_concurrency, "request_rate": rate,
           "burstiness": args.burstiness, "lora_modules": args.lora_modules,
           "lora_fraction": (1.0 if args.lora_fraction is None else args.lora_fraction) if args.lora_modules else 0.0,
           "total_input_tokens": tin, "total_output_tokens": tout,
           "request_throughput": len(ok) / duration, "output_throughput": tout / duration,
           "total_token_throughput": (tin + tout) / duration}
    for name, xs in series.items():
        ms = [x * 1000 for x in xs]
        out[f"mean_{name}_ms"] = statistics.fmean(ms) if ms else 0.0
        out[f"median_{name}_ms"] = statistics.median(ms) if ms else 0.0
        out[f"std_{name}_ms"] = statistics.pstdev(ms) if ms else 0.0
        for p in _percentiles(args):
            out[f"p{p:g}_{name}_ms"] = percentile(ms, p)
    errors = [r.error for r in results if not r.ok]
    out["errors"] = errors[:MAX_ERRORS]
    out["error_counts"] = dict(Counter(errors).most_common())  # counted before the list above is cut
    if args.save_detailed:
        out.update(input_lens=[r.input_len for r in results], output_lens=[r.output_len for r in results],
                   ttfts=[r.ttft for r in results], itls=[r.itls for r in results])
    return out


def print_table(args, m: dict) -> None:
    def row(k, v):
        print(f"{k:<40}{v:<10.2f}" if isinstance(v, float) else f"{k:<40}{v:<10}")

    print("{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="))
    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    row("Maximum request concurrency:", m["max_concurrency"] or "unlimited")
    row("Request rate (req/s):", m["request_rate"])
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    for name in [x.strip() for x in args.percentile_metrics.split(",") if x.strip()]:
        if name not in METRICS or (args.disable_stream and name != "e2el"):
            continue  # without streaming only end-to-end latency is measured
        print("{s:{c}^50}".format(s=METRICS[name], c="-"))
        row(f"Mean {name.upper()} (ms):", m[f"mean_{name}_ms"])
        row(f"Median {name.upper()} (ms):", m[f"median_{name}_ms"])
        for p in _percentiles(args):
            row(f"P{p:g} {name.upper()} (ms):", m[f"p{p:g}_{name}_ms"])
    print("=" * 50)
    counts = m["error_counts"]
    for e, k in list(counts.items())[:5]:  # the most frequent
        print(f"error ({k}x): {e}")
    if len(counts) > 5:
        print(f"... and {len(counts) - 5} other distinct errors ({sum(list(counts.values())[5:])} requests)")
    timeouts = sum(k for e, k in counts.items() if e.startswith("timeout after"))
    if timeouts:
        print(f"{timeouts} request(s) timed out: the server answers slower than this load needs; ask for less "
              "(--num-prompts, --max-concurrency, --random-input-len, --random-output-len) or raise --timeout")


def note_lengths(args, vocab_size: int | None, max_model_len: int | None) -> None:
    """Say where the random prompts' token ids and lengths come from when the server, not a flag, decided."""
    if args.vocab_size is None and vocab_size is None:
        print("note: the server reports no vocab_size: random token ids in [1000, 30000) (give --vocab-size)")
    fitted = fit_lengths(args, max_model_len)
    if fitted != (args.random_prefix_len, args.random_input_len, args.random_output_len):
        prefix, inp, out = fitted
        print(f"note: lengths scaled to fit the server's max_model_len {max_model_len}: --random-input-len {inp}, "
              f"--random-output-len {out}" + (f", --random-prefix-len {prefix}" if args.random_prefix_len else ""))


def _get(url: str, headers: dict, timeout: float = 10.0):
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as r:
        return r.status, r.read()


def launch_server(server_argv: list[str], timeout: float):
    with socket.socket() as s:  # a free port: the OS picks one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.NamedTemporaryFile("w+", prefix="moeserve-bench-server-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "moeserve.cli", "serve", *server_argv, "--port", str(port)]  # last --port wins
    print(f"launching: {' '.join(cmd)} (log: {log.name})", flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if _get(base + "/health", {}, timeout=2)[0] == 200:
                return proc, log.name, base
        except OSError:
            pass
        time.sleep(0.25)
    why = "exited" if proc.poll() is not None else f"was not healthy after {timeout:g} s"
    stop_server(proc)
    raise RuntimeError(f"server {why}:\n{_tail(log.name)}")


def stop_server(proc) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tail(path: str, n: int = 40) -> str:
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])


def parse_with_server_argv(parser: argparse.ArgumentParser, argv: list[str] | None):
    """(the benchmark's parsed arguments, the arguments after `--`, which belong to `moeserve serve` and need
    --launch-server)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    server_argv = []
    if "--" in argv:
        i = argv.index("--")
        argv, server_argv = argv[:i], argv[i + 1:]
    args = parser.parse_args(argv)
    if server_argv and not args.launch_server:
        parser.error("arguments after `--` need --launch-server")
    return args, server_argv


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, server_argv = parse_with_server_argv(parser, argv)
    if args.quantization and not args.launch_server:
        parser.error("--quantization sets the launched server's weights: it needs --launch-server (a running "
                     "server was started with its own --quantization)")
    chat = args.endpoint.rstrip("/").endswith("/chat/completions")
    key = os.environ.get("OPENAI_API_KEY") or os.environ.get("MOESERVE_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    proc = log = None
    if args.launch_server:
        try:
            quantization = ["--quantization", args.quantization] if args.quantization else []
            proc, log, base = launch_server([*server_argv, *quantization], args.server_timeout)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    else:
        base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
        if base.endswith("/v1") and args.endpoint.startswith("/v1/"):
            base = base[:-3]  # accept the OpenAI-client style base URL too
    try:
        try:
            cards = json.loads(_get(base + "/v1/models", headers)[1])["data"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            if args.model is None:
                print(f"error: no model name from {base}/v1/models ({e}); give --model", file=sys.stderr)
                return 1
            cards = []
        model = args.model or (cards[0]["id"] if cards else None)
        if model is None:
            print(f"error: {base}/v1/models lists no model; give --model", file=sys.stderr)
            return 1
        card = next((c for c in cards if c.get("id") == model), cards[0] if cards else {})
        vocab_size, max_model_len = card.get("vocab_size"), card.get("max_model_len")
        if args.dataset_name == "random" and not chat:
            note_lengths(args, vocab_size, max_model_len)
        ignore_eos = args.dataset_name == "random" if args.ignore_eos is None else args.ignore_eos
        reqs = make_requests(args, model, chat, vocab_size, max_model_len)
        print(f"{len(reqs)} requests to {base}{args.endpoint} (model {model!r}, concurrency "
              f"{args.max_concurrency or 'unlimited'}, rate {args.request_rate:g}/s)", flush=True)
        results, duration = asyncio.run(run(args, base + args.endpoint, headers, reqs, chat, ignore_eos))
        m = metrics(args, results, duration, args.endpoint, model)
        print_table(args, m)
        if proc is not None and (m["failed"] or proc.poll() is not None):
            print(f"--- server log tail ({log}):\n{_tail(log)}", file=sys.stderr)
            log = None  # kept for the user
        if args.save_result:
            name = args.result_filename or "bench-serve-{}-{}.json".format(
                re.sub(r"[^A-Za-z0-9._-]+", "_", args.label or model), m["date"])
            path = Path(args.result_dir) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(m, indent=2) + "\n")
            print(f"wrote {path}")
        return 0 if m["completed"] else 1  # nothing answered: a failed run
    finally:
        if proc is not None:
            stop_server(proc)
        if log is not None:
            os.unlink(log)


if __name__ == "__main__":
    sys.exit(main())
