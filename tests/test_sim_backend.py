"""The model-free sim backend: echo outputs, slots, stopping, aborts, stats, timing."""

from __future__ import annotations

import time

import pytest

from shared.model_source import ModelSource
from shared.sampling import SamplingParams
from shared.settings import EngineSettings, ModelSettings
from worker.backends.base import EngineBackend, RequestOutput, RequestRejected
from worker.backends.factory import create_backend
from worker.backends.sim import SimBackend


def make(max_num_seqs: int = 2, step_time_ms: float = 0.0, max_model_len: int = 64, **kw: object) -> SimBackend:
    return SimBackend(ModelSettings(max_model_len=max_model_len), EngineSettings(max_num_seqs=max_num_seqs),
                      step_time_ms=step_time_ms, **kw)  # type: ignore[arg-type]


def run_all(backend: SimBackend) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(1000):
        if not backend.has_unfinished_requests():
            break
        for out in backend.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def test_satisfies_the_backend_protocol() -> None:
    backend: EngineBackend = make()
    assert backend.name == "sim" and backend.max_num_seqs == 2 and backend.block_size == 16
    assert backend.max_model_len == 64


def test_echoes_prompt_repeated_with_contiguous_indices_and_length_finish() -> None:
    backend = make()
    backend.add_request("a", [5, 6, 7], SamplingParams(max_tokens=7))
    outs = run_all(backend)["a"]
    assert [o.new_token_ids[0] for o in outs] == [5, 6, 7, 5, 6, 7, 5]
    assert [o.first_index for o in outs] == list(range(7))
    assert [o.finish_reason for o in outs] == [None] * 6 + ["length"]
    assert all(o.num_prompt_tokens == 3 and o.num_cached_tokens == 0 for o in outs)
    assert not backend.has_unfinished_requests()


def test_at_most_max_num_seqs_run_and_admittable_counts_free_slots() -> None:
    backend = make(max_num_seqs=2)
    assert backend.num_admittable() == 2
    for rid in "abc":
        backend.add_request(rid, [1], SamplingParams(max_tokens=2))
    assert backend.num_admittable() == 0
    first = backend.step()
    assert sorted(o.request_id for o in first) == ["a", "b"]  # c waits for a slot
    s = backend.stats()
    # One block reserved by each running request (1 prompt token + 2 outputs - 1) of
    # 2 slots x 64 tokens / 16 per block.
    assert (s.num_running, s.num_waiting, s.kv_usage) == (2, 1, 2 / 8)
    assert s.num_free_blocks == 6 and s.num_blocks == 2 * 4
    backend.step()  # a and b finish
    assert backend.num_admittable() == 1
    third = backend.step()
    assert [o.request_id for o in third] == ["c"] and third[0].first_index == 0
    s = backend.stats()
    assert (s.num_running, s.kv_usage, s.num_free_blocks) == (1, 1 / 8, 7)


