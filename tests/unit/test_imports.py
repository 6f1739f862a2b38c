"""The processes that handle no tensors never load torch (STYLE: heavy imports where they are needed).

Each module is imported in a fresh interpreter with a spy on the import system; if torch is
imported, the failure shows the import chain that pulled it in.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Modules that must import without torch: the HTTP front door, the dispatcher, the load
#: generator, the analytic planner, the torch-free parts of `shared.model`, and the KV plane's
#: server and client (the front door frees caches with it).
#: (`loadgen.__main__` is left out: importing it runs the benchmark.)
TORCH_FREE = [
    "services.prefill_queue.app",
    "services.prefill_queue.__main__",
    "services.dispatcher.dispatcher",
    "services.dispatcher.__main__",
    "loadgen.cli",
    "shared.policies.pipeline_plan",
    "shared.model",
    "shared.model.shape",
    "shared.model.tokenizer",
    "shared.model.chat_template",
    "shared.dataplane.kv",
    "shared.dataplane.kv_client",
]

# Run in the child: import each module named in argv; at the first `import torch` record the
# stack (the chain of importing files), and fail naming the module that pulled it in.
PROBE = """
import importlib, sys, traceback

class Spy:
    stack = None
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and self.stack is None:
            frames = traceback.extract_stack()[:-1]
            self.stack = [f"  {f.filename}:{f.lineno}" for f in frames if not f.filename.startswith("<frozen")]
        return None  # only watch: the real finders still do the import

spy = Spy()
sys.meta_path.insert(0, spy)
for name in sys.argv[1:]:
    importlib.import_module(name)
    if "torch" in sys.modules:
        print(f"importing {name} imported torch; the import chain:")
        print("\\n".join(spy.stack or ["  (not seen by the spy)"]))
        sys.exit(1)
"""


def probe(*modules: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PROBE, *modules], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_imports_without_torch(module: str) -> None:
    done = probe(module)
    assert done.returncode == 0, done.stdout + done.stderr


def test_probe_names_the_module_that_imports_torch() -> None:
    done = probe("shared.model.shape", "shared.model.gpt")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "importing shared.model.gpt imported torch" in done.stdout
    assert str(Path("shared", "model", "gpt.py")) in done.stdout  # the chain reaches the culprit's line
