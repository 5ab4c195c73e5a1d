"""The package's layering (.importlinter): one package per process (server, frontend, engine, worker) above the
layers they stand on, nothing imports a package above it, no import cycle between the modules of a package, and
the package never imports the developer benchmarks. import-linter reads the sources; nothing is imported."""
from pathlib import Path

from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept(monkeypatch):
    monkeypatch.chdir(ROOT)  # the root packages (moeserve, benchmarks) are found from here
    monkeypatch.syspath_prepend(str(ROOT))
    assert lint_imports(config_filename=str(ROOT / ".importlinter"), no_cache=True, no_logo=True) == 0, \
        "an import breaks a contract in .importlinter (the report above names it)"
