"""Scheduler on the CPU with hand-made model outputs: no model, no torch tensors."""

from __future__ import annotations

from shared.sampling import SamplingParams
from worker.engine.block_manager import BlockManager
from worker.engine.request import Request, RequestStatus
from worker.engine.scheduler import Scheduler
from worker.engine.step_types import SchedulerOutput

EOS = 0


def make(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8, budget: int = 32,
         caching: bool = False) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size, caching), max_num_seqs, budget)


def req(rid: str, n: int, max_tokens: int = 4, **kw: object) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, **kw), frozenset({EOS}))


def run_step(s: Scheduler, token: int = 7) -> tuple[dict[str, int], list[Request]]:
    out = s.schedule()
    counts = {x.request.request_id: x.num_tokens for x in out.scheduled}
    sampled = [token if x.samples else None for x in out.scheduled]
    _, finished = s.update(out, sampled)
    return counts, finished


def test_mixed_batch_decode_and_chunked_prefill_under_budget() -> None:
    s = make(budget=10)
    s.add(req("a", 3))
    s.add(req("b", 20))
    counts, _ = run_step(s)
    assert counts == {"a": 3, "b": 7}  # b's prefill is chunked to the remaining budget
    counts, _ = run_step(s)
    assert counts == {"a": 1, "b": 9}  # a decodes, b continues its prefill
    b = s.requests["b"]
    assert b.num_computed_tokens == 16 and b.num_output_tokens == 0  # no token for a partial chunk
    counts, _ = run_step(s)
    assert counts == {"a": 1, "b": 4}
    assert b.num_output_tokens == 1


def test_max_num_seqs_caps_running() -> None:
    s = make(max_num_seqs=2)
    for i in range(4):
        s.add(req(f"r{i}", 2))
    counts, _ = run_step(s)
    assert set(counts) == {"r0", "r1"} and len(s.waiting) == 2


def test_finish_on_length_eos_and_stop_token_frees_blocks() -> None:
    s = make()
    s.add(req("len", 3, max_tokens=2))
    s.add(req("eos", 3, max_tokens=5))
    s.add(req("stop", 3, max_tokens=5, stop_token_ids=(9,)))
    out = s.schedule()
    tokens = {"len": 5, "eos": EOS, "stop": 9}
    _, finished = s.update(out, [tokens[x.request.request_id] for x in out.scheduled])
    assert {r.request_id for r in finished} == {"eos", "stop"}
    assert all(r.status == RequestStatus.FINISHED_STOPPED for r in finished)
    _, finished = run_step(s)
    assert [r.request_id for r in finished] == ["len"] and finished[0].status == RequestStatus.FINISHED_LENGTH
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks


def test_ignore_eos_and_min_tokens() -> None:
    s = make()
    s.add(req("ign", 2, max_tokens=3, ignore_eos=True))
    s.add(req("min", 2, max_tokens=3, min_tokens=2))
    _, f1 = run_step(s, EOS)
    assert f1 == []  # min_tokens=2 keeps "min" going after an early EOS
    _, f2 = run_step(s, EOS)
    assert [r.request_id for r in f2] == ["min"]
    _, f3 = run_step(s, EOS)
    assert [r.request_id for r in f3] == ["ign"] and f3[0].status == RequestStatus.FINISHED_LENGTH


def test_preemption_by_recompute_when_blocks_run_out() -> None:
    # 4 blocks of 2 tokens: two requests of 3 prompt tokens take 2 blocks each; the first
    # decode that needs a new block preempts the most recently admitted request.
    s = make(num_blocks=4, block_size=2, budget=16)
    s.add(req("a", 3, max_tokens=4))
    s.add(req("b", 3, max_tokens=4))
    run_step(s)  # both prefilled (3 tokens, 2 blocks each), one token sampled each
    run_step(s)  # the 4th token's KV fills each second block
    out = s.schedule()  # the 5th token needs a third block: none is free
    assert [r.request_id for r in out.preempted] == ["b"]
    assert [x.request.request_id for x in out.scheduled] == ["a"]
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.block_table == []
    assert b.num_output_tokens == 2  # its output is kept and recomputed as prompt
    s.update(out, [7])
    finished: list[Request] = []
    for _ in range(20):
        if not s.num_unfinished:
            break
        _, f = run_step(s)
        finished += f
    assert {r.request_id for r in finished} == {"a", "b"}
    assert all(r.num_output_tokens == 4 for r in finished)
    assert s.block_manager.num_free_blocks == 4 and s.num_preemptions >= 1


