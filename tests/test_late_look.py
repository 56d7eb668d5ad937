"""The late look before an async decode step is chained (worker/engine/engine.py,
``_finish_inflight``): the enqueue script announces a request of a class above the lowest
on the model's arrivals channel, the worker hands that to the engine while a step runs,
and the engine then withholds the next chained decode step, so the newcomer is pulled
and prefilled one step sooner. Real Redis; the engine part on CUDA (async scheduling
needs the graphs)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from shared.fair_queue import PRIORITY_CLASSES, FairQueue
from shared.keys import Keys
from shared.protocol import GenerateRequest
from shared.sampling import SamplingParams
from shared.settings import EngineSettings, ModelSettings
from tests.test_worker_paths import replies_until_finished, running
from worker.backends.sim import SimBackend
from worker.service import Worker

INTERACTIVE, DEFAULT, BATCH = 0, 1, 2


def _request(rid: str, channel: str, max_tokens: int = 2, priority: int = DEFAULT) -> GenerateRequest:
    return GenerateRequest(request_id=rid, model="m", prompt_token_ids=[5, 6], reply_channel=channel,
                           sampling=SamplingParams(max_tokens=max_tokens), deadline_unix_s=time.time() + 60,
                           priority=priority)


async def test_enqueue_announces_each_class_above_the_lowest(client) -> None:
    keys = Keys("tarrive")
    queue = FairQueue(client, keys, "m")
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(keys.arrivals_channel("m"))
    try:
        for name in ("batch", "interactive", "default", "batch"):
            await queue.enqueue(queue.stream(name, "t1"), [_request(f"r-{name}", "c", priority=PRIORITY_CLASSES.index(name))])
        got = []
        deadline_s = time.monotonic() + 1.0
        while time.monotonic() < deadline_s:
            item = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
            if item is not None:
                got.append(item["data"])
    finally:
        await pubsub.aclose()
    assert got == [b"0:t1", b"1:t1"]  # the batch class, the lowest, is never announced
    assert await client.xlen(queue.stream("batch", "t1")) == 2


class ArrivalSim(SimBackend):
    """The sim backend, recording ``note_arrival`` calls with the number of steps
    completed and whether a step was running at that moment."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.num_done = 0
        self.stepping = False
        self.notes: list[tuple[int | None, int, bool]] = []
        self.tenants: list[str] = []

    def note_arrival(self, priority: int | None, tenant: str = "") -> None:
        self.notes.append((priority, self.num_done, self.stepping))
        self.tenants.append(tenant)

    def step(self) -> list[Any]:
        self.stepping = True
        try:
            return super().step()
        finally:
            self.stepping = False
            self.num_done += 1


async def _noted(backend: ArrivalSim, priority: int) -> None:
    while not any(p == priority for p, _, _ in backend.notes):
        await asyncio.sleep(0.005)


async def test_the_worker_hands_an_arrival_to_the_engine_while_a_step_runs(client) -> None:
    keys = Keys("tarrive2")
    channel = keys.gateway_channel("g1")
    queue = FairQueue(client, keys, "m")
    backend = ArrivalSim(ModelSettings(max_model_len=1000), EngineSettings(max_num_seqs=4), step_time_ms=250.0)
    worker = Worker(client, keys, "m", "w1", backend)
    pubsub = client.pubsub()
    await pubsub.subscribe(channel)
    try:
        await queue.enqueue(queue.stream("batch", "t1"), [_request("long", channel, 6, BATCH)])
        async with running(worker):
            while backend.num_done < 2 or not backend.stepping:
                await asyncio.sleep(0.005)
            step = backend.num_done
            await queue.enqueue(queue.stream("interactive", "t2"), [_request("late", channel, 1, INTERACTIVE)])
            await asyncio.wait_for(_noted(backend, INTERACTIVE), 10)
            assert backend.num_done == step  # handed over before the step in progress ended
            await asyncio.wait_for(replies_until_finished(pubsub, {"long", "late"}), 30)
    finally:
        await pubsub.aclose()
    arrivals = [(done, stepping) for p, done, stepping in backend.notes if p is not None]
    assert arrivals == [(step, True)] and "t2" in backend.tenants
    # Forgotten before each pull: the one after that step too.
    assert (None, step + 1, False) in backend.notes


def _engine(async_scheduling: bool = True, graph_pieces: int = 1) -> Any:
    from worker.llm import LLM

    llm = LLM(model="SmolLM2-135M", load_format="dummy", dtype="float32", device="cuda", num_kv_blocks=256,
              max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512, async_scheduling=async_scheduling,
              graph_pieces=graph_pieces)
    return llm


