"""Hostile adapter folders (issue 15, items 1, 3, 6 and 8): pattern keys cannot freeze the process, oversized or
bogus files are refused in milliseconds before anything is allocated, factors that overflow the serving dtype
are refused, nothing read is kept after a refusal, and adapter names are validated. Every refusal is a
LoRAAdapterError naming the adapter, the file or field, and the problem."""
import dataclasses
import gc
import json
import random
import re
import resource
import shutil
import struct
import subprocess
import sys
import textwrap
import time
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeserve.errors import PatternKeyError
from moeserve.lora.adapter import LoRAAdapterError, _max_tensor_count, _max_weights_bytes, load_lora_adapter
from moeserve.lora.names import validate_adapter_name
from moeserve.lora.pattern_keys import MAX_MATCH_SECONDS, MAX_PATTERN_KEYS, PatternTable
from peft_fixtures import make_peft_adapter, tiny_spec

FAMILY, MAX_RANK, NAME = "qwen3_moe", 16, "hostile"
SPEC = tiny_spec(FAMILY)
REPO = Path(__file__).resolve().parents[1]
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
Q0_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q0_B = Q0_A.replace("lora_A", "lora_B")
EXPERTS0_A = "base_model.model.model.layers.0.mlp.experts.lora_A.weight"  # down_proj, [E*r, I]
EXPERTS0_B = EXPERTS0_A.replace("lora_A", "lora_B")
GiB = 1 << 30


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path, _ = make_peft_adapter(FAMILY, tmp_path_factory.mktemp("base") / "adapter", rank=4, alpha=8)
    return path


@pytest.fixture
def adapter(base, tmp_path):
    """A fresh copy of the valid base adapter, to break."""
    return Path(shutil.copytree(base, tmp_path / "adapter"))


def load(path, **kw):
    return load_lora_adapter(NAME, path, SPEC, MAX_RANK, **kw)


def refused(path, *fragments, within: float = 1.0, **kw) -> str:
    """Load, expect a LoRAAdapterError naming the adapter and every fragment, within `within` seconds."""
    t0 = time.perf_counter()
    with pytest.raises(LoRAAdapterError) as info:
        load(path, **kw)
    elapsed = time.perf_counter() - t0
    msg = str(info.value)
    assert repr(NAME) in msg, msg
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"
    assert elapsed < within, f"refused after {elapsed:.2f} s: {msg}"
    return msg


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / CONFIG).read_text())
    cfg.update(changes)
    (path / CONFIG).write_text(json.dumps(cfg))


def edit_tensors(path: Path, fn) -> None:
    tensors = load_file(str(path / WEIGHTS))
    fn(tensors)
    save_file(tensors, str(path / WEIGHTS))


def write_safetensors(path: Path, header: dict | bytes, data: bytes = b"", header_len: int | None = None) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    (path / WEIGHTS).write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)


# ---------------------------------------------------------------------------------------------- pattern keys

_CHILD = textwrap.dedent("""
    import json, sys, time
    from moeserve.lora.adapter import LoRAAdapterError, load_lora_adapter
    from moeserve.model_spec import ModelSpec
    spec = ModelSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(sys.argv[1]).items()})
    for path in sys.argv[2:]:
        t0 = time.perf_counter()
        try:
            a = load_lora_adapter("hostile", path, spec, 16)
            result = {"q0": {str(l): [a.dense[(l, "q_proj")][0].shape[0], a.dense[(l, "q_proj")][1].abs().sum().item()]
                             for l in range(spec.num_layers)}}
        except LoRAAdapterError as e:
            result = {"error": str(e)}
        result["seconds"] = time.perf_counter() - t0
        print(json.dumps(result), flush=True)
""")