def test_abort_running_and_waiting() -> None:
    s = make(max_num_seqs=1)
    s.add(req("a", 3))
    s.add(req("b", 3))
    run_step(s)
    assert s.abort("a").status == RequestStatus.FINISHED_ABORTED
    assert s.abort("b").status == RequestStatus.FINISHED_ABORTED
    assert s.abort("nope") is None
    assert s.num_unfinished == 0 and s.block_manager.num_free_blocks == s.block_manager.num_blocks


def test_prefix_cache_hit_skips_computed_tokens() -> None:
    s = make(caching=True, block_size=4)
    s.add(req("a", 10, max_tokens=1))
    run_step(s)
    s.add(req("b", 10, max_tokens=1))
    counts, _ = run_step(s)
    assert counts == {"b": 2}  # 8 of 10 prompt tokens came from the cache
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks



def test_a_prompt_never_gets_another_prompts_block_after_different_tokens() -> None:
    """Chained hashes: b's second block holds the same tokens as a's after another first
    block, so it is computed, not shared, and c (b's prompt continued) runs on b's blocks,
    never on a's second block. Fails if a block's hash ignores its parent's."""
    s = make(caching=True, block_size=4)
    first = [Request("a", [1, 2, 3, 4, 9, 9, 9, 9, 5], SamplingParams(max_tokens=2), frozenset({EOS})),
             Request("b", [6, 6, 6, 6, 9, 9, 9, 9, 5], SamplingParams(max_tokens=2), frozenset({EOS}))]
    tables = {}
    for r in first:
        s.add(r)
        counts, _ = run_step(s)
        assert counts == {r.request_id: 9}  # nothing cached for b either
        tables[r.request_id] = list(r.block_table)
        run_step(s)  # finishes: its blocks stay cached
    c = Request("c", [6, 6, 6, 6, 9, 9, 9, 9, 8, 8], SamplingParams(max_tokens=1), frozenset({EOS}))
    s.add(c)
    out = s.schedule()
    assert [(x.request.request_id, x.num_tokens) for x in out.scheduled] == [("c", 2)]
    assert c.block_table[:2] == tables["b"][:2] and tables["a"][1] not in c.block_table

# -- admission counting (what the worker pulls from Redis) ---------------------------------

def test_num_admittable_counts_free_slots_while_blocks_cover_the_queue() -> None:
    s = make(num_blocks=8, block_size=4, max_num_seqs=4)
    assert s.num_admittable() == 4
    s.add(req("a", 10))  # 3 blocks still needed
    s.add(req("b", 10))
    assert s.num_admittable() == 2  # 8 free blocks > 6 reserved for the waiting prompts
    s.add(req("c", 6))  # 2 more blocks: 8 free no longer exceed 8 reserved
    assert s.num_admittable() == 0


def test_num_admittable_reserves_one_block_of_growth_per_running_request() -> None:
    s = make(num_blocks=9, block_size=4, max_num_seqs=4)
    s.add(req("a", 10))
    s.add(req("b", 10))
    run_step(s)  # both admitted: 6 blocks held, 3 free
    assert len(s.running) == 2 and s.block_manager.num_free_blocks == 3
    assert s.num_admittable() == 2  # 3 free > 2 blocks of growth
    s.block_manager.allocate(s.running[0], 8)  # a grows by 2 blocks: 1 left, 2 reserved
    assert s.num_admittable() == 0


