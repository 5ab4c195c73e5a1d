"""Text at the edges of a generation: the first output token after the prompt (a SentencePiece decoder strips
a decode's leading space), a stop string in the held-back partial character a request ends on, and the echoed
prompt's logprobs of a prompt prefilled in chunks. References: the HF tokenizer's decode of prompt + output,
its token pieces, and the same request answered without streaming."""
from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from moeserve import Engine, EngineConfig, SamplingParams
from moeserve.models.tiny import make_tiny
from moeserve.outputs import CoreOutput
from moeserve.frontend.output_processor import OutputProcessor, RequestState
from server_harness import RunningServer

MODEL = "tiny-sp"
ENGINE_KW = dict(max_model_len=128, num_kv_blocks=64, block_size=16)
PROMPT = "The capital of France is"


def _sentencepiece_tokenizer(out, vocab_size: int) -> None:
    """A Llama/Mistral-style tokenizer.json (Metaspace pieces; the decoder Mixtral's tokenizer has: "▁" to
    space, byte fallback, strip one leading space) over whole-word pieces."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for word in ("▁The", "▁capital", "▁of", "▁France", "▁is", "▁Paris", "<0xE4>", "<0xB8>", "<0xAD>"):
        vocab[word] = len(vocab)  # the three bytes of 中, as byte-fallback pieces
    while len(vocab) < vocab_size:
        vocab[f"▁w{len(vocab)}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    tok.save(str(out / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **special}))
    (out / "special_tokens_map.json").write_text(json.dumps(special))


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    d = make_tiny("qwen3_moe", tmp_path_factory.mktemp("tiny_sp"))
    for f in d.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            f.unlink() if f.is_file() else shutil.rmtree(f)
    _sentencepiece_tokenizer(d, json.loads((d / "config.json").read_text())["vocab_size"])
    return d


def _spoken(hf, ids: list[int]) -> list[str]:
    """What each piece stands for after other text ("▁" is a space)."""
    return [p.replace("▁", " ") for p in hf.convert_ids_to_tokens(ids)]


def test_the_first_generated_token_keeps_its_leading_space(sp_model):
    hf = AutoTokenizer.from_pretrained(str(sp_model))
    prompt_ids = hf.encode(PROMPT, add_special_tokens=False)
    assert hf.decode(prompt_ids[-1:]) == "is"  # the decoder strips a decode's leading space
    engine = Engine(EngineConfig(model=str(sp_model), **ENGINE_KW))
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    pieces, out = [], None
    while engine.has_unfinished():
        for o in engine.step():
            pieces.append(o.delta_text)
            out = o
    assert out.request_id == rid and len(out.token_ids) == 6
    want = hf.decode(prompt_ids + out.token_ids)[len(hf.decode(prompt_ids)):]
    assert want.startswith(" ") and out.text == want == "".join(_spoken(hf, out.token_ids))
    assert "".join(pieces) == want


def test_the_server_keeps_the_space_in_text_echo_and_logprob_tokens(sp_model):
    hf = AutoTokenizer.from_pretrained(str(sp_model))
    prompt_ids = hf.encode(PROMPT, add_special_tokens=False)
    s = RunningServer(EngineConfig(model=str(sp_model), **ENGINE_KW), MODEL)
    try:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "logprobs": 2}
        c = s.http.post("/v1/completions", json=body).json()["choices"][0]
        out_ids = hf.convert_tokens_to_ids([t.replace(" ", "▁") for t in c["logprobs"]["tokens"]])
        assert c["logprobs"]["tokens"] == _spoken(hf, out_ids)
        assert all(t.startswith(" ") for t in c["logprobs"]["tokens"])
        assert c["logprobs"]["text_offset"] == [len(hf.decode(out_ids[:k])) + (k > 0) for k in range(len(out_ids))]
        assert c["text"] == hf.decode(prompt_ids + out_ids)[len(hf.decode(prompt_ids)):]
        for top in c["logprobs"]["top_logprobs"]:
            assert all(t.startswith(" ") for t in top)  # every candidate here is a "▁word" piece
        echoed = s.http.post("/v1/completions", json={**body, "echo": True}).json()["choices"][0]
        assert echoed["text"] == hf.decode(prompt_ids + out_ids)
        lp = echoed["logprobs"]
        assert lp["tokens"] == [hf.decode(prompt_ids[:1])] + _spoken(hf, prompt_ids[1:] + out_ids)
        assert lp["text_offset"] == [len(hf.decode(prompt_ids[:k])) for k in range(len(prompt_ids))] + [
            len(hf.decode(prompt_ids + out_ids[:k])) for k in range(len(out_ids))]
        streamed = s.http.post("/v1/completions", json={**body, "stream": True})
        deltas = [json.loads(line[6:])["choices"][0]["text"] for line in streamed.text.split("\n\n")
                  if line.startswith("data: {")]
        assert "".join(deltas) == c["text"] and deltas[0].startswith(" ")
    finally:
        s.close()


def test_a_prompt_ending_inside_a_character_loses_no_output_text(sp_model):
    """A prompt of token ids may end with the first bytes of a character; the first output token completing it
    must not make the detokenizer drop text that follows (the window starts after the prompt's last complete
    character: the completing byte shows as U+FFFD, as it did before the window took prompt tokens)."""
    from moeserve.models.tokenizer import load_tokenizer

    hf = AutoTokenizer.from_pretrained(str(sp_model))
    tok = load_tokenizer(sp_model, json.loads((sp_model / "config.json").read_text())["vocab_size"])
    b1, b2, b3 = hf.convert_tokens_to_ids(["<0xE4>", "<0xB8>", "<0xAD>"])
    assert hf.decode([b1, b2, b3]) == "中"
    words = hf.convert_tokens_to_ids(["▁w20", "▁w21"])
    proc = OutputProcessor(tok)
    proc.add(RequestState("r", None, hf.encode("The capital", add_special_tokens=False) + [b1, b2],
                          SamplingParams(max_tokens=3), None))
    outs = [proc.process([CoreOutput("r", [t], finish_reason="length" if t == words[-1] else None)])[0][0]
            for t in [b3, *words]]
    assert outs[-1].text.endswith(" " + hf.decode(words)) and outs[-1].text in ("\ufffd w20 w21", " w20 w21")
    assert "".join(o.delta_text for o in outs) == outs[-1].text


def test_a_stop_string_in_the_partial_character_a_request_ends_on_still_stops_it(tiny_tokenizer):
    """A token whose text ends in an incomplete character is held back until the character completes; when the
    request ends there (max_tokens, EOS), the held text is shown, and a stop string in it must end the request
    at the stop string as anywhere else."""
    tok = tiny_tokenizer
    token, text = next((i, t) for i in range(len(tok.tok)) if len(t := tok.decode([i], skip_special_tokens=False))
                       >= 2 and t.endswith("\ufffd") and t[0].isascii() and t[0].isalpha())
    before = next(i for i in range(len(tok.tok)) if (t := tok.decode([i])) and t.isascii() and text[0] not in t
                  and not t.endswith("\ufffd"))
    eos = tok.eos_token_id
    for last, finish in (([token], "length"), ([token, eos], "stop")):
        proc = OutputProcessor(tok)
        proc.add(RequestState("r", None, [before], SamplingParams(max_tokens=8, stop=[text[0]]), None))
        outs, _ = proc.process([CoreOutput("r", [before])])
        outs2, _ = proc.process([CoreOutput("r", last, finish_reason=finish)])
        final = outs2[-1]
        assert final.finish_reason == "stop", (last, final)
        assert final.text == tok.decode([before]) and text[0] not in final.text
        assert outs[0].delta_text + final.delta_text == final.text


def test_streamed_echo_logprobs_of_a_prompt_prefilled_in_chunks_are_all_there(chunked_server):
    s = chunked_server
    prompt = list(range(3, 100))  # six prefill chunks
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "echo": True, "logprobs": 1}
    whole = s.http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert whole["token_logprobs"][0] is None and None not in whole["token_logprobs"][1:]
    r = s.http.post("/v1/completions", json={**body, "stream": True})
    chunks = [json.loads(line[6:])["choices"][0]["logprobs"] for line in r.text.split("\n\n")
              if line.startswith("data: {")]
    streamed = [x for c in chunks if c for x in c["token_logprobs"]]
    assert len(streamed) == len(prompt) + 3
    assert streamed[0] is None and streamed[1:] == pytest.approx(whole["token_logprobs"][1:], abs=1e-5)
    assert [t for c in chunks if c for t in c["tokens"]] == whole["tokens"]


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from moeserve.models.tokenizer import load_tokenizer

    d = make_tiny("qwen3_moe", tmp_path_factory.mktemp("tiny_tok"))
    return load_tokenizer(d, json.loads((d / "config.json").read_text())["vocab_size"])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny("qwen3_moe", tmp_path_factory.mktemp("tiny_stops"))


@pytest.fixture(scope="module")
def chunked_server(tiny_model):
    """The tiny model served with prefills in chunks of 16 tokens, for the two server tests on it (one start)."""
    s = RunningServer(EngineConfig(model=str(tiny_model), max_num_batched_tokens=16, **ENGINE_KW), MODEL)
    yield s
    s.close()


def _first_unique_word(hf, tokens: list[int]) -> int:
    """Index of an output token (past the first) with text of its own that does not occur earlier in the output."""
    return next(k for k in range(1, len(tokens)) if tokens[k] not in tokens[:k]
                and hf.decode(tokens[k:k + 1]).strip() and tokens[k] not in hf.all_special_ids)


def test_a_stop_token_ids_text_is_left_out_unless_include_stop_str_in_output(tiny_model):
    """As vLLM: the token that stops a request (EOS, a stop_token_ids entry) is in token_ids but its text is
    not in the output; include_stop_str_in_output keeps it, and keeps a matched stop string."""
    hf = AutoTokenizer.from_pretrained(str(tiny_model))
    engine = Engine(EngineConfig(model=str(tiny_model), **ENGINE_KW))
    prompt = "the quick brown fox"
    prompt_ids = hf.encode(prompt, add_special_tokens=False)
    greedy = dict(max_tokens=16, temperature=0, ignore_eos=True)
    free = engine.generate([prompt], SamplingParams(**greedy))[0]
    k = _first_unique_word(hf, free.token_ids)

    def text_of(ids):  # the reference: HF's decode of prompt + output, less the prompt's text
        return hf.decode(prompt_ids + ids, skip_special_tokens=True)[len(hf.decode(prompt_ids)):]

    for include in (False, True):
        rid = engine.add_request(prompt, SamplingParams(stop_token_ids=[free.token_ids[k]],
                                                        include_stop_str_in_output=include, **greedy))
        pieces, out = [], None
        while engine.has_unfinished():
            for o in engine.step():
                pieces.append(o.delta_text)
                out = o
        assert out.request_id == rid and out.finish_reason == "stop"
        assert out.token_ids == free.token_ids[:k + 1]
        assert out.text == text_of(free.token_ids[:k + 1 if include else k]) == "".join(pieces)

    stop = free.text[3:6]
    cut = free.text.find(stop)
    for include, want in ((False, free.text[:cut]), (True, free.text[:cut + len(stop)])):
        rid = engine.add_request(prompt, SamplingParams(stop=[stop], include_stop_str_in_output=include, **greedy))
        pieces, out = [], None
        while engine.has_unfinished():
            for o in engine.step():
                pieces.append(o.delta_text)
                out = o
        assert (out.finish_reason, out.text, "".join(pieces)) == ("stop", want, want)


def test_the_server_takes_include_stop_str_in_output(chunked_server):
    s = chunked_server
    completion = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 16, "temperature": 0,
                  "ignore_eos": True}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}

    def text(path, body):
        c = s.http.post(path, json=body).json()["choices"][0]
        return c["finish_reason"], c["text"] if "text" in c else c["message"]["content"]

    for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        _, free = text(path, body)
        stop = free[3:6]
        cut = free.find(stop)
        for include, want in ((False, free[:cut]), (True, free[:cut + len(stop)])):
            assert text(path, {**body, "stop": [stop], "include_stop_str_in_output": include}) == ("stop", want)
    r = s.http.post("/v1/completions", json={**completion, "include_stop_str_in_output": "yes"})
    assert r.status_code == 400 and "include_stop_str_in_output" in r.json()["error"]["param"]
