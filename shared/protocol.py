"""The wire protocol: every message that crosses Redis, as typed msgspec structs
encoded as msgpack. Nothing else in inferq builds Redis payloads.

Messages carry ``v`` (the protocol version); a receiver drops a message whose version
it does not know, with a log line, rather than guessing. Messages on one channel form a
tagged union (the ``type`` tag), so one decoder reads them all.

Flow (see docs/protocol.md):
    gateway --XADD GenerateRequest--> {ns}:{{model}}:requests --XREADGROUP--> worker
    worker --PUBLISH TokenBatch | ErrorMessage--> {ns}:gateway:{gateway_id}
    gateway --PUBLISH AbortMessage--> {ns}:control --> every worker
    worker --SET WorkerStatus (TTL)--> {ns}:worker:{worker_id}
"""

from __future__ import annotations

from typing import Literal

import msgspec

from shared.sampling import SamplingParams
from shared.token_ids import TokenIds

#: 2: one ``TokenBatch`` per gateway per engine step replaced the per-request
#: ``TokenMessage`` of version 1. 3: ``GenerateRequest.prompt_token_ids`` travel as
#: little-endian int32 bytes (``TokenIds``), not a msgpack array.
PROTOCOL_VERSION = 3

#: Why a request stopped, in OpenAI terms. ``abort`` never reaches a client as a
#: finish_reason: the gateway turns it into an error.
FinishReason = Literal["stop", "length", "abort"]


class GenerateRequest(msgspec.Struct, tag="generate", kw_only=True):
    """One request (or a continuation of one), as queued on the model's stream.

    ``prompt_token_ids`` are already tokenized by the gateway (the chat template
    applied): a ``TokenIds`` (int32 bytes on the wire; a list or tuple given here is
    turned into one). ``attempt`` counts re-enqueues after failover; replies carry it so the
    gateway can drop messages of older attempts. ``deadline_unix_s`` is wall-clock
    (seconds since the epoch): a worker that pulls an entry after it drops it with an
    error instead of running it.

    ``output_token_ids`` is empty for a new request. A continuation (failover) carries
    the output tokens the client already has: the worker resumes after them, counts
    them against ``max_tokens``, and numbers its tokens from ``len(output_token_ids)``,
    so ``first_index`` always counts from the start of the request's output.

    ``priority`` is the request's class rank, lower served first as in vLLM's
    ``priority`` (0 interactive, 1 default, 2 batch; docs/operations.md, "Priority
    classes"): the engine admits waiting requests in (priority, arrival) order and
    preempts running ones of a strictly higher number to fit a lower one. Defaults to
    0, so an entry from a build without it decodes unchanged.

    ``tenant`` is the request's tenant (``gateway/tenants.py``): the unit of fair share
    and rate limits. A request on a (class, tenant) stream also has it in the stream's
    name; one placed on a worker's own stream (``Keys.placed_stream``) only here.
    """

    request_id: str
    model: str
    prompt_token_ids: TokenIds
    sampling: SamplingParams
    reply_channel: str
    deadline_unix_s: float
    attempt: int = 0
    created_unix_s: float = 0.0
    output_token_ids: list[int] = []
    priority: int = 0
    tenant: str = ""
    v: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.prompt_token_ids, TokenIds):
            self.prompt_token_ids = TokenIds.of(self.prompt_token_ids)


class TokenLogprobs(msgspec.Struct, array_like=True):
    """One output token's log-probability (natural log, of the raw model distribution:
    docs/operations.md, "Logprobs") and ``top``, the ``(token_id, logprob)`` pairs of the
    ``SamplingParams.logprobs`` most likely tokens, most likely first (empty when 0).
    Encoded as an array, not a map: it repeats once per token."""

    logprob: float
    top: list[tuple[int, float]] = []


class TokenOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """New output tokens of one request after one engine step: an entry of a ``TokenBatch``.

    ``first_index`` is the position of ``token_ids[0]`` among the request's output
    tokens (0-based), so a receiver can detect gaps and duplicates. ``finish_reason``
    is set on the request's last entry. ``num_prompt_tokens`` and ``num_cached_tokens``
    (prefix-cache hits, tokens) are set on its first entry. ``logprobs`` has one entry
    per ``token_ids`` entry when the request asked for them (``SamplingParams.logprobs``),
    else it is ``None`` and, like every default, left out of the payload.
    ``prompt_logprobs`` (first entry only, when ``SamplingParams.prompt_logprobs`` is set
    and the request carries no ``output_token_ids``) has one entry per prompt token
    after the first: entry ``i`` scores ``prompt_token_ids[i + 1]``.
    """

    request_id: str
    attempt: int
    first_index: int
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None


class TokenBatch(msgspec.Struct, tag="token_batch", kw_only=True):
    """What one engine step of one worker produced for one gateway: an entry per
    request of that gateway that got tokens, in one PUBLISH on its reply channel.

    A request appears at most once per step; a batch that re-sends outputs a Redis
    error held back (docs/protocol.md, "TokenBatch") may hold several entries of one
    request, in order.
    """

    worker_id: str
    outputs: list[TokenOutput]
    v: int = PROTOCOL_VERSION


