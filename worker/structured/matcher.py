"""One request's position in its grammar: an llguidance ``LLMatcher`` that consumes each
token the request keeps and says when the grammar has ended.

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
    ``finish_reason`` ``stop``.
    """

    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False (and the matcher in its error state, for good)
        when the grammar does not allow it, which the mask rules out for sampled tokens."""
        if self.matcher.consume_token(token_id):
            return True
        log.error("grammar rejected token %d: %s", token_id, self.matcher.get_error())
        return False

    def replay(self, token_ids: Sequence[int]) -> bool:
        """Advance past tokens generated before (a failover continuation); False when the
        grammar rejects one of them."""
        return self.matcher.consume_tokens(list(token_ids)) if token_ids else True

    @property
    def is_finished(self) -> bool:
        """True when no token but EOS may follow (or the matcher is in its error state)."""
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str:
        """llguidance's message for the error state; empty when there is none."""
        return str(self.matcher.get_error())
