"""The step cost model behind ``--itl-target-ms`` on hand-made steps, and the scheduler's
budget under a target: no model, no torch."""

from __future__ import annotations

import random

import pytest

from shared.sampling import SamplingParams
from worker.engine.block_manager import BlockManager
from worker.engine.request import Request
from worker.engine.scheduler import MIN_TARGET_PREFILL_TOKENS, Scheduler
from worker.engine.step_cost import (
    MIN_OBSERVATIONS,
    StepCostModel,
    StepFeatures,
    chunk_attention,
    step_features,
)
from worker.engine.step_types import ScheduledRequest

#: A made-up card: 4 ms fixed, 20 µs a token, 6 µs per thousand context tokens decoded,
#: 30 µs per million token pairs of prefill attention.
LAW = (4e-3, 20e-6, 6e-6, 30e-6)


def law_time(f: StepFeatures, law: tuple[float, ...] = LAW) -> float:
    return sum(c * v for c, v in zip(law, f.vector(), strict=True))


def random_step(rng: random.Random) -> StepFeatures:
    num_decodes = rng.randrange(0, 256)
    prefill = rng.choice((0, rng.randrange(16, 4096)))
    context = rng.randrange(0, 20_000)
    return StepFeatures(num_decodes + prefill, num_decodes, num_decodes * rng.randrange(100, 3000),
                        chunk_attention(context, prefill) if prefill else 0.0)


def trained(law: tuple[float, ...] = LAW, steps: int = 400, noise: float = 0.02, seed: int = 0) -> StepCostModel:
    rng = random.Random(seed)
    model = StepCostModel()
    for _ in range(steps):
        f = random_step(rng)
        model.observe(f, law_time(f, law) * (1 + rng.uniform(-noise, noise)))
    return model


def test_the_fit_finds_the_law_behind_noisy_steps() -> None:
    model = trained()
    assert model.ready
    # The attention terms move the time least, so 2% noise blurs them most.
    for got, want, rel in zip(model.coefficients, LAW, (0.1, 0.1, 0.2, 0.3), strict=True):
        assert got == pytest.approx(want, rel=rel)
    f = StepFeatures(1024, 64, 64 * 1500, chunk_attention(2000, 960))
    assert model.predict(f) == pytest.approx(law_time(f), rel=0.03)


def test_the_fit_follows_a_change_of_law() -> None:
    """Forgetting: after the card (or the model) changes, the newer steps decide."""
    model = trained()
    slower = tuple(2 * c for c in LAW)
    rng = random.Random(1)
    for _ in range(2000):
        f = random_step(rng)
        model.observe(f, law_time(f, slower))
    assert model.coefficients[1] == pytest.approx(slower[1], rel=0.05)


def test_not_ready_until_enough_varied_steps() -> None:
    model = StepCostModel()
    f = StepFeatures(64, 64, 64 * 100)
    for _ in range(MIN_OBSERVATIONS - 1):
        model.observe(f, 0.005)
    assert not model.ready
    with pytest.raises(RuntimeError):
        model.prefill_budget(0.03, f)
    with pytest.raises(ValueError):
        model.observe(f, -1.0)
    with pytest.raises(ValueError):
        StepCostModel(forgetting=0.0)


def test_the_budget_fills_the_target_and_no_more() -> None:
    """The prefill tokens a step can add stay within the target (to one token), fewer
    beside more decodes and beside a longer context to attend to; none when the decodes
    alone take it."""
    model = trained(noise=0.0)
    target = 0.030
    budgets = []
    for num_decodes, context in ((8, 0), (128, 0), (128, 16_000)):
        decodes = StepFeatures(num_decodes, num_decodes, num_decodes * 1000)
        p = model.prefill_budget(target, decodes, context)
        step = StepFeatures(num_decodes + p, num_decodes, num_decodes * 1000, chunk_attention(context, p))
        bigger = StepFeatures(num_decodes + p + 1, num_decodes, num_decodes * 1000, chunk_attention(context, p + 1))
        assert model.predict(step) <= target < model.predict(bigger)
        budgets.append(p)
    assert budgets[0] > budgets[1] > budgets[2] > 0
    crowd = StepFeatures(2000, 2000, 2000 * 4000)
    assert model.prefill_budget(target, crowd) == 0


def test_step_features_read_decodes_and_chunks() -> None:
    def request(n: int, computed: int) -> Request:
        r = Request(f"r{n}", list(range(1, n + 1)), SamplingParams(max_tokens=4), frozenset({0}))
        r.num_computed_tokens = computed
        return r

    items = [ScheduledRequest(request(100, 99), 1), ScheduledRequest(request(50, 49), 3, num_spec_tokens=2),
             ScheduledRequest(request(4000, 1000), 512)]
    assert step_features(items) == StepFeatures(516, 2, 99 + 49, chunk_attention(1000, 512))
    assert chunk_attention(1000, 512) == 512 * (1000 + 256)


# -- the scheduler under a target ------------------------------------------------------------
def req(rid: str, n: int, max_tokens: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), frozenset({0}))


def prefill_chunks(model: StepCostModel | None, num_decoding: int, target_s: float = 0.030,
                   per_decode: int = 8) -> list[int]:
    """The prefill tokens of the first step after ``num_decoding`` sequences started
    decoding and a 6,000-token prompt arrived."""
    s = Scheduler(BlockManager(4096, 16, False), 512, 8192, prefill_tokens_per_decode=per_decode,
                  itl_target_s=target_s if model is not None else 0.0, step_cost=model)
    for i in range(num_decoding):
        s.add(req(f"d{i}", 8, 50))
    s.update(first := s.schedule(), [1] * num_decoding)
    assert len(first.scheduled) == num_decoding
    s.add(req("long", 6000, 5))
    out = s.schedule()
    return [item.num_tokens for item in out.scheduled if item.request.request_id == "long"]


def test_a_target_sizes_the_prefill_beside_the_decodes() -> None:
    """Few decodes: a long chunk (what fits in the target); many: a short one; the
    decodes alone over the target: the floor; no decode: the whole step budget."""
    model = trained(noise=0.0)
    few, many = prefill_chunks(model, 8), prefill_chunks(model, 256)
    for n, [chunk] in ((8, few), (256, many)):
        decodes = StepFeatures(n, n, n * 8)  # each decode attends to its 8-token prompt
        assert chunk == model.prefill_budget(0.030, decodes)
    assert few[0] > many[0] > MIN_TARGET_PREFILL_TOKENS
    assert prefill_chunks(model, 256, target_s=0.004) == [MIN_TARGET_PREFILL_TOKENS]
    assert prefill_chunks(model, 0) == [6000]
    # The token-count rule decides until the model is ready: 256 x 8 = 2,048.
    assert prefill_chunks(StepCostModel(), 256) == [2048]
    with pytest.raises(ValueError):
        Scheduler(BlockManager(64, 16, False), 8, 256, itl_target_s=0.03)
