"""One request's position in its grammar: an llguidance ``LLMatcher`` that consumes each
token the request keeps and says when the grammar has ended, and for JSON outputs a
second one, the number cap (shared/grammars.py), that the mask intersects with the first.

Imports no torch: the scheduler's ``Request.append_token`` drives it (the grammar advances
where the token is appended, as in vLLM's ``Scheduler.update_from_output``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import llguidance

log = logging.getLogger(__name__)


class GrammarMatcher:
    """Wraps one ``LLMatcher`` (a deep copy of a compiled grammar, ``GrammarCache``).

    The matcher allows EOS exactly where the grammar accepts, and stops (allows nothing
    but EOS) where the grammar can go no further; either ends the request with
    ``finish_reason`` ``stop``. ``number_cap`` (JSON outputs only; ``None`` otherwise) is
    dropped for good at the first token it rejects: the mask let that token through
    because the grammar needed it (``GrammarMasks.mask``), and the grammar alone rules
    from then on.
    """

    __slots__ = ("_ends_in_digit", "after_digit", "matcher", "number_cap")

    def __init__(self, matcher: llguidance.LLMatcher, number_cap: llguidance.LLMatcher | None = None,
                 ends_in_digit: bytes = b"") -> None:
        """``ends_in_digit``: per token id, 1 where its text ends in a digit
        (``cache.ends_in_digit``); with ``number_cap`` only."""
        self.matcher = matcher
        self.number_cap = number_cap
        self._ends_in_digit = ends_in_digit
        self.after_digit = False  # the last token ended in a digit: the cap's mask is needed

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False (and the matcher in its error state, for good)
        when the grammar does not allow it, which the mask rules out for sampled tokens."""
        if self.number_cap is not None:
            if not self.number_cap.consume_token(token_id):
                self.number_cap = None
            self.after_digit = token_id < len(self._ends_in_digit) and self._ends_in_digit[token_id] == 1
        if self.matcher.consume_token(token_id):
            return True
        log.error("grammar rejected token %d: %s", token_id, self.matcher.get_error())
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
        return bool(self.matcher.consume_tokens(list(token_ids)))

    @property
    def is_finished(self) -> bool:
        """True when no token but EOS may follow (or the matcher is in its error state)."""
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str:
        """llguidance's message for the error state; empty when there is none."""
        return str(self.matcher.get_error())
