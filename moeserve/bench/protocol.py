"""The serving protocol (docs/benchmarks.md, "Serving") in one run: what users see, beside what the GPU can do.

1. `bench decode` at B = 1 and 256 (graph step, base and idle-dual), in its own process.
2. `moeserve serve --load-format dummy` at the preset's shape, started once per server flavour:
   LoRA disabled; LoRA enabled with default flags; LoRA enabled with --no-record-nolora-graph.
   Against each, `bench serve` with 256 concurrent streaming clients (prompt 256 random tokens,
   128 new tokens, ignore_eos, logprobs=0, 512 requests); against the LoRA servers also the same
   traffic with every request on one of 4 rank-16 adapters (attention + all routed experts); against
   the LoRA-disabled one also a single client.
3. With `--parts cold`: a fresh LoRA server, base traffic, then the first traffic on adapters it ever sees, then
   adapter traffic of the same shape on other prompts (the same prompts would hit the prefix cache the first run
   filled): what the first adapter requests after a start cost.
4. With `--parts prefix`: prefix caching on and off (the same LoRA server flags), a shared 1,024-token
   system prompt before 256 distinct 64-token user turns, 64 new tokens, half the requests on two adapters;
   TTFT p50, output tok/s and the prefix-cache hit rate, on over off.
5. A table of ratios (server tok/s over the decode graph's, TPOT over the graph step) and one JSON.

    python -m moeserve.bench.protocol --preset qwen3-30b-a3b --out bench_out/protocol
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

NUM_ADAPTERS, RANK = 4, 16


def write_model_config(preset: str, out: Path, num_layers: int | None) -> Path:
    """An HF config.json (no weights: served with --load-format dummy) for a decode-bench preset."""
    from moeserve.bench.decode import PRESETS
    from moeserve.models.tiny import tiny_hf_config

    p = dict(PRESETS[preset])
    names = {"hidden_size": "hidden_size", "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
             "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim", "num_experts": "num_experts",
             "top_k": "num_experts_per_tok", "moe_intermediate_size": "moe_intermediate_size",
             "intermediate_size": "intermediate_size", "norm_topk_prob": "norm_topk_prob", "vocab_size": "vocab_size",
             "shared_expert_intermediate_size": "shared_expert_intermediate_size"}
    kw = {names[k]: v for k, v in p.items() if k in names}
    if num_layers:
        kw["num_hidden_layers"] = num_layers
    if p["family"] in ("qwen3_moe", "qwen2_moe"):
        kw.update(mlp_only_layers=[], decoder_sparse_step=1)  # every layer routed, as in the real models
    cfg = tiny_hf_config(p["family"], max_position_embeddings=4096, eos_token_id=0, **kw)
    out.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(out)
    return out


def write_adapter(model_dir: Path, out: Path, seed: int) -> Path:
    """A rank-16 PEFT adapter on q/k/v/o and every routed expert (target_parameters form), bf16."""
    from safetensors.torch import save_file

    from moeserve.model_spec import ModelSpec

    spec = ModelSpec.from_model_dir(model_dir)
    H, E, inter, r = spec.hidden_size, spec.num_experts, spec.moe_intermediate_size, RANK
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g, device=dev) * 0.01).to(torch.bfloat16).cpu()

    tensors = {}
    for layer in range(spec.num_layers):
        p = f"base_model.model.model.layers.{layer}."
        for proj, (fan_in, fan_out) in {"q_proj": (H, spec.q_size), "k_proj": (H, spec.kv_size),
                                        "v_proj": (H, spec.kv_size), "o_proj": (spec.q_size, H)}.items():
            tensors[p + f"self_attn.{proj}.lora_A.weight"] = rnd(r, fan_in)
            tensors[p + f"self_attn.{proj}.lora_B.weight"] = rnd(fan_out, r)
        # PEFT's nested ParamWrappers: for a parameter [E, out, in], A is [E*r, in], B is [out, r*E]
        tensors[p + "mlp.experts.base_layer.lora_A.weight"] = rnd(E * r, H)  # gate_up [E, 2I, H]
        tensors[p + "mlp.experts.base_layer.lora_B.weight"] = rnd(2 * inter, r * E)
        tensors[p + "mlp.experts.lora_A.weight"] = rnd(E * r, inter)  # down [E, H, I]
        tensors[p + "mlp.experts.lora_B.weight"] = rnd(H, r * E)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], "lora_dropout": 0.0,
        "bias": "none", "task_type": "CAUSAL_LM"}))
    return out


def serve_run(label: str, server, out: Path, args, extra: list[str]) -> dict:
    from moeserve.bench import serve

    argv = ["--base-url", server, "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
            "--max-concurrency", str(args.concurrency), "--logprobs", "0", "--ignore-eos", "--vocab-size", "100000",
            "--num-warmups", "8", "--save-result", "--result-dir", str(out), "--result-filename", f"{label}.json",
            "--seed", "0", *extra]
    print(f"\n=== {label}: bench serve {' '.join(extra)}", flush=True)
    serve.main(argv)
    path = out / f"{label}.json"
    m = json.loads(path.read_text()) if path.exists() else {"failed": args.num_prompts, "completed": 0}
    try:  # the engine's own counters after the run (prefix-cache hit rate, graph replays, ...)
        text = serve._get(server + "/metrics", {})[1].decode()
        m["engine_metrics"] = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                               if line.startswith(("moeserve_prefix_cache", "moeserve_graph_replays",
                                                   "moeserve_kernel_compiles"))}
    except (OSError, ValueError, IndexError):
        pass
    return m


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="moeserve bench protocol", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the preset")
    ap.add_argument("--out", default="bench_out/protocol")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--parts", default="decode,base,lora,norecord",
                    help="comma list of parts to run: decode, base, lora, norecord, prefix (prefix caching on and "
                         "off: a shared 1,024-token system prompt, 256 distinct user turns, 64 new tokens, half "
                         "the requests on two adapters), cold (a fresh LoRA server: base traffic, then the first "
                         "adapter traffic, then the same on other prompts)")
    ap.add_argument("--server-args", default="", help="extra flags for every `moeserve serve`")
    args = ap.parse_args(argv)
    from moeserve.bench import serve

    out = Path(args.out)
    parts = set(filter(None, args.parts.split(",")))
    model = write_model_config(args.preset, out / "model", args.layers)
    results: dict = {"preset": args.preset, "layers": args.layers, "gpu": torch.cuda.get_device_name()
                     if torch.cuda.is_available() else "cpu", "date": time.strftime("%Y-%m-%d")}
    if "decode" in parts:
        cmd = [sys.executable, "-m", "moeserve.bench.decode", "--preset", args.preset, "--batches", "1,256",
               "--modes", "base,idle-dual", "--steps", "64", "--repeats", "3", "--out", str(out / "decode")]
        if args.layers:
            cmd += ["--layers", str(args.layers)]
        print("=== bench decode:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=False)
        dec = sorted((out / "decode").glob("decode_*.json"))
        if dec:
            results["decode"] = json.loads(dec[-1].read_text())
    common = ["--model", str(model), "--load-format", "dummy", "--max-num-seqs", str(args.concurrency),
              "--log-level", "warning", *args.server_args.split()]
    adapters = []
    if parts & {"lora", "norecord", "prefix", "cold"}:
        for i in range(NUM_ADAPTERS):
            adapters.append(f"ad{i}={write_adapter(model, out / 'adapters' / f'ad{i}', seed=i + 1)}")
    lora_flags = ["--enable-lora", "--max-loras", str(NUM_ADAPTERS), "--max-lora-rank", str(RANK),
                  "--lora-modules", *adapters]
    active = ["--lora-modules", *[a.split("=")[0] for a in adapters], "--lora-fraction", "1.0"]
    flavours = [("base", [], [("base", []), ("one-client", ["--max-concurrency", "1", "--num-prompts", "16"])]),
                ("lora", lora_flags, [("lora-base", []), ("lora-active", active)]),
                ("norecord", lora_flags + ["--no-record-nolora-graph"], [("norecord-base", []),
                                                                          ("norecord-active", active)])]
    shared = ["--random-prefix-len", "1024", "--random-input-len", "64", "--random-output-len", "64",
              "--num-prompts", "256", "--lora-modules", *[a.split("=")[0] for a in adapters[:2]],
              "--lora-fraction", "0.5"]
    # the first adapter traffic on a fresh server (warmed by base traffic only), then the same traffic again,
    first = [*active, "--num-warmups", "0"]
    # the again run draws other prompts: the same ones would hit the prefix cache the first run filled (keyed by
    # adapter version), which made "again" look 2.6x faster in TTFT p99 than any warm server is on new prompts
    flavours += [("cold", lora_flags, [("cold-base", []), ("cold-active-first", first),
                                       ("cold-active-again", [*first, "--seed", "1"])])]
    flavours += [("prefix", lora_flags, [("prefix-on", shared)]),
                 ("prefix", lora_flags + ["--no-enable-prefix-caching"], [("prefix-off", shared)])]
    runs = {}
    for name, flags, jobs in flavours:
        if name not in parts:
            continue
        print(f"\n=== server `{name}`: moeserve serve {' '.join(common + flags)[:300]}", flush=True)
        t0 = time.monotonic()
        try:
            proc, log, base = serve.launch_server(common + flags, 1200)
        except RuntimeError as e:
            print(f"server {name} failed: {e}", flush=True)
            continue
        startup_s = time.monotonic() - t0
        print(f"server up in {startup_s:.0f} s", flush=True)
        try:
            for label, extra in jobs:
                runs[label] = serve_run(label, base, out, args, extra)
                runs[label]["server_startup_s"] = startup_s
        finally:
            serve.stop_server(proc)
        compiled = compiled_after_start(log)
        results.setdefault("compiled_after_start", {})[name] = compiled
        if compiled:
            print(f"server `{name}`: {len(compiled)} kernel variants compiled on the request path: "
                  f"{', '.join(sorted(set(compiled)))}", flush=True)
    results["serve"] = runs
    (out / "protocol.json").write_text(json.dumps(results, indent=2))
    print_summary(results)
    return 0


def compiled_after_start(log_path: str) -> list[str]:
    """Kernels the server's engine core logged as compiled on the request path (engine/warmup.py CompileWatch)."""
    marker = " compiled on the request path"
    with open(log_path, errors="replace") as f:
        return [line.split(marker)[0].rsplit("kernel ", 1)[-1] for line in f if marker in line]