def load_in_child(paths: list[Path]) -> list[dict]:
    """Load each adapter in a child process: a regression to backtracking regexes then fails on the timeout
    instead of freezing the test run (CPython's re holds the GIL, so a thread could not be timed out)."""
    spec = json.dumps(dataclasses.asdict(SPEC))
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD, spec, *map(str, paths)], cwd=REPO, capture_output=True,
                              text=True, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("loading an adapter with hostile pattern keys did not finish in 90 s (catastrophic backtracking?)")
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_backtracking_pattern_keys_are_matched_in_bounded_time(base, tmp_path):
    """Keys that make CPython's re backtrack exponentially: the adapter loads in well under a second and the
    keys mean what PEFT's re.match(rf"(.*\\.)?({key})$", module) would (if it ever finished)."""
    redos_prefix = "x" * 40  # a module name (from the file) on which (x+x+)+y backtracks 2^40 ways
    cases = {}

    def case(name, edit_cfg=None, rename_q0=False):
        d = Path(shutil.copytree(base, tmp_path / name))
        if edit_cfg:
            edit_config(d, **edit_cfg)
        if rename_q0:
            def rename(t):
                for k in (Q0_A, Q0_B):
                    t[k.replace("model.model.layers", f"model.{redos_prefix}.layers")] = t.pop(k)
            edit_tensors(d, rename)
        cases[name] = d

    case("plain")
    case("nested_star", {"rank_pattern": {"(.*.*.*.*.*)*z": 2}})  # the key from the issue: matches nothing here
    case("redos_name", {"rank_pattern": {"(x+x+)+y": 2},  # backtracks on the renamed module, then does not match
                        "alpha_pattern": {r"(x+x+)+\.layers\.0\.self_attn\.q_proj": 16}}, rename_q0=True)
    case("redos_target_modules", {"target_modules": "(.*.*.*.*.*)*z", "layers_pattern": ["(a|a)*b"]})
    results = dict(zip(cases, load_in_child(list(cases.values()))))

    for name, result in results.items():
        assert "error" not in result, f"{name}: {result}"
        assert result["seconds"] < 1.0, f"{name}: {result['seconds']:.2f} s"
    plain = results["plain"]["q0"]
    assert results["nested_star"]["q0"] == plain
    assert results["redos_target_modules"]["q0"] == plain
    redos = results["redos_name"]["q0"]
    assert redos["0"][0] == 4 and redos["0"][1] == pytest.approx(2 * plain["0"][1], rel=1e-5)  # alpha 16, not 8
    assert redos["2"] == plain["2"]


def _random_regex(rng, depth=0) -> str:
    atoms = ["a", "b", ".", r"\.", "[ab]", "[^a]", r"\d", r"\w", "1", "_", "[a-c.]"]
    k = rng.random()
    if depth > 3 or k < 0.35:
        return rng.choice(atoms)
    if k < 0.55:
        return _random_regex(rng, depth + 1) + _random_regex(rng, depth + 1)
    if k < 0.65:
        return f"({_random_regex(rng, depth + 1)}|{_random_regex(rng, depth + 1)})"
    if k < 0.8:
        return f"({_random_regex(rng, depth + 1)})" + rng.choice(["*", "+", "?", "{2}", "{1,3}", "{,2}", "*?", "{2,}"])
    if k < 0.85:
        return "^" + _random_regex(rng, depth + 1)
    if k < 0.9:
        return _random_regex(rng, depth + 1) + "$"
    return f"(?:{_random_regex(rng, depth + 1)})"


def test_pattern_lookup_agrees_with_peft_get_pattern_key():
    """Differential check against PEFT's rule (peft.utils.other.get_pattern_key, then .get(module_name)) run with
    CPython's re: random keys on short names (where backtracking stays cheap), typical keys on module names."""
    rng = random.Random(0)
    short = ["".join(rng.choice("ab.1_") for _ in range(rng.randint(0, 9))) for _ in range(300)]
    modules = ["model.layers.0.self_attn.q_proj", "model.layers.12.mlp.experts.3.down_proj", "q_proj", "lm_head",
               "model.layers.1.self_attn.q_proj", "model.layers.10.mlp.experts.base_layer.gate_up_proj"]
    typical = ["q_proj", r"layers\.1\d\..*_proj", "self_attn.q_proj", r"model\.layers\.0\.self_attn\.q_proj",
               r"experts.[0-9]+.down_proj", "^model.*q_proj", r"layers\.\d+\.self_attn\.(q|k)_proj$", "_proj",
               "layers.1.self_attn.q_proj", r"(mlp|block_sparse_moe)\.experts\..*", "lm_head", "", r"\w+_up_proj"]

    def check(keys, names):
        table = PatternTable("rank_pattern", {k: i for i, k in enumerate(keys)})
        for name in names:
            want = next((k for k in keys if re.match(rf"(.*\.)?({k})$", name)), name if name in keys else None)
            got = table.lookup(name)
            if (got[0] if got else None) != want:
                wrong.append(f"keys {keys}, module {name!r}: got {got and got[0]!r}, PEFT {want!r}")

    wrong = []
    for _ in range(400):
        keys = list(dict.fromkeys([_random_regex(rng) for _ in range(rng.randint(1, 4))] + rng.sample(typical, 2)))
        rng.shuffle(keys)
        check(keys, rng.sample(short, 30))
    for _ in range(100):
        check(rng.sample(typical, rng.randint(1, 5)), modules)
    assert not wrong, "\n".join(wrong[:10])


