"""Decode throughput with the model split across GPUs (tensor / expert parallelism) against one GPU.

The same protocol as `bench decode` (docs/benchmarks.md, "Decode"): random bf16 weights (--load-format dummy), B sequences
with a 512-token context in the KV cache (prefill excluded), `steps` timed decode steps, tokens/s =
B * steps / time, median of repeats. Each step is the engine core runner's own `launch` + `collect`, pipelined as
the engine runs them (step n+1 launched before step n is read: bench decode's `timed_steps`; before session 13 each
step was read before the next launched): under parallelism that includes sending the step's plan to the other
ranks, the graph replay with its collectives, the logits all-gather and the token broadcast.

Modes: base (LoRA off), idle-dual (LoRA on, no request uses an adapter: the no-LoRA graph), active (4
random rank-16 adapters on attention and every expert, every row with one).

Every engine runs in a fresh interpreter of its own (a child: `python -m moeserve.bench.tp_decode --one JOB`), one
per (setting, all-reduce backend, engine kind): "base" (LoRA off) times mode base, "lora" (LoRA on) times idle-dual
then active on one engine. Symmetric memory serves the first tensor-parallel engine of a process only
(parallel_state), so each engine is the first of its process; and a child's teardown cannot stall the run (a TP=2
process once aborted at exit). A child that fails or runs past --child-timeout is a FAILED row with its stderr
tail, and the next child runs. The parent prints the table and writes the JSON.

`--all-reduce symm_mem,nccl` runs every multi-rank setting once per all-reduce backend asked for (symm_mem: the
default, symmetric memory where every rank can set it up; nccl: --disable-custom-all-reduce); each row reports the
backend asked and the one that actually ran (a symm_mem request that fell back says nccl).

`--profile` then runs one more child per setting and backend: the per-region kernel budget of one decode layer on
rank 0 at each batch size (layer_profile, as `bench decode --profile`; the all-reduces after attention and after
the MoE are regions of their own, named by the path they took), every rank running the regions in lockstep
(bench/tp_profile.py); a table puts the settings side by side per batch size.

    python -m moeserve.bench.tp_decode --preset qwen3-30b-a3b --settings tp1,tp2,ep2 --batches 1,64,256,512 \\
        --all-reduce symm_mem,nccl --profile
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import traceback
from collections import deque
from contextlib import contextmanager
from pathlib import Path

import torch

from moeserve.bench import layer_profile
from moeserve.bench.decode import PRESETS, PROMPT, preset_spec, timed_steps
from moeserve.config import EngineConfig
from moeserve.lora.adapter import ExpertLoRA, LoRAAdapter
from moeserve.model_spec import ModelSpec
from moeserve.engine.core import EngineCore
from moeserve.worker.sequence import ScheduledBatch
from moeserve.worker.sequence import Sequence
from moeserve.sampling_params import SamplingParams

MODES = ("base", "idle-dual", "active")
ALL_REDUCE = ("symm_mem", "nccl")
NUM_ADAPTERS, RANK = 4, 16


def hf_config(spec: ModelSpec) -> dict:
    """config.json for a preset (what --load-format dummy reads)."""
    cfg = dict(model_type=spec.family, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
               num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
               num_experts=spec.num_experts, num_experts_per_tok=spec.top_k,
               moe_intermediate_size=spec.moe_intermediate_size, intermediate_size=spec.intermediate_size,
               norm_topk_prob=spec.norm_topk_prob, vocab_size=spec.vocab_size,
               max_position_embeddings=spec.max_position_embeddings, rms_norm_eps=spec.rms_norm_eps,
               rope_theta=spec.rope_theta, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[])
    if spec.family == "qwen2_moe":
        cfg.update(shared_expert_intermediate_size=spec.shared_expert_intermediate_size, qkv_bias=spec.qkv_bias)
    return cfg


def random_adapter(spec: ModelSpec, name: str, seed: int) -> LoRAAdapter:
    """A rank-16 adapter on q/k/v/o and every expert of every layer, in the whole model's shapes."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    H, E, inter = spec.hidden_size, spec.num_experts, spec.moe_intermediate_size
    dense, experts = {}, {}
    for layer in range(spec.num_layers):
        for target, (fan_in, fan_out) in {"q_proj": (H, spec.q_size), "k_proj": (H, spec.kv_size),
                                          "v_proj": (H, spec.kv_size), "o_proj": (spec.q_size, H)}.items():
            dense[(layer, target)] = (r(RANK, fan_in), r(fan_out, RANK))
        experts[layer] = ExpertLoRA(r(E, RANK, H), r(E, 2 * inter, RANK), r(E, RANK, inter), r(E, H, RANK))
    return LoRAAdapter(name, "random", RANK, dense, experts,
                       frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "experts"}))


