"""The package's layering (.importlinter): one package per process (server, frontend, engine, worker) above the
layers they stand on, nothing imports a package above it, no import cycle between the modules of a package, and
the package never imports the developer benchmarks. import-linter reads the sources; nothing is imported. It runs in
a child process: in this one it changed the logging set-up that later tests read."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the root packages (moeserve, benchmarks) are found from here
    run = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
                          "sys.exit(lint_imports(config_filename='.importlinter', no_cache=True, no_logo=True))"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"an import breaks a contract in .importlinter:\n{run.stdout}{run.stderr}"
