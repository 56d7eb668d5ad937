"""A tensor-parallel worker's stop (``worker/parallel/group.py``, ``TPGroup.close``):
every process of the group gone within ``TEARDOWN_BUDGET_S`` of the signal, whatever
stops it, with no abort message and no teardown that ran out of time.

A real ``inferq worker --tensor-parallel-size 2`` (the tiny checkpoint of
``test_tensor_parallel``) against a real Redis, as the worker's own session, so that
SIGINT can go to its whole process group as a terminal's Ctrl-C goes to ``inferq
serve``'s: SIGTERM (it drains, then exits 0), SIGINT to the group, idle and while it
generates (it stops at once, exits 0; its follower ignores the signal and leaves on STOP,
sent after the step in progress) and SIGKILL of the follower (``EXIT_RANK_DIED``). On CPU the ranks talk over gloo; the ``cuda`` twin runs the same
on 2 GPUs over NCCL and also checks that the GPUs' memory is back (``nvidia-smi`` lists no
process of the group, and ``torch.cuda.mem_get_info`` is where it was before the start).

``close`` itself, in this process as rank 0 with a follower that runs the real
``follower.serve_then_exit``: one that takes STOP exits 0; one stuck in a call is
SIGKILLed; either way within the budget.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from bench import procs
from shared import protocol
from shared.keys import STREAM_FIELD, Keys
from shared.protocol import GenerateRequest, TokenBatch
from shared.redis_connect import connect_sync
from shared.sampling import SamplingParams
from tests import processes
from tests.test_tensor_parallel import NCCL_ENV, tiny_config, write_checkpoint
from worker.parallel import group as tp_group
from worker.parallel.group import EXIT_RANK_DIED, TEARDOWN_BUDGET_S

#: Lines that a clean stop never logs: a C++ std::thread destroyed while joinable (NCCL's
#: watchdog at interpreter exit), a teardown step past its bound, a Python traceback.
BAD_LINES = ("terminate called", "took over", "Traceback")
#: How each way of stopping ends the worker: its exit status, and whether its follower
#: took STOP (status 0) rather than died.
WAYS = {"sigterm": (0, True), "sigint_to_group": (0, True), "sigint_mid_generation": (0, True),
        "follower_killed": (EXIT_RANK_DIED, False)}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tp-teardown") / "tiny", tiny_config())


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, waiting for a parent that may never reap it in a
    container, has exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def start_tp_worker(folder: Path, redis_url: str, log: Path, device: str, env: dict[str, str] | None = None
                    ) -> subprocess.Popen[bytes]:
    """``inferq worker --tensor-parallel-size 2`` on ``folder`` as the leader of its own
    session (so its process group is its own), output to ``log``."""
    argv = [sys.executable, "-m", "shared.cli", "worker", "--redis-url", redis_url, "--model", str(folder),
            "--tensor-parallel-size", "2", "--device", device, "--num-kv-blocks", "64", "--max-model-len", "256",
            "--dtype", "float32"]
    if device == "cpu":
        argv += ["--cpu-threads", "1"]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    with open(log, "ab") as out:
        return subprocess.Popen(argv, cwd=processes.ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def generate_until_tokens(redis_url: str, model: str) -> None:
    """Queue a request of 200 tokens for ``model`` and return once its first tokens are
    out: the worker's engine thread is then stepping, its collectives in flight."""
    client = connect_sync(redis_url)
    pubsub = client.pubsub()
    pubsub.subscribe("tp-replies")
    request = GenerateRequest(request_id="long", model=model, prompt_token_ids=list(range(1, 40)),
                              sampling=SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True),
                              reply_channel="tp-replies", deadline_unix_s=time.time() + 300)
    client.xadd(Keys().requests_stream(model), {STREAM_FIELD: protocol.encode(request)})
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            message = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
            if message and isinstance(protocol.decode(message["data"]), TokenBatch):
                return
        raise TimeoutError("no token of the request came out")
    finally:
        pubsub.close()
        client.close()