@pytest.mark.parametrize("field,value,fragments", [
    ("rank_pattern", {f"layers.{i}.q_proj": 2 for i in range(MAX_PATTERN_KEYS + 1)}, ["rank_pattern has 1025 keys"]),
    ("alpha_pattern", {"q" * 257: 2}, ["alpha_pattern key 'qqqq", "has 257 characters (limit 256)"]),
    ("rank_pattern", {r"(q)\1_proj": 2}, [r"rank_pattern key '(q)\\1_proj'", "backreferences not supported"]),
    ("rank_pattern", {r"\101_proj": 2}, ["backreferences not supported (nor octal escapes"]),
    ("rank_pattern", {"(?=q)q_proj": 2}, ["not supported by RE2 (invalid perl operator: (?=)", "lookaround"]),
    ("rank_pattern", {"(?<!k)q_proj": 2}, ["not supported by RE2 (invalid perl operator: (?<!)", "lookaround"]),
    ("rank_pattern", {"(?>q)_proj": 2}, ["not supported by RE2 (invalid perl operator: (?>)", "atomic groups"]),
    ("rank_pattern", {"(?x:q )_proj": 2}, ["not supported by RE2 (invalid perl operator: (?x)"]),
    pytest.param("rank_pattern", {"(?i)Q_PROJ": 2}, ["not a valid regular expression", "global flags not at the start"],
                 marks=pytest.mark.skipif(sys.version_info < (3, 11), reason="an error from Python 3.11")),
    ("rank_pattern", {r"\u0071_proj": 2}, ["not supported by RE2 (invalid escape sequence: \\u)"]),
    ("rank_pattern", {"q_pr\u00f6j.*": 2}, ["a regular-expression key must be printable ASCII"]),
    ("alpha_pattern", {"q_proj(": 2}, ["alpha_pattern key 'q_proj('", "not a valid regular expression"]),
    ("rank_pattern", {"(a{100}){100}": 2}, ["not supported by RE2 (invalid repetition size: {100})"]),
    ("rank_pattern", {"a{5000}": 2}, ["not supported by RE2 (invalid repetition size: {5000})"]),
    ("rank_pattern", {f"(ab|ba){{{i},}}x": 2 for i in range(300)}, ["too complex together"]),
    ("rank_pattern", ["q_proj"], ["rank_pattern must be a mapping"]),
    ("target_modules", [f"m{i}" for i in range(MAX_PATTERN_KEYS + 1)], ["target_modules has 1025 entries"]),
    ("target_modules", ["q" * 300], ["target_modules entry", "300 characters"]),
    ("target_modules", "q" * 5000, ["target_modules is a string of 5000 characters"]),
    ("exclude_modules", 7, ["exclude_modules must be a string or a list"]),
    ("layers_pattern", [3], ["layers_pattern entry 3 is not a string"]),
])
def test_pattern_fields_beyond_limits_or_features_are_refused_by_name(adapter, field, value, fragments):
    edit_config(adapter, **{field: value})
    refused(adapter, CONFIG, *fragments)


def test_possessive_quantifiers_are_refused(adapter):
    if sys.version_info < (3, 11):
        pytest.skip("possessive quantifiers exist from Python 3.11")
    edit_config(adapter, rank_pattern={"q_pro*+j": 2})
    refused(adapter, "not supported by RE2 (bad repetition operator: *+)", "possessive quantifiers")


