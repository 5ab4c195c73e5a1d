"""Engine foundation against transformers: logits, greedy generation, batching, sampling, errors."""
import json
import shutil

import pytest
import torch
import transformers as tf

from moeserve import Engine, EngineConfig, RequestError, SamplingParams
from moeserve.errors import CheckpointError
from moeserve.errors import UnsupportedModelError
from moeserve.models.tiny import TINY_FAMILIES, make_tiny
from moeserve.frontend.detokenizer import detokenize_step
from moeserve.frontend.output_processor import RequestState

from engine_probe import prompt_logits

GREEDY = dict(temperature=0.0, ignore_eos=True)


def hf_model(path):
    return tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager").eval()


def engine_for(path, **kw) -> Engine:
    kw.setdefault("block_size", 4)
    return Engine(EngineConfig(model=str(path), device="cpu", dtype="float32", **kw))


def random_prompts(lengths, vocab=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_prefill_logits_and_greedy_tokens_match_transformers(tiny_models, family):
    path = tiny_models[family]
    ref = hf_model(path)
    engine = engine_for(path)
    ids = random_prompts([23], seed=1)[0]
    ours = prompt_logits(engine, ids)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0].float()
    assert (ours - theirs).abs().max().item() <= 1e-4
    prompts = random_prompts([7, 19], seed=2)
    outs = engine.generate(prompts, SamplingParams(max_tokens=32, **GREEDY))
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert o.token_ids == want[0, len(p):].tolist()
        assert o.finish_reason == "length"


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_expert_layouts_and_shards_load_to_the_same_logits(tmp_path, family):
    per_expert = make_tiny(family, tmp_path / "per", expert_layout="per_expert", seed=3)
    fused = make_tiny(family, tmp_path / "fused", expert_layout="fused", seed=3, shard_size="60KB")
    assert (fused / "model.safetensors.index.json").is_file()
    ids = random_prompts([11], seed=4)[0]
    a = prompt_logits(engine_for(per_expert), ids)
    b = prompt_logits(engine_for(fused), ids)
    assert torch.equal(a, b)


def test_logprobs_and_prompt_logprobs_match_transformers(tiny_models):
    path = tiny_models["olmoe"]
    ref = hf_model(path)
    engine = engine_for(path)
    prompt = random_prompts([9], seed=5)[0]
    out = engine.generate([prompt], SamplingParams(max_tokens=6, logprobs=3, prompt_logprobs=2, **GREEDY))[0]
    full = prompt + out.token_ids
    with torch.no_grad():
        logp = torch.log_softmax(ref(torch.tensor([full])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        lp = out.prompt_logprobs[i]
        assert lp.token_id == prompt[i]
        assert abs(lp.logprob - logp[i - 1, prompt[i]].item()) < 1e-4
        assert [t for t, _ in lp.top] == logp[i - 1].topk(2).indices.tolist()
    for j, lp in enumerate(out.logprobs):
        row = logp[len(prompt) - 1 + j]
        assert lp.token_id == out.token_ids[j] == row.argmax().item()
        assert abs(lp.logprob - row.max().item()) < 1e-4
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()


def _run_staggered(engine, prompts, max_tokens, stagger):
    """Submit request i at step stagger[i]; return request outputs in submission order."""
    pending = list(range(len(prompts)))
    ids, final, step = {}, {}, 0
    while pending or engine.has_unfinished():
        for i in [i for i in pending if stagger[i] <= step]:
            ids[i] = engine.add_request(prompts[i], SamplingParams(max_tokens=max_tokens[i], **GREEDY))
            pending.remove(i)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        step += 1
    return [final[ids[i]] for i in range(len(prompts))]


@pytest.mark.parametrize("num_kv_blocks", [None, 24])
def test_continuous_batching_equals_running_alone(tiny_models, num_kv_blocks):
    path = tiny_models["qwen2_moe"]
    lengths = [3, 40, 17, 5, 29, 11, 2, 33, 8, 21, 14, 6, 37, 9, 25, 12]
    prompts = random_prompts(lengths, seed=6)
    max_tokens = [4 + (i * 7) % 13 for i in range(16)]
    stagger = [(i * 3) % 7 for i in range(16)]
    alone_engine = engine_for(path)
    alone = [alone_engine.generate([p], SamplingParams(max_tokens=m, **GREEDY))[0].token_ids
             for p, m in zip(prompts, max_tokens)]
    # chunked prefill forced: a 16-token step budget splits the longer prompts
    engine = engine_for(path, max_num_batched_tokens=16, num_kv_blocks=num_kv_blocks)
    outs = _run_staggered(engine, prompts, max_tokens, stagger)
    assert [o.token_ids for o in outs] == alone
    if num_kv_blocks is not None:
        assert engine.stats().num_preemptions > 0
    assert engine.allocator.num_free == engine.allocator.num_usable  # every block came back


def test_seeded_sampling_reproduces_whatever_the_batch(tiny_models):
    engine = engine_for(tiny_models["mixtral"])
    prompt = random_prompts([8], seed=7)[0]
    sp = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = engine.generate([prompt], sp)[0].token_ids
    others = random_prompts([5, 13, 3], seed=8)
    mixed = engine.generate(others + [prompt], [SamplingParams(max_tokens=7, temperature=1.0, ignore_eos=True)] * 3 + [sp])
    assert mixed[-1].token_ids == alone
    other_seed = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.9, seed=99, ignore_eos=True))
    greedy = engine.generate([prompt], SamplingParams(max_tokens=12, **GREEDY))
    assert other_seed[0].token_ids != alone or greedy[0].token_ids != alone