class ErrorMessage(msgspec.Struct, tag="error", kw_only=True):
    """A request failed on the worker; ``status`` is the HTTP status the gateway
    answers with (e.g. 504 for an expired deadline, 500 for an engine error)."""

    request_id: str
    attempt: int
    worker_id: str
    status: int
    message: str
    v: int = PROTOCOL_VERSION


class AbortMessage(msgspec.Struct, tag="abort", kw_only=True):
    """Stop and free these requests (client gone, stop string matched)."""

    request_ids: list[str]
    reason: str = ""
    v: int = PROTOCOL_VERSION


class WorkerStatus(msgspec.Struct, tag="status", kw_only=True):
    """A worker's heartbeat value: who it is, how loaded it is, and whether its engine
    makes progress.

    ``kv_usage`` is the fraction of KV-cache blocks in use (0..1);
    ``num_free_blocks`` and ``block_size`` (tokens) give the same in absolute terms.
    ``num_steps`` counts engine steps completed since the worker started;
    ``last_step_unix_s`` is when the last one completed (0: none yet);
    ``step_running_s`` is how long the step in flight has been running, on the worker's
    monotonic clock (0: no step running, i.e. the engine holds no request), so no clock
    skew between hosts enters the stall rule; ``engine_stall_timeout_s`` is the worker's
    own limit for one step (0: never judged stalled). All four default to 0, so a status
    from a build without them decodes and reads as never stalled.

    What placement reads (``gateway/placement.py``): ``num_waiting_prefill_tokens``, the
    prompt tokens of the requests it holds that are not computed yet (cache hits left
    out); ``num_blocks`` (KV-cache size, blocks); ``max_num_batched_tokens``;
    ``prefix_cache_queries`` / ``prefix_cache_hits`` (tokens looked up / found since
    start); ``mean_num_output_tokens``, a moving average of the output tokens (decode
    steps) of the requests it finished (0: none finished yet, or a build without it: the
    gateway then assumes ``gateway.placement.DEFAULT_OUTPUT_TOKENS``), which with
    ``max_num_seqs`` prices a wait for a decode slot. ``max_model_len`` (tokens) is the
    longest prompt + output it runs: gateways use the ready workers' value. 0 in a
    status from a build without them.

    KV fragmentation of its running requests (``EngineStats``, both 0..1, 0 from a build
    or backend without them): ``kv_internal_fragmentation``, the share of the KV slots
    they hold that hold no token; ``kv_contiguous_waste_ratio``, the share a contiguous
    reservation of ``max_model_len`` slots per request would leave empty.
    """

    worker_id: str
    model: str
    backend: str
    num_running: int
    num_waiting: int
    kv_usage: float
    num_free_blocks: int
    block_size: int
    max_num_seqs: int
    updated_unix_s: float
    started_unix_s: float
    pid: int
    num_steps: int = 0
    last_step_unix_s: float = 0.0
    step_running_s: float = 0.0
    engine_stall_timeout_s: float = 0.0
    num_waiting_prefill_tokens: int = 0
    num_blocks: int = 0
    max_num_batched_tokens: int = 0
    max_model_len: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    mean_num_output_tokens: float = 0.0
    kv_internal_fragmentation: float = 0.0
    kv_contiguous_waste_ratio: float = 0.0
    v: int = PROTOCOL_VERSION

    @property
    def engine_stalled(self) -> bool:
        """One engine step has run longer than ``engine_stall_timeout_s``: the worker
        holds requests and makes no progress (a deadlocked kernel or lock), so gateways
        and reapers treat it as dead (``shared/liveness.py``)."""
        return 0.0 < self.engine_stall_timeout_s < self.step_running_s


ReplyMessage = TokenBatch | ErrorMessage
AnyMessage = GenerateRequest | TokenBatch | ErrorMessage | AbortMessage | WorkerStatus


def _enc_hook(obj: object) -> bytes:
    if isinstance(obj, TokenIds):
        return obj.data
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(kind: type, obj: object) -> object:
    # A TypeError or ValueError here reaches the caller as a msgspec.ValidationError.
    if kind is TokenIds and isinstance(obj, bytes):
        return TokenIds(obj)
    raise TypeError(f"expected int32 bytes for {kind.__name__}, got {type(obj).__name__}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoder: msgspec.msgpack.Decoder[AnyMessage] = msgspec.msgpack.Decoder(AnyMessage, dec_hook=_dec_hook)


class ProtocolError(ValueError):
    """A payload could not be decoded, or has an unknown protocol version."""


def encode(message: AnyMessage) -> bytes:
    """Encode any protocol message as msgpack bytes."""
    return _encoder.encode(message)


def decode(payload: bytes) -> AnyMessage:
    """Decode msgpack bytes into the message they hold.

    Raises:
        ProtocolError: malformed payload, unknown message type or protocol version.
    """
    try:
        message = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"undecodable message: {exc}") from exc
    if message.v != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {message.v} (this build speaks {PROTOCOL_VERSION})")
    return message