def peft_pattern_key(keys, name):
    """PEFT's rule (peft.utils.other.get_pattern_key, then .get(module_name)), with CPython's re."""
    return next((k for k in keys if re.match(rf"(.*\.)?({k})$", name)), name if name in keys else None)


def test_keys_python_and_re2_spell_differently_resolve_as_peft():
    """Keys whose constructs RE2 spells or reads differently from Python's re (x{,n}, \\Z, '[' in a class, ASCII vs
    Unicode \\b \\w and case folding): each resolves as PEFT resolves it, one key per table."""
    keys = ["layers\\.0{,2}\\.self_attn\\.q_proj", "1{,}\\.self_attn\\.q_proj", "(?:_?q){,1}_proj", "q_proj\\Z",
            "[[:q]+_proj", "[^[:]_proj", "(?i:Q)_PROJ", "(?i:SELF_ATTN)\\.[K-Q]_proj", "\\bq_proj", "\\Bproj",
            "\\w+\\.\\d\\.self_attn\\.q_proj", "\\s*q_proj", "[\\d.]+self_attn\\.q_proj", "q_proj{,", "q_proj{}",
            "(?s:.)_proj", "(?m:^)q_proj$", "\\x71_proj", "\\0?q_proj", "\\Aq_proj", "layers\\.\\d{,2}\\.mlp"]
    names = ["model.layers.0.self_attn.q_proj", "model.layers.00.self_attn.q_proj", "model.layers.1.self_attn.q_proj",
             "model.layers.0.self_attn.k_proj", "q_proj", "_q_proj", "a.q_proj", ":_proj", "x.[_proj", "qq_proj",
             "model.layers.11.self_attn.q_proj", "model.layers.11.mlp", "model.layers.111.mlp", "Q_PROJ",
             "model.layers.0.SELF_ATTN.K_proj", "q_proj{", "q_proj{}", "q_proj{,", "model.layers.0.self_attn. q_proj"]
    wrong = []
    for key in keys:
        table = PatternTable("rank_pattern", {key: 1})
        for name in names:
            got, want = table.lookup(name), peft_pattern_key([key], name)
            if (got[0] if got else None) != want:
                wrong.append(f"key {key!r}, module {name!r}: got {got and got[0]!r}, PEFT {want!r}")
    assert not wrong, "\n".join(wrong)


def test_regex_keys_refuse_module_names_outside_printable_ascii():
    """RE2's \\d \\w \\s \\b are ASCII, Python's Unicode: regex keys are matched only against printable ASCII
    names. Plain keys are looked up in a dictionary and keep working on any name."""
    table = PatternTable("rank_pattern", {"q_proj": 1, "layers\\.\\d+": 2})
    assert table.lookup("model.layers.0.self_attn.q_proj") == ("q_proj", 1)
    with pytest.raises(PatternKeyError, match="module name 'model.layers.\u0663.mlp' is not printable ASCII") as info:
        table.lookup("model.layers.\u0663.mlp")  # ARABIC-INDIC DIGIT THREE: a \\d to Python, not to RE2
    assert info.value.about_names  # the adapter's weights file is at fault, not its config
    plain = PatternTable("rank_pattern", {"q_proj": 1, "self_attn\\.q_proj": 2})
    assert plain.lookup("mod\u00e8l.layers.0.self_attn.q_proj") == ("q_proj", 1)


def test_a_module_name_outside_printable_ascii_is_refused_naming_the_weights_file(adapter):
    """Through the loader: the same refusal names the adapter's weights file (its config is not at fault)."""
    edit_config(adapter, rank_pattern={"layers\\.\\d+\\.self_attn\\.q_proj": 4})

    def rename_layer_0(tensors):
        for key in [k for k in tensors if "layers.0." in k]:
            tensors[key.replace("layers.0.", "layers.\u0660.")] = tensors.pop(key)  # ARABIC-INDIC DIGIT ZERO

    edit_tensors(adapter, rename_layer_0)
    refused(adapter, WEIGHTS, "is not printable ASCII, and rank_pattern has regular-expression keys")


