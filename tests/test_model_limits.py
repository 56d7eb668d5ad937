"""One source for the model's length (docs/operations.md, "The model's
length"): ``shared.model_source.max_model_len`` defaults to what the config allows, capped by
what the KV cache holds; each worker announces its value in its heartbeat; the gateway admits
by the ready workers' value, falls back to its own, caps it with an explicit
``--max-model-len``, and ``/ready`` answers 503 ``workers_disagree`` while they disagree.
"""

from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from gateway.readiness import disagreement
from gateway.state import effective_max_model_len
from shared import protocol
from shared.keys import HEARTBEAT_TTL_S
from shared.model_source import (
    DEFAULT_MAX_MODEL_LEN,
    DUMMY_CONFIGS,
    ModelSource,
    config_max_model_len,
    max_model_len,
)
from shared.protocol import WorkerStatus
from shared.settings import EngineSettings, GatewaySettings, ModelSettings
from tests import processes
from tests.gateway_harness import MODEL, Harness, running_harness
from worker.backends.factory import create_backend

pytestmark = pytest.mark.timeout(240)

#: A tiny Llama config whose positions allow 4,096 tokens.
TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "rms_norm_eps": 1e-5,
        "eos_token_id": 0, "max_position_embeddings": 4096}


# -- the rule -------------------------------------------------------------------------
def test_default_is_the_configs_limit_capped_by_the_cache() -> None:
    config = {"max_position_embeddings": 8192}
    assert max_model_len(config, 0) == 8192  # the gateway's fallback: no cache known
    assert max_model_len(config, 0, num_kv_tokens=2912) == 2912
    assert max_model_len(config, 0, num_kv_tokens=11_648) == 8192
    assert max_model_len({}, 0) == DEFAULT_MAX_MODEL_LEN == 2048  # vLLM's default for a config without one
    assert max_model_len({}, 0, num_kv_tokens=1000) == 1000


def test_an_explicit_length_is_kept_and_capped_by_the_config_only() -> None:
    assert max_model_len({"max_position_embeddings": 8192}, 4096, num_kv_tokens=100) == 4096
    assert max_model_len({"max_position_embeddings": 8192}, 32768) == 8192
    assert max_model_len({}, 10_000, num_kv_tokens=100) == 10_000
    with pytest.raises(ValueError):
        max_model_len({}, -1)
    with pytest.raises(ValueError):
        max_model_len({}, 0, num_kv_tokens=0)


def test_config_limit_follows_vllms_keys_and_linear_rope_scaling() -> None:
    assert config_max_model_len({}) is None
    assert config_max_model_len({"max_position_embeddings": 4096, "seq_length": 2048}) == 2048  # the smallest
    assert config_max_model_len({"n_positions": 1024}) == 1024
    linear = {"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    assert config_max_model_len(linear) == 8192
    assert config_max_model_len({**linear, "model_type": "gemma3_text"}) == 4096  # stated scaled already
    assert config_max_model_len({"max_position_embeddings": 4096,  # transformers 5's key
                                 "rope_parameters": {"rope_type": "linear", "factor": 4.0}}) == 16384
    assert config_max_model_len({"max_position_embeddings": 8192,
                                 "rope_parameters": {"rope_type": "default", "rope_theta": 1e5}}) == 8192
    assert config_max_model_len(DUMMY_CONFIGS["Llama-3.2-1B"]) == 131072  # llama3 scaling: stated scaled
    assert config_max_model_len(DUMMY_CONFIGS["Gemma-3-12B"]) == 131072
    assert config_max_model_len(DUMMY_CONFIGS["Qwen2.5-7B"]) == 32768


# -- the backends ---------------------------------------------------------------------
def test_engine_default_fits_its_cache() -> None:
    """The in-house engine, no ``--max-model-len``: the config's 4,096 capped by 8 blocks
    of 16 tokens; with one, the setting (a longer request then gets the cache's 400)."""
    from worker.engine.engine import LLMEngine

    source = ModelSource("tiny", None, dict(TINY), dummy=True)
    cache = EngineSettings(num_kv_blocks=8, block_size=16, attention_backend="torch")
    settings = ModelSettings(device="cpu", dtype="float32")
    assert LLMEngine(source, settings, cache).max_model_len == 8 * 16
    explicit = ModelSettings(device="cpu", dtype="float32", max_model_len=256)
    assert LLMEngine(source, explicit, cache).max_model_len == 256
    roomy = EngineSettings(num_kv_blocks=1024, block_size=16, attention_backend="torch")
    assert LLMEngine(source, settings, roomy).max_model_len == 4096


def test_sim_default_fits_its_cache() -> None:
    source = ModelSource("tiny", None, dict(TINY), dummy=True)
    assert create_backend("sim", source, ModelSettings(), EngineSettings()).max_model_len == 4096
    assert create_backend("sim", source, ModelSettings(), EngineSettings(num_kv_blocks=8)).max_model_len == 128
    assert create_backend("sim", source, ModelSettings(max_model_len=512),
                          EngineSettings(num_kv_blocks=8)).max_model_len == 512


def test_vllm_default_is_vllms_auto_fit(monkeypatch, tmp_path: Path) -> None:
    """No ``--max-model-len``: vLLM's ``-1`` (its auto-fit); a given one passes through.
    (``vllm`` is stubbed: importing it takes most of a minute on 2 cores.)"""
    import worker.backends.vllm as vllm_backend

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(EngineArgs=types.SimpleNamespace))
    monkeypatch.setattr(vllm_backend, "structured_outputs_config", lambda: None)
    folder = ModelSource("tiny", tmp_path, dict(TINY), dummy=True)
    assert vllm_backend.engine_args(folder, ModelSettings(), EngineSettings(), on_cpu=True).max_model_len == -1
    assert vllm_backend.engine_args(folder, ModelSettings(max_model_len=1000), EngineSettings(),
                                    on_cpu=True).max_model_len == 1000


