"""Every Triton kernel the engine launches carries the engine's `pdl` setting (kernels/pdl.py): a layer that did not
pass it down would launch that kernel serially on Hopper, and one launched with PDL but without its in-kernel wait
would race. The CPU interpreter cannot run PDL, so the test keeps the setting the config was given (the CPU has
no PDL) and records each launch's USE_PDL / launch_pdl. The kernels themselves are not run (their results are
what the other tests check; here only the launches matter, and interpreting them was most of a minute): the
engine's buffers are allocated zeroed for the test, so every index a skipped kernel would have written (expert ids,
sorted rows, sampled tokens) is a valid one and the run does not depend on memory left over."""
import inspect

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from moeserve import Engine, EngineConfig, SamplingParams
from peft_fixtures import make_peft_adapter, save_base_checkpoint


def _recording_engine(tmp_path, monkeypatch, family, pdl, **engine_kw):
    """(a LoRA engine on the CPU whose Triton launches are recorded, not run; the list they go to: (kernel name,
    {parameter: value}) each). pdl kept as given (the CPU has none)."""
    monkeypatch.setattr(EngineConfig, "_resolve_pdl", lambda self, on_cuda: None)
    launches = []

    def recording_launch(self, *args, grid, warmup, **kwargs):
        names = inspect.signature(self.fn).parameters
        launches.append((self.fn.__name__, {**dict(zip(names, args)), **kwargs}))

    monkeypatch.setattr(InterpretedFunction, "run", recording_launch)
    zeros, zeros_like = torch.zeros, torch.zeros_like
    monkeypatch.setattr(torch, "empty", lambda *a, **k: zeros(*a, **k))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: zeros_like(*a, **k))
    base = save_base_checkpoint(family, tmp_path / "base")
    ad, _ = make_peft_adapter(family, tmp_path / "ad", kind="attn+experts", rank=4, seed=3)
    engine = Engine(EngineConfig(model=str(base), device="cpu", dtype="float32", lora_modules={"ad": str(ad)},
                                 max_lora_rank=4, block_size=16, moe_backend="triton", attention_backend="triton",
                                 pdl=pdl, **engine_kw))
    return engine, launches


@pytest.mark.parametrize("family,pdl_on", [("qwen2_moe", True), ("qwen3_moe", False)])
def test_every_triton_launch_carries_the_engine_pdl_setting(tmp_path, monkeypatch, family, pdl_on):
    engine, launches = _recording_engine(tmp_path, monkeypatch, family, pdl_on)
    assert engine.config.pdl is pdl_on
    prompts = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (37, 4)]
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.generate(prompts, sp, lora=["ad", None])  # prefill: 41 tokens x top-2 on the sorted path; decode: GEMVs
    engine.generate(prompts[1:], sp)  # decode of one row: the GEMV, the router GEMM + top-k, no LoRA
    names = {name for name, _ in launches}
    for kernel in ("_gemv_kernel", "_rms_norm_kernel", "_qk_norm_rotary_kv_kernel", "_decode_split_kernel",
                   "_gemm_topk_kernel", "_gemv_gate_up_kernel", "_moe_gate_up_kernel", "_lora_shrink_pairs_kernel",
                   "_lora_block_shrink_kernel", "_dense_lora_shrink_kernel", "_dense_lora_expand_kernel",
                   "_align_place_kernel"):
        assert kernel in names, f"{kernel} never ran: the test no longer covers it"
    wrong = sorted({(name, kw.get("USE_PDL"), kw.get("launch_pdl")) for name, kw in launches
                    if kw.get("USE_PDL") is not pdl_on or kw.get("launch_pdl") is not pdl_on})
    assert not wrong, f"launched with USE_PDL / launch_pdl other than {pdl_on}: {wrong}"


def _record_decode_launches(tmp_path, monkeypatch, family, **engine_kw):
    """(kernel name, {parameter: value}) of every Triton launch of a LoRA engine's prefill + decode steps with PDL
    on, the kernels not run."""
    engine, launches = _recording_engine(tmp_path, monkeypatch, family, True, **engine_kw)
    launches.clear()
    out = engine.generate([list(range(3, 40))], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                          lora="ad")
    assert len(out[0].token_ids) == 3, out[0]
    return launches


def _same(a, b) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.data_ptr() == b.data_ptr()


# late consumers: the parameter holding the LoRA shrink they read after their wait; shrinks: their output
_SHRUNK_PARAM = {"_gemv_kernel": "scratch_ptr", "_fp8_gemv_kernel": "scratch_ptr", "_fp8_linear_kernel": "scratch_ptr",
                 "_gemv_gate_up_kernel": "shrunk_ptr", "_gemv_down_kernel": "shrunk_ptr", "_gemv_fp8_kernel": "shrunk_ptr"}
_SHRINK_OUT = {"_dense_lora_shrink_kernel": "scratch_ptr", "_lora_shrink_pairs_kernel": "out_ptr"}


@pytest.mark.parametrize("family,activations", [("qwen2_moe", None), ("qwen3_moe", "none"), ("qwen3_moe", "dynamic")],
                         ids=["bf16", "fp8-weight-only", "fp8-w8a8"])
def test_a_kernel_that_walks_k_before_its_wait_follows_its_own_shrink(tmp_path, monkeypatch, family, activations):
    """Under PDL a kernel may read before its wait only what the kernel launched just before it does not write
    (kernels/pdl.py). In the decode steps of a LoRA engine (bf16 with a shared expert, FP8 weight-only and W8A8),
    a projection or expert GEMV that walks K before its wait (late wait) has its own shrink just before it, which
    writes only the partials read after the wait. Under W8A8 the activation's quantization sits between the shrink
    and the FP8 expert GEMV, which must then wait at entry. Launches recorded, kernels not run; fails when a launch
    moves between a pair or the late wait is taken behind another kernel."""
    kw = dict(quantization="fp8", fp8_activations=activations) if activations else {}
    launches = _record_decode_launches(tmp_path, monkeypatch, family, **kw)
    seen = {}
    for i, (name, kw_) in enumerate(launches):
        before, before_kw = launches[i - 1] if i else ("", {})
        late = kw_.get("HAS_LORA") and (name != "_gemv_fp8_kernel" or kw_.get("LORA_LATE"))
        if name in _SHRUNK_PARAM and late:
            assert before in _SHRINK_OUT and _same(before_kw[_SHRINK_OUT[before]], kw_[_SHRUNK_PARAM[name]]), \
                f"launch {i} {name} walks K before its wait behind {before}, not its own shrink"
            seen[name] = seen.get(name, 0) + 1
    expected = {None: ("_gemv_kernel", "_gemv_gate_up_kernel", "_gemv_down_kernel"),
                "none": ("_fp8_linear_kernel", "_gemv_fp8_kernel"), "dynamic": ()}[activations]
    assert all(seen.get(k) for k in expected), f"a case never ran, the test no longer covers it: {seen}"
    if activations == "dynamic":  # the FP8 expert GEMV ran with its LoRA, waiting at entry
        assert any(n == "_gemv_fp8_kernel" and k.get("HAS_LORA") for n, k in launches)
        assert "_gemv_fp8_kernel" not in seen