def test_pattern_matching_work_is_bounded():
    """1024 regex keys against ~18k module names (a 48-layer, 128-expert per-expert adapter): matched (as PEFT
    matches them) or refused, within a few seconds either way."""
    rng = random.Random(1)
    alphabet = "abcdefghijklmnopqrstuvwxyz_.0123456789"
    keys = {".*" + "".join(rng.choice(alphabet) for _ in range(3)) + ".*(z|y)": 2 for _ in range(MAX_PATTERN_KEYS)}
    names = [f"model.layers.{layer}.mlp.experts.{e}.{p}" for layer in range(48) for e in range(128)
             for p in ("gate_proj", "up_proj", "down_proj")]
    table = PatternTable("rank_pattern", keys)
    t0 = time.perf_counter()
    try:
        got = {name: table.lookup(name) for name in names}
    except PatternKeyError as e:
        assert "rank_pattern: its 1024 regular-expression keys are too costly" in str(e)
        got = {}
    assert time.perf_counter() - t0 < 5
    for name in rng.sample(sorted(got), min(len(got), 40)):
        assert (got[name] or [None])[0] == peft_pattern_key(list(keys), name), name


def test_costly_regex_keys_are_refused_within_the_cpu_budget(monkeypatch):
    """Keys whose automata blow up together (RE2 rebuilds DFA states on every character of long names; ~0.1 s a
    name here): refused once matching has taken MAX_MATCH_SECONDS of CPU time, not after hours. Here with a budget
    of 1 s instead of 3 (the same check, read when it is made; ~10 names' worth of matching)."""
    from moeserve.lora import pattern_keys

    budget = 1.0
    assert budget < MAX_MATCH_SECONDS
    monkeypatch.setattr(pattern_keys, "MAX_MATCH_SECONDS", budget)
    rng = random.Random(2)
    keys = {f"[ab]*a[ab]{{{d}}}": 2 for d in range(1, 200)}
    names = ["".join(rng.choice("ab") for _ in range(480)) + ".layers.0.self_attn.q_proj" for _ in range(2000)]
    table = PatternTable("rank_pattern", keys)
    t0 = time.perf_counter()
    with pytest.raises(PatternKeyError, match=r"rank_pattern: its 199 regular-expression keys are too costly .* "
                                               rf"\(more than {budget:g} s of CPU time\)"):
        for name in names:
            table.lookup(name)
    assert time.perf_counter() - t0 < budget + 5


def test_regex_rank_pattern_keys_still_resolve(adapter):
    """Ordinary regex keys (the kind PEFT users write) keep working: first key in file order wins."""
    edit_config(adapter, rank_pattern={r"model\.layers\.[02]\.self_attn\.(q|v)_proj": 6, "q_proj": 4, "k_proj": 4})

    def widen(t):  # layers 0 and 2 q/v at rank 6
        for layer in (0, 2):
            for proj in ("q_proj", "v_proj"):
                a = f"base_model.model.model.layers.{layer}.self_attn.{proj}.lora_A.weight"
                b = a.replace("lora_A", "lora_B")
                t[a] = torch.cat([t[a], torch.randn(2, t[a].shape[1]) * 0.01])
                t[b] = torch.cat([t[b], torch.randn(t[b].shape[0], 2) * 0.01], dim=1)
    edit_tensors(adapter, widen)
    got = load(adapter)
    assert {(k, a.shape[0]) for k, (a, _) in got.dense.items() if k[1] in ("q_proj", "v_proj")} == {
        ((0, "q_proj"), 6), ((0, "v_proj"), 6), ((1, "q_proj"), 4), ((1, "v_proj"), 4),
        ((2, "q_proj"), 6), ((2, "v_proj"), 6)}


# ---------------------------------------------------------------------------------------------- sizes


def _rss_peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def test_sparse_1gb_config_is_refused_before_reading(adapter):
    with open(adapter / CONFIG, "r+b") as f:
        f.truncate(GiB)  # sparse: no disk, and reading it would cost 1 GiB of memory
    peak = _rss_peak_mib()
    refused(adapter, f"{CONFIG}: {GiB} bytes, larger than the 4 MiB limit")
    assert _rss_peak_mib() - peak < 256


def test_deeply_nested_config_json_is_refused(adapter):
    (adapter / CONFIG).write_text("[" * 200_000 + "]" * 200_000)
    refused(adapter, f"{CONFIG}: invalid JSON")


