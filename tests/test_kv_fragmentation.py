"""KV fragmentation (``BlockManager.fragmentation``, docs/operations.md "Metrics"): exact
counts on the block manager (partly filled last blocks, blocks shared by a prefix hit,
blocks reserved ahead of their tokens, a sliding window's released blocks), in the sim
backend's and the real engine's ``stats()`` (a tiny dummy model on the CPU), in the
worker's Prometheus gauges, and end to end in ``GET /stats`` while the real SmolLM2 worker
of the shared stack runs a request."""

from __future__ import annotations

import threading
import time
from fractions import Fraction

import httpx
import pytest

from shared.model_source import ModelSource
from shared.sampling import SamplingParams
from shared.settings import EngineSettings, ModelSettings
from worker.backends.sim import SimBackend
from worker.engine.block_manager import BlockManager, KVFragmentation
from worker.engine.request import Request

pytestmark = pytest.mark.timeout(120)

MAX_MODEL_LEN = 32


def req(rid: str, token_ids: list[int]) -> Request:
    return Request(rid, token_ids, SamplingParams(max_tokens=8))


def test_an_empty_cache_reads_zero() -> None:
    frag = BlockManager(num_blocks=4, block_size=4).fragmentation([], MAX_MODEL_LEN)
    assert frag == KVFragmentation(0, 0, 0, 0)
    assert (frag.internal_fragmentation, frag.contiguous_waste_ratio) == (0.0, 0.0)


def test_partial_tails_shared_prefix_and_reserved_blocks() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = req("a", list(range(10)))
    bm.allocate(a, 10)
    a.num_computed_tokens = 10  # 3 blocks: 4 + 4 + 2 tokens, 2 slots empty
    bm.cache_full_blocks(a)
    b = req("b", [*range(8), 99, 98, 97])  # a's first two blocks, then its own 3 tokens
    bm.allocate_prefix(b, bm.find_cached_prefix(b))
    bm.allocate(b, 3)
    b.num_computed_tokens = 11  # shares 2 full blocks, owns 1 with 3 tokens: 1 empty slot
    frag = bm.fragmentation([a, b], MAX_MODEL_LEN)
    # 4 distinct blocks (16 slots), 3 empty; 21 tokens in 2 contiguous reservations of 32.
    assert frag == KVFragmentation(num_allocated_slots=16, num_empty_slots=3, num_tokens=21,
                                   num_contiguous_slots=64)
    assert frag.internal_fragmentation == 3 / 16
    assert frag.contiguous_waste_ratio == pytest.approx(float(1 - Fraction(21, 64)), abs=1e-15)
    # c: 6 tokens with 11 slots reserved ahead (3 blocks, 6 empty); d: a 10-token prompt
    # whose first 8-token chunk is allocated and being computed (2 blocks, none empty: its
    # tokens exist, their KV is being written).
    c = req("c", list(range(100, 106)))
    bm.allocate(c, 11)
    d = req("d", list(range(200, 210)))
    bm.allocate(d, 8)
    frag = bm.fragmentation([a, b, c, d], MAX_MODEL_LEN)
    assert frag == KVFragmentation(num_allocated_slots=36, num_empty_slots=9, num_tokens=37,
                                   num_contiguous_slots=128)
    assert frag.internal_fragmentation == 0.25
    assert frag.contiguous_waste_ratio == pytest.approx(1 - 37 / 128, abs=1e-15)
    bm.free(d)
    bm.free(c)
    bm.free(b)
    bm.free(a)
    assert bm.fragmentation([], MAX_MODEL_LEN).num_allocated_slots == 0


def test_sliding_window_released_blocks_count_in_neither() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, sliding_window=8)
    r = req("r", list(range(21)))
    bm.allocate(r, 20)
    r.num_computed_tokens = 20
    assert bm.free_outside_window(r) == 3  # blocks 0-2 lie before every later query's window
    bm.allocate(r, 1)
    r.num_computed_tokens = 21
    # Blocks 3, 4 (full) and 5 (1 token): 12 slots, 3 empty; the contiguous copy holds all 21.
    frag = bm.fragmentation([r], MAX_MODEL_LEN)
    assert frag == KVFragmentation(num_allocated_slots=12, num_empty_slots=3, num_tokens=21,
                                   num_contiguous_slots=32)
    assert frag.internal_fragmentation == 0.25


def test_sim_backend_reports_its_up_front_reservation() -> None:
    """The sim reserves a request's prompt and ``max_tokens - 1`` at admission: after its
    prefill step a 20-token prompt with ``max_tokens`` 30 holds 4 blocks (64 slots) for its
    21 tokens (the prompt and its first output)."""
    sim = SimBackend(ModelSettings(max_model_len=128), EngineSettings(max_num_seqs=4, block_size=16),
                     step_time_ms=0.0)
    idle = sim.stats()
    assert (idle.kv_internal_fragmentation, idle.kv_contiguous_waste_ratio) == (0.0, 0.0)
    sim.add_request("r", list(range(1, 21)), SamplingParams(max_tokens=30, ignore_eos=True))
    (out,) = sim.step()
    assert out.new_token_ids and out.finish_reason is None
    stats = sim.stats()
    assert stats.kv_internal_fragmentation == (64 - 21) / 64
    assert stats.kv_contiguous_waste_ratio == 1 - 21 / 128
    while sim.has_unfinished_requests():
        sim.step()
    assert sim.stats().kv_internal_fragmentation == 0.0


