"""`moeserve bench serve` against a real server on a tiny model (CPU): flags, metrics JSON, failures."""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from moeserve.bench import serve as bench

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
FIELDS = ["date", "duration", "completed", "failed", "num_prompts", "max_concurrency", "request_rate",
          "total_input_tokens", "total_output_tokens", "request_throughput", "output_throughput",
          "total_token_throughput", "errors", "lora_fraction", "endpoint", "model"]
FIELDS += [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
           for s in ("mean", "median", "std", "p50", "p90", "p99")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from moeserve.models.tiny import make_tiny

    return make_tiny("qwen3_moe", tmp_path_factory.mktemp("bench_serve_tiny"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """Base URL of `moeserve serve` on the tiny model, on a free loopback port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [sys.executable, "-m", "moeserve.cli", "serve", "--model", str(model_dir), "--port", str(port),
           "--device", "cpu", "--served-model-name", "tiny", "--log-level", "warning", "--max-model-len", "128"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=ENV)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                if urllib.request.urlopen(base + "/health", timeout=1).status == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.time() < deadline, log.read_text()
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        proc.wait(30)


def _only_json(result_dir: Path) -> dict:
    files = list(result_dir.glob("*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


def test_help_lists_flags(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--base-url", "--endpoint", "--model", "--dataset-name", "--dataset-path", "--random-input-len",
                 "--random-output-len", "--random-range-ratio", "--random-prefix-len", "--num-prompts",
                 "--max-concurrency", "--request-rate", "--burstiness", "--ignore-eos", "--logprobs",
                 "--lora-modules", "--lora-fraction", "--disable-stream", "--percentile-metrics",
                 "--metric-percentiles", "--save-result", "--result-dir", "--launch-server", "--num-warmups"):
        assert flag in out, flag


def test_quantization_needs_a_launched_server(capsys):
    """--quantization sets the launched server's weights; against a running server it is refused by name (and
    the other benchmarks that share the `--` parsing, which have no such flag, still parse)."""
    with pytest.raises(SystemExit):
        bench.main(["--quantization", "fp8", "--num-prompts", "1"])
    assert "--quantization" in capsys.readouterr().err
    from moeserve.bench import churn

    args, server_argv = bench.parse_with_server_argv(churn.build_parser(), ["--adapters", "a=/x", "--launch-server",
                                                                            "--", "--model", "m"])
    assert args.launch_server and server_argv == ["--model", "m"]


def test_requests_and_percentiles():
    """Lengths, the shared prefix and adapter assignment are seeded; percentiles interpolate like numpy."""
    args = bench.build_parser().parse_args(
        ["--num-prompts", "10", "--random-input-len", "20", "--random-range-ratio", "0.5", "--random-prefix-len",
         "5", "--vocab-size", "512", "--lora-modules", "a", "b", "--lora-fraction", "0.4", "--seed", "3"])
    reqs = bench.make_requests(args, "base", chat=False)
    assert reqs == bench.make_requests(args, "base", chat=False)
    assert all(r.prompt[:5] == reqs[0].prompt[:5] and 15 <= r.input_len <= 35 for r in reqs)
    assert all(0 <= t < 512 for r in reqs for t in r.prompt)
    assert sorted(r.model for r in reqs) == ["a", "a", "b", "b"] + ["base"] * 6
    xs = [3.0, 1.0, 4.0, 1.5, 9.0]
    assert bench.percentile(xs, 50) == 3.0 and bench.percentile(xs, 90) == pytest.approx(7.0)


def test_real_run(server, tmp_path, capsys):
    rc = bench.main(["--base-url", server, "--num-prompts", "12", "--max-concurrency", "4", "--random-input-len",
                     "8", "--random-output-len", "4", "--vocab-size", "512", "--logprobs", "0", "--num-warmups",
                     "2", "--save-result", "--result-dir", str(tmp_path), "--save-detailed"])
    out, err = capsys.readouterr()
    assert rc == 0, out
    m = _only_json(tmp_path)
    assert not [f for f in FIELDS if f not in m]
    assert (m["completed"], m["failed"], m["num_prompts"], m["max_concurrency"]) == (12, 0, 12, 4), m["errors"]
    assert (m["total_input_tokens"], m["total_output_tokens"], m["model"]) == (96, 48, "tiny")
    assert m["endpoint"] == "/v1/completions" and m["request_rate"] == "inf" and m["errors"] == []
    # one gap per chunk after the first; a chunk holds several tokens where the frontend folded outputs its
    # reader had not read yet (a busy 2-core machine), so up to 3 gaps for 4 tokens
    assert m["output_lens"] == [4] * 12 and all(len(itl) <= 3 for itl in m["itls"])
    assert all(x >= 0 for itl in m["itls"] for x in itl) and len(m["ttfts"]) == 12
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < m[f"p50_{name}_ms"] <= m[f"p90_{name}_ms"] <= m[f"p99_{name}_ms"], name
    assert m["mean_ttft_ms"] <= m["mean_e2el_ms"]
    assert "Serving Benchmark Result" in out and "P99 TPOT (ms):" in out
    assert "12/12" in err  # the progress bar's last state


def test_models_report_vocab_size_and_max_model_len(server):
    card = json.loads(urllib.request.urlopen(server + "/v1/models", timeout=10).read())["data"][0]
    assert (card["id"], card["object"], card["vocab_size"], card["max_model_len"]) == ("tiny", "model", 512, 128)


def test_defaults_fit_the_server(server, tmp_path, capsys):
    """No --vocab-size and lengths (256 in, 128 out) that do not fit max_model_len 128: the token ids come from the
    server's vocab_size and both lengths are scaled down by one factor, so every request is answered."""
    rc = bench.main(["--base-url", server, "--num-prompts", "3", "--save-result", "--result-dir", str(tmp_path),
                     "--save-detailed", "--disable-tqdm"])
    out, err = capsys.readouterr()
    assert rc == 0, out
    m = _only_json(tmp_path)
    assert (m["completed"], m["failed"]) == (3, 0), m["errors"]
    assert m["input_lens"] == [85] * 3 and m["output_lens"] == [42] * 3  # 256:128 scaled by 128/384
    assert "note: lengths scaled to fit the server's max_model_len 128" in out
    assert "requests" not in err  # --disable-tqdm: no bar


def test_errors_are_counted_before_the_list_is_cut(capsys):
    args = bench.build_parser().parse_args([])
    results = [bench.Result(error="timeout after 600 s")] * 150 + [bench.Result(error="HTTP 400: bad")] * 3
    m = bench.metrics(args, results, 1.0, "/v1/completions", "m")
    assert len(m["errors"]) == bench.MAX_ERRORS and m["failed"] == 153
    assert m["error_counts"] == {"timeout after 600 s": 150, "HTTP 400: bad": 3}
    bench.print_table(args, m)
    out = capsys.readouterr().out
    assert "error (150x): timeout after 600 s" in out and "error (3x): HTTP 400: bad" in out
    assert "150 request(s) timed out" in out


def test_refused_requests_are_failures(server, tmp_path, capsys):
    rc = bench.main(["--base-url", server, "--model", "does-not-exist", "--num-prompts", "5", "--random-input-len",
                     "4", "--random-output-len", "2", "--vocab-size", "512", "--save-result", "--result-dir",
                     str(tmp_path), "--result-filename", "r.json"])
    out, err = capsys.readouterr()
    assert rc == 1  # nothing completed
    m = json.loads((tmp_path / "r.json").read_text())
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (0, 5, 0)
    assert len(m["errors"]) == 5 and all("404" in e and "does-not-exist" in e for e in m["errors"])
    assert "error (5x): HTTP 404" in out
    assert "5/5" in err and "failed=5" in err  # the progress bar counts failures as they come


def test_launch_server_chat(model_dir, tmp_path, capsys, monkeypatch):
    """--launch-server starts `moeserve serve` with the arguments after `--`; chat endpoint, no streaming too."""
    common = ["--endpoint", "/v1/chat/completions", "--num-prompts", "3", "--random-input-len", "6",
              "--random-output-len", "3", "--save-result", "--result-dir", str(tmp_path)]
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the launched server imports this checkout
    rc = bench.main([*common, "--launch-server", "--label", "chat", "--",
                     "--model", str(model_dir), "--device", "cpu", "--log-level", "warning"])
    assert rc == 0, capsys.readouterr()
    m = _only_json(tmp_path)
    assert (m["completed"], m["total_output_tokens"], m["endpoint"]) == (3, 9, "/v1/chat/completions")
    assert m["total_input_tokens"] > 3 * 6  # the chat template adds tokens; counted from usage
    assert m["p50_ttft_ms"] > 0
