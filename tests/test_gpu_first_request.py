"""Right from the first request, on the GPU: every sorted-path MoE plan runs in float32 and bfloat16 at every
family's shapes (tiles fitted to the dtype's shared memory), and after start-up no request compiles a kernel
(the warm-up compiled every variant real traffic reaches). CPU: skipped."""
import random

import pytest
import torch

from moeserve import Engine, EngineConfig, SamplingParams
from moeserve.engine.warmup import compile_details
from moeserve.kernels.fused_moe import MoELoRAArgs, fused_moe
from moeserve.layers.batch import LoRABatch
from moeserve.layers.moe import ExpertLoRABuffers, moe_experts_torch
from moeserve.models.tiny import TINY_FAMILIES

from peft_fixtures import make_peft_adapter, save_base_checkpoint

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# (E, H, I, top_k): the tiny test models, then Qwen3-30B-A3B, OLMoE-1B-7B, Qwen1.5-MoE-A2.7B, Mixtral-8x7B
SHAPES = {"tiny-qwen": (8, 64, 48, 2), "tiny-mixtral": (4, 64, 48, 2), "qwen3_moe": (128, 2048, 768, 8),
          "olmoe": (64, 2048, 1024, 8), "qwen2_moe": (60, 2048, 1408, 4), "mixtral": (8, 4096, 14336, 2)}


def _problem(shape, num_tokens, dtype, seed):
    experts, hidden, inter, top_k = shape
    gen = torch.Generator("cuda").manual_seed(seed)
    rnd = lambda *s, std=1.0: (torch.randn(*s, generator=gen, device="cuda") * std)  # noqa: E731
    x = rnd(num_tokens, hidden)
    w13, w2 = rnd(experts, 2 * inter, hidden, std=hidden ** -0.5), rnd(experts, hidden, inter, std=inter ** -0.5)
    weights, ids = torch.softmax(rnd(num_tokens, experts), -1).topk(top_k, -1)
    ranks = torch.tensor([16, 8, 0, 16], dtype=torch.int32, device="cuda")
    pool = [rnd(4, experts, 16, hidden, std=0.05), rnd(4, experts, 2 * inter, 16, std=0.05),
            rnd(4, experts, 16, inter, std=0.05), rnd(4, experts, hidden, 16, std=0.05)]
    for s, r in enumerate(ranks.tolist()):
        for i, w in enumerate(pool):
            (w[s, :, r:] if i % 2 == 0 else w[s, ..., r:]).zero_()
    slots = (torch.arange(num_tokens, device="cuda") % 5 - 1).to(torch.int32)  # -1 (no adapter), 0, 1, 2 (rank 0), 3
    ref_args = (x, w13, w2, weights, ids.to(torch.int32))
    return ref_args, slots, ranks, pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_gpu_sorted_path_runs_every_family_shape_in_every_dtype(name, dtype):
    """Every plan tier of the sorted path, with and without LoRA, against the plain-torch twin in fp32 (the
    Triton dots run fp32 inputs as TF32, hence the fp32 bound)."""
    shape = SHAPES[name]
    for num_tokens in (16, 100, 600, 2500):
        (x, w13, w2, weights, ids), slots, ranks, pool = _problem(shape, num_tokens, torch.float32, num_tokens)
        active = tuple(s for s in sorted(set(slots.tolist())) if s >= 0)
        ref = moe_experts_torch(x, w13, w2, weights, ids, LoRABatch(slots, ranks, active), ExpertLoRABuffers(*pool))
        ref_base = moe_experts_torch(x, w13, w2, weights, ids, None, None)
        cast = [t.to(dtype) for t in (x, w13, w2)]
        lora = MoELoRAArgs(slots, ranks, *[w.to(dtype) for w in pool])
        for args, want in ((None, ref_base), (lora, ref)):
            out = fused_moe(*cast, weights, ids, args, decode=False)
            assert out.dtype == dtype and torch.isfinite(out).all()
            err = ((out.float() - want).abs().max() / want.abs().max()).item()
            assert err < (5e-3 if dtype == torch.float32 else 2e-2), (num_tokens, args is not None, err)


