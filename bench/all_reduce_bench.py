"""The one-shot all-reduce (``kernels/all_reduce.py``) against NCCL's, alone, at the
message sizes of decode steps: microseconds per call on W GPUs of one host.

One process per GPU (spawned), one NCCL group with multicast off
(``group.MULTICAST_OFF``), the one-shot all-reduce installed as the engine installs it
(``worker.parallel.all_reduce.install``). For each ``[rows, hidden]`` bfloat16 message
(the hidden states of ``rows`` decoding sequences) and each of ``one_shot`` (only where
the message fits its buffer) and ``nccl`` (``dist.all_reduce``):

- ``graph_us``: ``CALLS`` calls captured in one CUDA graph, the graph replayed
  ``REPLAYS`` times between two CUDA events on rank 0, per call; this is how a decode
  step runs them (two a layer, inside the step's graph);
- ``eager_us``: ``CALLS`` calls launched one by one, per call (launch cost included).

The messages hold zeros, so that ``CALLS`` sums in place stay finite; the time of a sum
does not depend on its values. The ranks start each timing together (a barrier, then a
device synchronize). Rank 0's figures go to ``--out`` (JSON) and a table.

    python bench/all_reduce_bench.py --world-sizes 2,4 --out $OUT/all_reduce.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: the repository on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from worker.parallel.group import MULTICAST_OFF, free_port

#: (rows, hidden) of the messages: batch 1, 8 and 64 of a 7B (3,584) and a 70B (8,192)
#: hidden size, and 256 rows of the 70B's (4 MiB: NCCL's alone at every world size).
SHAPES = ((1, 3584), (8, 3584), (64, 3584), (1, 8192), (8, 8192), (64, 8192), (256, 8192))
#: Calls per timed run, and replays of the captured graph.
CALLS = 50
REPLAYS = 20


def _time_calls(fn: Any, x: torch.Tensor, device: torch.device, graph: bool) -> float:
    """Microseconds per call of ``fn(x)``: ``CALLS`` calls in a CUDA graph replayed
    ``REPLAYS`` times, or launched eagerly ``REPLAYS`` times over."""
    import torch.distributed as dist

    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm: compiled and connected before any capture
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream(device).wait_stream(stream)
    g = None
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(CALLS):
                fn(x)
        g.replay()
    torch.cuda.synchronize(device)
    dist.barrier(device_ids=[device.index])
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        if g is not None:
            g.replay()
        else:
            for _ in range(CALLS):
                fn(x)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (REPLAYS * CALLS)


def _rank_main(rank: int, world: int, port: int, results: Any) -> None:
    os.environ.update(MULTICAST_OFF)
    import torch.distributed as dist

    from worker.parallel.all_reduce import all_reduce, install

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=device)
    custom = install(dist.group.WORLD, device)
    rows = []
    for n, hidden in SHAPES:
        x = torch.zeros(n, hidden, dtype=torch.bfloat16, device=device)
        row: dict[str, Any] = {"rows": n, "hidden": hidden, "bytes": x.numel() * x.element_size()}
        ways = {"nccl": lambda t: dist.all_reduce(t)}
        if custom is not None and custom.fits(x):
            ways["one_shot"] = lambda t: all_reduce(t, dist.group.WORLD)  # the engine's call: fits, so one-shot
        for name, fn in ways.items():
            for graph in (True, False):
                row[f"{name}_{'graph' if graph else 'eager'}_us"] = round(_time_calls(fn, x, device, graph), 2)
        rows.append(row)
    if rank == 0:
        results.put({"world_size": world, "one_shot_installed": custom is not None, "rows": rows})
    dist.barrier(device_ids=[device.index])
    from worker.parallel.group import exit_process

    exit_process(0)  # no NCCL teardown at interpreter exit (docs/architecture.md, "Stopping")


def run_world(world: int, timeout_s: float) -> dict[str, Any]:
    """One group of ``world`` GPUs; rank 0's rows.

    Raises:
        RuntimeError: a rank failed, or no result within ``timeout_s`` seconds.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return results.get(timeout=timeout_s)
    except Exception as exc:  # queue.Empty: a rank died or hung
        raise RuntimeError(f"no result from {world} ranks in {timeout_s:.0f} s (exit codes "
                           f"{[p.exitcode for p in procs]})") from exc
    finally:
        deadline = time.monotonic() + 10
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()


def table(res: dict[str, Any]) -> str:
    lines = ["| GPUs | message | one-shot, graph | NCCL, graph | one-shot, eager | NCCL, eager |",
             "| --- | --- | --- | --- | --- | --- |"]
    for run in res["runs"]:
        for r in run["rows"]:
            cells = [f"{r[k]:.1f} µs" if k in r else "-"
                     for k in ("one_shot_graph_us", "nccl_graph_us", "one_shot_eager_us", "nccl_eager_us")]
            lines.append(f"| {run['world_size']} | {r['rows']} x {r['hidden']} ({r['bytes'] // 1024} KiB) | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-sizes", default="2", help="comma-separated GPU counts")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="per world size")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    sizes = [int(w) for w in args.world_sizes.split(",") if w.strip()]
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not sizes or min(sizes) < 2 or max(sizes) > have:
        print(f"all_reduce_bench: world sizes {sizes} need 2 or more CUDA GPUs each; this host has {have}",
              file=sys.stderr)
        return 2
    res: dict[str, Any] = {"date": date.today().isoformat(), "device": torch.cuda.get_device_name(0),
                           "torch": torch.__version__, "calls": CALLS, "replays": REPLAYS,
                           "command": "python bench/all_reduce_bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
                           "runs": []}
    for world in sizes:
        res["runs"].append(run_world(world, args.timeout_s))
        args.out.write_text(json.dumps(res, indent=1))
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
