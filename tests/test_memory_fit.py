"""Start-up memory planning: weights + LoRA slot pool + one max_model_len sequence of KV cache must fit the
device, or the engine refuses to start with the accounting and the flags that change it (issue 10.3).

On CPU the device budget is given through EngineConfig.device_memory_bytes (--device-memory-bytes)."""
import pytest
import torch

from moeserve import Engine, EngineConfig
from moeserve.engine_args import add_engine_args, engine_config_from_args
from moeserve.errors import InsufficientMemoryError
from moeserve.worker.model_runner import ACTIVATION_HEADROOM
from peft_fixtures import make_peft_adapter, save_base_checkpoint, tiny_base_model, tiny_spec

FAMILY = "qwen2_moe"  # attention, routed experts, a shared expert and a dense layer: every pool target
MAX_MODEL_LEN, BLOCK = 64, 16
FLAGS = ("--max-loras", "--max-lora-rank", "--lora-target-modules", "--max-model-len", "--gpu-memory-utilization",
         "--device-memory-bytes")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("memfit")
    base = save_base_checkpoint(FAMILY, root / "base")
    attn_only, _ = make_peft_adapter(FAMILY, root / "attn", kind="attn", rank=4, seed=1)
    return base, attn_only


def kv_bytes_per_block():  # K and V, every layer, fp32
    s = tiny_spec(FAMILY)
    return 2 * s.num_layers * BLOCK * s.num_kv_heads * s.head_dim * 4


def hf_weight_bytes():
    return sum(p.numel() for p in tiny_base_model(FAMILY).parameters()) * 4


def engine(base, budget, **kw):
    return Engine(EngineConfig(model=str(base), device="cpu", dtype="float32", block_size=BLOCK,
                               max_model_len=MAX_MODEL_LEN, gpu_memory_utilization=1.0,
                               device_memory_bytes=budget, **kw))


