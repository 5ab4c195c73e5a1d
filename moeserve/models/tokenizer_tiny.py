"""A real byte-level BPE tokenizer for tiny test models, trained at call time on an embedded corpus.

Tiny random models need a tokenizer that behaves like a production one: byte-level BPE
(multi-byte UTF-8 characters split across tokens), special tokens, a ChatML chat template.
Training takes milliseconds and is deterministic, so nothing is downloaded or checked in.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Enough distinct words that BPE can fill a 512-token vocabulary; non-ASCII words exercise
# multi-byte handling (a character split over several byte tokens must decode back whole).
CORPUS = """\
The quick brown fox jumps over the lazy dog, and the dog does not seem to mind at all.
A small language model can still learn the shape of a language: which letters follow which,
where words begin and end, and how sentences tend to close with a period or a question mark.
What is the capital of France? The capital of France is Paris. Berlin is the capital of Germany,
Madrid is the capital of Spain, Rome is the capital of Italy, and Tokyo is the capital of Japan.
In a small café near the river, a naïve student ordered a crème brûlée and a glass of water.
The waiter smiled, said "voilà", and wrote the order in a notebook with a green pencil.
Travellers say that 日本 is beautiful in spring, when the cherry trees bloom along the canals;
others prefer the quiet of 東京 at night, or the mountains of Zürich and the lakes near Genève.
Mixture-of-experts models route every token to a few experts chosen by a learned router.
Each expert is a small feed-forward network; the router scores all of them and keeps the top ones.
Serving many adapters at once means that each request may carry its own low-rank update,
and the engine must apply the right update to the right rows without slowing the others down.
Numbers matter too: 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42, 100, 2024, 3.14159, and 1,000,000.
Hello, world! How are you today? I am fine, thank you. Please tell me a short story about a robot
who learns to paint, a cat who learns to swim, and a teacher who learns to listen.
Once upon a time, in a village by the sea, there lived an old fisherman and his daughter.
Every morning they sailed out before sunrise and came back at noon with baskets full of silver fish.
The weather changed quickly; clouds gathered, the wind grew strong, and waves crashed on the rocks.
She looked at the sky, counted the seconds between lightning and thunder, and decided to return.
Good software is simple, tested, and measured. Write the reference first, then make it fast.
Señor Muñoz drank his café con leche while reading the newspaper, then walked to the station.
Über alles liebte er die Musik; straße, Mädchen und schön are German words with special letters.
"""


@functools.lru_cache(maxsize=8)
def tiny_tokenizer_json(vocab_size: int = 512) -> str:
    """The serialized `tokenizers` tokenizer (tokenizer.json contents), trained on CORPUS.

    Vocabulary: the 3 special tokens (ids 0..2), the 256 byte symbols, then merges up to
    `vocab_size` (fewer only if the corpus runs out of pairs to merge).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size={vocab_size} is too small for a byte-level BPE (needs >= 259)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    return tok.to_str()


def save_tiny_tokenizer(out_dir, vocab_size: int = 512, model_max_length: int = 512) -> dict[str, int]:
    """Write tokenizer.json, tokenizer_config.json (with the ChatML template) and
    special_tokens_map.json into `out_dir`; return the special token ids by name."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok_json = tiny_tokenizer_json(vocab_size)
    (out / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    vocab = json.loads(tok_json)["model"]["vocab"]
    ids = {t: vocab[t] for t in SPECIAL_TOKENS}

    special = dict(bos_token=ENDOFTEXT, eos_token=ENDOFTEXT, pad_token=ENDOFTEXT,
                   additional_special_tokens=[IM_START, IM_END])
    added = {
        str(ids[t]): dict(content=t, lstrip=False, normalized=False, rstrip=False, single_word=False, special=True)
        for t in SPECIAL_TOKENS
    }
    config = dict(
        tokenizer_class="PreTrainedTokenizerFast",
        added_tokens_decoder=added,
        **special,
        unk_token=None,
        add_bos_token=False,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
        chat_template=CHATML_TEMPLATE,
    )
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return {"endoftext": ids[ENDOFTEXT], "im_start": ids[IM_START], "im_end": ids[IM_END]}
