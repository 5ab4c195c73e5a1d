"""Server CPU per refused connection under the 5,000-connection flood of tests/test_reliability.py (CPU, tiny
model, engine held so every request past the queue is refused). Prints one line per flood and writes JSON.

    python benchmarks/session7_2026-11-30/flood_cpu.py --floods 3 --out flood_cpu.json
"""
import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--floods", type=int, default=3)
    ap.add_argument("--connections", type=int, default=5000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import test_reliability as tr
    from moeserve import EngineConfig
    from moeserve.models.tiny import make_tiny

    model = make_tiny("qwen3_moe", tempfile.mkdtemp())
    server = tr.start_server(EngineConfig(model=str(model), **tr.ENGINE_KW), tr.HTTPLimits())
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"model": tr.MODEL, "prompt": "hello", "max_tokens": 2})
    rows = []
    try:
        for _ in range(args.floods):
            server.wait_idle()
            with server.engine_paused():
                r0 = resource.getrusage(resource.RUSAGE_SELF)  # this process: the HTTP server's thread
                proc = subprocess.Popen([sys.executable, "-c", tr.FLOOD_CLIENT, host, port, str(args.connections),
                                         body, str(tr.MAX_QUEUE_LEN)], stdout=subprocess.PIPE, text=True)
                proc.stdout.readline()  # every refusal is in
                r1 = resource.getrusage(resource.RUSAGE_SELF)
            out, _ = proc.communicate(timeout=120)
            refused = sorted(r[1] for r in json.loads(out)["results"] if r[0] == 503)
            row = {"user_us_per_conn": 1e6 * (r1.ru_utime - r0.ru_utime) / args.connections,
                   "sys_us_per_conn": 1e6 * (r1.ru_stime - r0.ru_stime) / args.connections,
                   "refused": len(refused), "worst_ms": 1e3 * refused[-1], "p50_ms": 1e3 * refused[len(refused) // 2]}
            rows.append(row)
            print(f"server CPU per connection: user {row['user_us_per_conn']:.0f} us, sys {row['sys_us_per_conn']:.0f} us; "
                  f"{row['refused']} refused, worst {row['worst_ms']:.0f} ms, p50 {row['p50_ms']:.0f} ms", flush=True)
    finally:
        server.close()
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