def test_the_pool_decides_whether_the_engine_starts(setup):
    base, attn_only = setup
    per_block = kv_bytes_per_block()
    min_kv = (MAX_MODEL_LEN // BLOCK + 1) * per_block  # one sequence + the block reserved for padded rows
    unbounded = engine(base, None, enable_lora=True)  # CPU without a budget: no planning
    pool = unbounded.lora_manager.pool.nbytes  # default: 8 slots x rank 16 x every target (checked elsewhere)
    weights = unbounded.runner.weight_bytes()
    # weights are the model's parameters (transformers counts the same ones) plus small rotary tables
    assert hf_weight_bytes() <= weights < hf_weight_bytes() + pool // 8
    assert pool > 8 * per_block
    budget = ACTIVATION_HEADROOM + hf_weight_bytes() + min_kv + pool // 2

    plain = engine(base, budget)  # LoRA off: the KV cache gets what the weights leave
    left = budget - weights - ACTIVATION_HEADROOM
    assert plain.allocator.num_blocks == left // per_block + 1 >= MAX_MODEL_LEN // BLOCK + 1

    with pytest.raises(InsufficientMemoryError) as err:  # LoRA with defaults: the pool leaves too little
        engine(base, budget, enable_lora=True)
    msg = str(err.value)
    assert all(flag in msg for flag in FLAGS), msg
    assert f"max_model_len={MAX_MODEL_LEN}" in msg and "LoRA slot pool (8 slots x rank 16:" in msg
    assert "experts" in msg and "router" in msg  # the pool's bytes per target

    small_rank = engine(base, budget, enable_lora=True, max_lora_rank=4)  # a quarter of the pool fits
    assert small_rank.lora_manager.pool.nbytes == pool // 4
    assert small_rank.allocator.num_blocks == (left - pool // 4) // per_block + 1
    # targets sized from the adapters given: attention only
    known = engine(base, budget, lora_modules={"a": str(attn_only)})
    assert set(known.lora_manager.pool.nbytes_by_target) == {"q_proj/k_proj/v_proj", "o_proj"}


def test_pool_targets_sized_from_the_adapters_name_the_shared_expert_as_one_target(tmp_path):
    """lora_modules without lora_target_modules: the pool holds the targets the adapters use, each shared-expert
    projection (shared_expert.gate_proj, ...) under its lora_target_modules entry "shared_expert"."""
    base = save_base_checkpoint(FAMILY, tmp_path / "base")
    shared, _ = make_peft_adapter(FAMILY, tmp_path / "shared", kind="shared-expert", rank=4, seed=2)
    attn, _ = make_peft_adapter(FAMILY, tmp_path / "attn", kind="attn", rank=4, seed=1)
    eng = engine(base, None, lora_modules={"s": str(shared), "a": str(attn)})
    assert eng.lora_manager.pool.targets == {"shared_expert", "q_proj", "k_proj", "v_proj", "o_proj"}
    assert set(eng.lora_manager.pool.nbytes_by_target) == {"shared_expert", "q_proj/k_proj/v_proj", "o_proj"}


def test_kv_budget_flags_skip_the_device_plan(setup):
    """An explicit KV size is the user's: no device planning (the core lowers an automatic max_model_len)."""
    base, _ = setup
    e = engine(base, 1, enable_lora=True, num_kv_blocks=MAX_MODEL_LEN // BLOCK + 1)
    assert e.allocator.num_usable == MAX_MODEL_LEN // BLOCK


def test_device_memory_bytes_flag_and_validation():
    import argparse

    parser = add_engine_args(argparse.ArgumentParser())
    cfg = engine_config_from_args(parser.parse_args(["--device-memory-bytes", "3GiB"]))
    assert cfg.device_memory_bytes == 3 << 30
    with pytest.raises(ValueError, match=r"device_memory_bytes \(--device-memory-bytes\) must be a positive integer"):
        EngineConfig(device="cpu", device_memory_bytes=0).resolve()


def test_kv_caches_are_the_runners_bound_to_the_model(setup):
    """The model runner owns the KV cache and hands it to the model: a cache for fewer layers than the model has
    is refused when bound (zip would silently run fewer layers, issue 10.4), an unbound model refuses to run, and
    after a resize the model runs on the new cache, not the freed one."""
    from moeserve import SamplingParams
    from moeserve.layers.batch import AttentionMetadata, ForwardBatch
    from moeserve.models.moe_decoder import MoEForCausalLM
    from moeserve.worker.kv_cache import allocate_kv_cache

    spec = tiny_spec(FAMILY)
    model = MoEForCausalLM(spec)
    batch = ForwardBatch(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                         AttentionMetadata(torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.int32),
                                           torch.ones(1, dtype=torch.int32), is_decode=True))
    with pytest.raises(RuntimeError, match="no KV caches bound"):
        model(batch)
    short = allocate_kv_cache(spec, 2, BLOCK, torch.float32, torch.device("cpu"))[:spec.num_layers - 1]
    with pytest.raises(ValueError, match=f"KV caches given for {spec.num_layers - 1} of {spec.num_layers} layers"):
        model.bind_kv_caches(short)

    base, _ = setup
    eng = engine(base, None, num_kv_blocks=6)
    runner = eng.runner
    old = runner.kv_caches
    runner.resize_kv_cache(9)
    assert runner.num_kv_blocks == 9 and all(k.shape[0] == v.shape[0] == 9 for k, v in runner.kv_caches)
    eng.generate([[5, 9, 30, 2, 7, 11, 4]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert all(k[1:].abs().sum() > 0 and v[1:].abs().sum() > 0 for k, v in runner.kv_caches)  # written to
    assert all(k[1:].abs().sum() == 0 for k, _ in old)  # the freed cache was not


@pytest.mark.gpu
def test_a_pool_larger_than_the_device_is_refused_before_allocation(setup):
    base, _ = setup
    free = torch.cuda.mem_get_info()[0]
    with pytest.raises(ValueError, match=r"LoRA slot pool \(\d+ slots x rank 64\) needs .*--max-loras.*"
                                         r"--max-lora-rank.*--lora-target-modules"):
        Engine(EngineConfig(model=str(base), device="cuda", enable_lora=True, max_lora_rank=64,
                            max_loras=max(1, int(free // (64 * 4096)))))