def stop_and_time(worker: subprocess.Popen[bytes], way: str, redis_url: str, model: str
                  ) -> tuple[int, float, float]:
    """Stop ``worker`` (ready) the ``way`` named; return its exit status, the seconds
    from the signal to its exit, and to the exit of every process it had started."""
    if way == "sigint_mid_generation":
        generate_until_tokens(redis_url, model)
    group = [pid for pid, _ in procs.descendants(worker.pid)]
    followers = [pid for pid, parent in procs.descendants(worker.pid)
                 if parent == worker.pid and "spawn_main" in " ".join(procs.cmdline(pid))]
    assert len(followers) == 1, followers
    t0 = time.monotonic()
    if way == "sigterm":
        worker.send_signal(signal.SIGTERM)
    elif way.startswith("sigint"):  # as Ctrl-C in a terminal: every process of the group
        os.killpg(worker.pid, signal.SIGINT)
    else:
        os.kill(followers[0], signal.SIGKILL)
    status = worker.wait(60)
    exited_s = time.monotonic() - t0
    while any(alive(pid) for pid in group) and time.monotonic() - t0 < 60:
        time.sleep(0.01)
    assert not any(alive(pid) for pid in group), [procs.cmdline(pid) for pid in group if alive(pid)]
    return status, exited_s, time.monotonic() - t0


