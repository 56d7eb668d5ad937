"""A worker that cannot start says why in one line and exits 1; ``inferq serve`` exits
(status 1, with that line) when its worker exits unasked, at start or later, and leaves
nothing running (docs/operations.md, "Signals"). Real processes,
Linux ``/proc``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from shared.cli import load_commands

app = load_commands()
from tests import processes
from tests.test_serve_lifecycle import _alive, _descendants
from worker.main import WorkerStartError, start_error

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PDEATHSIG is Linux")]

#: The worker's line for ``--tensor-parallel-size 2`` on the default model (9 heads).
TP_REASON = "llama: tensor parallel size 2 does not divide num_attention_heads 9"
#: Bound on serve's exit after its worker is gone: the gateway's graceful shutdown (5 s,
#: idle here), the batch worker's stop, Redis's stop; seconds.
EXIT_AFTER_WORKER_S = 30.0


def clean_env() -> dict[str, str]:
    """This environment without ``INFERQ_*`` (serve must start its own Redis)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERQ_")}
    env.update(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    return env


def test_start_errors_become_one_line() -> None:
    assert str(start_error(ValueError("bad\n  value"))) == "bad value"
    assert str(start_error(RuntimeError("CUDA out of memory"))) == "RuntimeError: CUDA out of memory"
    same = WorkerStartError("as is")
    assert start_error(same) is same


def test_worker_with_a_model_that_does_not_resolve_prints_one_line(tmp_path: Path) -> None:
    reason = tmp_path / "reason"
    result = CliRunner().invoke(app, ["worker", "--redis-url", "redis://127.0.0.1:1", "--model",
                                      str(tmp_path / "missing"), "--exit-reason-file", str(reason)], env=clean_env())
    assert result.exit_code == 1, result.output
    line = f"inferq worker: model '{tmp_path / 'missing'}' is neither"
    assert result.output.splitlines()[-1].startswith(line), result.output
    assert "Traceback" not in result.output
    assert reason.read_text().startswith(line.removeprefix("inferq worker: "))


@pytest.mark.slow
def test_worker_with_weights_missing_prints_one_line(tmp_path: Path) -> None:
    """A model that does not load (a folder with a config and no weights): the real entry
    point, its exception's type and message on one line, status 1."""
    folder = tmp_path / "no-weights"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "rms_norm_eps": 1e-5,
        "eos_token_id": 0}))
    run = subprocess.run([sys.executable, "-m", "shared.cli", "worker", "--redis-url", "redis://127.0.0.1:1",
                          "--model", str(folder), "--device", "cpu"], check=False, cwd=processes.ROOT,
                         env=clean_env(), capture_output=True, text=True, timeout=180)
    assert run.returncode == 1, run.stderr
    assert run.stderr.strip().splitlines()[-1] == f"inferq worker: WeightLoadError: no *.safetensors in {folder}"
    assert "Traceback" not in run.stderr


def start_serve(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    """``inferq serve args...`` on a free port in its own session, output to a log."""
    port = processes.free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "shared.cli", "serve", "--port", str(port), *args],
                                cwd=processes.ROOT, env=clean_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, f"http://127.0.0.1:{port}", log_path


def wait_watching(proc: subprocess.Popen[bytes], timeout_s: float) -> tuple[int, dict[int, int]]:
    """Wait for ``proc`` to exit, collecting every descendant it had meanwhile: its
    status and that family (pid -> start time). Kills it past ``timeout_s`` seconds."""
    family: dict[int, int] = {}
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        family.update(_descendants(proc.pid))
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError(f"serve still running after {timeout_s:.0f} s")
        time.sleep(0.1)
    return int(proc.returncode), family


def assert_gone(family: dict[int, int]) -> None:
    """Every member of ``family`` exits within a few seconds (redis-server after SIGTERM)."""
    deadline = time.monotonic() + 10
    while _alive(family):
        assert time.monotonic() < deadline, f"left running: {_alive(family)}"
        time.sleep(0.1)


@pytest.mark.slow
def test_serve_exits_when_its_worker_cannot_start(tmp_path: Path, smollm_source) -> None:
    """``inferq serve --tensor-parallel-size 2`` on the default model (9 heads): the worker
    prints its one line and exits 1, and serve stops the gateway, the batch worker and
    Redis and exits 1 with that line, in bounded time (28 to 36 s measured on 2 busy cores,
    mostly the worker's imports)."""
    proc, _url, log_path = start_serve(tmp_path, "--tensor-parallel-size", "2", "--device", "cpu")
    t0 = time.monotonic()
    status, family = wait_watching(proc, 150)
    log = log_path.read_text(errors="replace")
    assert status == 1, log[-3000:]
    assert f"inferq worker: {TP_REASON}\n" in log
    assert log.rstrip().splitlines()[-1] == (f"Error: the worker exited with status 1: {TP_REASON}; "
                                             "stopped the gateway and Redis"), log[-3000:]
    assert "Traceback" not in log
    assert len(family) >= 3, family  # Redis, the worker and the batch worker at least
    assert_gone(family)
    print(f"serve exited {time.monotonic() - t0:.1f} s after its start")


@pytest.mark.slow
def test_serve_exits_when_its_worker_is_killed(tmp_path: Path, smollm_source) -> None:
    """A SIGKILLed worker under serve (sim backend): serve stops the rest and exits 1,
    saying so, within ``EXIT_AFTER_WORKER_S``. (serve does not restart it: a supervisor
    restarts serve, seeing its status; docs/operations.md, "Signals".)"""
    proc, url, log_path = start_serve(tmp_path, "--backend", "sim", "--drain-timeout-s", "2")
    try:
        processes.wait_for_gateway(url, proc, timeout_s=240)
        deadline = time.monotonic() + 120
        while httpx.get(f"{url}/ready", timeout=5, trust_env=False).status_code != 200:
            assert time.monotonic() < deadline and proc.poll() is None, log_path.read_text()[-3000:]
            time.sleep(0.2)
        family = _descendants(proc.pid)
        workers = [pid for pid, cmd in _alive(family).items() if "shared.cli worker" in cmd]
        assert len(workers) == 1, _alive(family)
        os.kill(workers[0], signal.SIGKILL)
        t0 = time.monotonic()
        status, more = wait_watching(proc, EXIT_AFTER_WORKER_S)
        exited_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log = log_path.read_text(errors="replace")
    assert status == 1, log[-3000:]
    assert log.rstrip().splitlines()[-1] == "Error: the worker was killed by SIGKILL; stopped the gateway and Redis"
    assert_gone({**family, **more})
    print(f"serve exited {exited_s:.1f} s after its worker was killed")
