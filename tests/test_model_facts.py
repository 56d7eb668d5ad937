"""Facts about the served model that the gateway and every worker backend must agree on,
each decided in one place (``shared.model_source``): ``max_model_len``, the EOS ids and
the served name; and the backend contract importable without torch."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from gateway.app import create_app
from gateway.tokenize import TokenizerWorker
from shared.model_source import ModelSource, eos_token_ids, max_model_len, served_model_name
from shared.sampling import SamplingParams
from shared.settings import EngineSettings, GatewaySettings, ModelSettings, RedisSettings
from worker.backends.factory import create_backend

pytestmark = pytest.mark.timeout(120)

#: A tiny Llama config with no ``max_position_embeddings`` and an EOS id of 0.
TINY_NO_LIMIT = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "rms_norm_eps": 1e-5,
                 "eos_token_id": 0}
#: Above the 4096 that the engine once assumed for a config without a limit.
LONG_MAX_MODEL_LEN = 8192


@pytest.fixture(scope="module")
def source() -> ModelSource:
    return ModelSource("tiny-no-limit", None, dict(TINY_NO_LIMIT), dummy=True)


@pytest.fixture(scope="module")
def settings() -> ModelSettings:
    return ModelSettings(max_model_len=LONG_MAX_MODEL_LEN, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def engine(source, settings):
    from worker.engine.engine import LLMEngine

    # 320 blocks of 16 tokens: room for the 5,000-token prompt below (a bigger one is a 400).
    return LLMEngine(source, settings, EngineSettings(num_kv_blocks=320, attention_backend="torch"))


def test_max_model_len_is_the_setting_capped_by_a_stated_limit() -> None:
    assert max_model_len({"max_position_embeddings": 2048}, 4096) == 2048
    assert max_model_len({"max_position_embeddings": 8192}, 4096) == 4096
    assert max_model_len({}, 10_000) == 10_000


def test_eos_token_ids_keep_an_id_of_0() -> None:
    assert eos_token_ids({"eos_token_id": 0}) == {0}
    assert eos_token_ids({"eos_token_id": [0, 7]}) == {0, 7}
    assert eos_token_ids({}) == frozenset()


def test_served_model_name_is_the_flag_else_the_model(source) -> None:
    assert served_model_name(ModelSettings(), source) == "tiny-no-limit"
    assert served_model_name(ModelSettings(served_model_name="chat"), source) == "chat"


async def test_gateway_and_backends_agree_on_max_model_len_without_a_config_limit(
        redis_server, smollm_tokenizer, source, settings, engine) -> None:
    """A config without ``max_position_embeddings`` and ``--max-model-len`` 8192: the
    gateway's ``/v1/models`` length is the engine's and the sim's, and a prompt the
    gateway would accept (over 4096 tokens) is one the engine takes."""
    sim = create_backend("sim", source, settings, EngineSettings())
    app = create_app(GatewaySettings(), RedisSettings(redis_url=redis_server.url, namespace=uuid.uuid4().hex[:8]),
                     settings, source, tokenizer=smollm_tokenizer)
    async with (app.router.lifespan_context(app),
                httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http):
        r = await http.get("/v1/models")
    assert r.status_code == 200, r.text
    gateway_len = r.json()["data"][0]["max_model_len"]
    assert gateway_len == engine.max_model_len == sim.max_model_len == LONG_MAX_MODEL_LEN
    engine.add_request("long", [1] * 5000, SamplingParams(max_tokens=8))
    assert engine.abort("long")


@pytest.mark.vllm
def test_vllm_engine_args_use_the_same_max_model_len(source, settings, tmp_path: Path) -> None:
    from worker.backends.vllm import engine_args

    with_folder = ModelSource(source.name, tmp_path, source.config, dummy=True)
    args = engine_args(with_folder, settings, EngineSettings(), on_cpu=True)
    assert args.max_model_len == LONG_MAX_MODEL_LEN


def test_engine_and_gateway_keep_an_eos_id_of_0(engine, smollm_tokenizer) -> None:
    assert engine.eos_token_ids == {0}
    tokenizer = TokenizerWorker(smollm_tokenizer, TINY_NO_LIMIT, num_encode_threads=1)
    try:
        assert tokenizer.eos_token_ids == {0, smollm_tokenizer.eos_token_id}
    finally:
        tokenizer.close()


def test_backend_contract_imports_without_the_torch_engine() -> None:
    """The Redis adapter and the sim backend import their types from
    ``worker/backends/base.py``, so a sim worker loads neither torch nor the engine."""
    code = ("import sys, worker.backends.sim, worker.service; "
            "print('worker.engine.engine' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr


def test_the_gguf_conversion_parses_once_and_restores_the_library() -> None:
    """``_gguf_parsed_once`` (the default model's conversion): inside the block one parse
    per file and one tensor-name map per (architecture, layers); after it, gguf's own
    functions again."""
    import gguf

    from shared.model_source import _gguf_parsed_once

    before = gguf.GGUFReader, gguf.get_tensor_name_map
    arch = next(iter(gguf.MODEL_ARCH_NAMES))
    with _gguf_parsed_once():
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
        assert gguf.GGUFReader is not before[0]
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == before
    assert gguf.get_tensor_name_map(arch, 2) is not gguf.get_tensor_name_map(arch, 2)
