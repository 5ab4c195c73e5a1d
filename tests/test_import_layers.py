"""The package's layering (.importlinter): one package per process (server, frontend, engine, worker) above the
layers they stand on, nothing imports a package above it, no import cycle between the modules of a package, and
the package never imports the developer benchmarks. import-linter reads the sources; nothing is imported. It runs in
a child process: in this one it changed the logging set-up that later tests read.

And what the HTTP process of `moeserve serve` imports, in a fresh interpreter: not torch (the engine core, in its own
process, does), so a server's start does not pay for it twice."""
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


# What `moeserve serve` runs in the HTTP process: the command line parsed into a config, the server's modules, the
# clients (one core, or several under data parallelism), and the tokenizer loaded as the class the core chose. A
# meta-path finder records who asked for torch first, so a failure names the package's import chain.
VOCAB_SIZE = 512
HTTP_PROCESS = """
import sys, traceback
from dataclasses import replace

PACKAGE, TOKENIZER_DIR, TOKENIZER_CLASS, VOCAB_SIZE = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
first_torch_import = []


class TorchWatch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not first_torch_import:
            first_torch_import.extend(f"{f.filename}:{f.lineno}" for f in traceback.extract_stack()
                                      if f.filename.startswith(PACKAGE))
        return None


sys.meta_path.insert(0, TorchWatch())
from moeserve.cli import build_parser
from moeserve.engine_args import engine_config_from_args, split_lora_modules_argv
from moeserve.frontend.dp_client import core_environments
from moeserve.models.tokenizer import load_tokenizer
from moeserve.server.app import check_serve_args

argv = split_lora_modules_argv(["serve", "--model", "/models/m", "--device", "cpu", "--enable-lora",
                                "--lora-modules", "a=/adapters/a", "--dtype", "float32"])
args = build_parser(argv).parse_args(argv)
check_serve_args(args)
config = engine_config_from_args(args)
assert config.lora_modules == {"a": "/adapters/a"}, config.lora_modules
assert core_environments(replace(config, data_parallel_size=2)) == [None, None]
tokenizer = load_tokenizer(TOKENIZER_DIR, VOCAB_SIZE, TOKENIZER_CLASS)
assert type(tokenizer.tok).__name__ == TOKENIZER_CLASS, type(tokenizer.tok)
if "torch" in sys.modules:
    sys.exit("torch was imported; first by: " + " <- ".join(reversed(first_torch_import or ["(not the package)"])))
"""


def test_http_process_does_not_import_torch(tmp_path):
    from moeserve.models.tokenizer import load_tokenizer
    from moeserve.models.tokenizer_tiny import save_tiny_tokenizer

    save_tiny_tokenizer(tmp_path, VOCAB_SIZE)
    chosen = load_tokenizer(tmp_path, VOCAB_SIZE).class_name  # AutoTokenizer's choice, as the engine core makes it
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", HTTP_PROCESS, str(ROOT / "moeserve"), str(tmp_path), chosen,
                          str(VOCAB_SIZE)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"the HTTP process imports torch:\n{run.stdout}{run.stderr}"
