"""The offline Engine loads an adapter at its first use, as the server does (issue 21): with
enable_lora_runtime_loading and a lora_dir, a request naming an adapter that is not loaded but is a folder inside
lora_dir loads it, and generates what the same adapter loaded explicitly generates."""
import os

import pytest

from moeserve import Engine, EngineConfig, SamplingParams
from moeserve.lora.adapter import LoRAAdapterError
from moeserve.errors import UnknownAdapterError
from peft_fixtures import make_peft_adapter, save_base_checkpoint

FAMILY = "qwen3_moe"
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2)
PROMPTS = [[5, 17, 42, 9], [300, 12, 7]]


def config(base, **kw):
    return EngineConfig(model=str(base), device="cpu", dtype="float32", block_size=4, num_kv_blocks=64,
                        max_num_seqs=4, enable_lora=True, max_lora_rank=8, max_loras=2, **kw)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("first_use")
    base = save_base_checkpoint(FAMILY, root / "base")
    lora_dir = root / "adapters"
    make_peft_adapter(FAMILY, lora_dir / "ad", kind="attn+experts", rank=4, seed=1)
    make_peft_adapter(FAMILY, root / "outside", kind="attn", rank=4, seed=2)  # a real adapter, outside lora_dir
    os.symlink(root / "outside", lora_dir / "escape")
    return base, lora_dir


def test_adapter_in_lora_dir_loads_at_first_use_like_an_explicit_load(setup):
    base, lora_dir = setup
    explicit = Engine(config(base, lora_modules={"ad": str(lora_dir / "ad")}))
    ref = explicit.generate(PROMPTS, GREEDY, lora="ad")
    base_out = explicit.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in ref] != [o.token_ids for o in base_out]  # the adapter changes the output

    engine = Engine(config(base, enable_lora_runtime_loading=True, lora_dir=str(lora_dir)))
    assert engine.list_loras() == []
    got = engine.generate(PROMPTS, GREEDY, lora="ad")
    assert engine.list_loras() == ["ad"]
    for a, b in zip(got, ref):
        assert a.token_ids == b.token_ids
        assert [x.logprob for x in a.logprobs] == pytest.approx([x.logprob for x in b.logprobs], abs=1e-5)

    with pytest.raises(UnknownAdapterError, match="lora_dir .--lora-dir. has no adapter folder 'missing'"):
        engine.add_request(PROMPTS[0], GREEDY, lora="missing")
    with pytest.raises(UnknownAdapterError, match="'escape'"):  # a symlink out of lora_dir is not followed
        engine.add_request(PROMPTS[0], GREEDY, lora="escape")
    with pytest.raises(LoRAAdapterError, match="invalid adapter name"):
        engine.add_request(PROMPTS[0], GREEDY, lora="../base")
    assert engine.list_loras() == ["ad"] and not engine.has_unfinished()


def test_without_runtime_loading_a_name_is_not_loaded(setup):
    base, lora_dir = setup
    engine = Engine(config(base, lora_dir=str(lora_dir)))
    with pytest.raises(UnknownAdapterError, match="'ad' is not loaded"):
        engine.add_request(PROMPTS[0], GREEDY, lora="ad")