def _run(llm: Any, arrive_at: dict[int, int | None]) -> tuple[dict[str, list[int]], list[int], int]:
    """Four batch-class requests; before step ``k`` in ``arrive_at``, ``note_arrival``
    of that class, and, for a class, an interactive request added after that step.
    Returns the tokens by request, the steps that scheduled a prefill of "i", and how
    many chains were withheld."""
    engine = llm.engine
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"b{i}", [7 + i, 11, 13, 17], greedy, priority=BATCH)
    outs: dict[str, list[int]] = {}
    prefill_steps = []
    step = 0
    while engine.has_unfinished_requests():
        arrival = arrive_at.get(step, -1)
        if arrival != -1:
            engine.note_arrival(arrival)
        for out in engine.step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if arrival is not None and arrival != -1:
            engine.note_arrival(None)  # the worker's pull
            engine.add_request("i", [3, 5, 7], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                               priority=arrival)
            prefill_steps.append(step + 1)
        step += 1
        assert step < 500
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
    return outs, prefill_steps, engine.num_chains_withheld


@pytest.mark.cuda
@pytest.mark.parametrize("pieces", [1, 2])
def test_a_higher_class_arrival_withholds_one_chained_step_and_changes_no_token(pieces: int) -> None:
    """Whole graphs: the late look withholds the chained step. In two pieces: the look
    between them drops the step in flight before the late look comes (the note is there
    from the start)."""
    llm = _engine(graph_pieces=pieces)
    plain, _, withheld = _run(llm, {})
    assert withheld == 0 and llm.engine.num_async_steps > 0 and llm.engine.num_steps_stopped == 0
    assert llm.engine.runner.decode_pieces == pieces
    for arrival in (INTERACTIVE, DEFAULT):
        llm = _engine(graph_pieces=pieces)
        engine = llm.engine
        outs, _, _ = _run(llm, {6: arrival})
        assert (engine.num_chains_withheld, engine.num_steps_stopped) == ((1, 0) if pieces == 1 else (0, 1)), arrival
        assert {k: v for k, v in outs.items() if k != "i"} == plain  # greedy, unchanged
        assert len(outs["i"]) == 4
        assert engine.runner.num_eager_steps == 0  # every step a replay
    # A request of the running class, or a note forgotten by the pull, withholds nothing.
    llm = _engine(graph_pieces=pieces)
    llm.engine.note_arrival(BATCH)
    llm.engine.note_arrival(INTERACTIVE)
    llm.engine.note_arrival(None)
    outs, _, withheld = _run(llm, {})
    assert withheld == 0 and llm.engine.num_steps_stopped == 0 and outs == plain


@pytest.mark.cuda
@pytest.mark.parametrize("pieces", [1, 2])
def test_the_chain_waits_for_the_step_in_flight_only_after_traffic_that_could_preempt(pieces: int) -> None:
    """Without any announcement a chained decode step is replayed before the engine waits
    for the step in flight (its launch overlaps that step); after an announcement of a
    class above the running one (within ``LOOK_WINDOW_S``, though the pull forgot it),
    every chain takes the late look instead. The tokens are the same either way."""
    llm = _engine(graph_pieces=pieces)
    plain, _, withheld = _run(llm, {})
    assert withheld == 0 and llm.engine.num_chains_unlooked > 0
    llm = _engine(graph_pieces=pieces)
    llm.engine.note_arrival(INTERACTIVE)
    llm.engine.note_arrival(None)
    outs, _, withheld = _run(llm, {})
    assert withheld == 0 and llm.engine.num_async_steps > 0 and llm.engine.num_chains_unlooked == 0
    assert outs == plain


@pytest.mark.cuda
@pytest.mark.parametrize("pieces", [1, 2])
def test_withheld_step_lets_the_newcomer_prefill_in_the_next_step(pieces: int) -> None:
    """Step by step: without the note the interactive request, added after step 6 (the
    worker's pull), waits one more step (the one chained during step 6) before its
    prefill; with it, its prefill is the very next step."""

    def first_token_step(arrival: int | None) -> int:
        llm = _engine(graph_pieces=pieces)
        engine = llm.engine
        greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        for i in range(4):
            engine.add_request(f"b{i}", [7 + i, 11, 13, 17], greedy, priority=BATCH)
        for _ in range(6):
            engine.step()
        assert engine._inflight is not None  # decodes are being chained
        if arrival is not None:
            engine.note_arrival(arrival)
        engine.step()
        engine.note_arrival(None)
        engine.add_request("i", [3, 5, 7], SamplingParams(max_tokens=2, temperature=0.0), priority=INTERACTIVE)
        for k in range(1, 10):
            if any(out.request_id == "i" for out in engine.step()):
                return k
        raise AssertionError("no token for the interactive request")

    assert first_token_step(INTERACTIVE) == 1
    assert first_token_step(None) == 2