class Setting:
    """One engine (tp ranks, expert-parallel or not, LoRA on or off) and its timed decode."""

    def __init__(self, model_dir: str, spec: ModelSpec, tp: int, ep: bool, lora: bool, batches: list[int],
                 steps: int, device: str, all_reduce: str = "symm_mem"):
        self.spec, self.steps = spec, steps
        self.max_len = PROMPT + steps + 16
        self.blocks_per_seq = -(-self.max_len // 16)
        kw = dict(enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=RANK,
                  lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "experts"]) if lora else {}
        self.core = EngineCore(EngineConfig(
            model=model_dir, load_format="dummy", device=device, tensor_parallel_size=tp, enable_expert_parallel=ep,
            max_model_len=self.max_len, max_num_seqs=max(batches), block_size=16, cuda_graph_bs=batches,
            num_kv_blocks=max(batches) * self.blocks_per_seq + 2, disable_custom_all_reduce=all_reduce == "nccl",
            **kw))
        parallel = getattr(self.core.runner, "tp", None)
        self.all_reduce = parallel.all_reduce_backend if parallel is not None else "-"  # what ran, on every rank
        if lora:  # straight into the slots, on every rank (the manager's bookkeeping is not needed here)
            for slot in range(NUM_ADAPTERS):
                self.core.lora_manager.pool.load(slot, random_adapter(spec, f"a{slot}", slot + 1))

    @torch.inference_mode()
    def time_decode(self, B: int, slots: list[int], repeats: int) -> float:
        runner = self.core.runner
        times = []
        g = torch.Generator().manual_seed(B)
        for _ in range(repeats):
            seqs = []
            for i in range(B):
                # distinct tokens per row: identical rows would all route to the same top-k experts (the
                # KV cache holds no real context here), reading a fraction of the expert bytes real traffic reads
                prompt = torch.randint(3, self.spec.vocab_size, (PROMPT,), generator=g).tolist()
                s = Sequence(f"b{i}", prompt, SamplingParams(max_tokens=self.steps + 8, temperature=0.0))
                s.block_table = [1 + i * self.blocks_per_seq + j for j in range(self.blocks_per_seq)]
                s.num_computed_tokens = PROMPT - 1
                s.lora_slot = slots[i]
                seqs.append(s)
            times.append(timed_steps(runner, ScheduledBatch(seqs, [1] * B, is_decode=True), self.steps))
        return statistics.median(times)

    def close(self) -> None:
        if hasattr(self.core.runner, "shutdown"):
            self.core.runner.shutdown()


def slots_for(mode: str, B: int) -> list[int]:
    return [i % NUM_ADAPTERS for i in range(B)] if mode == "active" else [-1] * B


def parse_setting(name: str) -> tuple[int, bool]:
    """"tp2" -> (2 ranks, tensor-parallel experts); "ep2" -> (2, expert-parallel)."""
    if name[:2] not in ("tp", "ep") or not name[2:].isdigit() or int(name[2:]) < 1:
        raise ValueError(f"setting {name!r}: expected tpN (tensor-parallel) or epN (expert-parallel), N >= 1")
    return int(name[2:]), name.startswith("ep")


# ---- one child: one engine (or one profile) in a fresh interpreter ---------------------------------------

