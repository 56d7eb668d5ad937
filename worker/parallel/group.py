"""Start and stop a tensor-parallel process group (``--tensor-parallel-size N``).

The worker process is rank 0: it spawns ranks 1..N-1 (``follower.follower_main``, handed
to ``start``, one process each, ``torch.multiprocessing``'s spawn context) and all N join one
``torch.distributed`` group on a free localhost port: NCCL on CUDA (rank r on GPU r),
gloo on CPU. The group is process-wide (``current()``): the loader builds this rank's
shard and the model runner syncs steps through it (``worker/parallel/layers.py``,
``step_sync.py``).

A rank that dies takes the group down (docs/architecture.md, "Tensor parallelism"):
rank 0 watches its followers' process sentinels and exits with ``EXIT_RANK_DIED`` the
moment one ends unasked, so its heartbeat stops and the gateway's failover reclaims its
streams; a follower watches rank 0 the same way and exits with it. Collectives get a
long timeout: a follower waits for the next step as long as rank 0 is idle, and deaths
are seen through the sentinels, not through timeouts.

Stopping never waits on a peer: NCCL's collective teardown (``destroy_process_group``,
``ncclCommDestroy``) waits for every rank's, so one rank that is slow or gone would hold
the others (measured on 2 GPUs: over 10 s, then a C++ thread destroyed at interpreter
exit aborted the process). Instead rank 0 sends STOP, each follower leaves with
``os._exit`` at once (it holds no request state), rank 0 kills what has not left and
aborts its own communicators, which is local; every step has a bound
(``TEARDOWN_BUDGET_S``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from worker.parallel import all_reduce

log = logging.getLogger(__name__)

#: NVLink multicast (NVLS) off in NCCL, in torch's symmetric memory (which the one-shot
#: all-reduce allocates: ``worker/parallel/all_reduce.py``) and in NVSHMEM: set by ``start``
#: where the environment does not say otherwise. Multicast objects are a scarce, per-host
#: resource that the peer-to-peer paths do not need.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
#: Exit status of a rank whose peer died.
EXIT_RANK_DIED = 3
#: Collective timeout: longer than any idle period (deaths are seen through sentinels).
COLLECTIVE_TIMEOUT = timedelta(days=30)
#: A tensor-parallel worker's bound from its stop (SIGTERM once drained, SIGINT, a dead
#: rank) to the exit of every process of its group, seconds. ``close`` takes at most the
#: three bounds below (1.25 s); the rest is the worker's own stop (its loop sees the signal
#: within one idle poll, ``worker.service.IDLE_BLOCK_MS``) and the exit.
TEARDOWN_BUDGET_S = 2.0
#: Rank 0's wait for STOP to leave it: the step in progress on the engine thread, then
#: the header's broadcast (an idle follower takes it at once), seconds.
STOP_DELIVERY_TIMEOUT_S = 0.5
#: Rank 0's wait for its followers to exit after STOP (they exit at once), seconds.
FOLLOWER_EXIT_TIMEOUT_S = 0.5
#: Rank 0's wait for a follower it SIGKILLed to be gone, seconds.
KILL_WAIT_S = 0.25
assert STOP_DELIVERY_TIMEOUT_S + FOLLOWER_EXIT_TIMEOUT_S + KILL_WAIT_S < TEARDOWN_BUDGET_S
#: Rank 0's wait for the abort of its own communicators when the process goes on after
#: its group (``LLM.close`` in a benchmark or test that builds another engine; a worker
#: exits instead and aborts nothing), seconds. The abort is local (it waits for no peer),
#: but NCCL's took over 0.25 s on 2 and 4 H200s (2026-11-28).
ABORT_TIMEOUT_S = 10.0

_current: TPGroup | None = None
_groups_joined = 0  # groups this process has joined (``groups_joined``)


@dataclass
class TPGroup:
    """This process's place in a tensor-parallel group: ``rank`` of ``world_size``, the
    process group, and on rank 0 the follower processes."""

    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup | None = None
    followers: list[Any] = field(default_factory=list)
    closing: threading.Event = field(default_factory=threading.Event)

    def broadcast_int(self, value: int) -> int:
        """Rank 0's ``value`` on every rank (start-up facts such as the KV block count)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=0, group=self.group)
        return int(t.item())

    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value`` (a start-up fact that must fit on each
        rank, such as the KV block count: one rank's GPU may have less memory free)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def same_everywhere(self, fact: str) -> bool:
        """Whether every rank passed the same ``fact`` (a start-up fact such as the engine
        settings, compared by a 56-bit BLAKE2b digest: rank 0's is broadcast, then the
        ranks' verdicts are MIN-reduced, so every rank returns the same answer)."""
        digest = int.from_bytes(hashlib.blake2b(fact.encode(), digest_size=7).digest(), "little")
        return self.min_int(int(self.broadcast_int(digest) == digest)) == 1

    def close(self, stop: Callable[[], None] | None = None, abort: bool = True) -> None:
        """Leave the group, within ``TEARDOWN_BUDGET_S`` whatever the peers do (and
        ``ABORT_TIMEOUT_S`` more with ``abort``). Marks the group closing first (the
        watchers stay quiet as followers exit).

        On rank 0: ``stop`` delivers STOP (``StepSync.send_stop``, run after the step in
        progress; ``worker.main`` runs it on the engine thread, which issues rank 0's
        collectives) and gets ``STOP_DELIVERY_TIMEOUT_S``; a follower that has STOP exits
        at once (``follower.follower_main``). Without ``stop``, or when it fails or times
        out, the followers are SIGKILLed at once (they ignore SIGTERM and SIGINT: a
        follower stops with its rank 0). Each follower gets ``FOLLOWER_EXIT_TIMEOUT_S`` to
        exit, then is SIGKILLed (``KILL_WAIT_S``); their exit statuses are logged. Last, with
        ``abort``, this rank aborts its communicators (``abort_group``: local, within
        ``ABORT_TIMEOUT_S``), so that the process may start a new group. A process that
        ends next passes ``abort=False`` and leaves by ``exit_process`` (the worker, and
        every follower): its communicators go with it, and nothing needs tearing down.
        """
        global _current
        self.closing.set()
        if self.rank == 0 and self.followers:
            delivered = stop is not None and bounded(stop, STOP_DELIVERY_TIMEOUT_S, "sending STOP")
            if not delivered:
                for p in self.followers:
                    if p.is_alive():
                        p.kill()
            self._join_followers()
        all_reduce.uninstall()
        if abort and dist.is_initialized():
            bounded(abort_group, ABORT_TIMEOUT_S, "aborting the group's communicators")
        if _current is self:
            _current = None

    def _join_followers(self) -> None:
        """Wait ``FOLLOWER_EXIT_TIMEOUT_S`` for the followers (rank 0), SIGKILL those left
        and wait ``KILL_WAIT_S`` for them, then log every exit status (negative: the
        signal)."""
        deadline = time.monotonic() + FOLLOWER_EXIT_TIMEOUT_S
        for p in self.followers:
            p.join(max(0.0, deadline - time.monotonic()))
        left = [p for p in self.followers if p.is_alive()]
        for p in left:
            p.kill()
        deadline = time.monotonic() + KILL_WAIT_S
        for p in left:
            p.join(max(0.0, deadline - time.monotonic()))
        log.info("tensor parallel: followers exited with status %s",
                 ", ".join(f"rank {r}: {p.exitcode}" for r, p in enumerate(self.followers, 1)))


def abort_group() -> None:
    """Abort every communicator of this process's groups and forget them
    (``_abort_process_group``: NCCL's ``ncclCommAbort``, which, unlike the collective
    destroy, waits for no peer; gloo closes its sockets). Where torch lacks it, destroy
    (gloo's is local too)."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    (abort or dist.destroy_process_group)()


def bounded(fn: Callable[[], None], timeout_s: float, what: str) -> bool:
    """Run ``fn`` on a daemon thread and wait up to ``timeout_s`` seconds for it: True
    when it returned in time. An exception or the timeout is logged (``what`` names the
    step) and gives False; past the timeout ``fn`` is left running, so that a stuck peer
    cannot keep this process from going on (or exiting: the thread is a daemon)."""
    done = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported below, on the caller's thread
            failed.append(exc)
        done.set()

    threading.Thread(target=run, name="tp-teardown", daemon=True).start()
    if not done.wait(timeout_s):
        log.warning("tensor parallel: %s took over %.2f s; going on without it", what, timeout_s)
        return False
    if failed:
        log.warning("tensor parallel: %s failed: %s", what, failed[0])
        return False
    return True


def flush_logs() -> None:
    """Flush the root logger's handlers and stdout/stderr (before ``os._exit``, which
    flushes nothing)."""
    for flush in [h.flush for h in logging.getLogger().handlers] + [sys.stdout.flush, sys.stderr.flush]:
        with contextlib.suppress(Exception):  # a closed stream: nothing left to flush
            flush()


def exit_process(status: int) -> NoReturn:
    """End this process now with ``status``, after ``flush_logs``: ``os._exit`` runs no
    atexit hook and no C++ destructor, so neither a collective teardown nor a
    communicator's threads (NCCL's watchdog, a teardown left running by ``bounded``) can
    hold or abort the exit. For a rank whose work is done or handed back: the GPU memory
    goes back with the process."""
    flush_logs()
    os._exit(status)


def ignore_stop_signals() -> None:
    """A follower's SIGINT and SIGTERM are ignored: Ctrl-C reaches a terminal's whole
    process group and systemd's default stop every process of a unit, but a follower
    stops with its rank 0 (STOP, or rank 0's death), never on its own mid-step."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def watch(closing: threading.Event, sentinels: list[Any], on_death: Callable[[], None]) -> None:
    """Call ``on_death`` from a daemon thread when any of ``sentinels`` (process
    sentinels) becomes ready, unless ``closing`` is set by then."""
    def run() -> None:
        multiprocessing.connection.wait(sentinels)
        if not closing.is_set():
            on_death()
    threading.Thread(target=run, name="tp-watch", daemon=True).start()


def current() -> TPGroup | None:
    """The tensor-parallel group of this process, or None (one process, the whole model)."""
    return _current


def exit_now() -> None:
    """Leave at once with ``EXIT_RANK_DIED`` (a peer died: this rank's next collective
    would fail or hang, and the engine thread may be inside one). The other followers
    see rank 0 go and exit the same way."""
    log.error("tensor parallel: a rank of this worker's group died; exiting")
    exit_process(EXIT_RANK_DIED)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def join(rank: int, world_size: int, port: int, device: torch.device) -> TPGroup:
    """Join the group as ``rank`` (blocks until every rank has joined) and make it this
    process's ``current()``. On CUDA rank r takes GPU r."""
    global _current, _groups_joined
    if device.type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(backend_for(device), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    _current = TPGroup(rank, world_size, device, dist.group.WORLD)
    _groups_joined += 1
    return _current


def groups_joined() -> int:
    """How many groups this process has joined (``join``), the current one included: 1 in
    a worker and its followers, more in a process that built engines one after another."""
    return _groups_joined


def start(world_size: int, device: torch.device, follower_main: Callable[..., None],
          follower_args: tuple[Any, ...], on_death: Callable[[], None] = exit_now) -> TPGroup:
    """Rank 0: on CUDA set ``MULTICAST_OFF`` where unset, spawn ranks 1..``world_size``-1
    running ``follower_main(rank, world_size, port, device, *follower_args)`` (a module-level function: the processes are spawned;
    ``follower.follower_main`` for the engine), join the group with them, and watch them
    (``on_death`` when one ends unasked; default: exit with ``EXIT_RANK_DIED``).

    Raises:
        ValueError: ``world_size`` < 2, or more than the visible GPUs on CUDA.
        RuntimeError: a group already exists in this process, or the communicators of
            one it closed are not yet aborted (``close(abort=False)``, or an abort past
            ``ABORT_TIMEOUT_S``).
    """
    if world_size < 2:
        raise ValueError(f"tensor parallel size {world_size}: a group needs at least 2 ranks")
    if device.type == "cuda" and world_size > torch.cuda.device_count():
        raise ValueError(f"tensor parallel size {world_size} > {torch.cuda.device_count()} visible GPUs")
    if _current is not None:
        raise RuntimeError("a tensor-parallel group already runs in this process")
    if dist.is_initialized():
        raise RuntimeError("the communicators of this process's last tensor-parallel group are not aborted yet; "
                           "start the next group in a new process")
    if device.type == "cuda":  # before NCCL starts here, and inherited by the followers
        for name, value in MULTICAST_OFF.items():
            os.environ.setdefault(name, value)
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=follower_main, args=(r, world_size, port, device, *follower_args),
                         name=f"inferq-tp-rank{r}", daemon=True) for r in range(1, world_size)]
    for p in procs:
        p.start()
    log.info("tensor parallel: %d ranks (%s), followers %s, port %d", world_size, backend_for(device),
             [p.pid for p in procs], port)
    closing = threading.Event()
    # Watched before joining: a follower that fails to start would leave the join waiting.
    watch(closing, [p.sentinel for p in procs], on_death)
    group = join(0, world_size, port, device)
    group.followers, group.closing = procs, closing
    return group