@pytest.mark.cuda
def test_a_replayed_step_stops_between_its_pieces_and_changes_no_token() -> None:
    """The CUDA engine with steps in two pieces, driven as the CPU test below: the prefill
    (a mixed-step replay) and a chained decode (a decode replay) each stop after their
    first piece for an interactive note, nothing of them is applied, and every token is
    the whole-graph engine's; the stops happen in replays, not eager steps."""
    from worker.engine.engine import LLMEngine
    from worker.llm import LLM

    def run(pieces: int, notes: dict[int, tuple[int, str]]) -> tuple[LLMEngine, dict[str, list[int]], list[int]]:
        engine = _engine(graph_pieces=pieces).engine
        greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        for rid, prompt in {"b0": [9, 8, 7, 6, 5, 4, 3, 2, 1], "b1": [9, 8, 7, 6, 5, 4, 3, 2, 1],
                            "b2": [11, 12, 13]}.items():
            engine.add_request(rid, prompt, greedy, priority=BATCH)
        added = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        outs, empty = _drive(engine, notes, lambda step: engine.add_request(
            f"i{step}", [21, 22, 23, 24, 25], added, priority=INTERACTIVE))
        return engine, outs, empty

    _, plain, _ = run(1, {})
    engine, outs, empty = run(2, {0: (INTERACTIVE, ""), 8: (INTERACTIVE, "")})
    assert empty == [0, 8] and engine.num_steps_stopped == 2 and engine.runner.num_eager_steps == 0
    assert engine.runner.mixed is not None and engine.runner.mixed.num_replays > 0
    assert {k: v for k, v in outs.items() if k.startswith("b")} == plain
    alone = LLM(model="SmolLM2-135M", load_format="dummy", dtype="float32", device="cuda", num_kv_blocks=256,
                max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512, graph_pieces=1)
    ref = alone.generate([[21, 22, 23, 24, 25]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert outs["i0"] == outs["i8"] == list(ref[0].token_ids)


@pytest.mark.cuda
def test_decode_and_mixed_graphs_in_pieces_give_the_whole_graphs_logits() -> None:
    """The same steps replayed whole and in three pieces (the hidden state crossing in the
    carry buffers) give the same logits, bit for bit."""
    import torch

    logits = {}
    for pieces in (1, 3):
        llm = _engine(graph_pieces=pieces)
        runner = llm.engine.runner
        assert len(runner.graphs.pieces) == len(runner.mixed.pieces) == pieces
        engine = llm.engine
        for i in range(3):
            engine.add_request(f"r{i}", list(range(3 + i, 40 + 7 * i)),
                               SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        out = engine.scheduler.schedule()  # the prefill: a mixed step
        rows = runner.mixed.run(out.scheduled)
        mixed_logits = engine.runner.model.compute_logits(rows).clone()
        requests = [item.request for item in out.scheduled]
        positions = [r.num_prompt_tokens - 1 for r in requests]
        decode = runner._decode_logits(requests, positions, [r.token_ids[-1] for r in requests]).clone()
        torch.cuda.synchronize()
        logits[pieces] = (mixed_logits, decode)
    assert torch.equal(logits[1][0], logits[3][0]) and torch.equal(logits[1][1], logits[3][1])


# -- the same arrival stops an eager step between layers (the CPU engine) -------------------

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 512, "eos_token_id": 0}


def _tiny_engine(prefix_caching: bool = True) -> Any:
    from shared.model_source import ModelSource
    from worker.engine.engine import LLMEngine

    return LLMEngine(ModelSource("tiny", None, dict(TINY), dummy=True),
                     ModelSettings(device="cpu", dtype="float32", max_model_len=256),
                     EngineSettings(num_kv_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                                    attention_backend="torch", enable_prefix_caching=prefix_caching))


def _stopped_run(engine: Any, arrive_before: dict[int, int],
                 added_max_tokens: int = 3) -> tuple[dict[str, list[int]], list[int]]:
    """Three batch requests (two share a prompt, so prefix caching has blocks to find),
    driven by ``_drive`` with a note of class ``arrive_before[k]`` before step ``k``; the
    request pulled after a step that returned nothing is ``i<step>`` of that class
    (``added_max_tokens``)."""
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = {"b0": [9, 8, 7, 6, 5, 4, 3, 2, 1], "b1": [9, 8, 7, 6, 5, 4, 3, 2, 1], "b2": [11, 12, 13]}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, greedy, priority=BATCH)
    added = SamplingParams(max_tokens=added_max_tokens, temperature=0.0, ignore_eos=True)
    return _drive(engine, {k: (c, "") for k, c in arrive_before.items()},
                  lambda step: engine.add_request(f"i{step}", [21, 22, 23, 24, 25], added,
                                                  priority=arrive_before[step]))


def _drive(engine: Any, notes: dict[int, tuple[int, str]],
           pull: Callable[[int], None]) -> tuple[dict[str, list[int]], list[int]]:
    """Step ``engine`` to the end as its worker would: before step ``k`` in ``notes``,
    ``note_arrival(*notes[k])``; after every step the notes are forgotten (the worker does
    so before each pull), and after a step that returned nothing ``pull(step)`` adds the
    announced request. Returns the tokens by request and the steps that returned nothing;
    every block is free at the end."""
    outs: dict[str, list[int]] = {}
    empty = []
    for step in range(200):
        if not engine.has_unfinished_requests():
            break
        if step in notes:
            engine.note_arrival(*notes[step])
        got = engine.step()
        for out in got:
            assert out.first_index == len(outs.setdefault(out.request_id, []))
            outs[out.request_id] += out.new_token_ids
        engine.note_arrival(None)
        if not got:
            empty.append(step)
            pull(step)
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks and not engine.has_unfinished_requests()
    return outs, empty


def _alone(max_tokens: int) -> list[int]:
    engine = _tiny_engine()
    engine.add_request("i", [21, 22, 23, 24, 25], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                   ignore_eos=True))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    return tokens


