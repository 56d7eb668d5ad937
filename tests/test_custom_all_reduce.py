"""The one-shot all-reduce (``kernels/all_reduce.py``, ``worker/parallel/all_reduce.py``)
against NCCL's on 2 and 4 GPUs, eager and replayed from a CUDA graph: real processes,
one per GPU, a real NCCL group and real symmetric memory."""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from worker.parallel.group import MULTICAST_OFF

pytestmark = [pytest.mark.cuda]

#: Multicast stays off in every process (docs/operations.md, "Tensor parallelism").
NO_MULTICAST = MULTICAST_OFF
#: (rows, hidden) of decode-sized messages, one over a program's block count, one ragged.
SHAPES = [(1, 4096), (7, 3584), (64, 8192), (33, 1000)]


def _rank_main(rank: int, world: int, port: int, errors: mp.Queue) -> None:
    try:
        os.environ.update(NO_MULTICAST)
        import torch.distributed as dist

        from worker.parallel.all_reduce import MAX_BYTES, all_reduce, install, installed

        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                device_id=device)
        group = dist.group.WORLD
        custom = install(group, device)
        assert custom is not None and installed() is custom, "the one-shot all-reduce did not install"
        gen = torch.Generator(device=device).manual_seed(1000 + rank)
        for dtype in (torch.bfloat16, torch.float32):
            for rows, hidden in SHAPES:
                x = torch.randn(rows, hidden, generator=gen, device=device).to(dtype)
                gathered = [torch.empty_like(x) for _ in range(world)]
                dist.all_gather(gathered, x)
                want = torch.stack(gathered).float().sum(0).to(dtype)
                nccl = x.clone()
                dist.all_reduce(nccl)
                got = all_reduce(x.clone(), group)
                # The float32 sum in rank order, rounded once: the reference's own bits
                # up to float32 summation order; NCCL's within its rounding.
                torch.testing.assert_close(got, want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)
                torch.testing.assert_close(got, nccl, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=2e-2)
                # Every rank gets the same bits (tensor parallelism needs identical states).
                everyone = [torch.empty_like(got) for _ in range(world)]
                dist.all_gather(everyone, got)
                assert all(torch.equal(e, everyone[0]) for e in everyone), "ranks disagree"
        # Too large: NCCL's, same result.
        big = torch.randn(MAX_BYTES[world] // 2 + 1024, generator=gen, device=device)
        assert not custom.fits(big)
        ref = big.clone()
        dist.all_reduce(ref)
        torch.testing.assert_close(all_reduce(big, group), ref)
        # Captured in a CUDA graph, replayed with new inputs, many times in a row (the
        # flags must be back at rest after every call).
        static = torch.zeros(64, 4096, dtype=torch.bfloat16, device=device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            all_reduce(static, group)  # warm: compiled before capture
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            all_reduce(static, group)
        for step in range(50):
            fresh = torch.randn(64, 4096, generator=gen, device=device).to(torch.bfloat16)
            gathered = [torch.empty_like(fresh) for _ in range(world)]
            dist.all_gather(gathered, fresh)
            static.copy_(fresh)
            graph.replay()
            want = torch.stack(gathered).float().sum(0).to(torch.bfloat16)
            torch.testing.assert_close(static, want, rtol=1e-2, atol=1e-2, msg=f"replay {step}")
        torch.cuda.synchronize(device)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # reported to the test process, then raised
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.timeout(300)
def test_one_shot_all_reduce_equals_nccl_eager_and_in_graphs(world: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    from worker.parallel.group import free_port

    os.environ.update(NO_MULTICAST)
    ctx = mp.get_context("spawn")
    errors: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, errors)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    messages = []
    while not errors.empty():
        messages.append(errors.get())
    assert not alive, f"ranks hung: {[p.pid for p in alive]}\n" + "\n".join(messages)
    assert all(p.exitcode == 0 for p in procs), "\n".join(messages)
