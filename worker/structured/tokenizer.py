"""The llguidance tokenizer of a model, built once from its Hugging Face tokenizer."""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from pathlib import Path

import llguidance

from shared.tokenizer_loader import load_tokenizer


def build_tokenizer(path: Path, vocab_size: int, eos_token_ids: AbstractSet[int]) -> llguidance.LLTokenizer:
    """llguidance's view of the tokenizer in the Hugging Face folder ``path``.

    Its vocabulary is the model config's ``vocab_size`` (the logits' width), which may
    exceed the tokenizer's: the ids past the tokenizer's have no bytes and are never
    allowed by a grammar mask. EOS is every id in ``eos_token_ids`` (the model config's),
    or the tokenizer's own when that set is empty. About 1 s on SmolLM2 (49k tokens).

    Raises:
        ValueError: no fast tokenizer in ``path`` (llguidance needs one), or a tokenizer
            larger than ``vocab_size``.
    """
    import llguidance.hf
    hf = load_tokenizer(path)
    if len(hf) > vocab_size:
        raise ValueError(f"the tokenizer has {len(hf)} tokens, more than the model's vocab_size {vocab_size}")
    return llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=sorted(eos_token_ids) or None)
