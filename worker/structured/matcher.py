"""One request's position in its grammar: an llguidance ``LLMatcher`` that consumes each
token the request keeps and says when the grammar has ended, and for JSON outputs a
second one, the number cap (shared/grammars.py), that the mask intersects with the first.

Imports no torch: the scheduler's ``Request.append_token`` drives it (the grammar advances
where the token is appended, as in vLLM's ``Scheduler.update_from_output``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import llguidance

from shared.grammar_check import short_error

log = logging.getLogger(__name__)


class GrammarMatcher:
    """Wraps one ``LLMatcher`` (a deep copy of a compiled grammar, ``GrammarCache``).

    The matcher allows EOS exactly where the grammar accepts, and stops (allows nothing
    but EOS) where the grammar can go no further; either ends the request with
    ``finish_reason`` ``stop``. ``number_cap`` (JSON outputs only; ``None`` otherwise) is
    dropped for good at the first token it rejects: the mask let that token through
    because the grammar needed it (``GrammarMasks.mask``), and the grammar alone rules
    from then on.

    A matcher that enters llguidance's error state (a token it rejects, or a lexer or
    parser limit reached while computing a mask) fails the request: in that state
    llguidance allows and even accepts EOS, which would end the request as an empty or
    cut answer that ``stop``ped. ``on_error()`` runs once when that happens (the cache
    drops the grammar, whose lexer this matcher shared).
    """

    __slots__ = ("_ends_in_digit", "_on_error", "after_digit", "matcher", "number_cap")

    def __init__(self, matcher: llguidance.LLMatcher, number_cap: llguidance.LLMatcher | None = None,
                 ends_in_digit: bytes = b"", on_error: Callable[[], None] | None = None) -> None:
        """``ends_in_digit``: per token id, 1 where its text ends in a digit
        (``cache.ends_in_digit``); with ``number_cap`` only."""
        self.matcher = matcher
        self.number_cap = number_cap
        self._ends_in_digit = ends_in_digit
        self._on_error = on_error
        self.after_digit = False  # the last token ended in a digit: the cap's mask is needed

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False (and the matcher in its error state, for good)
        when the grammar does not allow it, which the mask rules out for sampled tokens,
        or when the matcher was already in its error state (its last mask hit a limit)."""
        if self.number_cap is not None:
            if not self.number_cap.consume_token(token_id):
                self.number_cap = None
            self.after_digit = token_id < len(self._ends_in_digit) and self._ends_in_digit[token_id] == 1
        if self.matcher.consume_token(token_id) and not self.matcher.is_error():
            return True
        log.warning("structured output failed at token %d: %s", token_id, short_error(self.matcher.get_error()))
        if self._on_error is not None:
            self._on_error()
            self._on_error = None
        return False

    def replay(self, token_ids: Sequence[int]) -> bool:
        """Advance past tokens generated before (a failover continuation); False when the
        grammar rejects one of them."""
        if not token_ids:
            return True
        if self.number_cap is not None:
            if not self.number_cap.consume_tokens(list(token_ids)):
                self.number_cap = None
            last = token_ids[-1]
            self.after_digit = last < len(self._ends_in_digit) and self._ends_in_digit[last] == 1
        if self.matcher.consume_tokens(list(token_ids)) and not self.matcher.is_error():
            return True
        if self._on_error is not None:
            self._on_error()
            self._on_error = None
        return False

    @property
    def is_finished(self) -> bool:
        """True when no token but EOS may follow (or the matcher is in its error state)."""
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str:
        """llguidance's message for the error state (``short_error``); empty when there is none."""
        return short_error(str(self.matcher.get_error()))