def test_num_admittable_is_zero_without_free_slots() -> None:
    s = make(num_blocks=64, max_num_seqs=2)
    s.add(req("a", 2))
    run_step(s)
    s.add(req("b", 2))
    assert s.num_admittable() == 0


# -- the decode step behind one in flight (async scheduling) ---------------------------------

def in_flight_decode(s: Scheduler, *requests: Request) -> SchedulerOutput:
    """Prefill ``requests`` (one sampled token each), then schedule a decode step and
    leave it unapplied, as the engine does while its tokens are on the GPU."""
    for r in requests:
        s.add(r)
    run_step(s)
    out = s.schedule()
    assert all(x.num_tokens == 1 for x in out.scheduled)
    return out


def test_next_decode_follows_in_flight_step_with_blocks_for_two_positions() -> None:
    s = make(num_blocks=8, block_size=4)
    out = in_flight_decode(s, req("a", 3, max_tokens=8), req("b", 3, max_tokens=8))
    assert s.can_schedule_next_decode(out)
    nxt = s.schedule_next_decode(out)
    assert [(x.request.request_id, x.num_tokens) for x in nxt.scheduled] == [("a", 1), ("b", 1)]
    for r in s.running:  # positions 3 (in flight) and 4 (next) need a second block
        assert r.num_computed_tokens == 3 and len(r.block_table) == 2
    s.update(out, [7, 7])
    s.update(nxt, [8, 8])
    for r in s.running:
        assert r.num_computed_tokens == 5 and r.output_token_ids == [7, 7, 8]


def test_no_next_decode_when_a_request_waits_or_was_aborted() -> None:
    s = make(num_blocks=8, block_size=4)
    out = in_flight_decode(s, req("a", 3, max_tokens=8), req("b", 3, max_tokens=8))
    s.add(req("c", 3))
    assert not s.can_schedule_next_decode(out)
    s.abort("c")
    assert s.can_schedule_next_decode(out)
    s.abort("b")
    assert not s.can_schedule_next_decode(out)


def test_next_decode_when_requests_wait_but_no_slot_is_free() -> None:
    s = make(num_blocks=8, block_size=4, max_num_seqs=2)
    out = in_flight_decode(s, req("a", 3, max_tokens=8), req("b", 3, max_tokens=8))
    s.add(req("c", 3))  # cannot be admitted before a or b finishes: the next step is decode
    assert s.can_schedule_next_decode(out)
    assert [x.request.request_id for x in s.schedule_next_decode(out).scheduled] == ["a", "b"]


def test_no_next_decode_when_the_token_in_flight_reaches_max_tokens() -> None:
    s = make(num_blocks=8, block_size=4)
    out = in_flight_decode(s, req("a", 3, max_tokens=8), req("b", 3, max_tokens=2))
    assert not s.can_schedule_next_decode(out)  # b's second (last) token is in flight


def test_no_next_decode_without_free_blocks() -> None:
    s = make(num_blocks=3, block_size=4)
    out = in_flight_decode(s, req("a", 3, max_tokens=8), req("b", 3, max_tokens=8))
    assert s.block_manager.num_free_blocks == 1  # each needs one more block for position 4
    assert not s.can_schedule_next_decode(out)


def test_make_stats_reads_queues_and_blocks() -> None:
    s = make(num_blocks=8, block_size=4, max_num_seqs=1)
    s.add(req("a", 3))
    s.add(req("b", 3))
    run_step(s)
    stats = s.make_stats()
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks, stats.num_blocks) == (1, 1, 7, 8)
    assert stats.kv_usage == 1 / 8