def _count_compiles():
    """Install a hook counting Triton compiles (and on-disk cache loads) of kernels not yet in memory."""
    from triton import knobs

    seen = []
    previous = knobs.runtime.jit_cache_hook

    def hook(*args, **kwargs):
        seen.append(f"{kwargs.get('repr')} key={kwargs.get('key')} {compile_details(kwargs)}")
        return previous(*args, **kwargs) if previous else False  # the engine's own watch too; then compile
    knobs.runtime.jit_cache_hook = hook
    return seen, lambda: setattr(knobs.runtime, "jit_cache_hook", previous)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_gpu_no_request_compiles_a_kernel_and_none_fails(tmp_path, family, dtype):
    """Random traffic after start-up (prompt lengths 1..464 in every batch composition the scheduler makes,
    adapters and none, prefix-cache hits, chunked prefill): no Triton kernel is compiled, no request fails."""
    base = save_base_checkpoint(family, tmp_path / "base")
    path, _ = make_peft_adapter(family, tmp_path / "ad", kind="attn+experts", rank=8, seed=1)
    engine = Engine(EngineConfig(model=str(base), dtype=dtype, lora_modules={"ad": str(path)}, max_lora_rank=8,
                                 max_num_batched_tokens=512, max_model_len=512, cuda_graph_max_bs=16))
    seen, restore = _count_compiles()
    try:
        rng = random.Random(0)
        shared = [rng.randrange(3, 500) for _ in range(64)]
        prompts, loras = [], []
        for i in range(40):
            n = rng.choice([1, 2, 7, 16, 31, 64, 100, 257, 400])
            prompt = [rng.randrange(3, 500) for _ in range(n)]
            if i % 4 == 0:
                prompt = shared + prompt  # a prefix-cache hit after the first
            prompts.append(prompt)
            loras.append(rng.choice([None, "ad"]))
        params = [SamplingParams(max_tokens=rng.randrange(1, 24), temperature=rng.choice([0.0, 0.8]), seed=i,
                                 ignore_eos=True) for i in range(len(prompts))]
        outs = engine.generate(prompts, params, lora=loras)
    finally:
        restore()
    assert [o.finish_reason for o in outs] == ["length"] * len(prompts)
    assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in params]
    assert engine.stats().kernel_compiles_after_start_total == len(seen)  # the engine's watch (/metrics) agrees
    assert seen == [], f"{len(seen)} kernels compiled after start-up: {[_variant(k) for k in seen]}"
    engine.shutdown()


def _variant(key) -> str:
    return " ".join(str(key).split())[:3000]


def test_gpu_served_shape_traffic_with_four_adapters_compiles_nothing(tmp_path):
    """The served model's shapes (Qwen3-30B-A3B, two layers, dummy weights) with four rank-16 adapters on attention
    and every expert, 8,192-token steps and up to 256 sequences, as `moeserve serve` runs it: random traffic of
    mixed adapters and base rows, prompts of 1..700 tokens, in two waves. No kernel variant is compiled after
    start-up, and each one that is gets named with its specialization."""
    from moeserve.bench.protocol import write_adapter, write_model_config

    model = write_model_config("qwen3-30b-a3b", tmp_path / "model", num_layers=2)
    adapters = {f"ad{i}": str(write_adapter(model, tmp_path / f"ad{i}", seed=i + 1)) for i in range(4)}
    engine = Engine(EngineConfig(model=str(model), load_format="dummy", enable_lora=True, max_loras=4,
                                 max_lora_rank=16, lora_modules=adapters, gpu_memory_utilization=0.5))
    seen, restore = _count_compiles()
    try:
        rng = random.Random(1)
        for wave in (300, 40):
            prompts = [[rng.randrange(3, 30000) for _ in range(rng.randrange(1, 700))] for _ in range(wave)]
            loras = [rng.choice([None, "ad0", "ad1", "ad2", "ad3"]) for _ in prompts]
            params = [SamplingParams(max_tokens=rng.randrange(1, 48), temperature=0.0, ignore_eos=True)
                      for _ in prompts]
            outs = engine.generate(prompts, params, lora=loras)
            assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in params]
    finally:
        restore()
        engine.shutdown()
    assert seen == [], f"{len(seen)} kernel variants compiled after start-up: {[_variant(k) for k in seen]}"