def test_a_higher_class_arrival_stops_the_eager_step_and_changes_no_token() -> None:
    plain, empty = _stopped_run(_tiny_engine(), {})
    assert empty == [] and set(plain) == {"b0", "b1", "b2"}
    # Step 0 prefills, step 5 decodes the batch (after i0's last token): each is stopped
    # after its first layer and redone. Step 2 (i0 beside the batch) would stop for the
    # DEFAULT note, but only one step completed since the last stop.
    engine = _tiny_engine()
    outs, empty = _stopped_run(engine, {0: INTERACTIVE, 2: DEFAULT, 5: DEFAULT})
    assert empty == [0, 5] and engine.num_steps_stopped == 2
    assert {k: v for k, v in outs.items() if k.startswith("b")} == plain
    # Alone, the added requests get the same tokens (the stopped steps left no
    # half-written KV behind that a later step or a prefix-cache hit could read).
    assert outs["i0"] == outs["i5"] == _alone(3)


def test_a_step_with_a_class_between_stops_for_a_higher_one() -> None:
    """Step 6 carries i0 (INTERACTIVE) beside the batch: a DEFAULT note stops it, as the
    newcomer's prefill step pauses the batch (i0 decodes in it)."""
    plain, _ = _stopped_run(_tiny_engine(), {})
    engine = _tiny_engine()
    outs, empty = _stopped_run(engine, {0: INTERACTIVE, 6: DEFAULT}, added_max_tokens=8)
    assert empty == [0, 6]
    assert {k: v for k, v in outs.items() if k.startswith("b")} == plain
    assert outs["i0"] == outs["i6"] == _alone(8)


def test_an_arrival_of_the_steps_own_class_or_lower_stops_nothing() -> None:
    engine = _tiny_engine()
    plain, _ = _stopped_run(_tiny_engine(), {})
    outs, empty = _stopped_run(engine, {0: BATCH, 2: BATCH})
    assert empty == [] and engine.num_steps_stopped == 0 and outs == plain


def test_a_tenant_that_claims_a_slot_of_a_full_engine_stops_the_step() -> None:
    """Tenant A holds every slot of its class; B's announced request may claim one (fair
    share of slots), so the step in progress stops for it, as for a higher class. A's own
    next request, or B's while the engine has a free slot, stops nothing."""

    def run(notes: dict[int, tuple[int, str]], num_a: int) -> tuple[dict[str, list[int]], list[int]]:
        engine = _tiny_engine()
        greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        for k in range(num_a):
            engine.add_request(f"a{k}", [30 + k, 31, 32, 33], greedy, priority=DEFAULT, tenant="A")
        return _drive(engine, notes,
                      lambda step: engine.add_request("b", [21, 22, 23, 24, 25], greedy, priority=DEFAULT, tenant="B"))

    plain, _ = run({}, 4)
    outs, empty = run({5: (DEFAULT, "B")}, 4)
    assert empty == [5]
    assert {k: v for k, v in outs.items() if k != "b"} == plain  # a3, preempted for b, recomputes
    assert outs["b"] == _alone(10)
    assert run({5: (DEFAULT, "A")}, 4)[1] == []  # A is the tenant that runs the most
    assert run({5: (DEFAULT, "B")}, 3)[1] == []  # a free slot: B is pulled into it anyway


