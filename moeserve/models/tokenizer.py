"""A model folder's tokenizer: loading it (or knowing there is none), its end-of-sequence ids, chat templating."""
from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger("moeserve")

# files any of which makes a folder hold a real tokenizer (AutoTokenizer will otherwise build an
# empty one from config.json alone, whose vocabulary of 1 makes every id decode to nothing)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(path: str | Path, vocab_size: int, tokenizer_class: str | None = None) -> "TokenizerWrapper | None":
    """The tokenizer in `path`, or None (prompts must then be token ids) when the folder has no
    tokenizer files or holds one that does not fit the model's vocabulary. `tokenizer_class`: the class AutoTokenizer
    chose for this folder where the engine core loaded it (TokenizerWrapper.class_name); the frontend loads that class
    itself, without AutoTokenizer, whose import loads torch (transformers' model configs) into the HTTP process."""
    path = Path(path)
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        logger.warning("no tokenizer files in %s; prompts must be token ids", path)
        return None
    try:
        tok = _tokenizer_class(tokenizer_class).from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - a model without tokenizer still serves token ids
        logger.warning("no tokenizer loaded from %s (%s); prompts must be token ids", path, e)
        return None
    if len(tok) < 2 or len(tok) > vocab_size:
        logger.warning("tokenizer in %s has %d tokens but the model's vocabulary is %d; not using it",
                       path, len(tok), vocab_size)
        return None
    return TokenizerWrapper(tok)


def _tokenizer_class(name: str | None):
    """The transformers tokenizer class of that name; AutoTokenizer for None or a name transformers does not export
    (its choice is then made again, as it was in the core)."""
    import transformers

    cls = getattr(transformers, name, None) if name else None
    if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase):
        return cls
    from transformers import AutoTokenizer

    return AutoTokenizer


def eos_token_ids(model_dir: str | Path, config_eos: tuple[int, ...], tokenizer) -> set[int]:
    """End-of-sequence ids: generation_config.json first (what the model was tuned to stop on), then
    config.json's, then the tokenizer's."""
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except (OSError, ValueError):
            eos = None
        if eos is not None:
            return set(eos) if isinstance(eos, list) else {eos}
    if config_eos:
        return set(config_eos)
    return {tokenizer.eos_token_id} if tokenizer is not None and tokenizer.eos_token_id is not None else set()


class TokenizerWrapper:
    """Thin wrapper: HF tokenizer plus a cached set of special ids and chat templating."""

    def __init__(self, hf_tokenizer):
        self.tok = hf_tokenizer
        self.class_name = type(hf_tokenizer).__name__  # what AutoTokenizer chose (load_tokenizer's tokenizer_class)
        self.all_special_ids_set = set(hf_tokenizer.all_special_ids)
        self.eos_token_id = hf_tokenizer.eos_token_id
        self._anchor = (self.encode("a") or [0])[-1]  # token_text's anchor: any token with a text of its own
        self._anchor_text = self.decode([self._anchor], skip_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text one token adds after other text (logprobs' token strings). Decoded alone, a token loses
        the leading space a SentencePiece decoder strips from the start of a text; so it is decoded after a
        fixed anchor token, whose own text is then cut off."""
        both = self.decode([self._anchor, token_id], skip_special_tokens=False)
        if both.startswith(self._anchor_text):
            return both[len(self._anchor_text):]
        return self.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict]) -> str:
        if not getattr(self.tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use a plain completion prompt")
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        return self.tok.encode(self.apply_chat_template(messages), add_special_tokens=False)
