"""Every Triton kernel the engine launches carries the engine's `pdl` setting (kernels/pdl.py): a layer that did not
pass it down would launch that kernel serially on Hopper, and one launched with PDL but without its in-kernel wait
would race. The CPU interpreter cannot run PDL, so the test keeps the setting the config was given (the CPU has
no PDL) and records each launch's USE_PDL / launch_pdl. The kernels themselves are not run (their results are
what the other tests check; here only the launches matter, and interpreting them was most of a minute): the
engine's buffers are allocated zeroed for the test, so every index a skipped kernel would have written (expert ids,
sorted rows, sampled tokens) is a valid one and the run does not depend on memory left over."""
import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from moeserve import Engine, EngineConfig, SamplingParams
from peft_fixtures import make_peft_adapter, save_base_checkpoint


@pytest.mark.parametrize("family,pdl_on", [("qwen2_moe", True), ("qwen3_moe", False)])
def test_every_triton_launch_carries_the_engine_pdl_setting(tmp_path, monkeypatch, family, pdl_on):
    monkeypatch.setattr(EngineConfig, "_resolve_pdl", lambda self, on_cuda: None)  # keep pdl as given, on the CPU
    launches = []
    run = InterpretedFunction.run

    def recording_launch(self, *args, grid, warmup, **kwargs):
        launches.append((self.fn.__name__, kwargs.get("USE_PDL"), kwargs.get("launch_pdl")))

    monkeypatch.setattr(InterpretedFunction, "run", recording_launch)
    zeros, zeros_like = torch.zeros, torch.zeros_like
    monkeypatch.setattr(torch, "empty", lambda *a, **k: zeros(*a, **k))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: zeros_like(*a, **k))
    base = save_base_checkpoint(family, tmp_path / "base")
    ad, _ = make_peft_adapter(family, tmp_path / "ad", kind="attn+experts", rank=4, seed=3)
    engine = Engine(EngineConfig(model=str(base), device="cpu", dtype="float32", lora_modules={"ad": str(ad)},
                                 max_lora_rank=4, block_size=16, moe_backend="triton", attention_backend="triton",
                                 pdl=pdl_on))
    assert engine.config.pdl is pdl_on
    prompts = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (37, 4)]
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.generate(prompts, sp, lora=["ad", None])  # prefill: 41 tokens x top-2 on the sorted path; decode: GEMVs
    engine.generate(prompts[1:], sp)  # decode of one row: the GEMV, the router GEMM + top-k, no LoRA
    names = {name for name, _, _ in launches}
    for kernel in ("_gemv_kernel", "_rms_norm_kernel", "_qk_norm_rotary_kv_kernel", "_decode_split_kernel",
                   "_gemm_topk_kernel", "_gemv_gate_up_kernel", "_moe_gate_up_kernel", "_lora_shrink_pairs_kernel",
                   "_lora_block_shrink_kernel", "_dense_lora_shrink_kernel", "_dense_lora_expand_kernel",
                   "_align_place_kernel"):
        assert kernel in names, f"{kernel} never ran: the test no longer covers it"
    wrong = sorted({(name, use, launch) for name, use, launch in launches if use is not pdl_on or launch is not pdl_on})
    assert not wrong, f"launched with USE_PDL / launch_pdl other than {pdl_on}: {wrong}"
