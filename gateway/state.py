"""Everything one running gateway app owns, created in the app's lifespan."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from gateway.admission import Enqueuer
from gateway.generation import Generation
from gateway.metrics import GatewayMetrics, observe_many
from gateway.placement import WorkerView
from gateway.rate_limits import RateLimiter
from gateway.relay import Relay
from gateway.tasks import BackgroundTasks
from gateway.tenants import Tenants
from gateway.tokenize import TokenizerWorker
from shared import protocol
from shared.fair_queue import FairQueue
from shared.keys import Keys
from shared.protocol import AbortMessage, WorkerStatus
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
    #: Tenant ids of API keys and the batch credential (gateway/tenants.py).
    tenants: Tenants
    created_unix_s: int
    #: The ready workers of the model, as placement sees them (``Placer.view``, refreshed
    #: every heartbeat interval): their heartbeats carry the ``max_model_len`` they run.
    workers: WorkerView
    #: The gateway's own longest prompt + output, tokens (``shared.model_source.max_model_len``
    #: of its ``--max-model-len`` and the model's config): ``max_model_len`` while no ready
    #: worker announces one, and a cap on theirs when ``--max-model-len`` was given.
    own_max_model_len: int
    #: The last ``max_model_len`` logged (a change is logged once).
    _logged_max_model_len: int = 0

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output this gateway admits, tokens: ``effective_max_model_len``
        of the ready workers, ``own_max_model_len`` and whether ``--max-model-len`` was given."""
        length = effective_max_model_len(self.workers.workers, self.own_max_model_len,
                                          self.model_settings.max_model_len > 0)
        if length != self._logged_max_model_len:
            self._logged_max_model_len = length
            log.info("max_model_len %d (own %d; ready workers: %s)", length, self.own_max_model_len,
                     ", ".join(f"{w.worker_id} {w.max_model_len}" for w in self.workers.workers) or "none")
        return length

    @max_model_len.setter
    def max_model_len(self, value: int) -> None:
        """Set ``own_max_model_len`` (what tests and tools that build a gateway by hand use)."""
        self.own_max_model_len = value

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


def effective_max_model_len(workers: Sequence[WorkerStatus], own: int, explicit: bool) -> int:
    """The gateway's ``max_model_len``, tokens (docs/operations.md, "Limits"): the ready
    ``workers``' announced value (the smallest, while they disagree: ``/ready`` then answers
    503 ``workers_disagree``), capped by ``own`` when ``explicit`` (``--max-model-len`` given
    to the gateway: a vLLM user's flag is the limit, and the gateway cannot lift the
    workers' own); ``own`` while no ready worker announces one (none is ready, or each
    is of a build before ``WorkerStatus.max_model_len``, which reads 0)."""
    announced = [w.max_model_len for w in workers if w.max_model_len > 0]
    if not announced:
        return own
    return min(min(announced), own) if explicit else min(announced)
