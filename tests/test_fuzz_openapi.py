"""Schema fuzz (issue 15): schemathesis generates requests for every operation in the running server's
/openapi.json — valid ones and ones that break the schema — and no answer may be a 5xx.

A real server on loopback (tiny model, CPU) with LoRA and runtime adapter loading on, so the adapter endpoints
do real work too. The example count per operation is bounded to keep the file well under a minute on 2 cores."""
from __future__ import annotations

import zlib

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("uvicorn")
from hypothesis import HealthCheck, Phase, settings  # noqa: E402

from moeserve import EngineConfig  # noqa: E402
from moeserve.models.tiny import make_tiny  # noqa: E402
from server_harness import RunningServer  # noqa: E402

MODEL = "tiny-moe"
MAX_EXAMPLES = 40  # per operation


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    from peft_fixtures import make_peft_adapter

    model = make_tiny("qwen3_moe", tmp_path_factory.mktemp("tiny_fuzz"))
    lora_dir = tmp_path_factory.mktemp("fuzz_adapters")
    make_peft_adapter("qwen3_moe", lora_dir / "a", kind="attn", rank=4, seed=1)
    config = EngineConfig(model=str(model), max_model_len=64, num_kv_blocks=128, max_num_seqs=16, block_size=16,
                          enable_lora=True, max_loras=2, max_lora_rank=8, lora_modules={"a": str(lora_dir / "a")},
                          enable_lora_runtime_loading=True, lora_dir=str(lora_dir))
    s = RunningServer(config, MODEL)
    yield s
    s.close()


@pytest.fixture(scope="module")
def openapi(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("openapi")


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
def test_no_operation_answers_5xx(case, fuzz_server):
    if case.path in ("/v1/completions", "/v1/chat/completions") and isinstance(case.body, dict):
        # most random model names are 404s before any generation: serve the model or its adapter in 3 of 4 cases
        pick = zlib.crc32(repr(case.body).encode()) % 4
        if pick and isinstance(case.body.get("model"), str):
            case.body["model"] = (MODEL, "a", f"{MODEL}:a")[pick - 1]
        # generation lengths are not what this test is about: keep each request short
        if isinstance(case.body.get("max_tokens"), int) and case.body["max_tokens"] > 4:
            case.body["max_tokens"] = 4
        if isinstance(case.body.get("n"), int) and case.body["n"] > 2:
            case.body["n"] = 2
    response = case.call(timeout=60)
    assert response.status_code < 500, (case.method, case.path, case.body, response.status_code, response.text)
    assert fuzz_server.engine.is_running
