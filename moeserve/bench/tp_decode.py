"""Decode throughput with the model split across GPUs (tensor / expert parallelism) against one GPU.

The same protocol as `bench decode` (DESIGN.md §7): random bf16 weights (--load-format dummy), B sequences
with a 512-token context in the KV cache (prefill excluded), `steps` timed decode steps, tokens/s =
B * steps / time, median of repeats. Each step is the engine core runner's own `launch` + `collect`: under
parallelism that includes sending the step's plan to the other ranks, the graph replay with its collectives,
the logits all-gather and the token broadcast. Settings are measured one after another in one process,
each with its own engine (its workers stopped before the next starts).

Modes: base (LoRA off), idle-dual (LoRA on, no request uses an adapter: the no-LoRA graph), active (4
random rank-16 adapters on attention and every expert, every row with one).

`--all-reduce symm_mem,nccl` runs every multi-rank setting once per all-reduce backend asked for (symm_mem: the
default, symmetric memory where every rank can set it up; nccl: --disable-custom-all-reduce); each row reports the
backend that actually ran (a symm_mem request that fell back says nccl). Symmetric memory serves the first
multi-rank engine of a process only (parallel_state), and every (setting, mode, backend) gets its own engine: to
time symm_mem in another setting or mode, run it in its own invocation (e.g. `--settings ep2 --modes active`).

    python -m moeserve.bench.tp_decode --preset qwen3-30b-a3b --settings tp1,tp2,ep2 --batches 1,64,256,512 \
        --all-reduce symm_mem,nccl
"""
from __future__ import annotations

import argparse
import gc
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from moeserve.bench.decode import PRESETS, PROMPT, preset_spec
from moeserve.config import EngineConfig
from moeserve.lora.adapter import ExpertLoRA, LoRAAdapter
from moeserve.models.spec import ModelSpec
from moeserve.runtime.core import EngineCore
from moeserve.runtime.scheduler import ScheduledBatch
from moeserve.runtime.sequence import Sequence
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
            sb = ScheduledBatch(seqs, [1] * B, is_decode=True)
            for step in range(self.steps + 3):
                if step == 3:
                    if torch.cuda.is_available():
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                result = runner.collect(runner.launch(sb))
                for s in seqs:
                    s.output_token_ids.append(result.sampled[s])
                    s.num_computed_tokens += 1
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def close(self) -> None:
        if hasattr(self.core.runner, "shutdown"):
            self.core.runner.shutdown()


def slots_for(mode: str, B: int) -> list[int]:
    return [i % NUM_ADAPTERS for i in range(B)] if mode == "active" else [-1] * B


def run(spec: ModelSpec, settings: list[str], batches: list[int], modes: list[str], steps: int, repeats: int,
        device: str, all_reduce: list[str] = ALL_REDUCE[:1]) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(hf_config(spec)))
        for name in settings:
            tp, ep = int(name[2:]), name.startswith("ep")
            for asked in (all_reduce if tp > 1 else ["-"]):
                for lora in (False, True):
                    wanted = [m for m in modes if (m != "base") == lora]
                    if not wanted:
                        continue
                    setting = Setting(model_dir, spec, tp, ep, lora, batches, steps, device, asked)
                    try:
                        for mode in wanted:
                            for B in batches:
                                t = setting.time_decode(B, slots_for(mode, B), repeats)
                                rows.append(dict(setting=name, all_reduce=setting.all_reduce, asked=asked, mode=mode,
                                                 batch=B, tok_s=B * steps / t, step_ms=t / steps * 1e3))
                                print(f"  {name:5s} {setting.all_reduce:8s} {mode:10s} B={B:4d} "
                                      f"{B * steps / t:10.1f} tok/s {t / steps * 1e3:8.2f} ms/step", flush=True)
                    finally:
                        setting.close()
                        del setting  # the next setting needs this one's KV cache and weights freed first
                        gc.collect()
                        if torch.cuda.is_available():
                            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moeserve.bench.tp_decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the preset (memory, adapter size)")
    ap.add_argument("--settings", default="tp1,tp2,ep2", help="tpN (tensor-parallel) / epN (expert-parallel)")
    ap.add_argument("--batches", default="1,8,64,256,512")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--all-reduce", default=ALL_REDUCE[0],
                    help="all-reduce backends to run each multi-rank setting with, comma-separated: "
                         f"{', '.join(ALL_REDUCE)} (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    spec = preset_spec(args.preset, args.layers)
    settings = [s for s in args.settings.split(",") if s]
    batches = [int(b) for b in args.batches.split(",")]
    all_reduce = [b for b in args.all_reduce.split(",") if b]
    bad = [b for b in all_reduce if b not in ALL_REDUCE]
    if bad or not all_reduce:
        ap.error(f"--all-reduce: unknown backend(s) {bad}; choose from {', '.join(ALL_REDUCE)}")
    rows = run(spec, settings, batches, [m for m in args.modes.split(",") if m], args.steps, args.repeats,
               args.device, all_reduce)
    first = rows[0] if rows else {}
    base = {(r["mode"], r["batch"]): r["tok_s"] for r in rows
            if (r["setting"], r["asked"]) == (first.get("setting"), first.get("asked"))}
    print(f"\n{'setting':8s} {'all-red.':8s} {'mode':10s} {'B':>5s} {'tok/s':>10s} {'ms/step':>8s}  vs {settings[0]}")
    for r in rows:
        ref = base.get((r["mode"], r["batch"]))
        ratio = f"{r['tok_s'] / ref:.2f}" if ref else "-"
        print(f"{r['setting']:8s} {r['all_reduce']:8s} {r['mode']:10s} {r['batch']:5d} {r['tok_s']:10.1f} "
              f"{r['step_ms']:8.2f}  {ratio}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tp_decode.json").write_text(json.dumps(dict(preset=args.preset, spec=dataclasses.asdict(spec),
                                                        steps=args.steps, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