def test_config_with_invalid_utf8_is_refused(adapter):
    (adapter / CONFIG).write_bytes(b'{"r": 4, "x": "\xff\xfe"}')
    refused(adapter, f"{CONFIG}: invalid JSON")


def test_sparse_1gb_weights_file_is_refused_before_reading(adapter):
    with open(adapter / WEIGHTS, "r+b") as f:
        f.truncate(GiB)  # a valid header, then a gigabyte of (sparse) zeros
    peak = _rss_peak_mib()
    limit = _max_weights_bytes(SPEC, MAX_RANK)
    refused(adapter, WEIGHTS, "bytes of tensor data, more than any LoRA adapter of this model at max_rank 16",
            f"({limit} bytes)")
    assert _rss_peak_mib() - peak < 256


@pytest.mark.parametrize("header,header_len,size,fragment", [
    (b"", 2 ** 64 - 1, 0, f"declared header length {2 ** 64 - 1} bytes exceeds the 16 MiB limit"),
    (b"", (16 << 20) + 1, GiB, "exceeds the 16 MiB limit"),
    (b"{}", 1 << 20, 0, "runs past the end of the"),
    (b"\x00" * 64, None, 0, "header is not valid JSON"),
    (b"[" * 100_000, None, 0, "header is not valid JSON"),
    (b"[1, 2]", None, 0, "header is a JSON list, not an object"),
    (b"abcde", "raw", 0, "5 bytes, shorter than the 8-byte header length"),
], ids=["len_2^64", "len_16MiB+1", "len_past_end", "nul_bytes", "nested_json", "json_list", "5_bytes"])
def test_bogus_safetensors_headers_are_refused(adapter, header, header_len, size, fragment):
    if header_len == "raw":
        (adapter / WEIGHTS).write_bytes(header)
    else:
        write_safetensors(adapter, header, header_len=header_len)
    if size:
        with open(adapter / WEIGHTS, "r+b") as f:
            f.truncate(size)
    refused(adapter, f"{WEIGHTS}: corrupt or truncated safetensors file", fragment)


def _entry(dtype="F32", shape=(4, 64), begin=0, itemsize=4):
    n = itemsize
    for d in shape:
        n *= d
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, begin + n]}


def test_declared_tensor_sizes_beyond_the_model_are_refused_without_allocating(adapter):
    huge = 1 << 20
    write_safetensors(adapter, {Q0_A: _entry(shape=(huge, huge))})  # 4 TiB declared, nothing stored
    msg = refused(adapter, f"{WEIGHTS}[{Q0_A}]", f"shape ({huge}, {huge}) brings the declared tensor data to")
    assert "more than any LoRA adapter of this model" in msg
    # many modest tensors that together exceed the bound
    limit = _max_weights_bytes(SPEC, MAX_RANK)
    n = limit // (64 * 64 * 4) + 1
    header = {f"t{i}.lora_A.weight": _entry(shape=(64, 64), begin=i * 64 * 64 * 4) for i in range(n)}
    write_safetensors(adapter, header)
    refused(adapter, "brings the declared tensor data to")


@pytest.mark.parametrize("entry,fragment", [
    ({"dtype": "F32", "shape": [4, -64], "data_offsets": [0, 0]}, "not a list of at most 4 non-negative integers"),
    ({"dtype": "F32", "shape": ["4", 64], "data_offsets": [0, 0]}, "not a list of at most 4 non-negative integers"),
    ({"dtype": "F32", "shape": [1, 1, 1, 1, 1], "data_offsets": [0, 4]}, "not a list of at most 4"),
    ({"dtype": "F32", "shape": [4, 64], "data_offsets": [0, 1024]}, "takes 1024 bytes"),  # 1024 == 4*64*4: passes
    ({"dtype": "F32", "shape": [4, 64], "data_offsets": [0, 10]}, "data_offsets of"),
    ({"dtype": "F32", "shape": [4, 64], "data_offsets": [-1, 1023]}, "data_offsets of"),
    ({"dtype": "F32", "shape": [4, 64]}, "data_offsets of"),
    ("not an object", "is not an object"),
])
def test_malformed_header_entries_are_refused(adapter, entry, fragment):
    write_safetensors(adapter, {Q0_A: entry})
    if fragment == "takes 1024 bytes":  # consistent entry, but the file holds no data for it
        refused(adapter, "corrupt or truncated", "ends at data byte 1024, past the 0 bytes of tensor data")
    else:
        refused(adapter, "corrupt or truncated", fragment)


