"""Stop strings, applied to detokenized text by the gateway (the worker only knows
token ids).

While streaming, the last ``len(longest stop) - 1`` characters are held back: they could
be the start of a stop string whose end has not arrived yet, and text once sent cannot
be taken back. Invariant: no stop string lies wholly inside text already released, and
any stop string that starts in released text would have ended inside the held part, so
searching only the unreleased buffer finds every match.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class StopResult:
    """What ``StopChecker.add`` released: ``text`` is safe to send; ``stopped`` is True
    when a stop string matched (``text`` then ends right before it, the stop string
    excluded, and the output is over)."""

    text: str
    stopped: bool = False
    stop: str | None = None


class StopChecker:
    """Finds the earliest stop string in a growing text.

    Empty stop strings are ignored. With no stop strings every character is released at
    once. After a match the checker releases nothing more.
    """

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self.stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._buffer = ""
        self.stopped = False

    def add(self, text: str) -> StopResult:
        """Append ``text``; return what can be released now."""
        if self.stopped:
            return StopResult("", stopped=True)
        self._buffer += text
        if not self.stops:
            out, self._buffer = self._buffer, ""
            return StopResult(out)
        best: tuple[int, str] | None = None
        for stop in self.stops:
            idx = self._buffer.find(stop)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is not None:
            out = self._buffer[:best[0]]
            self._buffer = ""
            self.stopped = True
            return StopResult(out, stopped=True, stop=best[1])
        cut = len(self._buffer) - self._hold
        if cut <= 0:
            return StopResult("")
        out, self._buffer = self._buffer[:cut], self._buffer[cut:]
        return StopResult(out)

    def flush(self) -> str:
        """At the end of the output: release the held-back tail (no match is possible
        in it, or ``add`` would have found it)."""
        out, self._buffer = ("" if self.stopped else self._buffer), ""
        return out
