"""Compiled grammars, one per distinct ``StructuredOutput``, and new matchers from them.

Compiling (``LLMatcher(tokenizer, grammar)``) takes about a millisecond for a typical
JSON schema on SmolLM2's vocabulary and much longer for large grammars; a deep copy of a
compiled matcher in its start state takes microseconds (bench/structured_bench.py). So
the cache keeps one start-state matcher per spec, least recently used out first, and
every request gets a deep copy. The grammar text is ``shared.grammars.grammar_for``'s,
the one the gateway validated.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence

import llguidance

from shared.grammars import grammar_for
from shared.sampling import StructuredOutput
from worker.structured.matcher import GrammarMatcher

log = logging.getLogger(__name__)

#: Compiled grammars kept. A start-state matcher holds the grammar and the lexer states
#: built so far (kilobytes to a few MB); 256 distinct schemas cover a service's tools
#: and response formats, and a miss costs one compile.
MAX_NUM_CACHED_GRAMMARS = 256


class InvalidGrammar(ValueError):
    """A structured output the worker cannot compile (bad spec, unsupported feature)."""


class GrammarCache:
    """Start-state ``LLMatcher``s keyed by ``StructuredOutput``, LRU-bounded.

    ``tokenizer`` builds the model's llguidance tokenizer (``build_tokenizer``) on the
    first structured request, once; ``None`` for a model without a tokenizer.
    """

    def __init__(self, tokenizer: Callable[[], llguidance.LLTokenizer] | None,
                 max_num_grammars: int = MAX_NUM_CACHED_GRAMMARS) -> None:
        assert max_num_grammars >= 1
        self._build_tokenizer = tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()
        self.max_num_grammars = max_num_grammars
        self.num_compiled = 0  # grammars compiled since start (misses)

    def __len__(self) -> int:
        return len(self._compiled)

    def matcher(self, structured: StructuredOutput, replay_token_ids: Sequence[int] = ()) -> GrammarMatcher:
        """A fresh matcher for ``structured``, advanced past ``replay_token_ids`` (the
        outputs a failover continuation already delivered).

        Raises:
            InvalidGrammar: no tokenizer, a spec that does not compile, or replayed
                tokens the grammar rejects; the message says which.
        """
        compiled = self._compiled.get(structured)
        if compiled is None:
            compiled = self._compile(structured)
        self._compiled.move_to_end(structured)
        matcher = GrammarMatcher(compiled.deep_copy())
        if not matcher.replay(replay_token_ids):
            raise InvalidGrammar(f"the delivered output tokens do not match the {structured.kind}: {matcher.error}")
        return matcher

    def _compile(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        try:
            grammar = grammar_for(structured)
        except Exception as exc:  # llguidance's GBNF converter raises a bare Exception
            raise InvalidGrammar(f"invalid {structured.kind}: {exc}") from exc
        # log_level 0: errors are read with get_error() and logged here, not printed by Rust.
        compiled = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
        if compiled.is_error():
            raise InvalidGrammar(f"invalid {structured.kind}: {compiled.get_error()}")
        self.num_compiled += 1
        self._compiled[structured] = compiled
        if len(self._compiled) > self.max_num_grammars:
            self._compiled.popitem(last=False)
        return compiled

    def tokenizer(self) -> llguidance.LLTokenizer:
        """The model's llguidance tokenizer, built on first use.

        Raises:
            InvalidGrammar: the model has no tokenizer.
        """
        if self._tokenizer is None:
            if self._build_tokenizer is None:
                raise InvalidGrammar("structured outputs need the model's tokenizer; this model has none")
            self._tokenizer = self._build_tokenizer()
            log.info("llguidance tokenizer ready: %d tokens", self._tokenizer.vocab_size)
        return self._tokenizer
