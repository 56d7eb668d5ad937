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
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

#: Exit status of a rank whose peer died.
EXIT_RANK_DIED = 3
#: Collective timeout: longer than any idle period (deaths are seen through sentinels).
COLLECTIVE_TIMEOUT = timedelta(days=30)
#: How long close() waits for the group's teardown, and then for the followers to exit, seconds.
STOP_TIMEOUT_S = 10.0

_current: TPGroup | None = None


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

    def close(self, stop: Callable[[], None] | None = None) -> None:
        """Mark the group closing (the watchers stay quiet) and leave it; on rank 0 first
        call ``stop`` (``StepSync.send_stop``: each follower then leaves too and exits),
        or without ``stop`` terminate the followers; then wait up to ``STOP_TIMEOUT_S``
        for them and kill those left.

        NCCL tears a communicator down collectively: a rank's ``ncclCommDestroy`` waits
        until its peers destroy theirs (NCCL >= 2.16). So rank 0 leaves the group right
        after STOP, while its followers leave theirs, and joins them after; had it joined
        them first, each side would wait for the other. After a failed STOP, or none, the
        followers never leave: rank 0 then aborts its communicators instead
        (``_abort_process_group``, which does not wait for them) where torch has it.
        """
        global _current
        self.closing.set()
        stopped = False
        if stop is not None:
            try:
                stop()
                stopped = True
            except Exception:  # a follower already gone: killed below
                log.warning("tensor parallel: stop message not delivered", exc_info=True)
        if not stopped:
            for p in self.followers:
                p.terminate()
        if dist.is_initialized():
            leave_group(peers_leave=stopped or not self.followers)
        for p in self.followers:
            p.join(STOP_TIMEOUT_S)
            if p.is_alive():
                p.kill()
                p.join()
        if _current is self:
            _current = None


def leave_group(peers_leave: bool) -> None:
    """Destroy this process's default group (``peers_leave``: every other rank destroys
    its own now, as NCCL's teardown needs), or else abort it, which waits for no peer
    (where torch has ``_abort_process_group``; else destroy, and hope). Either is given
    ``STOP_TIMEOUT_S``; past that it is left to finish on a daemon thread, logged, so
    that a stuck peer cannot keep this process from exiting."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    teardown = dist.destroy_process_group if peers_leave or abort is None else abort
    done = threading.Event()

    def run() -> None:
        try:
            teardown()
        except Exception:  # a peer gone mid-teardown: nothing left to free
            log.warning("tensor parallel: leaving the group failed", exc_info=True)
        done.set()

    threading.Thread(target=run, name="tp-leave", daemon=True).start()
    if not done.wait(STOP_TIMEOUT_S):
        log.warning("tensor parallel: leaving the group took over %.0f s; going on without it", STOP_TIMEOUT_S)


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
    would fail or hang, and the engine thread may be inside one)."""
    log.error("tensor parallel: a rank of this worker's group died; exiting")
    os._exit(EXIT_RANK_DIED)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def join(rank: int, world_size: int, port: int, device: torch.device) -> TPGroup:
    """Join the group as ``rank`` (blocks until every rank has joined) and make it this
    process's ``current()``. On CUDA rank r takes GPU r."""
    global _current
    if device.type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(backend_for(device), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    _current = TPGroup(rank, world_size, device, dist.group.WORLD)
    return _current


def start(world_size: int, device: torch.device, follower_main: Callable[..., None],
          follower_args: tuple[Any, ...], on_death: Callable[[], None] = exit_now) -> TPGroup:
    """Rank 0: spawn ranks 1..``world_size``-1 running ``follower_main(rank, world_size,
    port, device, *follower_args)`` (a module-level function: the processes are spawned;
    ``follower.follower_main`` for the engine), join the group with them, and watch them
    (``on_death`` when one ends unasked; default: exit with ``EXIT_RANK_DIED``).

    Raises:
        ValueError: ``world_size`` < 2, or more than the visible GPUs on CUDA.
        RuntimeError: a group already exists in this process.
    """
    if world_size < 2:
        raise ValueError(f"tensor parallel size {world_size}: a group needs at least 2 ranks")
    if device.type == "cuda" and world_size > torch.cuda.device_count():
        raise ValueError(f"tensor parallel size {world_size} > {torch.cuda.device_count()} visible GPUs")
    if _current is not None:
        raise RuntimeError("a tensor-parallel group already runs in this process")
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