def test_too_many_tensors_and_overlong_names_are_refused(adapter):
    n = _max_tensor_count(SPEC) + 1
    write_safetensors(adapter, {f"t{i}": _entry(shape=(0,)) for i in range(n)})
    refused(adapter, f"{n} tensors, more than any LoRA adapter of this model has")
    long = "base_model.model." + "x." * 300 + "layers.0.self_attn.q_proj.lora_A.weight"
    write_safetensors(adapter, {long: _entry(shape=(0,))})
    refused(adapter, "tensor name of 656 characters (limit 512)")


@pytest.mark.parametrize("dtype,name", [(torch.int64, "I64"), (torch.float64, "F64"), (torch.uint8, "U8"),
                                        (torch.bool, "BOOL"), (torch.int32, "I32")])
def test_tensors_of_other_dtypes_are_refused_by_name(adapter, dtype, name):
    edit_tensors(adapter, lambda t: t.__setitem__(Q0_A, t[Q0_A].to(dtype)))
    refused(adapter, f"{WEIGHTS}[{Q0_A}]: dtype '{name}' is not supported (LoRA factors must be F16, BF16 or F32)")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_factors_are_accepted(adapter, dtype):
    edit_tensors(adapter, lambda t: t.update({k: v.to(dtype) for k, v in t.items()}))
    assert load(adapter).rank == 4


# ---------------------------------------------------------------------------------------------- values


@pytest.mark.parametrize("changes,fragment", [
    ({"lora_alpha": 1e30}, "lora_alpha=1e+30 gives model.layers.0.mlp.experts."),
    ({"lora_alpha": -1e30}, "lora_alpha=-1e+30 gives"),
    ({"lora_alpha": 8e6}, "the LoRA scaling lora_alpha / r = 2e+06, beyond the limit 1e+06"),
    ({"lora_alpha": 8e6, "use_rslora": True}, "lora_alpha / sqrt(r) (use_rslora) = 4e+06"),
    ({"alpha_pattern": {"q_proj": 1e30}}, "alpha_pattern['q_proj']=1e+30 gives model.layers.0.self_attn.q_proj"),
    ({"lora_alpha": float("inf")}, "lora_alpha=inf is not a finite number"),
    ({"lora_alpha": float("nan")}, "lora_alpha=nan is not a finite number"),
    ({"lora_alpha": 10 ** 400}, "lora_alpha=1000"),  # an integer beyond float range
    ({"alpha_pattern": {"k_proj": "8"}}, "alpha_pattern['k_proj']='8' is not a finite number"),
    ({"rank_pattern": {"k_proj": 0}}, "rank_pattern['k_proj']=0 is not a positive integer"),
])
def test_absurd_alpha_is_refused_by_field(adapter, changes, fragment):
    edit_config(adapter, **changes)
    refused(adapter, CONFIG, fragment)


def test_alpha_within_limits_still_scales(adapter):
    edit_config(adapter, lora_alpha=4e6)  # scaling 1e6: the limit itself
    b = load(adapter).dense[(0, "q_proj")][1]
    torch.testing.assert_close(b, load_file(str(adapter / WEIGHTS))[Q0_B] * 1e6)


def _set(key, index, value):
    def f(t):
        t[key].view(-1)[index] = value
    return f


@pytest.mark.parametrize("key,value,serve_dtype,fragment", [
    (Q0_A, float("inf"), torch.float32, "contains NaN or Inf values"),
    (EXPERTS0_B, float("nan"), torch.float32, "contains NaN or Inf values"),
    (Q0_B, 3e38, torch.float32, "contains NaN or Inf values after applying the LoRA scaling"),  # x2 overflows fp32
    (Q0_A, 7e4, torch.float16, "values up to 7e+04 overflow the serving dtype torch.float16"),
    (Q0_B, 4e4, torch.float16, "values up to 8e+04 (with the LoRA scaling) overflow"),  # fine raw, not scaled
    (EXPERTS0_A, 1e5, torch.float16, "overflow the serving dtype torch.float16"),
])
def test_nonfinite_or_overflowing_factors_are_refused_by_tensor(adapter, key, value, serve_dtype, fragment):
    edit_tensors(adapter, _set(key, 3, value))
    refused(adapter, f"{WEIGHTS}[{key}]", fragment, serve_dtype=serve_dtype)