def child_jobs(settings: list[str], modes: list[str], all_reduce: list[str]) -> list[dict]:
    """One job per (setting, backend asked, engine kind): "base" (LoRA off) times mode base, "lora" (LoRA on)
    times idle-dual then active on the same engine."""
    jobs = []
    for name in settings:
        tp, _ = parse_setting(name)
        for asked in (all_reduce if tp > 1 else ["-"]):
            for kind, kind_modes in (("base", ["base"]), ("lora", ["idle-dual", "active"])):
                wanted = [m for m in modes if m in kind_modes]
                if wanted:
                    jobs.append(dict(kind=kind, setting=name, asked=asked, modes=wanted))
    return jobs


def time_modes(job: dict) -> list[dict]:
    """A timing child's work: its engine, each of its modes at each batch size."""
    tp, ep = parse_setting(job["setting"])
    spec = ModelSpec.from_model_dir(job["model_dir"])
    setting = Setting(job["model_dir"], spec, tp, ep, job["kind"] == "lora", job["batches"], job["steps"],
                      job["device"], job["asked"])
    rows = []
    try:
        for mode in job["modes"]:
            for B in job["batches"]:
                t = setting.time_decode(B, slots_for(mode, B), job["repeats"])
                rows.append(dict(setting=job["setting"], all_reduce=setting.all_reduce, asked=job["asked"], mode=mode,
                                 batch=B, tok_s=B * job["steps"] / t, step_ms=t / job["steps"] * 1e3))
                print(f"  {job['setting']:5s} {setting.all_reduce:8s} {mode:10s} B={B:4d} "
                      f"{B * job['steps'] / t:10.1f} tok/s {t / job['steps'] * 1e3:8.2f} ms/step", flush=True)
    finally:
        setting.close()
    return rows


def profile_layer(job: dict) -> dict:
    """A profile child's work: the budget of one decode layer on rank 0 at each batch size (bench/tp_profile.py)."""
    from moeserve.bench import tp_profile

    tp, ep = parse_setting(job["setting"])
    out = tp_profile.profile(job["model_dir"], tp, ep, job["asked"], job["batches"], job["device"])
    for B, rows in out["budgets"].items():
        layer_profile.print_budget(B, rows, f", {job['setting']} rank 0 (all-reduce {out['all_reduce']})")
    out["budgets"] = {str(B): rows for B, rows in out["budgets"].items()}  # as the JSON keys them
    return dict(setting=job["setting"], asked=job["asked"], **out)


def child_main(job_path: str) -> None:
    """Entry of a child (`--one JOB`): do the job, write its result (JSON) where the job says, and leave without the
    interpreter's teardown — the results are written, and a TP=2 process once aborted in its exit's garbage
    collection after printing its table."""
    job = json.loads(Path(job_path).read_text())
    code = 0
    try:
        out = {"profile": profile_layer(job)} if job["kind"] == "profile" else {"rows": time_modes(job)}
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which goes on with the next child
        traceback.print_exc()
        out, code = {"error": (f"{type(e).__name__}: {e}".splitlines() or [""])[0][:500]}, 1
    Path(job["result"]).write_text(json.dumps(out))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_child(job: dict, timeout_s: float, tail_lines: int = 40) -> dict:
    """Run `job` in a fresh interpreter (`python -m moeserve.bench.tp_decode --one JOB`), its stdout passed through
    and its stderr echoed; returns the child's result, or {"error", "stderr_tail"} if it failed or ran past
    `timeout_s`. The child leads its own process group, killed afterwards with whatever it left behind (its
    engine's rank processes)."""
    with tempfile.TemporaryDirectory(prefix="tp_decode_child_") as tmp:
        job = dict(job, result=str(Path(tmp) / "result.json"))
        job_path = Path(tmp) / "job.json"
        job_path.write_text(json.dumps(job))
        env = dict(os.environ)  # the child imports this same moeserve
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        sys.stdout.flush()  # the child writes to the same stdout: keep the order
        proc = subprocess.Popen([sys.executable, "-m", "moeserve.bench.tp_decode", "--one", str(job_path)],
                                stderr=subprocess.PIPE, text=True, errors="replace", env=env,
                                start_new_session=True)
        tail: deque[str] = deque(maxlen=tail_lines)

        def relay():
            for line in proc.stderr:
                sys.stderr.write(line)
                tail.append(line.rstrip("\n"))

        relay_thread = threading.Thread(target=relay, daemon=True)
        relay_thread.start()
        error = None
        try:
            rc = proc.wait(timeout=timeout_s)
            if rc != 0:
                error = f"exited with code {rc}" if rc > 0 else f"killed by signal {-rc}"
        except subprocess.TimeoutExpired:
            error = f"ran past --child-timeout {timeout_s:g} s and was killed"
        finally:
            try:  # the child and anything it started
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
            relay_thread.join(5.0)
        result_path = Path(job["result"])
        result = json.loads(result_path.read_text()) if result_path.exists() else {}
    if "error" in result or ("rows" not in result and "profile" not in result):
        why = result.get("error") or error or "wrote no result"
        if error and result.get("error"):
            why = f"{result['error']} ({error})"
        return {"error": why, "stderr_tail": list(tail)}
    return result


