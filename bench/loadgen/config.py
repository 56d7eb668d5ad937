"""Benchmark settings: one frozen dataclass built once at the entry point (CLI or a calling script)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

COMPLETIONS_ENDPOINT = "/v1/completions"
CHAT_ENDPOINT = "/v1/chat/completions"

# Name vLLM's result JSON gives each endpoint kind (field ``endpoint_type``, formerly ``backend``).
ENDPOINT_TYPES = {COMPLETIONS_ENDPOINT: "openai", CHAT_ENDPOINT: "openai-chat"}

# SLO metrics accepted by ``--goodput``, as in ``vllm bench serve``.
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """Everything one benchmark run needs.

    Lengths are in tokens, times in the unit their name says. ``request_rate_per_s`` of ``inf``
    sends every request at once; ``max_concurrency`` of ``None`` means no client-side cap.
    ``goodput_slos_ms`` maps ``ttft``/``tpot``/``e2el`` to a limit in milliseconds.
    """

    base_url: str = "http://127.0.0.1:8000"
    # Further servers of the same deployment (e.g. more gateways): requests go round-robin over
    # (base_url, *extra_base_urls); the model list is read from base_url.
    extra_base_urls: tuple[str, ...] = ()
    endpoint: str = COMPLETIONS_ENDPOINT
    model: str | None = None  # None: first id from GET /v1/models
    tokenizer: str | None = None  # Hugging Face tokenizer folder or id; None: send token ids
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    # Without a tokenizer, ids are drawn from [low, high): low skips the small ids that many
    # vocabularies reserve for special tokens (BOS/EOS/PAD), high fits every common vocabulary.
    random_token_id_low: int = 1000
    random_token_id_high: int = 32000
    num_prompts: int = 1000
    max_concurrency: int | None = None
    request_rate_per_s: float = math.inf
    burstiness: float = 1.0
    ignore_eos: bool = False
    seed: int = 0
    api_key: str | None = None
    percentiles: tuple[float, ...] = (99.0,)
    goodput_slos_ms: dict[str, float] = field(default_factory=dict)
    label: str | None = None
    timeout_s: float = 6 * 60 * 60.0  # vLLM's default per-request timeout (6 h)
    show_progress: bool = True

    def __post_init__(self) -> None:
        assert self.endpoint in ENDPOINT_TYPES, f"endpoint must be one of {list(ENDPOINT_TYPES)}"
        assert self.random_input_len >= 1 and self.random_output_len >= 1
        assert 0.0 <= self.random_range_ratio < 1.0, "random_range_ratio must be in [0, 1)"
        assert 0 <= self.random_token_id_low < self.random_token_id_high
        assert self.num_prompts >= 1
        assert self.max_concurrency is None or self.max_concurrency >= 1
        assert self.request_rate_per_s > 0.0, "request rate must be positive (inf for all at once)"
        assert self.burstiness > 0.0
        assert self.timeout_s > 0.0
        assert all(0.0 < p <= 100.0 for p in self.percentiles), "percentiles must be in (0, 100]"
        unknown = set(self.goodput_slos_ms) - set(GOODPUT_METRICS)
        assert not unknown, f"unknown goodput metrics {sorted(unknown)}; use {GOODPUT_METRICS}"
        assert all(v >= 0.0 for v in self.goodput_slos_ms.values())

    @property
    def endpoint_type(self) -> str:
        """``openai`` or ``openai-chat``: vLLM's name for the endpoint kind."""
        return ENDPOINT_TYPES[self.endpoint]

    @property
    def url(self) -> str:
        """Full URL requests are POSTed to (on ``base_url``)."""
        return self.base_url.rstrip("/") + self.endpoint

    @property
    def urls(self) -> tuple[str, ...]:
        """Full URLs requests are POSTed to round-robin: ``base_url`` first, then ``extra_base_urls``."""
        return tuple(base.rstrip("/") + self.endpoint for base in (self.base_url, *self.extra_base_urls))
