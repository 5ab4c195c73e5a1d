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


def _triton_engine_with_adapter(tmp_path, kind: str) -> Engine:
    """A qwen3_moe engine on the Triton backends with one rank-4 adapter "ad" of PEFT kind `kind`."""
    family = "qwen3_moe"
    base = save_base_checkpoint(family, tmp_path / "base", **INTERPRETED_LAYERS)
    ad, _ = make_peft_adapter(family, tmp_path / "ad", kind=kind, rank=4, seed=3, config_overrides=INTERPRETED_LAYERS)
    return Engine(EngineConfig(model=str(base), device="cpu", dtype="float32", lora_modules={"ad": str(ad)},
                               max_lora_rank=4, block_size=16, moe_backend="triton", attention_backend="triton"))


def test_dense_lora_rows_are_grouped_once_per_forward(tmp_path, monkeypatch):
    """The model groups a forward's rows by adapter slot once, and every dense LoRA call of that forward (q|k|v, o;
    the GEMV path's shrink at one row) reads that grouping: none makes its own (a launch per projection)."""
    from moeserve.kernels import lora_dense
    from moeserve.models.moe_decoder import MoEForCausalLM

    made, used, lora_forwards = [], [], []
    wrap = {name: getattr(lora_dense, name) for name in ("group_rows", "dense_lora", "dense_lora_shrink")}
    monkeypatch.setattr(lora_dense, "group_rows", lambda *a, **k: made.append(wrap["group_rows"](*a, **k)) or made[-1])
    for name in ("dense_lora", "dense_lora_shrink"):
        def recording(*a, _fn=wrap[name], **k):
            used.append(k.get("groups", a[4] if len(a) > 4 else None))  # the shrink takes it fifth, positionally
            return _fn(*a, **k)
        monkeypatch.setattr(lora_dense, name, recording)
    forward = MoEForCausalLM.forward
    monkeypatch.setattr(MoEForCausalLM, "forward",
                        lambda self, batch: lora_forwards.append(batch.lora is not None) or forward(self, batch))
    engine = _triton_engine_with_adapter(tmp_path, "attn+experts")
    made.clear(), used.clear(), lora_forwards.clear()  # start-up (warm-up, capture) aside: the requests' steps
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.generate([[5, 6, 7, 8, 9], [11, 12, 13]], sp, lora=["ad", None])  # a prefill, then decode steps of 2 rows
    engine.generate([[5, 6, 7]], sp, lora=["ad"])  # decode of one row: the GEMV path (the shrink alone)
    assert sum(lora_forwards) >= 4 and len(made) == sum(lora_forwards), (len(made), lora_forwards)
    assert used and all(any(g is m for m in made) for g in used)
    assert len(used) >= 2 * len(engine.runner.model.layers) * len(made)  # q|k|v and o in every layer, each forward


def test_adapters_on_experts_alone_group_no_rows(tmp_path, monkeypatch):
    """With LoRA on the routed experts alone no dense projection reads a grouping of the rows by slot, so a LoRA
    forward makes none (a launch a step for nothing); the adapter still changes the output."""
    from moeserve.kernels import lora_dense

    made = []
    group_rows = lora_dense.group_rows
    monkeypatch.setattr(lora_dense, "group_rows", lambda *a, **k: made.append(1) or group_rows(*a, **k))
    engine = _triton_engine_with_adapter(tmp_path, "experts")
    sp = SamplingParams(max_tokens=2, logprobs=0, temperature=0.0, ignore_eos=True)
    with_ad, without = (engine.generate([[5, 6, 7, 8, 9]], sp, lora=lora)[0] for lora in ("ad", None))
    assert not made
    assert with_ad.logprobs[0].logprob != without.logprobs[0].logprob