def test_stop_token_ids_eos_ignore_eos_and_min_tokens() -> None:
    backend = make(max_num_seqs=8, config={"eos_token_id": [9]})
    backend.add_request("stop", [1, 2, 3], SamplingParams(max_tokens=10, stop_token_ids=(2,)))
    backend.add_request("eos", [1, 9, 3], SamplingParams(max_tokens=10))
    backend.add_request("ignore", [1, 9, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    backend.add_request("min", [2, 3], SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=(2,)))
    outs = run_all(backend)
    tokens = {rid: [o.new_token_ids[0] for o in seq] for rid, seq in outs.items()}
    assert tokens["stop"] == [1, 2] and outs["stop"][-1].finish_reason == "stop"
    assert tokens["eos"] == [1, 9] and outs["eos"][-1].finish_reason == "stop"
    assert tokens["ignore"] == [1, 9, 3, 1] and outs["ignore"][-1].finish_reason == "length"
    assert tokens["min"] == [2, 3, 2] and outs["min"][-1].finish_reason == "stop"


def test_no_eos_without_eos_ids() -> None:
    backend = make()
    backend.add_request("a", [0, 1, 2], SamplingParams(max_tokens=5))
    assert len(run_all(backend)["a"]) == 5


def test_create_backend_keeps_an_eos_id_of_0() -> None:
    """The config's ``eos_token_id: 0`` stops the sim built as the worker builds it."""
    source = ModelSource("tiny", None, {"eos_token_id": 0, "max_position_embeddings": 32}, dummy=True)
    backend = create_backend("sim", source, ModelSettings(max_model_len=64), EngineSettings())
    assert backend.max_model_len == 32  # the config's limit caps the setting
    backend.add_request("a", [1, 0, 2], SamplingParams(max_tokens=5))
    outs = run_all(backend)["a"]  # type: ignore[arg-type]
    assert [o.new_token_ids[0] for o in outs] == [1, 0] and outs[-1].finish_reason == "stop"


def test_abort_running_and_waiting() -> None:
    backend = make(max_num_seqs=1)
    backend.add_request("a", [1], SamplingParams(max_tokens=5))
    backend.add_request("b", [2], SamplingParams(max_tokens=5))
    backend.step()
    assert backend.abort("a") and backend.abort("b") and not backend.abort("a") and not backend.abort("zz")
    assert not backend.has_unfinished_requests() and backend.step() == []
    assert backend.num_admittable() == 1


@pytest.mark.parametrize("prompt, params, match", [
    ([], SamplingParams(), "empty"),
    ([1] * 60, SamplingParams(max_tokens=10), "max_model_len"),
    ([1], SamplingParams(max_tokens=0), "max_tokens"),
])
def test_rejects_bad_requests(prompt: list[int], params: SamplingParams, match: str) -> None:
    with pytest.raises(RequestRejected, match=match):
        make().add_request("x", prompt, params)


def test_rejects_duplicate_id_but_accepts_it_after_finish() -> None:
    backend = make()
    backend.add_request("a", [1], SamplingParams(max_tokens=1))
    with pytest.raises(RequestRejected, match="already"):
        backend.add_request("a", [1], SamplingParams(max_tokens=1))
    run_all(backend)
    backend.add_request("a", [1], SamplingParams(max_tokens=1))


def test_step_takes_step_time() -> None:
    backend = make(step_time_ms=30.0)
    backend.add_request("a", [1], SamplingParams(max_tokens=3))
    start = time.perf_counter()
    run_all(backend)
    assert time.perf_counter() - start >= 3 * 0.030


def test_resume_continues_the_echo_and_counts_against_max_tokens() -> None:
    backend = make()
    backend.add_request("a", [5, 6, 7], SamplingParams(max_tokens=5), output_token_ids=[5, 6])
    outs = run_all(backend)["a"]
    assert [(o.first_index, o.new_token_ids[0]) for o in outs] == [(2, 7), (3, 5), (4, 6)]
    assert outs[-1].finish_reason == "length"
    with pytest.raises(RequestRejected, match="resumed"):
        backend.add_request("b", [5], SamplingParams(max_tokens=2), output_token_ids=[5, 5])


# -- the prefix-cache model: cached prefixes, prefill time, chunks, load, KV events -------

def test_a_cached_prefix_is_reported_costs_no_prefill_time_and_makes_kv_events() -> None:
    from shared.block_hashes import block_hashes

    backend = SimBackend(ModelSettings(max_model_len=4096), EngineSettings(max_num_seqs=4),
                         step_time_ms=1.0, prefill_ms_per_token=0.05)
    assert not backend.take_kv_events()  # starts the recording
    prompt = list(range(1000, 3000))  # 2,000 tokens: 125 blocks of 16
    timings = []
    for rid in ("first", "again"):
        backend.add_request(rid, prompt, SamplingParams(max_tokens=1))
        start = time.perf_counter()
        (out,) = run_all(backend)[rid]
        timings.append(time.perf_counter() - start)
        assert out.finish_reason == "length"
    assert out.num_cached_tokens == 1984  # 124 full blocks: the last token is computed
    assert timings[0] >= 0.1 > timings[1]  # 2,000 x 0.05 ms against 16 x 0.05 ms
    s = backend.stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (4000, 1984)
    assert backend.num_prefill_tokens == 2000 + 16
    events = backend.take_kv_events()
    assert set(events.stored) == set(block_hashes(prompt, 16)) and events.removed == ()


def test_long_prompts_prefill_in_chunks_and_count_as_waiting_prefill() -> None:
    backend = SimBackend(ModelSettings(max_model_len=4096),
                         EngineSettings(max_num_seqs=4, max_num_batched_tokens=1000), step_time_ms=0.0)
    backend.add_request("long", list(range(1, 2501)), SamplingParams(max_tokens=2))
    backend.add_request("short", [5, 6], SamplingParams(max_tokens=2))
    assert backend.stats().num_waiting_prefill_tokens == 2502
    assert backend.step() == []  # 1,000 of long's tokens
    assert backend.stats().num_waiting_prefill_tokens == 1502
    assert backend.step() == []
    outs = backend.step()  # long's last 500, then short's 2: the first token of each
    assert [o.request_id for o in outs] == ["long", "short"] and backend.stats().num_waiting_prefill_tokens == 0


def test_the_sim_caches_a_block_only_after_the_same_blocks_before_it() -> None:
    """Chained hashes in the sim's cache (it is the engine's block manager): two prompts
    whose second blocks match after different first blocks store four blocks, and the
    first prompt's second block is not served to the second."""
    backend = make(max_num_seqs=4, max_model_len=128)
    backend.take_kv_events()
    for rid, head in (("a", 1), ("b", 2)):
        backend.add_request(rid, [head] * 16 + [9] * 16 + [5], SamplingParams(max_tokens=1))
        assert run_all(backend)[rid][0].num_cached_tokens == 0
    assert len(set(backend.take_kv_events().stored)) == 4