def test_the_sim_backend_stops_a_step_for_a_higher_class_as_the_engine_does() -> None:
    sim = SimBackend(ModelSettings(max_model_len=1000), EngineSettings(max_num_seqs=4), step_time_ms=200.0)
    sim.add_request("b", [5, 6, 7], SamplingParams(max_tokens=8), priority=BATCH)
    sim.note_arrival(BATCH, "t")  # its own class: nothing stops
    assert [o.new_token_ids for o in sim.step()] == [[5]]
    sim.note_arrival(DEFAULT, "t")
    start_s = time.perf_counter()
    assert sim.step() == [] and sim.num_steps_stopped == 1
    assert time.perf_counter() - start_s < 0.1  # well before the 200 ms step time
    sim.note_arrival(None)
    sim.add_request("d", [8, 9], SamplingParams(max_tokens=2), priority=DEFAULT)
    sim.note_arrival(INTERACTIVE, "t")  # too soon after the last stop: the step runs
    assert [(o.request_id, o.new_token_ids, o.first_index) for o in sim.step()] == [("b", [6], 1), ("d", [8], 0)]


def test_layer_pieces_run_in_turn_give_the_whole_pass() -> None:
    """``LayerPieces`` (what each piece's graph captures; CPU here, eager): the pieces run
    one after the other, the hidden state crossing in the carry buffers, give the whole
    forward pass's hidden states exactly, and split the layers evenly."""
    import torch

    from worker.engine.cuda_graphs import LayerPieces, piece_bounds

    assert piece_bounds(4, 3) == [(0, 2), (2, 3), (3, 4)] and piece_bounds(2, 5) == [(0, 1), (1, 2)]
    with pytest.raises(ValueError):
        piece_bounds(4, 0)
    engine = _tiny_engine()
    engine.add_request("r", list(range(3, 20)), SamplingParams(max_tokens=2))
    out = engine.scheduler.schedule()
    runner = engine.runner
    ids, pos, meta, _ = runner.prepare(out.scheduled)
    model = runner.model
    with torch.inference_mode():
        whole = model(ids, pos, runner.kv_caches, meta, runner.backend)
        pieces = LayerPieces(model, 3, 32, torch.device("cpu"))
        got = [pieces.forward(model, k, ids, pos, runner.kv_caches, meta, runner.backend) for k in range(3)]
    assert got[0] is None and got[1] is None
    assert torch.equal(got[2], whole)
    assert pieces.indices() == [0, 1, 2] and LayerPieces(model, 1, 32, torch.device("cpu")).indices() == [None]


def test_the_engine_looks_between_pieces_only_after_traffic_that_could_preempt() -> None:
    """``Arrivals.worth_looking``: a class above the step's lowest one announced within
    ``LOOK_WINDOW_S``, or a second tenant while the engine is full; a worker that serves
    one tenant in one class (the product benchmark) never waits between pieces."""
    from worker.engine.arrivals import LOOK_WINDOW_S, Arrivals

    now = [100.0]
    arrivals = Arrivals(clock=lambda: now[0])
    assert not arrivals.worth_looking(BATCH, engine_full=True)
    arrivals.note(DEFAULT, "a")
    arrivals.note(None)  # a pull forgets the notes, not when they came
    assert not arrivals.worth_looking(DEFAULT, engine_full=True)  # its own class, one tenant
    assert arrivals.worth_looking(BATCH, engine_full=False)
    arrivals.note(DEFAULT, "b")
    assert arrivals.worth_looking(DEFAULT, engine_full=True) and not arrivals.worth_looking(DEFAULT, False)
    now[0] += LOOK_WINDOW_S + 1
    assert not arrivals.worth_looking(BATCH, engine_full=True)
    for k in range(100):  # many tenants: the most recent are remembered
        arrivals.note(DEFAULT, f"t{k}")
    assert arrivals.worth_looking(DEFAULT, engine_full=True)