#: A tiny Llama for the real engine (dummy weights): fast on the CPU.
TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256}


def test_engine_stats_report_the_running_requests_fragmentation() -> None:
    from worker.engine.engine import LLMEngine

    engine = LLMEngine(ModelSource("tiny", None, dict(TINY), dummy=True),
                       ModelSettings(max_model_len=256, device="cpu", dtype="float32"),
                       EngineSettings(num_kv_blocks=64, attention_backend="torch", block_size=16,
                                      enable_prefix_caching=False))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request("a", list(range(1, 21)), params)  # 20 tokens: 2 blocks after prefill
    engine.add_request("b", list(range(1, 41)), params)  # 40 tokens: 3 blocks
    engine.step()
    stats = engine.stats()
    assert stats.num_running == 2
    # Each has its prompt and first output: empty 32 - 21 and 48 - 41 of 80 slots;
    # contiguous: 62 of 2 * 256 slots hold a token.
    assert stats.kv_internal_fragmentation == pytest.approx((11 + 7) / 80, abs=1e-12)
    assert stats.kv_contiguous_waste_ratio == pytest.approx(1 - 62 / 512, abs=1e-12)
    while engine.has_unfinished_requests():
        engine.step()
    done = engine.stats()
    assert (done.kv_internal_fragmentation, done.kv_contiguous_waste_ratio) == (0.0, 0.0)


def test_worker_metrics_export_both_gauges() -> None:
    from worker.metrics import FAMILIES

    sim = SimBackend(ModelSettings(max_model_len=128), EngineSettings(max_num_seqs=4, block_size=16),
                     step_time_ms=0.0)
    sim.add_request("r", list(range(1, 21)), SamplingParams(max_tokens=30, ignore_eos=True))
    sim.step()
    stats = sim.stats()
    read = {f.name: f.read(None, stats) for f in FAMILIES if f.name.startswith("inferq:kv_")}  # type: ignore[arg-type]
    assert read["inferq:kv_internal_fragmentation"] == (64 - 21) / 64
    assert read["inferq:kv_contiguous_waste_ratio"] == 1 - 21 / 128
    assert {f.kind for f in FAMILIES if f.name in read} == {"gauge"}


# ---- end to end: the shared SmolLM2 stack's /stats while a request runs ------------------

@pytest.mark.timeout(300)
def test_stats_show_the_fragmentation_of_a_running_worker(smollm_stack, smollm_tokenizer) -> None:
    """A streamed completion runs on the real worker; while it runs, ``/stats`` (the
    worker's heartbeat) shows its fragmentation: less than one block of its slots empty,
    and a contiguous waste between what its longest and its prompt's lengths leave of
    ``max_model_len``. The client then leaves (the request is aborted), and both read 0
    once nothing runs."""
    prompt = "Describe the history of the city of Paris in great detail. " * 4
    max_tokens = 200
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    decoding, leave = threading.Event(), threading.Event()

    def generate() -> None:
        with httpx.stream("POST", f"{smollm_stack}/v1/completions", json=body, timeout=240) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i == 20:  # 10 events (each line, then a blank one)
                    decoding.set()
                if leave.is_set():
                    return

    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    seen = None
    try:
        assert decoding.wait(120), "no tokens streamed"
        deadline = time.monotonic() + 60
        while seen is None and time.monotonic() < deadline:
            (w,) = httpx.get(f"{smollm_stack}/stats", timeout=10).json()["workers"]
            if w["num_running"] == 1 and w["kv_internal_fragmentation"] > 0:
                seen = w
            time.sleep(0.2)
    finally:
        leave.set()
        thread.join(60)
    assert seen is not None, "no heartbeat showed the running request's fragmentation"
    num_prompt = len(smollm_tokenizer(prompt)["input_ids"])  # as the gateway encodes a completions prompt
    max_len, block = seen["max_model_len"], seen["block_size"]
    assert seen["backend"] == "inferq" and max_len > num_prompt + max_tokens
    # One request: less than one block of its slots holds no token, and it has at least
    # its prompt.
    assert 0 < seen["kv_internal_fragmentation"] < block / (num_prompt + block)
    assert 1 - (num_prompt + max_tokens) / max_len <= seen["kv_contiguous_waste_ratio"] <= 1 - num_prompt / max_len
    deadline = time.monotonic() + 60
    while True:
        (w,) = httpx.get(f"{smollm_stack}/stats", timeout=10).json()["workers"]
        if w["num_running"] == 0:
            break
        assert time.monotonic() < deadline, w
        time.sleep(0.2)
    assert (w["kv_internal_fragmentation"], w["kv_contiguous_waste_ratio"]) == (0.0, 0.0)
