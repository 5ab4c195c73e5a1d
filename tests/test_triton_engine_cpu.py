"""The whole engine with the Triton backends (run by Triton's interpreter on CPU) against the torch
reference backends: same tokens, same logprobs to fp32 rounding, with and without adapters."""
import pytest
import torch

from moeserve import Engine, EngineConfig, SamplingParams
from engine_probe import prompt_logits
from peft_fixtures import INTERPRETED_LAYERS, make_peft_adapter, save_base_checkpoint


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_triton_backends_match_torch_backends(tmp_path, family):
    """One batch mixes no adapter, a fused gate_up expert adapter (A) and one with separate gate_proj / up_proj
    LoRAs of rank 4, each with its own A (B), in a rank-4 pool."""
    base = save_base_checkpoint(family, tmp_path / "base", **INTERPRETED_LAYERS)
    a, _ = make_peft_adapter(family, tmp_path / "a", rank=4, seed=1, config_overrides=INTERPRETED_LAYERS)
    b, _ = make_peft_adapter(family, tmp_path / "b", rank=4, seed=2, expert_format="per-expert", separate_gate_up=True,
                             config_overrides=INTERPRETED_LAYERS)
    kw = dict(model=str(base), device="cpu", dtype="float32", lora_modules={"A": str(a), "B": str(b)}, max_loras=2,
              max_lora_rank=4, block_size=16)
    tri = Engine(EngineConfig(moe_backend="triton", attention_backend="triton", **kw))
    ref = Engine(EngineConfig(moe_backend="torch", attention_backend="torch", **kw))
    prompts = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 19, 7)]
    # a prefill, then a decode step (the second token): each path once; more steps repeat the decode step's kernels
    sp = SamplingParams(max_tokens=2, logprobs=0, temperature=0.0, ignore_eos=True)
    loras = [None, "A", "B"]
    for got, want in zip(tri.generate(prompts, sp, lora=loras), ref.generate(prompts, sp, lora=loras)):
        assert got.token_ids == want.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(got.logprobs, want.logprobs)) < 1e-4


def test_triton_separate_gate_up_adapter_matches_peft(tmp_path):
    """Separate gate_proj / up_proj LoRAs of rank 4 in a rank-4 pool (up A's allocated for them), the Triton
    kernels against PEFT: a 33-token prompt (66 pairs: the sorted path, one N tile across gate and up) and greedy
    decode (the GEMV path)."""
    family = "qwen3_moe"
    base = save_base_checkpoint(family, tmp_path / "base", **INTERPRETED_LAYERS)
    path, pm = make_peft_adapter(family, tmp_path / "ad", kind="attn+experts", rank=4, seed=7,
                                 expert_format="per-expert", separate_gate_up=True, config_overrides=INTERPRETED_LAYERS)
    engine = Engine(EngineConfig(model=str(base), device="cpu", dtype="float32", lora_modules={"ad": str(path)},
                                 max_lora_rank=4, block_size=16, moe_backend="triton", attention_backend="triton"))
    assert engine.lora_manager.pool.separate_gate_up
    prompt = torch.randint(3, 512, (33,), generator=torch.Generator().manual_seed(8)).tolist()
    with torch.no_grad():
        theirs = pm(input_ids=torch.tensor([prompt])).logits[0].float()
        want = pm.generate(input_ids=torch.tensor([prompt[:6]]), attention_mask=torch.ones(1, 6, dtype=torch.long),
                           max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 6:].tolist()
    assert (prompt_logits(engine, prompt, "ad") - theirs).abs().max().item() <= 1e-4
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)  # a prefill and a decode step
    assert engine.generate([prompt[:6]], sp, lora="ad")[0].token_ids == want
