"""What a process imports at start: each process of the suite and of a deployment pays it.
``llguidance.torch`` loads ``torch._dynamo`` (about 1.5 s on 2 cores), so the worker loads
it on its first grammar only (worker/structured/bitmask.py)."""

from __future__ import annotations

import subprocess
import sys

from tests import processes


def _modules_after(statement: str, names: list[str]) -> list[bool]:
    code = f"import sys; {statement}; print(*[n in sys.modules for n in {names!r}])"
    out = subprocess.run([sys.executable, "-c", code], cwd=processes.ROOT, capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    return [word == "True" for word in out]


def test_the_inferq_engine_loads_without_torch_dynamo() -> None:
    assert _modules_after("import worker.backends.inferq", ["torch", "torch._dynamo", "llguidance.torch"]) == [
        True, False, False]
