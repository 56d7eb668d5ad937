"""What a step costs, learned from the steps the engine runs: the model behind
``--itl-target-ms`` (``Scheduler._prefill_budget``).

A step's time, from one step's return to the next's while the engine stays busy (what a
decoding stream sees as its inter-token latency, ITL), is modelled as linear in four
features of the step (``StepFeatures``)::

    t = c0 + c1 * num_tokens + c2 * decode_context / 1e3 + c3 * prefill_attention / 1e6

- ``c0``: the fixed cost (weights read once, launches, the host's share);
- ``c1``: each scheduled token's matmuls (decode and prefill alike);
- ``c2``: reading the KV cache of each decoding sequence's context;
- ``c3``: prefill attention, each chunk's tokens times the context they attend to.

The coefficients are fitted online by recursive least squares with exponential
forgetting (Haykin, *Adaptive Filter Theory*, ch. 10; ``FORGETTING``), so the model
follows the card, the model and the load without a profile taken at start-up. A
memory-bound step at small batch costs about the same at any token count, which a
straight line overestimates in the middle: the budget it gives errs on the short side.

This is how the scheduler turns an inter-token-latency target into a token budget where
Sarathi-Serve (Agrawal et al., OSDI 2024) profiles the step time once, offline, and
picks one chunk size for the target, and vLLM's chunked prefill takes a fixed
``max_num_batched_tokens``: here the prefill share of each step is solved from the
target, the step's decodes and the context the prefill attends to (``prefill_budget``).

The module imports no torch: tests drive it with hand-made steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from worker.engine.step_types import ScheduledRequest

#: Per-step forgetting factor of the least-squares fit: the last ~1 / (1 - FORGETTING)
#: steps (200) weigh most, so the model follows a change of load within a few seconds.
FORGETTING = 0.995
#: Steps observed before the model sizes any budget (``ready``): until then the
#: scheduler keeps its token-count rule.
MIN_OBSERVATIONS = 16
#: Initial variance of the coefficients (the fit's prior: large, so the first steps decide).
_PRIOR = 1e6
#: Feature scales: tokens, thousands of context tokens, millions of token pairs.
_CONTEXT_SCALE = 1e3
_ATTENTION_SCALE = 1e6
_NUM_FEATURES = 4


@dataclass(frozen=True, slots=True)
class StepFeatures:
    """What a step carries, as the cost model reads it.

    ``num_tokens``: tokens computed (decodes, their drafts, prefill chunks);
    ``num_decodes``: sequences that decode (one new token each, drafts aside);
    ``decode_context``: the context tokens those sequences' attention reads (the KV
    cache bytes of a decode step grow with it);
    ``prefill_attention``: per prefill chunk, its tokens times the context each attends
    to on average (``chunk * (computed + chunk / 2)``), summed (token pairs).
    """

    num_tokens: int
    num_decodes: int = 0
    decode_context: int = 0
    prefill_attention: float = 0.0

    def vector(self) -> tuple[float, float, float, float]:
        """The fit's regressors: ``(1, num_tokens, decode_context / 1e3, prefill_attention / 1e6)``."""
        return (1.0, float(self.num_tokens), self.decode_context / _CONTEXT_SCALE,
                self.prefill_attention / _ATTENTION_SCALE)


def chunk_attention(num_computed: int, num_new: int) -> float:
    """Token pairs a prefill chunk of ``num_new`` tokens after ``num_computed`` computed
    ones attends over (causal: ``num_new * (num_computed + num_new / 2)``)."""
    return num_new * (num_computed + num_new / 2)


def step_features(scheduled: Sequence[ScheduledRequest]) -> StepFeatures:
    """The features of a step of ``scheduled`` items, read before the step is applied
    (``num_computed_tokens`` is each request's context before the step): an item of one
    token (drafts aside) decodes, any other is a prefill chunk."""
    num_tokens = num_decodes = decode_context = 0
    attention = 0.0
    for item in scheduled:
        num_tokens += item.num_tokens
        computed = item.request.num_computed_tokens
        if item.num_tokens - item.num_spec_tokens == 1:
            num_decodes += 1
            decode_context += computed
        else:
            attention += chunk_attention(computed, item.num_tokens)
    return StepFeatures(num_tokens, num_decodes, decode_context, attention)


