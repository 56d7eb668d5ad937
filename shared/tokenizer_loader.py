"""Loading a model folder's Hugging Face tokenizer: one place for the gateway, the
offline ``LLM``, FP8 KV calibration and the grammar compiler.

``AutoTokenizer.from_pretrained`` imports transformers' auto-config machinery, and with
it torch: about 3.5 s on a 2-core host, paid by every gateway process at start even
though the gateway never runs a model. When the folder's ``tokenizer_config.json`` names
the generic fast tokenizer (``PreTrainedTokenizerFast``, ``TokenizersBackend`` in
transformers 5), which is what ``AutoTokenizer`` would build anyway, that class is
loaded directly (about 0.2 s, no torch). Any other class, or a folder without
``tokenizer.json``, goes through ``AutoTokenizer`` as before, so model-specific tokenizer
classes keep their behaviour.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: ``tokenizer_class`` values that name the generic fast tokenizer itself.
GENERIC_FAST_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})


def tokenizer_class_name(path: str | Path) -> str | None:
    """The ``tokenizer_class`` that ``path/tokenizer_config.json`` names, or None (no
    such file or field)."""
    config = Path(path) / "tokenizer_config.json"
    if not config.is_file():
        return None
    name = json.loads(config.read_text(encoding="utf-8")).get("tokenizer_class")
    return name if isinstance(name, str) else None


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer of the Hugging Face folder ``path`` (module docstring for which class);
    a ``path`` that is no folder goes to ``AutoTokenizer`` as a hub id.

    Raises:
        OSError: ``path`` holds no tokenizer files (from transformers).
        ValueError: transformers cannot build the named tokenizer class.
    """
    folder = Path(path)
    if (folder / "tokenizer.json").is_file() and tokenizer_class_name(folder) in GENERIC_FAST_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))