@contextmanager
def model_folder(spec: ModelSpec):
    """A model folder holding the preset's config.json (what --load-format dummy reads), for every child."""
    with tempfile.TemporaryDirectory(prefix="tp_decode_model_") as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(hf_config(spec)))
        yield model_dir


def run(spec: ModelSpec, settings: list[str], batches: list[int], modes: list[str], steps: int, repeats: int,
        device: str, all_reduce: list[str] = ALL_REDUCE[:1], child_timeout: float = 600.0) -> list[dict]:
    """Timed rows, one child per (setting, backend, engine kind); a child that failed gives one row with its
    error and stderr tail (its setting, backend and modes), and the next child runs."""
    rows = []
    with model_folder(spec) as model_dir:
        for job in child_jobs(settings, modes, all_reduce):
            job.update(model_dir=model_dir, batches=batches, steps=steps, repeats=repeats, device=device)
            result = run_child(job, child_timeout)
            if "error" in result:
                print(f"  {job['setting']:5s} {job['asked']:8s} {','.join(job['modes'])}: FAILED ({result['error']})",
                      flush=True)
                rows.append(dict(setting=job["setting"], asked=job["asked"], all_reduce="-", modes=job["modes"],
                                 **result))
            else:
                rows.extend(result["rows"])
    return rows


def profile_layers(spec: ModelSpec, settings: list[str], batches: list[int], device: str,
                   all_reduce: list[str] = ALL_REDUCE[:1], child_timeout: float = 600.0) -> list[dict]:
    """One child per (setting, backend): the budget of one decode layer on rank 0 (tp1 too, to compare against)."""
    out = []
    with model_folder(spec) as model_dir:
        for name in settings:
            tp, _ = parse_setting(name)
            for asked in (all_reduce if tp > 1 else ["-"]):
                job = dict(kind="profile", setting=name, asked=asked, modes=[], model_dir=model_dir, batches=batches,
                           device=device)
                result = run_child(job, child_timeout)
                out.append(dict(setting=name, asked=asked, **result) if "error" in result else result["profile"])
    return out


def region_key(name: str) -> str:
    """A region's row in the comparison: the all-reduce rows without the path they took, the layer row as one."""
    if " all_reduce " in name:
        return name.split(" all_reduce ")[0] + " all_reduce"
    return "layer" if name.startswith("layer (") else name


def print_comparison(profiles: list[dict], batches: list[int]) -> None:
    """µs per region of one layer, every profiled setting side by side, at each batch size."""
    done = [p for p in profiles if "error" not in p]
    for p in profiles:
        if "error" in p:
            print(f"\nprofile {p['setting']} ({p['asked']}) FAILED: {p['error']}")
    if not done:
        return
    heads = [f"{p['setting']} {p['all_reduce']}" for p in done]
    for B in batches:
        per = [{region_key(r["region"]): r["us"] for r in p["budgets"][str(B)]} for p in done]
        # the regions in layer order: the longest list first (a multi-rank one has the all-reduces)
        keys = list(dict.fromkeys(k for d in sorted(per, key=len, reverse=True) for k in d))
        print(f"\nµs per layer at B={B} (rank 0; regions timed across all layers in one CUDA graph)")
        print(f"{'region':>24} " + " ".join(f"{h:>16s}" for h in heads))
        for k in keys:
            print(f"{k:>24} " + " ".join(f"{d[k]:16.1f}" if k in d else f"{'-':>16s}" for d in per))


