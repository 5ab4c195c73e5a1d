"""Compile every Triton kernel variant that CPU tests launch, for sm_90, with the device's Triton version.

The CPU tests run kernels under TRITON_INTERPRET=1, which accepts code that the GPU compiler refuses (a name
assigned with different shapes in two branches of an `if`, for one). This records each launch's signature and
constexprs while the tests run under the interpreter, then compiles them ahead of time in a subprocess that
imports the Triton found under TRITON_CHECK_PATH: a device round trip saved per front-end error.

    python -m pip install --no-deps --target /tmp/t36 triton==3.6.0      # the device's version, once
    TRITON_CHECK_PATH=/tmp/t36 PYTHONPATH=$PWD TRITON_INTERPRET=1 python scripts/triton_compile_check.py -q \\
        tests/test_kernels_moe.py tests/test_kernels_router.py ...
"""
import importlib
import inspect
import json
import os
import subprocess
import sys
import tempfile

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)  # H200
TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
         torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}


def signature_of(fn, args, kwargs) -> tuple[dict, dict, dict]:
    """(signature, constexprs, options) of one launch, as triton.compile takes them (constexprs JSON-able)."""
    params = list(inspect.signature(fn).parameters.values())
    bound = {**dict(zip([p.name for p in params], args)), **kwargs}
    options = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages")}
    sig, consts = {}, {}
    for p in params:
        v = bound.get(p.name, p.default)
        if p.annotation is tl.constexpr or "constexpr" in str(p.annotation) or v is None:
            sig[p.name] = "constexpr"
            consts[p.name] = {"tl_dtype": v.name} if isinstance(v, tl.dtype) else v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + TYPES[v.dtype]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i64" if abs(v) >= 2**31 else "i32"
        else:
            sig[p.name] = "fp32"
    return sig, consts, options


def record(test_args: list[str]) -> list:
    import pytest
    from triton.runtime.interpreter import InterpretedFunction

    seen, launches = set(), []
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        sig, consts, options = signature_of(self.fn, args, kwargs)
        key = json.dumps([self.fn.__module__, self.fn.__name__, sig, consts, options], sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            launches.append([self.fn.__module__, self.fn.__name__, sig, consts, options])
            if consts.get("USE_PDL") is False:  # the CPU never launches with PDL; the GPU does (kernels/pdl.py)
                launches.append([self.fn.__module__, self.fn.__name__, sig, {**consts, "USE_PDL": True}, options])
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    pytest.main(test_args)
    return launches


def compile_all(launches: list) -> int:
    failed = 0
    for module, name, sig, consts, options in launches:
        consts = {k: tl.dtype(v["tl_dtype"]) if isinstance(v, dict) else v for k, v in consts.items()}
        try:
            triton.compile(ASTSource(getattr(importlib.import_module(module), name), sig, consts), target=TARGET,
                           options=options)
        except Exception as e:  # noqa: BLE001 - reported, the next variant goes on
            failed += 1
            print(f"FAIL {module}.{name} {consts} {options}\n{str(e)[-1500:]}\n")
    print(f"compiled {len(launches) - failed} / {len(launches)} kernel variants with triton {triton.__version__} "
          f"for sm_{TARGET.arch}")
    return 1 if failed else 0


def main() -> int:
    if sys.argv[1:2] == ["--compile"]:
        with open(sys.argv[2]) as f:
            return compile_all(json.load(f))
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run the tests under the interpreter: TRITON_INTERPRET=1")
    launches = record(sys.argv[1:])
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(launches, f)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("TRITON_CHECK_PATH"), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, __file__, "--compile", f.name], env=env).returncode


if __name__ == "__main__":
    raise SystemExit(main())
