"""Wire protocol round trips, version checks, key names, settings precedence."""

from __future__ import annotations

import pytest

from shared import protocol
from shared.keys import Keys
from shared.protocol import AbortMessage, GenerateRequest, ProtocolError, TokenBatch, TokenOutput
from shared.sampling import InvalidParameter, SamplingParams
from shared.settings import EngineSettings, GatewaySettings, build, settings_table


def test_every_message_round_trips() -> None:
    req = GenerateRequest(request_id="r1", model="m", prompt_token_ids=[1, 2, 3],
                          sampling=SamplingParams(max_tokens=5, stop_token_ids=(7,), seed=3),
                          reply_channel="c", deadline_unix_s=1e9, attempt=2)
    tok = TokenBatch(worker_id="w", outputs=[
        TokenOutput(request_id="r1", attempt=2, first_index=4, token_ids=[9], finish_reason="length"),
        TokenOutput(request_id="r2", attempt=0, first_index=0, token_ids=[1, 2], num_prompt_tokens=3)])
    for message in (req, tok, AbortMessage(request_ids=["a", "b"], reason="x")):
        assert protocol.decode(protocol.encode(message)) == message


def test_unknown_version_and_garbage_are_rejected() -> None:
    tok = TokenBatch(worker_id="w", outputs=[], v=99)
    with pytest.raises(ProtocolError, match="version"):
        protocol.decode(protocol.encode(tok))
    with pytest.raises(ProtocolError):
        protocol.decode(b"\x00garbage")


def test_keys_share_a_namespace() -> None:
    k = Keys("ns")
    assert k.requests_stream("m") == "ns:{m}:requests"
    assert k.gateway_channel("g").startswith("ns:") and k.control_channel() == "ns:control"
    assert k.worker_key("w") == "ns:worker:w"


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0),
                                         ("top_k", -5), ("min_p", 1.5), ("repetition_penalty", 0.0),
                                         ("presence_penalty", 3.0)])
def test_invalid_sampling_names_the_parameter(field: str, value: object) -> None:
    with pytest.raises(InvalidParameter) as err:
        SamplingParams(**{field: value}).validate()
    assert err.value.param == field


def test_settings_precedence_flag_env_default() -> None:
    env = {"INFERQ_MAX_NUM_SEQS": "7", "INFERQ_ENABLE_PREFIX_CACHING": "false", "INFERQ_API_KEYS": "a, b"}
    s = build(EngineSettings, {"max_num_seqs": None, "block_size": 32}, env)
    assert s.max_num_seqs == 7 and s.block_size == 32 and s.enable_prefix_caching is False
    assert s.max_num_batched_tokens == EngineSettings().max_num_batched_tokens
    assert build(GatewaySettings, {}, env).api_keys == ("a", "b")
    with pytest.raises(ValueError, match="INFERQ_PORT"):
        build(GatewaySettings, {}, {"INFERQ_PORT": "eighty"})
    assert "`INFERQ_MAX_NUM_SEQS`" in settings_table()


def test_offline_defaults_sit_between_given_values_and_the_class_defaults() -> None:
    from shared.settings import OFFLINE_GPU_ENGINE_DEFAULTS
    from worker.llm import offline_engine_settings

    gpu = offline_engine_settings({}, "cuda")
    assert gpu.max_num_batched_tokens == 16384 and gpu.prefill_tokens_per_decode == 0
    assert offline_engine_settings({"max_num_batched_tokens": 4096}, "cuda").max_num_batched_tokens == 4096
    assert offline_engine_settings({}, "cpu") == EngineSettings()  # on a CPU a served worker's
    env = {"INFERQ_MAX_NUM_BATCHED_TOKENS": "8192"}
    s = build(EngineSettings, {"max_num_seqs": 9}, env, defaults=OFFLINE_GPU_ENGINE_DEFAULTS)
    assert (s.max_num_batched_tokens, s.prefill_tokens_per_decode, s.max_num_seqs) == (8192, 0, 9)
    assert build(EngineSettings, {}, {}, defaults=OFFLINE_GPU_ENGINE_DEFAULTS).max_num_batched_tokens == 16384


def test_cpu_threads_setting_env_and_default() -> None:
    import os

    from shared.settings import EngineSettings
    from worker.engine.engine import cpu_threads

    assert cpu_threads(EngineSettings(cpu_threads=3), {"OMP_NUM_THREADS": "5"}) == 3  # the setting wins
    assert cpu_threads(EngineSettings(), {"OMP_NUM_THREADS": "5"}) == 5
    assert cpu_threads(EngineSettings(), {"OMP_NUM_THREADS": "junk"}) == os.cpu_count()
    assert cpu_threads(EngineSettings(), {}) == os.cpu_count()


def test_docs_settings_tables_match_code() -> None:
    """README.md and docs/operations.md carry `inferq settings`' table verbatim."""
    from pathlib import Path

    from shared.settings import settings_table

    root = Path(__file__).resolve().parents[1]
    for doc in ("README.md", "docs/operations.md"):
        text = (root / doc).read_text()
        start = text.index("| variable | default | meaning |")
        assert text[start:text.index("\n\n", start)] == settings_table().strip(), f"{doc}: run `inferq settings`"
