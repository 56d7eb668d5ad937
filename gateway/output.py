"""Turns one request's output token ids into released text: incremental
detokenization, hidden stop tokens, stop strings, and the count of tokens consumed.
Pure and synchronous: the relay runs it on the event loop, for every request of a
token batch in one pass (a few µs per token; docs/architecture.md, "The relay")."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.detokenizer import make_detokenizer
from gateway.stop import StopChecker
from shared.protocol import TokenLogprobs


@dataclass(slots=True)
class Step:
    """Text released after one token message.

    ``finish_reason`` is set when the output is over ("stop" or "length");
    ``stop_string`` is set when a stop string ended it (the worker does not know yet
    and must be told to abort). ``token_ids`` and ``logprobs`` are the tokens consumed
    and their logprobs, when the request asked for logprobs (else both empty).
    """

    text: str
    finish_reason: str | None = None
    stop_string: str | None = None
    token_ids: Sequence[int] = ()
    logprobs: Sequence[TokenLogprobs] = ()


class OutputProcessor:
    """Per-request output state. ``num_output_tokens`` counts the token ids consumed,
    up to and including the one that completed a stop string (OpenAI
    ``completion_tokens``).

    ``hidden_token_ids`` (EOS ids and the request's ``stop_token_ids``) are left out of
    the text when they are the token that ended the output.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stops: Sequence[str] = (),
                 hidden_token_ids: Iterable[int] = ()) -> None:
        self._detok = make_detokenizer(tokenizer, prompt_ids)
        self._stop = StopChecker(stops)
        self._hidden = frozenset(hidden_token_ids)
        self.num_output_tokens = 0
        self.finished = False
        self._num_consumed = 0  # of the last ``process`` call's tokens (fewer when a stop string ended it)

    def process(self, token_ids: Sequence[int], finish_reason: str | None,
                logprobs: Sequence[TokenLogprobs] | None = None) -> Step:
        """Consume new, in-order ``token_ids``; ``finish_reason`` is the worker's (None
        while it runs); ``logprobs``, one per token, when the request asked for them.
        Returns the text to release and whether the output is over."""
        step = self._process(token_ids, finish_reason)
        if logprobs:  # the tokens consumed, up to the one that completed a stop string
            num = self._num_consumed
            step.token_ids, step.logprobs = token_ids[:num], logprobs[:num]
        return step

    def _process(self, token_ids: Sequence[int], finish_reason: str | None) -> Step:
        assert not self.finished, "output already finished"
        self._num_consumed = len(token_ids)
        if finish_reason is None and len(token_ids) == 1 and not self._stop.stops:
            self.num_output_tokens += 1  # the common case: one token a step, released at once
            return Step(self._detok.add(token_ids[0]))
        parts: list[str] = []
        last = len(token_ids) - 1
        for i, token_id in enumerate(token_ids):
            self.num_output_tokens += 1
            hide = i == last and finish_reason == "stop" and token_id in self._hidden
            text = "" if hide else self._detok.add(token_id)
            if not self._stop.stops:  # the common case: every character is released at once
                parts.append(text)
                continue
            result = self._stop.add(text)
            parts.append(result.text)
            if result.stopped:
                self.finished = True
                self._num_consumed = i + 1
                return Step("".join(parts), "stop", result.stop)
        if finish_reason is None:
            return Step("".join(parts))
        result = self._stop.add(self._detok.flush())
        parts.append(result.text)
        self.finished = True
        if result.stopped:
            return Step("".join(parts), "stop", result.stop)
        parts.append(self._stop.flush())
        return Step("".join(parts), finish_reason)
