"""Compiled grammars, one per distinct ``StructuredOutput``, and new matchers from them.

Compiling (``LLMatcher(tokenizer, grammar)``) takes about a millisecond for a typical
JSON schema on SmolLM2's vocabulary and much longer for large grammars; a deep copy of a
compiled matcher in its start state takes microseconds (bench/structured_bench.py). So
the cache keeps one start-state matcher per spec, least recently used out first, and
every request gets a deep copy. The grammar is built by ``shared.grammars
.compile_matcher``, under the limits and with the probe the gateway checked it with
(shared/grammar_check.py), so a spec the gateway let through compiles here too. A JSON
output's matcher also gets a deep copy of the number-cap grammar
(``shared.grammars.number_cap_grammar``), compiled once.

Deep copies share their grammar's lexer: once one of them hits a lexer or parser limit
(a grammar that passed the probe can still reach one on a path it did not force), every
later copy would start in that error, which allows only EOS: an empty answer. So a
matcher that fails drops its grammar from the cache (``GrammarMatcher``'s ``on_error``)
and the next request compiles it afresh.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import llguidance

from shared.grammars import (
    MAX_NUMBER_EXPONENT_DIGITS,
    MAX_NUMBER_FRACTION_DIGITS,
    MAX_NUMBER_INTEGER_DIGITS,
    caps_numbers,
    compile_matcher,
    number_cap_grammar,
)
from shared.sampling import InvalidParameter, StructuredOutput
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
    first structured request, once; ``None`` for a model without a tokenizer. The map is
    locked: requests are added on the worker's event loop while a step on the engine
    thread may report a failed matcher (``forget``).
    """

    def __init__(self, tokenizer: Callable[[], llguidance.LLTokenizer] | None,
                 max_num_grammars: int = MAX_NUM_CACHED_GRAMMARS) -> None:
        assert max_num_grammars >= 1
        self._build_tokenizer = tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._number_cap: llguidance.LLMatcher | None = None  # compiled on the first JSON output
        self._ends_in_digit = b""  # per token id: 1 where the cap must be masked after it
        self.max_num_grammars = max_num_grammars
        self.num_compiled = 0  # grammars compiled since start (misses)
        self.num_forgotten = 0  # grammars dropped because a matcher of theirs failed

    def __len__(self) -> int:
        return len(self._compiled)

    def matcher(self, structured: StructuredOutput, replay_token_ids: Sequence[int] = ()) -> GrammarMatcher:
        """A fresh matcher for ``structured``, advanced past ``replay_token_ids`` (the
        outputs a failover continuation already delivered), with the number cap for
        JSON outputs.

        Raises:
            InvalidGrammar: no tokenizer, a spec that does not compile, or replayed
                tokens the grammar rejects; the message says which.
        """
        with self._lock:
            compiled = self._compiled.get(structured)
            if compiled is not None:
                self._compiled.move_to_end(structured)
        if compiled is None:
            compiled = self._compile(structured)
        on_error = functools.partial(self.forget, structured, compiled)
        if caps_numbers(structured):
            matcher = GrammarMatcher(compiled.deep_copy(), self._number_cap_matcher(), self._ends_in_digit,
                                     on_error=on_error)
        else:
            matcher = GrammarMatcher(compiled.deep_copy(), on_error=on_error)
        if not matcher.replay(replay_token_ids):
            raise InvalidGrammar(f"the delivered output tokens do not match the {structured.kind}: {matcher.error}")
        return matcher

    def forget(self, structured: StructuredOutput, compiled: llguidance.LLMatcher) -> None:
        """Drop ``structured``'s grammar if it is still ``compiled``: a matcher copied from
        it failed, and the lexer they share may be spent (module docstring)."""
        with self._lock:
            if self._compiled.get(structured) is compiled:
                del self._compiled[structured]
                self.num_forgotten += 1

    def _compile(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        # The probe follows forced tokens only: the gateway walked its choices too
        # (shared/grammar_check.py), and this runs on the worker's event loop.
        try:
            compiled = compile_matcher(structured, self.tokenizer(), max_num_choices=0)
        except InvalidParameter as exc:
            raise InvalidGrammar(str(exc)) from exc
        with self._lock:
            self.num_compiled += 1
            self._compiled[structured] = compiled
            if len(self._compiled) > self.max_num_grammars:
                self._compiled.popitem(last=False)
        return compiled

    def _number_cap_matcher(self) -> llguidance.LLMatcher:
        if self._number_cap is None:
            tokenizer = self.tokenizer()
            self._number_cap = llguidance.LLMatcher(tokenizer, number_cap_grammar(), log_level=0)
            assert not self._number_cap.is_error(), self._number_cap.get_error()
            self._ends_in_digit = ends_in_digit(tokenizer)
        return self._number_cap.deep_copy()

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


def ends_in_digit(tokenizer: llguidance.LLTokenizer) -> bytes:
    """Per token id, 1 where the token's text ends in an ASCII digit: only after such a
    token can the number cap forbid a token the grammar allows, as long as no token holds
    more digits than a cap (``GrammarMasks.mask`` skips the cap's row elsewhere; its row
    costs a walk over most of the vocabulary). All ones for a vocabulary with such a
    token. About 0.1 s for 49k tokens, once."""
    texts = [tokenizer.decode_bytes([t]) for t in range(tokenizer.vocab_size)]
    longest = max((len(run) for text in texts for run in re.findall(rb"[0-9]+", text)), default=0)
    if longest > min(MAX_NUMBER_EXPONENT_DIGITS, MAX_NUMBER_FRACTION_DIGITS, MAX_NUMBER_INTEGER_DIGITS):
        return b"\x01" * tokenizer.vocab_size
    return bytes(1 if text[-1:].isdigit() else 0 for text in texts)
