"""rank_pattern / alpha_pattern of a PEFT adapter_config.json, looked up as PEFT looks them up, in linear time.

The keys are regular expressions from a file anyone may hand the server (runtime adapter loading), so they
are never run through Python's backtracking `re`: see PatternTable.
"""
from __future__ import annotations

import re
import time

import re2

from moeserve.errors import PatternKeyError

MAX_PATTERN_KEYS = 1024  # entries of rank_pattern / alpha_pattern / target_modules ...
MAX_PATTERN_KEY_LEN = 256

_RE2_MAX_MEM = 8 << 20  # per table: RE2's compiled keys and its DFA state cache
MAX_MATCH_SECONDS = 3.0  # CPU time per table spent matching regex keys (1024 keys on 18k names: ~0.7 s)
_PLAIN_KEY_RE = re.compile(r"(?:[^\\.^$*+?{}\[\]|()]|\\\.)*")  # a plain name, dots possibly escaped
# what Python's re and RE2 may spell differently: an escape, a [...] class, an x{,n} repeat (see _re2_spelling)
_RE2_SPELLING_RE = re.compile(r"\\(.)|(\[\^?\]?(?:\\.|[^\]\\])*\])|\{,(\d*)\}")
_RE2_LACKS = ("RE2 matches in linear time, so it has no backreferences, lookaround, atomic groups, possessive "
              "quantifiers or conditionals")


class _BadKey(Exception):
    """A pattern key that cannot be matched as PEFT matches it; the message says why."""


class PatternTable:
    r"""A rank_pattern / alpha_pattern mapping, looked up as PEFT does (get_pattern_key in peft/utils/other.py,
    used by LoraModel._create_and_replace; PEFT 0.21): the value of the first key, in file order, for which
    re.match(rf"(.*\.)?({key})$", module) succeeds, i.e. the key, as a Python regex, matches the whole module
    name or the part after one of its '.'; else of the key equal to the module name; else no value.

    CPython's backtracking `re` takes exponential time on keys like "(.*.*.*)*z", so keys are not matched with
    it: keys that are plain names (possibly with escaped dots) by dictionary lookup of the name's dot-suffixes,
    the others with one RE2 set (automata, no backtracking; memory bounded by _RE2_MAX_MEM), which reports every
    key that matches a name in one linear pass. RE2's cost per character still grows with the number and shape
    of the keys, so a CPU-time budget bounds the whole table (module names come from the file too, so they are
    bounded by MAX_TENSOR_NAME_LEN).

    RE2 reads a regex as Python's re does but for a few constructs, handled so that an accepted key means what
    it means to PEFT (https://github.com/google/re2/wiki/Syntax):
      * refused: keys PEFT's re.compile refuses (among them a global flag such as (?i), which cannot stand inside
        PEFT's wrapper pattern); Python-only syntax RE2 has no linear-time form for (backreferences, lookaround,
        atomic groups, possessive quantifiers, conditionals, (?x) (?a) (?u), \u \U \N escapes, repeat counts
        above 1000), and octal escapes \1-\777, which RE2 cannot tell from backreferences as Python does.
      * rewritten for RE2: x{,n} and x{,} (repeats in Python, literal text in RE2) become x{0,n} and x{0,}; \Z
        becomes \z (RE2's spelling); '[' inside a class is escaped (RE2 would read [[:alpha:]] as a POSIX class).
      * \d \w \s \b and case folding are ASCII in RE2 and Unicode in Python; they agree on printable ASCII,
        which is what module names are, so regex keys and the module names matched against them must be
        printable ASCII (else refused). Python's $ also matches before a final '\n', and its \B fails on an
        empty string; module names contain no '\n' (see _pair_lora_tensors) and are never empty."""

    def __init__(self, field: str, raw):
        self.field = field
        raw = raw or {}
        if not isinstance(raw, dict):
            raise PatternKeyError(f"{field} must be a mapping, got {type(raw).__name__}")
        if len(raw) > MAX_PATTERN_KEYS:
            raise PatternKeyError(f"{field} has {len(raw)} keys (limit {MAX_PATTERN_KEYS})")
        self.items = list(raw.items())
        self.exact = {}  # key -> index: PEFT's fallback rank_pattern.get(module_name)
        self.literal = {}  # plain name -> index of the first key meaning exactly that name
        self.regex_index = []  # RE2 set entry -> index of its key
        options = re2.Options()
        options.max_mem, options.encoding, options.log_errors = _RE2_MAX_MEM, re2.Options.Encoding.LATIN1, False
        self.regexes = re2.Set.MatchSet(options)  # anchored at the start, as re.match is
        for i, (key, _) in enumerate(self.items):
            self.exact.setdefault(key, i)
            if len(key) > MAX_PATTERN_KEY_LEN:
                raise PatternKeyError(f"{field} key {key[:40]!r}... has {len(key)} characters "
                                f"(limit {MAX_PATTERN_KEY_LEN})")
            if _PLAIN_KEY_RE.fullmatch(key):
                self.literal.setdefault(key.replace("\\.", "."), i)
                continue
            try:
                pattern = _re2_pattern(key)
                self.regexes.Add(pattern)
            except _BadKey as e:
                raise PatternKeyError(f"{field} key {key!r}: {e}") from None
            except re2.error:
                raise PatternKeyError(f"{field} key {key!r}: not supported by RE2 "
                                f"({_re2_problem(pattern, options)}); {_RE2_LACKS}") from None
            self.regex_index.append(i)
        if self.regex_index:
            try:
                self.regexes.Compile()
            except re2.error:
                raise PatternKeyError(f"{field}: its {len(self.regex_index)} regular-expression keys are too "
                                f"complex together (RE2 needs more than {_RE2_MAX_MEM >> 20} MiB for them)") from None
        self.seconds = 0.0  # CPU time spent in RE2
        self.memo: dict[str, tuple[str, object] | None] = {}

    def fields(self) -> list[tuple[str, object]]:
        """(`field[key]`, value) for messages about the values."""
        return [(f"{self.field}[{k!r}]", v) for k, v in self.items]

    def lookup(self, name: str) -> tuple[str, object] | None:
        """(key, value) PEFT would use for the module `name`, or None for the default."""
        if name not in self.memo:
            i = self._first_match(name)
            self.memo[name] = None if i is None else self.items[i]
        return self.memo[name]

    def _first_match(self, name: str) -> int | None:
        # the name and each part after a '.' (the `(.*\.)?` in PEFT's pattern) as a plain key
        hits = [self.literal.get(name[p:]) for p in [0] + [j + 1 for j, c in enumerate(name) if c == "."]]
        hits = [i for i in hits if i is not None] + (self._regex_matches(name) if self.regex_index else [])
        return min(hits) if hits else self.exact.get(name)

    def _regex_matches(self, name: str) -> list[int]:
        """Indices of the regex keys that match `name`."""
        if not (name.isascii() and name.isprintable()):
            raise PatternKeyError(f"module name {name[:80]!r} is not printable ASCII, and {self.field} has "
                                  "regular-expression keys, which are matched against printable ASCII names only",
                                  about_names=True)
        t0 = time.thread_time()
        # Once Compile() succeeded, a set's DFA cannot run out of memory (it flushes its state cache and goes
        # on: a set has no NFA to fall back to), so no result means no key matches.
        matches = self.regexes.Match(name.encode()) or []
        self.seconds += time.thread_time() - t0
        if self.seconds > MAX_MATCH_SECONDS:
            raise PatternKeyError(f"{self.field}: its {len(self.regex_index)} regular-expression keys are too costly "
                                  "to match against this adapter's module names (more than "
                                  f"{MAX_MATCH_SECONDS:g} s of CPU time)")
        return [self.regex_index[j] for j in matches]


