#!/usr/bin/env bash
# The Python packages the GPU machine's image lacks (it has torch, triton, transformers, safetensors, numpy, tqdm;
# nothing can be fetched there), downloaded as wheels into .whl/ for the device calls to carry (device_env.sh
# installs them). Versions are the ones scripts/setup.sh installed into .venv, so the server, the tests and the
# benchmarks run there against the same pins as on the CPU; a missing dependency of one of them fails at import
# (fastapi needs opentelemetry-api, pydantic exactly its pydantic-core).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
packages=(fastapi starlette opentelemetry-api uvicorn uvloop httptools h11 click pydantic pydantic-core
  typing-inspection annotated-types annotated-doc typing-extensions anyio sniffio idna prometheus-client pyzmq
  msgpack aiohttp aiohappyeyeballs aiosignal frozenlist multidict yarl propcache attrs google-re2 peft accelerate
  psutil openai httpx httpcore certifi distro jiter pytest pluggy iniconfig platformdirs gguf)
pins=$(.venv/bin/python - "${packages[@]}" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        print(f"device_wheels: {name} is not in .venv, skipped", file=sys.stderr)
PY
)
mkdir -p .whl
rm -f .whl/*.whl
platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $pins 2>&1 \
  | sed -e "/is ignored: it is neither a file nor a directory/d"
echo "device_wheels: $(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/ (carry it: [\".whl\"])"