def print_summary(results: dict) -> None:
    rows = {r["batch"]: r for r in results.get("decode", {}).get("rows", [])}
    g256 = rows.get(256, {}).get("base", {})
    g1 = rows.get(1, {}).get("base", {})
    print(f"\n{results['preset']} ({results['layers'] or 'all'} layers) on {results['gpu']}")
    if g256:
        print(f"decode graph step: B=1 {g1.get('step_ms', float('nan')):.2f} ms; B=256 {g256['step_ms']:.2f} ms "
              f"= {g256['tok_s']:,.0f} tok/s")
    print(f"{'run':<16}{'out tok/s':>11}{'/graph':>8}{'TPOT p50':>10}{'/step':>7}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'failed':>8}")
    for label, m in results.get("serve", {}).items():
        tok = m.get("output_throughput", 0.0)
        step = (g1 if label == "one-client" else g256).get("step_ms")
        ratio = tok / g256["tok_s"] if g256 and label != "one-client" else float("nan")
        tpot = m.get("median_tpot_ms", float("nan"))
        print(f"{label:<16}{tok:>11,.0f}{ratio:>8.2f}{tpot:>9.1f}m{(tpot / step) if step else float('nan'):>7.2f}"
              f"{m.get('median_ttft_ms', float('nan')):>9.0f}m{m.get('p99_ttft_ms', float('nan')):>9.0f}m"
              f"{m.get('failed', 0):>8}")
    serve = results.get("serve", {})
    for label in ("prefix-on", "prefix-off"):
        if label in serve:
            em = serve[label].get("engine_metrics", {})
            q, h = em.get("moeserve_prefix_cache_queries_total", 0.0), em.get("moeserve_prefix_cache_hits_total", 0.0)
            print(f"{label}: prefix-cache hit rate {h / q if q else 0.0:.1%} ({h:,.0f} of {q:,.0f} prompt tokens)")
    on, off = serve.get("prefix-on"), serve.get("prefix-off")
    if on and off and on.get("median_ttft_ms") and off.get("output_throughput"):
        print(f"prefix caching on / off: TTFT p50 {off['median_ttft_ms'] / on['median_ttft_ms']:.2f}x lower "
              f"(target >= 3), output tok/s {on['output_throughput'] / off['output_throughput']:.2f}x (target >= 1.5)")


if __name__ == "__main__":
    sys.exit(main())
