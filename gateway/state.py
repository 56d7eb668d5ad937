"""Everything one running gateway app owns, created in the app's lifespan."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from gateway.admission import Enqueuer
from gateway.generation import Generation
from gateway.metrics import GatewayMetrics, observe_many
from gateway.rate_limits import RateLimiter
from gateway.relay import Relay
from gateway.tasks import BackgroundTasks
from gateway.tokenize import TokenizerWorker
from shared import protocol
from shared.fair_queue import FairQueue
from shared.keys import Keys
from shared.protocol import AbortMessage
from shared.settings import GatewaySettings, ModelSettings

log = logging.getLogger(__name__)


@dataclass(slots=True)
class GatewayState:
    """The app's Redis client, relay (which holds the requests in flight), tokenizer
    threads, metrics and background tasks.

    ``gateway_id`` (random hex, made at startup) names this gateway's reply channel.
    """

    settings: GatewaySettings
    model_settings: ModelSettings
    served_model_name: str
    source_name: str
    keys: Keys
    gateway_id: str
    redis: aioredis.Redis
    relay: Relay
    tokenizer: TokenizerWorker
    metrics: GatewayMetrics
    tasks: BackgroundTasks
    #: The model's classes and tenants in Redis (``shared/fair_queue.py``).
    queue: FairQueue
    #: Admits and puts accepted requests on the stream (XADDs of lone requests
    #: group-committed; 429 past ``max_queue_len`` waiting).
    enqueuer: Enqueuer
    #: Requests and tokens per minute per tenant (gateway/rate_limits.py).
    rate_limiter: RateLimiter
    created_unix_s: int
    #: Longest prompt + output, tokens (``shared.model_source.max_model_len``, which
    #: every backend uses too).
    max_model_len: int

    @property
    def stream(self) -> str:
        """The model's base request stream (class ``default``, tenant ``anonymous``)."""
        return self.keys.requests_stream(self.served_model_name)

    def publish_abort(self, request_ids: list[str], reason: str) -> None:
        """Tell every worker to stop ``request_ids``, in one message (in a kept background
        task, so it is safe to call from ``finally`` of a cancelled request)."""
        for _ in request_ids:
            self.metrics.aborted(reason)
        payload = protocol.encode(AbortMessage(request_ids=request_ids, reason=reason))
        self.tasks.spawn(self.redis.publish(self.keys.control_channel(), payload), name=f"abort:{request_ids[0]}")

    def release(self, gen: Generation) -> None:
        """``Generation.on_close``: forget the request, abort it if the worker still runs
        it, and record its metrics."""
        self.relay.unregister(gen.request_id)
        reason = gen.abort_reason
        if reason is not None:
            self.publish_abort([gen.request_id], reason)
        m, name = self.metrics, self.served_model_name
        m.requests_in_flight.labels(name).dec()
        m.generation_tokens.labels(name).inc(gen.num_output_tokens)
        ttft_s = None if gen.first_token_s is None else gen.first_token_s - gen.arrival_s
        if ttft_s is not None:
            m.time_to_first_token.labels(name).observe(ttft_s)
        observe_many(m.inter_token_latency.labels(name), gen.token_gaps_s)
        if gen.finish_reason is not None:
            m.request_success.labels(name, gen.finish_reason).inc()
            m.observe_finished(ttft_s, time.monotonic() - gen.arrival_s, gen.num_output_tokens)
        elif gen.error is not None:
            m.request_errors.labels(name, str(gen.error.status)).inc()