# -- the gateway ----------------------------------------------------------------------
def status(worker_id: str, max_model_len: int, block_size: int = 16) -> WorkerStatus:
    """A ready worker's heartbeat announcing ``max_model_len``. No process stands behind it:
    its queue looks full, so placement sends requests to the harness's worker ``w1``."""
    return WorkerStatus(worker_id=worker_id, model=MODEL, backend="sim", num_running=0, num_waiting=0, kv_usage=0.0,
                        num_free_blocks=100, block_size=block_size, max_num_seqs=8, updated_unix_s=time.time(),
                        started_unix_s=time.time(), pid=0, max_model_len=max_model_len,
                        num_waiting_prefill_tokens=10**9, max_num_batched_tokens=16)


def test_effective_length_is_the_workers_capped_by_an_explicit_flag() -> None:
    assert effective_max_model_len([], 8192, explicit=False) == 8192
    assert effective_max_model_len([status("a", 0)], 8192, explicit=False) == 8192  # an older build: no value
    assert effective_max_model_len([status("a", 32768), status("b", 32768)], 8192, explicit=False) == 32768
    assert effective_max_model_len([status("a", 32768), status("b", 1024)], 8192, explicit=False) == 1024
    assert effective_max_model_len([status("a", 32768)], 4096, explicit=True) == 4096
    assert effective_max_model_len([status("a", 1024)], 4096, explicit=True) == 1024


def test_disagreement_names_the_field_and_each_worker() -> None:
    assert disagreement([status("a", 2048), status("b", 2048), status("c", 0)]) == ""
    assert disagreement([status("a", 2048), status("b", 1024)]) == "max_model_len: a 2048, b 1024"
    assert disagreement([status("a", 2048), status("b", 2048, block_size=32)]) == "block_size: a 16, b 32"


def gateway(server, model: ModelSettings, source, tokenizer):
    """The harness's gateway with ``model`` settings and its fake worker ``w1`` (which
    announces no ``max_model_len``: a build before the field)."""
    return running_harness(GatewaySettings(request_timeout_s=10.0), model, server, source, tokenizer)


async def announce(h: Harness, *statuses: WorkerStatus) -> None:
    """Write heartbeats for ``statuses`` and make the gateway's worker view read them now
    (it would within a second)."""
    client = aioredis.from_url(h.redis.url)
    try:
        for s in statuses:
            await client.set(h.keys.worker_key(s.worker_id), protocol.encode(s), ex=HEARTBEAT_TTL_S)
    finally:
        await client.aclose()
    await h.app.state.inferq.enqueuer.placer.refresh()