def test_top_k_one_is_greedy(tiny_models):
    engine = engine_for(tiny_models["mixtral"])
    prompt = random_prompts([8], seed=9)[0]
    a = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=1.5, top_k=1, seed=3, ignore_eos=True))
    b = engine.generate([prompt], SamplingParams(max_tokens=10, **GREEDY))
    assert a[0].token_ids == b[0].token_ids


def test_stop_strings_end_generation_at_the_match(tiny_models):
    engine = engine_for(tiny_models["qwen3_moe"])
    prompt = "the quick brown fox"
    free = engine.generate([prompt], SamplingParams(max_tokens=24, **GREEDY))[0]
    assert len(free.text) > 6
    stop = free.text[3:6]
    stopped = engine.generate([prompt], SamplingParams(max_tokens=24, stop=[stop], **GREEDY))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[:free.text.find(stop)]
    assert stop not in stopped.text


def test_streamed_text_equals_final_text(tiny_models):
    engine = engine_for(tiny_models["qwen3_moe"])
    rid = engine.add_request("café naïve", SamplingParams(max_tokens=20, stop=["zz"], **GREEDY))
    pieces, final = [], None
    while engine.has_unfinished():
        for o in engine.step():
            pieces.append(o.delta_text)
            final = o
    assert final.request_id == rid and "".join(pieces) == final.text


def test_incremental_detokenizer_never_splits_multibyte_characters(tiny_models):
    tok = engine_for(tiny_models["qwen3_moe"]).tokenizer
    text = "naïve café 日本語 🙂 done"
    ids = tok.encode(text)
    state = RequestState("d", None, [1], SamplingParams(max_tokens=100), None)
    pieces = []
    for t in ids:
        state.append_token(t)
        pieces.append(detokenize_step(tok, state, skip_special_tokens=True))
    assert "".join(pieces) == text == state.text
    assert not any("\ufffd" in p for p in pieces)


def test_abort_frees_blocks_and_others_continue(tiny_models):
    engine = engine_for(tiny_models["olmoe"])
    a = engine.add_request(random_prompts([30], seed=10)[0], SamplingParams(max_tokens=50, **GREEDY))
    b_prompt = random_prompts([6], seed=11)[0]
    b = engine.add_request(b_prompt, SamplingParams(max_tokens=8, **GREEDY))
    for _ in range(3):
        engine.step()
    assert engine.abort(a)
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    assert a not in outs
    assert outs[b].token_ids == engine.generate([b_prompt], SamplingParams(max_tokens=8, **GREEDY))[0].token_ids
    assert engine.allocator.num_free == engine.allocator.num_usable


def test_bad_requests_are_refused_and_the_engine_keeps_serving(tiny_models):
    engine = engine_for(tiny_models["qwen3_moe"], max_model_len=64)
    prompt = random_prompts([5], seed=12)[0]
    before = engine.generate([prompt], SamplingParams(max_tokens=5, **GREEDY))[0].token_ids
    with pytest.raises(RequestError, match="max_model_len"):
        engine.add_request(list(range(3, 80)), SamplingParams(max_tokens=4))
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("", SamplingParams(max_tokens=4))
    with pytest.raises(RequestError, match="empty"):
        engine.add_request([], SamplingParams(max_tokens=4))
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.add_request([1, 10**6], SamplingParams(max_tokens=4))
    for bad in (dict(max_tokens=0), dict(max_tokens=-3), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-5)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    with pytest.raises(RequestError, match="LoRA is not enabled"):
        engine.add_request(prompt, SamplingParams(max_tokens=4), lora="nope")
    assert engine.generate([prompt], SamplingParams(max_tokens=5, **GREEDY))[0].token_ids == before
    assert engine.stats().requests_rejected >= 4


def test_bad_checkpoints_name_the_problem(tiny_models, tmp_path):
    src = tiny_models["qwen3_moe"]

    def copy(name):
        dst = tmp_path / name
        shutil.copytree(src, dst)
        return dst

    cfg_path = copy("arch") / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model_type"] = "llama4_moe"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="llama4_moe"):
        engine_for(cfg_path.parent)

    cfg_path = copy("rope") / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="yarn"):
        engine_for(cfg_path.parent)

    from safetensors.torch import load_file, save_file

    for name, mutate, match in [
        ("missing", lambda sd: sd.pop("model.layers.0.self_attn.k_proj.weight"), "missing tensor 'model.layers.0.self_attn.k_proj.weight'"),
        ("shape", lambda sd: sd.__setitem__("model.layers.1.self_attn.o_proj.weight", torch.zeros(3, 3)), "o_proj.weight.*shape"),
    ]:
        d = copy(name)
        sd = load_file(str(d / "model.safetensors"))
        mutate(sd)
        save_file(sd, str(d / "model.safetensors"))
        with pytest.raises(CheckpointError, match=match):
            engine_for(d)

    with pytest.raises(FileNotFoundError):
        engine_for(tmp_path / "does-not-exist")


def test_demo_model_answers_paris_and_matches_transformers(demo_dir, demo_engine):
    """The demo model (through the engine, and transformers greedy on the same checkpoint, token for token)
    answers the capital of France."""
    engine = demo_engine
    prompt = engine.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])
    out = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0))[0]
    assert "Paris" in out.text
    ref = hf_model(demo_dir)
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                            max_new_tokens=20, do_sample=False)
    want = want[0, len(prompt):].tolist()
    assert out.token_ids == want[:len(out.token_ids)]
    assert len(out.token_ids) == 20 or out.finish_reason == "stop"


def test_stop_token_ids_end_generation(tiny_models):
    engine = engine_for(tiny_models["mixtral"])
    prompt = random_prompts([8], seed=13)[0]
    free = engine.generate([prompt], SamplingParams(max_tokens=12, **GREEDY))[0].token_ids
    stop_at = free[4]
    out = engine.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=[stop_at], **GREEDY))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free[:free.index(stop_at) + 1]