class StepCostModel:
    """Step time in seconds as a linear function of ``StepFeatures`` (module docstring),
    fitted by recursive least squares with forgetting.

    Not thread-safe: the engine thread observes and the scheduler (same thread) asks.
    """

    __slots__ = ("_coef", "_cov", "forgetting", "num_observations")

    def __init__(self, forgetting: float = FORGETTING) -> None:
        """Raises: ValueError: ``forgetting`` not in (0, 1]."""
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        self.forgetting = forgetting
        self.num_observations = 0
        self._coef = [0.0] * _NUM_FEATURES
        self._cov = [[_PRIOR if i == j else 0.0 for j in range(_NUM_FEATURES)] for i in range(_NUM_FEATURES)]

    @property
    def coefficients(self) -> tuple[float, ...]:
        """``(c0 s, c1 s/token, c2 s per 1e3 context tokens, c3 s per 1e6 token pairs)``."""
        return tuple(self._coef)

    @property
    def ready(self) -> bool:
        """Whether the model sizes budgets: ``MIN_OBSERVATIONS`` steps seen and a positive
        cost per token (a fit on steps that never varied in size has none)."""
        return self.num_observations >= MIN_OBSERVATIONS and self._coef[1] > 0.0

    def observe(self, features: StepFeatures, seconds: float) -> None:
        """Fold one step of ``features`` that took ``seconds`` into the fit (one RLS update).

        Raises:
            ValueError: ``seconds`` negative or not finite.
        """
        if not 0.0 <= seconds < float("inf"):
            raise ValueError(f"a step's time must be a finite non-negative number of seconds, got {seconds}")
        x = features.vector()
        cov, lam = self._cov, self.forgetting
        px = [sum(cov[i][j] * x[j] for j in range(_NUM_FEATURES)) for i in range(_NUM_FEATURES)]
        denom = lam + sum(x[i] * px[i] for i in range(_NUM_FEATURES))
        gain = [p / denom for p in px]
        err = seconds - sum(c * v for c, v in zip(self._coef, x, strict=True))
        self._coef = [c + g * err for c, g in zip(self._coef, gain, strict=True)]
        # P <- (P - k x^T P) / lambda; P stays symmetric (x^T P is px^T).
        self._cov = [[(cov[i][j] - gain[i] * px[j]) / lam for j in range(_NUM_FEATURES)]
                     for i in range(_NUM_FEATURES)]
        self.num_observations += 1

    def predict(self, features: StepFeatures) -> float:
        """The modelled time of a step of ``features``, seconds."""
        return sum(c * v for c, v in zip(self._coef, features.vector(), strict=True))

    def prefill_budget(self, target_s: float, decodes: StepFeatures, prefill_context: int = 0) -> int:
        """Most prefill tokens that a step carrying ``decodes`` (its decode part only) can
        add while its modelled time stays within ``target_s``; 0 when the decodes alone
        reach it. ``prefill_context``: tokens already computed of the prompt the chunk
        continues (its attention reads them), 0 for a new prompt. The chunk's own causal
        attention (``P * P / 2`` pairs) makes the time quadratic in ``P``; it is solved
        exactly.

        Raises:
            RuntimeError: the model is not ``ready``.
        """
        if not self.ready:
            raise RuntimeError("the step cost model has not seen enough steps")
        _, c1, _, c3 = self._coef
        spare = target_s - self.predict(decodes)
        if spare <= 0.0:
            return 0
        # spare = P * (c1 + c3 * context / 1e6) + P^2 * c3 / (2e6); c3 < 0 (noise) counts as 0.
        a = max(c3, 0.0) / (2 * _ATTENTION_SCALE)
        b = c1 + max(c3, 0.0) * prefill_context / _ATTENTION_SCALE
        if a == 0.0:
            return int(spare / b)
        return int((-b + (b * b + 4 * a * spare) ** 0.5) / (2 * a))