async def card_len(h: Harness) -> int:
    r = await h.http.get("/v1/models")
    return int(r.json()["data"][0]["max_model_len"])


async def complete(h: Harness, num_prompt_tokens: int, max_tokens: int) -> httpx.Response:
    return await h.http.post("/v1/completions", json={"model": MODEL, "prompt": [28] * num_prompt_tokens,
                                                      "max_tokens": max_tokens})


async def test_gateway_admits_by_the_ready_workers_length(redis_server, source, tokenizer) -> None:
    """No ``--max-model-len`` on the gateway: its own 8,192 (the config's) until a ready
    worker announces one; then the workers' value, in ``/v1/models`` and in admission;
    ``/ready`` 503 ``workers_disagree`` (naming them) while two disagree, admitting by
    the smaller."""
    async with gateway(redis_server, ModelSettings(), source, tokenizer) as h:
        assert await card_len(h) == 8192
        await announce(h, status("w2", 1024))
        assert await card_len(h) == 1024
        r = await complete(h, 1000, 100)
        assert r.status_code == 400 and "1024" in r.json()["error"]["message"], r.text
        assert (await complete(h, 1000, 24)).status_code == 200
        assert (await h.http.get("/ready")).status_code == 200  # w1 announces 0: no disagreement
        await announce(h, status("w3", 2048, block_size=32))
        r = await h.http.get("/ready")
        assert r.status_code == 503 and r.json()["status"] == "workers_disagree", r.text
        assert r.json()["detail"] == "block_size: w1 16, w2 16, w3 32; max_model_len: w2 1024, w3 2048"
        assert await card_len(h) == 1024
        await announce(h, status("w3", 1024))
        r = await h.http.get("/ready")
        assert r.status_code == 200 and "detail" not in r.json(), r.text


async def test_an_explicit_gateway_flag_caps_the_workers_length(redis_server, source, tokenizer) -> None:
    async with gateway(redis_server, ModelSettings(max_model_len=512), source, tokenizer) as h:
        assert await card_len(h) == 512
        await announce(h, status("w2", 4096))
        assert await card_len(h) == 512
        assert (await complete(h, 500, 24)).status_code == 400
        await announce(h, status("w2", 256))
        assert await card_len(h) == 256


# -- end to end: the goal -------------------------------------------------------
@pytest.mark.slow
def test_gateway_without_flag_takes_the_workers_32768(tmp_path: Path, smollm_source, redis_server) -> None:
    """A gateway started with no ``--max-model-len`` (its folder's config allows 8,192) in
    front of two sim workers started with ``--max-model-len 32768`` (their folder's config
    allows 131,072: Llama 3.2's) accepts a 30,000-token prompt once they are ready, and
    refuses it (400) before."""
    folder = tmp_path / "long-context"
    folder.mkdir()
    config = json.loads((smollm_source.path / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 131072}))
    port = processes.free_port()
    url = f"http://127.0.0.1:{port}"
    gateway_proc = processes.start("gateway", redis_server.url, "--port", str(port), log_path=tmp_path / "gateway.log")
    workers = []
    try:
        processes.wait_for_gateway(url, gateway_proc)
        body = {"model": MODEL, "prompt": [28] * 30_000, "max_tokens": 4}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 400 and "8192" in r.json()["error"]["message"], r.text
        for i in range(2):
            workers.append(processes.start(
                "worker", redis_server.url, "--backend", "sim", "--model", str(folder), "--served-model-name", MODEL,
                "--max-model-len", "32768", "--worker-id", f"long-{i}", log_path=tmp_path / f"worker{i}.log"))
        processes.wait_for_workers(redis_server.url, 2, workers)
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["max_model_len"] != 32768:
            assert time.monotonic() < deadline, "the gateway never took the workers' max_model_len"
            time.sleep(0.2)
        assert httpx.get(f"{url}/ready", timeout=5).json() == {"status": "ok", "model": MODEL, "workers_ready": 2}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 30_000, r.text
    finally:
        for w in workers:
            processes.stop(w)
        processes.stop(gateway_proc)