def check_stop(worker: subprocess.Popen[bytes], log: Path, way: str, redis_url: str, model: str) -> None:
    """``stop_and_time`` and the checks every device shares: the documented status,
    everything gone within the budget, no line of ``BAD_LINES``, and a follower that took
    STOP when it was not the one killed."""
    status, exited_s, gone_s = stop_and_time(worker, way, redis_url, model)
    text = log.read_text()
    expected, follower_stopped = WAYS[way]
    assert status == expected, text[-3000:]
    assert exited_s < TEARDOWN_BUDGET_S and gone_s < TEARDOWN_BUDGET_S, (exited_s, gone_s, text[-3000:])
    assert not [line for line in text.splitlines() if any(bad in line for bad in BAD_LINES)], text[-3000:]
    if follower_stopped:
        assert "followers exited with status rank 1: 0" in text, text[-3000:]
    else:
        assert "a rank of this worker's group died" in text, text[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("way", list(WAYS))
def test_tp_worker_stops_within_the_budget(tiny_folder: Path, redis_server, tmp_path: Path, way: str) -> None:
    """CPU, gloo: SIGTERM, SIGINT to the process group, or a killed follower; the worker
    and its follower are gone within ``TEARDOWN_BUDGET_S`` (2 s) of the signal."""
    log = tmp_path / "worker.log"
    worker = start_tp_worker(tiny_folder, redis_server.url, log, "cpu")
    try:
        processes.wait_for_workers(redis_server.url, 1, [worker], timeout_s=300)
        check_stop(worker, log, way, redis_server.url, tiny_folder.name)
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()


def gpu_free_bytes() -> list[int]:
    """Free memory of GPUs 0 and 1, bytes (``torch.cuda.mem_get_info``)."""
    return [torch.cuda.mem_get_info(i)[0] for i in range(2)]


def gpu_pids() -> set[int] | None:
    """Pids of the processes ``nvidia-smi`` lists on any GPU; None without nvidia-smi.
    (In a container it may list none at all: ``gpu_free_bytes`` is the check that holds.)"""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {int(line) for line in out.split() if line.strip().isdigit()}


#: The memory the group's processes hold on each GPU while they run is at least this
#: (a CUDA context alone is several hundred MiB); afterwards each GPU must be back
#: within it of where it was, bytes.
GPU_SLACK_BYTES = 200 * 2**20


@pytest.mark.slow
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("way", list(WAYS))
def test_tp_worker_stops_within_the_budget_on_gpus(tiny_folder: Path, redis_server, tmp_path: Path, way: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """2 GPUs, NCCL, CUDA graphs (their captures hold the all-reduces): as the CPU test,
    and afterwards no process of the group holds GPU memory."""
    for name, value in NCCL_ENV.items():  # this process's own CUDA context too
        monkeypatch.setenv(name, value)
    before = gpu_free_bytes()
    log = tmp_path / "worker.log"
    worker = start_tp_worker(tiny_folder, redis_server.url, log, "cuda", NCCL_ENV)
    try:
        processes.wait_for_workers(redis_server.url, 1, [worker], timeout_s=600)
        group = {worker.pid} | {pid for pid, _ in procs.descendants(worker.pid)}
        running = gpu_free_bytes()
        assert all(b - r > GPU_SLACK_BYTES for b, r in zip(before, running)), (before, running)
        seen = gpu_pids()
        check_stop(worker, log, way, redis_server.url, tiny_folder.name)
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
    # The driver frees an ended process's memory right after it ends: give it a moment.
    deadline = time.monotonic() + 10
    after = gpu_free_bytes()
    while any(b - a >= GPU_SLACK_BYTES for b, a in zip(before, after)) and time.monotonic() < deadline:
        time.sleep(0.1)
        after = gpu_free_bytes()
    assert all(b - a < GPU_SLACK_BYTES for b, a in zip(before, after)), (before, after)
    left = gpu_pids()
    if seen and left is not None:  # nvidia-smi sees this namespace's pids
        assert not group & left, (group, left)


def _follower(rank: int, world_size: int, port: int, device: torch.device, stuck: bool) -> None:
    """A follower of ``test_close_...``: joins, then runs the real
    ``follower.serve_then_exit`` (no model: STOP is all rank 0 sends), or when ``stuck``
    sleeps as inside a call that does not end."""
    from worker.parallel.follower import serve_then_exit
    from worker.parallel.step_sync import StepSync

    tp_group.ignore_stop_signals()
    parent = multiprocessing.parent_process()
    assert parent is not None
    tp_group.watch(threading.Event(), [parent.sentinel], tp_group.exit_now)  # never outlives this test
    group = tp_group.join(rank, world_size, port, device)
    if stuck:
        time.sleep(3600)
    serve_then_exit(None, StepSync(group.group, group.device, 8, torch.float32))


@pytest.mark.slow
@pytest.mark.parametrize("stuck", [False, True])
def test_close_ends_the_followers_within_the_budget(stuck: bool, caplog: pytest.LogCaptureFixture) -> None:
    """``TPGroup.close`` on rank 0 (this process): a follower that takes STOP exits 0;
    one stuck in a call never takes it, and is SIGKILLed once ``STOP_DELIVERY_TIMEOUT_S``
    has passed. Either way close
    returns within the budget, out of the group (a new one may start), and the watcher
    stays quiet."""
    from worker.parallel.step_sync import StepSync

    caplog.set_level(logging.INFO, logger=tp_group.__name__)
    deaths: list[float] = []
    joined = tp_group.groups_joined()
    group = tp_group.start(2, torch.device("cpu"), _follower, (stuck,), on_death=lambda: deaths.append(1.0))
    assert tp_group.groups_joined() == joined + 1  # a later group in this process keeps NCCL (all_reduce.install)
    sync = StepSync(group.group, group.device, 8, torch.float32)
    (follower,) = group.followers
    t0 = time.monotonic()
    group.close(sync.send_stop)
    took_s = time.monotonic() - t0
    assert took_s < TEARDOWN_BUDGET_S
    assert follower.exitcode == (-signal.SIGKILL if stuck else 0)
    assert tp_group.current() is None and not torch.distributed.is_initialized()
    threading.Event().wait(0.2)  # the watcher would have fired by now
    assert not deaths
    assert f"rank 1: {follower.exitcode}" in caplog.text
    # A stuck follower never takes STOP (gloo's broadcast waits for it): that wait is cut.
    assert ("sending STOP took over" in caplog.text) == stuck
    assert "aborting the group's communicators took over" not in caplog.text


@pytest.mark.slow
def test_close_without_abort_leaves_the_communicators_to_the_exit(caplog: pytest.LogCaptureFixture) -> None:
    """``close(stop, abort=False)``, as ``inferq worker`` closes before ``os._exit``: the
    follower takes STOP and exits 0 within the budget, and this rank aborts nothing (on 2
    and 4 H200s NCCL's abort took over 0.25 s, which the worker's stop then logged):
    the process is still in its group until it exits or aborts it."""
    from worker.parallel.step_sync import StepSync

    caplog.set_level(logging.INFO, logger=tp_group.__name__)
    group = tp_group.start(2, torch.device("cpu"), _follower, (False,), on_death=lambda: None)
    sync = StepSync(group.group, group.device, 8, torch.float32)
    (follower,) = group.followers
    t0 = time.monotonic()
    try:
        group.close(sync.send_stop, abort=False)
        assert time.monotonic() - t0 < TEARDOWN_BUDGET_S
        assert follower.exitcode == 0 and tp_group.current() is None
        assert torch.distributed.is_initialized()  # left to the exit
        assert "aborting" not in caplog.text
        with pytest.raises(RuntimeError, match="not aborted yet"):  # said, not "initialized twice" from torch
            tp_group.start(2, torch.device("cpu"), _follower, (False,), on_death=lambda: None)
    finally:
        tp_group.abort_group()  # this test process goes on: leave the group as LLM.close does
    assert not torch.distributed.is_initialized()