def print_table(rows: list[dict]) -> None:
    ok = [r for r in rows if "error" not in r]
    ref_key = (ok[0]["setting"], ok[0]["asked"]) if ok else None
    base = {(r["mode"], r["batch"]): r["tok_s"] for r in ok if (r["setting"], r["asked"]) == ref_key}
    print(f"\n{'setting':8s} {'asked':8s} {'ran':8s} {'mode':10s} {'B':>5s} {'tok/s':>10s} {'ms/step':>8s}  "
          f"vs {ref_key[0] if ref_key else '-'}")
    for r in rows:
        if "error" in r:
            print(f"{r['setting']:8s} {r['asked']:8s} {'-':8s} {','.join(r['modes']):10s} FAILED: {r['error']}")
            continue
        ref = base.get((r["mode"], r["batch"]))
        ratio = f"{r['tok_s'] / ref:.2f}" if ref else "-"
        print(f"{r['setting']:8s} {r['asked']:8s} {r['all_reduce']:8s} {r['mode']:10s} {r['batch']:5d} "
              f"{r['tok_s']:10.1f} {r['step_ms']:8.2f}  {ratio}")
    for r in rows:
        if "error" in r and r.get("stderr_tail"):
            print(f"\n{r['setting']} ({r['asked']}, {','.join(r['modes'])}) stderr, last lines:")
            print("\n".join("    " + line for line in r["stderr_tail"][-20:]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moeserve.bench.tp_decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the preset (memory, adapter size)")
    ap.add_argument("--settings", default="tp1,tp2,ep2", help="tpN (tensor-parallel) / epN (expert-parallel)")
    ap.add_argument("--batches", default="1,8,64,256,512")
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"{', '.join(MODES)} (default: all; empty with --profile: the layer budgets only)")
    ap.add_argument("--all-reduce", default=ALL_REDUCE[0],
                    help="all-reduce backends to run each multi-rank setting with, comma-separated: "
                         f"{', '.join(ALL_REDUCE)} (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--child-timeout", type=float, default=600.0,
                    help="seconds one child (one engine, or one profile) may run before it is killed and reported "
                         "as a failed row (default: %(default)s)")
    ap.add_argument("--profile", action="store_true",
                    help="after the timings, the per-region kernel budget of one decode layer on rank 0 of every "
                         "setting and backend at each batch size, the all-reduces as regions (needs CUDA)")
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--one", metavar="JOB", help=argparse.SUPPRESS)  # a child: runs one job file
    args = ap.parse_args(argv)
    if args.one:
        child_main(args.one)
    if args.profile and not (args.device.startswith("cuda") and torch.cuda.is_available()):
        ap.error(f"--profile needs CUDA (it times each region of a layer as a CUDA graph); --device is "
                 f"{args.device!r}{'' if torch.cuda.is_available() else ' and no CUDA device is available'}")
    spec = preset_spec(args.preset, args.layers)
    settings = [s for s in args.settings.split(",") if s]
    try:
        for name in settings:
            parse_setting(name)
    except ValueError as e:
        ap.error(f"--settings: {e}")
    batches = [int(b) for b in args.batches.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    if not set(modes) <= set(MODES):
        ap.error(f"--modes: unknown {sorted(set(modes) - set(MODES))}; choose from {', '.join(MODES)}")
    all_reduce = [b for b in args.all_reduce.split(",") if b]
    bad = [b for b in all_reduce if b not in ALL_REDUCE]
    if bad or not all_reduce:
        ap.error(f"--all-reduce: unknown backend(s) {bad}; choose from {', '.join(ALL_REDUCE)}")
    rows = run(spec, settings, batches, modes, args.steps, args.repeats, args.device, all_reduce, args.child_timeout)
    print_table(rows)
    profiles = []
    if args.profile:
        profiles = profile_layers(spec, settings, batches, args.device, all_reduce, args.child_timeout)
        print_comparison(profiles, batches)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tp_decode.json").write_text(json.dumps(dict(preset=args.preset, spec=dataclasses.asdict(spec),
                                                        steps=args.steps, rows=rows, layer_budget=profiles),
                                                   indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