def drive_to_completion(s: Scheduler, arrivals: list[tuple[int, Request]], max_steps: int = 20_000) -> int:
    """Run steps with fake sampled ids, adding each request at its step; returns the
    steps taken. Fails if a step schedules nothing while requests are unfinished (the
    engine would spin on empty steps forever)."""
    pending = sorted(arrivals, key=lambda a: a[0])
    step = 0
    while pending or s.num_unfinished:
        while pending and pending[0][0] <= step:
            s.add(pending.pop(0)[1])
        out = s.schedule()
        if out.is_empty:
            held = {r.request_id: len(r.block_table) for r in s.waiting if r.block_table}
            assert pending, f"step {step}: nothing scheduled, nothing running; waiting requests hold {held}"
        s.update(out, [7 if x.samples else None for x in out.scheduled])
        step += 1
        assert step < max_steps
    return step


def test_waiting_requests_hold_no_blocks_so_a_tight_cache_cannot_deadlock() -> None:
    """A waiting request that gets cached prefix blocks but cannot be admitted must not
    keep them: with prefix caching, preemptions and a tight cache, two waiting requests
    once held every block with nothing running, and every later step was empty."""
    import random

    rng = random.Random(7)
    s = Scheduler(BlockManager(160, 16, True), 16, 512)
    shared = [rng.randrange(1, 49152) for _ in range(300)]
    arrivals: list[tuple[int, Request]] = []
    for i in range(46):
        n = rng.randint(1, 1500)
        tokens = shared + [rng.randrange(1, 49152) for _ in range(rng.randint(1, 200))] if i >= 40 else \
            [rng.randrange(1, 49152) for _ in range(n)]
        params = SamplingParams(max_tokens=rng.choice((1, 2, 7, 33, 64)), ignore_eos=True)
        arrivals.append((rng.randint(0, 60), Request(f"r{i}", tokens, params, frozenset({EOS}))))
    drive_to_completion(s, arrivals)
    bm = s.block_manager
    assert s.num_preemptions > 0  # the cache was tight enough to matter
    assert bm.num_free_blocks == bm.num_blocks and not s.waiting and not s.running


def test_request_larger_than_the_cache_is_refused_at_add_also_with_a_cached_prefix() -> None:
    s = make(num_blocks=8, block_size=4, budget=64, caching=True)
    s.add(req("a", 9, max_tokens=1))
    run_step(s)  # a's first two blocks are now cached
    import pytest

    # 40 prompt tokens share a's prefix but need 10 blocks of 8 in all.
    with pytest.raises(ValueError, match="needs 10 KV blocks of 4 tokens; this worker's cache has 8"):
        s.add(req("huge", 40, max_tokens=1))
    # Prompt and outputs together: 30 + 3 tokens, the last one's KV never computed: 8 blocks fit.
    s.add(req("fits", 30, max_tokens=3))
    with pytest.raises(ValueError, match="needs 9 KV blocks"):
        s.add(req("outputs-too", 30, max_tokens=4))
    assert "huge" not in s.requests and "outputs-too" not in s.requests


# -- in-batch prefix caching: siblings of one prompt prefill it once ------------------------

def test_siblings_of_one_prompt_wait_for_the_first_and_hit_its_blocks() -> None:
    s = make(caching=True, block_size=4)
    for i in range(4):
        s.add(req(f"r{i}", 10))
    counts, _ = run_step(s)
    assert counts == {"r0": 10}  # r1..r3 wait: r0 computes their first block right now
    assert [r.request_id for r in s.waiting] == ["r1", "r2", "r3"]
    counts, _ = run_step(s)
    assert counts == {"r0": 1, "r1": 2, "r2": 2, "r3": 2}  # 8 of 10 prompt tokens from r0's blocks
    assert [s.requests[f"r{i}"].num_cached_tokens for i in range(4)] == [0, 8, 8, 8]


def test_different_prompts_are_not_deferred_and_fcfs_holds() -> None:
    s = make(caching=True, block_size=4)
    s.add(req("a", 10))
    s.add(Request("b", list(range(50, 60)), SamplingParams(max_tokens=4), frozenset({EOS})))
    s.add(req("a-sibling", 10))
    s.add(Request("c", list(range(70, 75)), SamplingParams(max_tokens=4), frozenset({EOS})))
    counts, _ = run_step(s)
    assert list(counts) == ["a", "b", "c"]  # in arrival order; only a's sibling waits
    counts, _ = run_step(s)
    assert counts["a-sibling"] == 2


