"""The shared tokenizer loader (shared/tokenizer_loader.py): the generic fast tokenizer
without transformers' auto machinery (no torch in a gateway), the same tokens and chat
template as ``AutoTokenizer``; any other named class through ``AutoTokenizer``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from shared.tokenizer_loader import load_tokenizer, tokenizer_class_name
from tests import processes

TEXTS = ["The capital of France is", "def f(x):\n    return x  # café ☕", " leading  spaces\tand tabs"]


def test_the_default_models_folder_loads_without_torch(smollm_source) -> None:
    code = ("import sys; from shared.tokenizer_loader import load_tokenizer; "
            f"t = load_tokenizer({str(smollm_source.path)!r}); "
            "print(type(t).__name__, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=processes.ROOT, capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    assert out == ["TokenizersBackend", "False"]


def test_same_tokens_and_chat_template_as_auto_tokenizer(smollm_source, smollm_tokenizer) -> None:
    assert tokenizer_class_name(smollm_source.path) == "TokenizersBackend"
    ours = load_tokenizer(smollm_source.path)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == smollm_tokenizer.encode(text)
        assert ours.decode(ids) == smollm_tokenizer.decode(ids)
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    assert (ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            == smollm_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    assert (ours.eos_token_id, ours.bos_token_id, len(ours)) == (smollm_tokenizer.eos_token_id,
                                                                 smollm_tokenizer.bos_token_id, len(smollm_tokenizer))


def test_another_named_class_goes_through_auto_tokenizer(smollm_source, tmp_path: Path) -> None:
    folder = tmp_path / "tok"
    shutil.copytree(smollm_source.path, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.gguf"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "GPT2Tokenizer"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(folder)
    assert type(tokenizer).__name__ == "GPT2Tokenizer"
    assert tokenizer.encode(TEXTS[0]) == load_tokenizer(smollm_source.path).encode(TEXTS[0])