def _re2_pattern(key: str) -> bytes:
    """PEFT's pattern for the regex `key`, spelled for RE2 (see PatternTable); _BadKey if it cannot be."""
    if not (key.isascii() and key.isprintable()):
        raise _BadKey("a regular-expression key must be printable ASCII")
    try:
        re.compile(rf"(.*\.)?({key})$")  # what PEFT compiles (only compiled: never matched here)
    except (re.error, RecursionError, OverflowError, ValueError, Warning) as e:  # Warning: under -W error
        raise _BadKey(f"not a valid regular expression in PEFT's pattern (.*\\.)?(key)$ ({e})") from None
    return rf"(?:.*\.)?(?:{_RE2_SPELLING_RE.sub(_re2_spelling, key)})$".encode()


def _re2_spelling(m: re.Match) -> str:
    """One _RE2_SPELLING_RE match of a key Python's re accepts, as RE2 must be told it."""
    escaped, char_class, repeat_max = m.groups()
    if escaped is not None:
        if escaped in "123456789":  # Python: a backreference, or an octal escape if three octal digits
            raise _BadKey(f"\\{escaped}...: backreferences not supported (nor octal escapes other than \\0); "
                          + _RE2_LACKS)
        return r"\z" if escaped == "Z" else m[0]
    if char_class is not None:
        return "[" + re.sub(r"\\.|\[", lambda t: r"\[" if t[0] == "[" else t[0], char_class[1:])
    return f"{{0,{repeat_max}}}"


def _re2_problem(pattern: bytes, options) -> str:
    """RE2's reason for refusing `pattern` (RE2::Set.Add gives none)."""
    try:
        re2.compile(pattern, options)
    except re2.error as e:
        reason = e.args[0] if e.args else ""
        return reason.decode(errors="replace") if isinstance(reason, bytes) else str(reason)
    return "unknown reason"