def test_a_deferred_request_runs_when_its_sibling_is_aborted_mid_prefill() -> None:
    s = make(caching=True, block_size=4)
    for rid in ("a", "b", "c"):
        s.add(req(rid, 10))
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["a"]
    assert s.abort("a") is not None  # while its prefill is in flight: its blocks are never cached
    s.update(out, [7])
    counts, _ = run_step(s)
    assert counts == {"b": 10}  # nobody computes b's first block any more; c now waits for b
    counts, _ = run_step(s)
    assert counts == {"b": 1, "c": 2} and s.requests["c"].num_cached_tokens == 8


def test_lookups_hash_each_block_once(monkeypatch) -> None:
    """Requests that match nothing pay one hash per full block in all, however many
    steps they wait, are preempted and recomputed (``Request.block_hashes``)."""
    import random

    from shared.block_hashes import BlockHasher

    calls = [0]  # blocks hashed
    real = BlockHasher.extend

    def counting(self: BlockHasher, token_ids: list[int], num_blocks: int) -> list[bytes]:
        before = len(self.hashes)
        out = real(self, token_ids, num_blocks)
        calls[0] += len(out) - before
        return out

    monkeypatch.setattr(BlockHasher, "extend", counting)
    rng = random.Random(3)
    s = Scheduler(BlockManager(24, 4, True), 4, 16)
    requests = [Request(f"r{i}", [rng.randrange(1, 49152) for _ in range(rng.randint(5, 40))],
                        SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=True), frozenset({EOS}))
                for i in range(20)]
    drive_to_completion(s, [(0, r) for r in requests])
    assert s.num_preemptions > 0
    num_full_blocks = sum(r.num_tokens // 4 for r in requests)
    assert 0 < calls[0] <= num_full_blocks


def test_prefill_tokens_per_decode_caps_chunks_next_to_decodes() -> None:
    """With decodes running, prefill chunks (an unfinished prefill and a new admission)
    share ``prefill_tokens_per_decode`` tokens per decoding sequence, at least
    ``MIN_PREFILL_TOKENS``; with no decode, or no cap, a prompt gets the whole budget."""
    from worker.engine.scheduler import MIN_PREFILL_TOKENS

    def run(cap: int, num_decoding: int) -> list[list[int]]:
        s = Scheduler(BlockManager(512, 16, False), 128, 2048, prefill_tokens_per_decode=cap)
        for i in range(num_decoding):
            s.add(req(f"d{i}", 8, max_tokens=50))
        s.update(first := s.schedule(), [1] * num_decoding)
        assert len(first.scheduled) == num_decoding
        s.add(req("long", 1500, max_tokens=5))
        s.add(req("next", 100, max_tokens=5))
        steps = []
        for _ in range(3):
            out = s.schedule()
            steps.append([item.num_tokens for item in out.scheduled][num_decoding:])
            s.update(out, [1 if item.samples else None for item in out.scheduled])
        return steps

    assert MIN_PREFILL_TOKENS == 512
    # 96 decodes at 8 tokens each: 768 prefill tokens a step, the long prompt's chunk
    # carried on until it ends, then the next prompt admitted beside its last chunk
    # (step 3: the long one decodes its first token beside the rest of the next one).
    assert run(8, 96) == [[768], [732, 36], [1, 64]]
    # The floor: 4 decodes x 8 tokens is below it.
    assert run(8, 4)[0] == [512]
    # No cap: the whole budget left after the decodes.
    assert run(0, 96)[0] == [1500, 100]
    alone = Scheduler(BlockManager(512, 16, False), 16, 2048, prefill_tokens_per_decode=8)
    alone.add(req("long", 1500, max_tokens=5))
    assert [item.num_tokens for item in alone.schedule().scheduled] == [1500]
