"""Child processes that die with their parent.

``inferq serve`` starts a worker and an embedded redis-server; neither may outlive it,
even when ``serve`` itself is SIGKILLed and runs no cleanup (docs/operations.md, Signals).

On Linux the kernel does it: ``prctl(PR_SET_PDEATHSIG, sig)`` in the child makes the
kernel send ``sig`` to the child when its parent dies. Two catches, both handled here:

- the "parent" is the *thread* that forked the child, not the process: a child started
  from a thread that exits before the process would get ``sig`` then. Start children
  from the main thread (``parent_death_preexec`` refuses other threads);
- the parent may die before the child sets the flag, and then nothing fires. After
  setting it the child compares ``os.getppid()`` with the parent's pid (a re-parented
  child sees another pid) and sends ``sig`` to itself if they differ.

Elsewhere (macOS, the BSDs) a Python child watches ``os.getppid()`` from a daemon
thread (``exit_with_parent``); a non-Python child such as redis-server has no such
fallback there and outlives a killed parent.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# How often the fallback watchdog (no prctl) checks whether its parent has changed, seconds.
PARENT_POLL_INTERVAL_S = 1.0


def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, or ``None`` where there is none (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl  # type: ignore[no-any-return]


def _set_death_signal(prctl: Callable[..., int], sig: int, parent_pid: int) -> None:
    """In the child: have the kernel send ``sig`` when the parent dies; send it now if
    the parent ``parent_pid`` is already gone.

    Runs between fork and exec (as ``preexec_fn``), so it only calls libc and ``os``:
    no logging, no imports, no locks.

    Raises:
        OSError: prctl failed.
    """
    if prctl(PR_SET_PDEATHSIG, sig) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)


def parent_death_preexec(sig: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` that makes the child receive ``sig``
    when this process dies (Linux ``PR_SET_PDEATHSIG``; it survives ``exec``).

    Returns ``None`` (start the child without it) where prctl does not exist, or when
    called from a thread other than the main thread, whose exit would send ``sig``
    while this process still runs.
    """
    prctl = _prctl()  # looked up here: the child must not load libraries between fork and exec
    if prctl is None:
        return None
    if threading.current_thread() is not threading.main_thread():
        log.debug("not the main thread: child started without a parent-death signal")
        return None
    parent_pid = os.getpid()
    return lambda: _set_death_signal(prctl, sig, parent_pid)


def exit_with_parent(parent_pid: int, sig: int) -> None:
    """In a Python child of ``parent_pid``: receive ``sig`` when that parent dies.

    On Linux through ``PR_SET_PDEATHSIG`` (the signal comes at once, even if the parent
    was SIGKILLed); elsewhere a daemon thread checks ``os.getppid()`` every
    ``PARENT_POLL_INTERVAL_S`` seconds and sends ``sig`` to this process when it has
    changed. Either way ``sig`` comes at once if the parent is already gone. Call it from
    any thread: the death that counts is the parent's.

    Raises:
        OSError: prctl failed.
    """
    prctl = _prctl()
    if prctl is not None:
        _set_death_signal(prctl, sig, parent_pid)
        return
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
        return
    threading.Thread(target=_watch_parent, args=(parent_pid, sig), name="inferq-parent-watch", daemon=True).start()


def _watch_parent(parent_pid: int, sig: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_INTERVAL_S)
    log.warning("parent process %d is gone: exiting", parent_pid)
    os.kill(os.getpid(), sig)