def test_factors_that_fit_but_whose_delta_overflows_are_refused(adapter):
    """Every factor entry 3e38 (within fp32 and bf16): B·A cannot be finite."""
    def huge(t):
        t[Q0_A] = torch.full_like(t[Q0_A], 3e38)
        t[Q0_B] = torch.full_like(t[Q0_B], 1e38)  # x2 scaling: 2e38, still finite
    edit_tensors(adapter, huge)
    for dtype in (torch.float32, torch.bfloat16):
        refused(adapter, f"{WEIGHTS}[{Q0_B}]: with {Q0_A} it makes a LoRA delta B·A whose entries can reach",
                f"beyond the serving dtype {dtype}", serve_dtype=dtype)


def test_serving_dtype_decides_what_overflows(adapter):
    edit_tensors(adapter, _set(Q0_B, 0, 1e5))  # 2e5 scaled: over fp16's 65504, nothing for fp32 / bf16
    assert load(adapter, serve_dtype=torch.float32).rank == 4
    assert load(adapter, serve_dtype=torch.bfloat16).rank == 4
    refused(adapter, f"{WEIGHTS}[{Q0_B}]", "torch.float16", serve_dtype=torch.float16)
    with pytest.raises(TypeError, match="serve_dtype"):
        load(adapter, serve_dtype=torch.int8)


def test_nothing_read_is_kept_after_a_refusal(adapter, monkeypatch):
    """The error a caller keeps must not keep the tensors (through traceback frames) alive."""
    import safetensors.torch

    loaded = []
    real_load_file = safetensors.torch.load_file

    def tracking_load_file(*args, **kwargs):
        tensors = real_load_file(*args, **kwargs)
        loaded.extend(weakref.ref(t) for t in tensors.values())
        return tensors

    monkeypatch.setattr(safetensors.torch, "load_file", tracking_load_file)
    edit_tensors(adapter, _set(EXPERTS0_B, 0, 1e5))  # refused late, after every tensor is read and converted
    with pytest.raises(LoRAAdapterError, match="float16") as info:
        load(adapter, serve_dtype=torch.float16)
    kept = info.value  # noqa: F841  (held on purpose, as a caller logging it would)
    gc.collect()
    assert loaded and not [r for r in loaded if r() is not None]


# ---------------------------------------------------------------------------------------------- names


@pytest.mark.parametrize("name", ["a", "my-adapter_v1.2", "org/name", "A" * 128, "a/b/c", "x..y", "0", "-a", "a."])
def test_valid_adapter_names(name):
    validate_adapter_name(name)


@pytest.mark.parametrize("name,fragment", [
    ("", "1-128 characters"), ("A" * 129, "1-128 characters"), ("a b", "1-128 characters"),
    ("a\n", "1-128 characters"), ("é", "1-128 characters"), ("a:b", "1-128 characters"),
    ("a\\b", "1-128 characters"), ("x" * 10_000, "..."),
    (".", "'.' or '..'"), ("..", "'.' or '..'"), ("../x", "'.' or '..'"), ("a/../b", "'.' or '..'"),
    ("a/./b", "'.' or '..'"), ("/abs", "no component may be empty"), ("a/", "empty"), ("a//b", "empty"),
])
def test_invalid_adapter_names_are_refused(name, fragment):
    with pytest.raises(LoRAAdapterError, match="invalid adapter name") as info:
        validate_adapter_name(name)
    assert fragment in str(info.value) and len(str(info.value)) < 300


@pytest.mark.parametrize("name", [None, 5, b"abc"])
def test_non_string_adapter_names_are_refused(name):
    with pytest.raises(LoRAAdapterError, match="adapter name must be a string"):
        validate_adapter_name(name)
