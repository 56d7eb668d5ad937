"""The gateway app factory and its runner (the CLI calls ``run``)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import Receive, Scope, Send

from gateway.admission import Enqueuer
from gateway.batches import install_batch_routes
from gateway.errors import OpenAIError, install_error_handlers, internal_error
from gateway.failover import failover_loop
from gateway.files import install_file_routes
from gateway.generate_api import install_generate_route
from gateway.handlers import check_auth, handle_generate
from gateway.http_timeouts import timed_protocol
from gateway.metrics import GatewayMetrics
from gateway.openapi import (
    ChatCompletion,
    Completion,
    DetokenizeResponse,
    Health,
    ModelCard,
    ModelList,
    TokenizeResponse,
    body_extra,
    error_responses,
    generation_extra,
    generation_responses,
    install_openapi,
)
from gateway.placement import Placer
from gateway.queue_metrics import queue_metrics_loop
from gateway.rate_limits import RateLimiter
from gateway.readiness import Readiness, readiness
from gateway.relay import Relay
from gateway.responses_api import handle_create, install_response_routes
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.sse import SERVER_SEND_KEY
from gateway.state import GatewayState
from gateway.stats import install_stats_route
from gateway.tasks import BackgroundTasks
from gateway.tenants import Tenants
from gateway.tgi import install_tgi_routes
from gateway.tokenize import TokenizerWorker
from gateway.tokenizer_routes import DetokenizeRequest, TokenizeRequest, handle_detokenize, handle_tokenize
from shared import tokenizer_loader
from shared.fair_queue import FairQueue
from shared.gc_heap import freeze_startup_heap
from shared.keys import Keys
from shared.model_source import ModelSource, max_model_len, served_model_name
from shared.redis_connect import connect
from shared.settings import BatchSettings, GatewaySettings, ModelSettings, RedisSettings

log = logging.getLogger(__name__)

#: Redis connect timeout, s: a Redis that does not answer turns into a 503 this fast.
REDIS_CONNECT_TIMEOUT_S = 2.0
#: How long ``/health`` waits for PING and ``/ready`` for the heartbeats, s.
HEALTH_TIMEOUT_S = 2.0
#: uvicorn's graceful shutdown: how long a stopping gateway lets responses in flight
#: finish before it cuts them, s.
GRACEFUL_SHUTDOWN_S = 5
#: Response header naming the gateway process that answered (its gateway id, as in its
#: reply channel and its "gateway <id> serving" log line).
GATEWAY_ID_HEADER = "x-inferq-gateway"


def load_tokenizer(source: ModelSource) -> Any:
    """The model's Hugging Face tokenizer.

    Raises:
        ValueError: the source has no tokenizer (dummy model without a folder).
    """
    if source.path is None or not source.has_tokenizer:
        raise ValueError(f"model {source.name!r} has no tokenizer folder; the gateway needs one")
    return tokenizer_loader.load_tokenizer(source.path)


#: FastAPI's own OpenTelemetry hooks (FastAPI >= 0.16x), off: with them on, every request
#: asks OpenTelemetry for its global providers and reads the environment (~2-3% of a
#: gateway process's samples at 8 output tokens a request, py-spy, 2-core CPU); the
#: gateway's metrics are Prometheus (gateway/metrics.py). Older FastAPI has no such argument.
_NO_TELEMETRY = ({"telemetry": {"tracing": False, "metrics": False, "logs": False}}
                 if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {})


class GatewayApp(FastAPI):
    """FastAPI that keeps the server's own ``send`` in each HTTP request's scope
    (``gateway.sse.SERVER_SEND_KEY``), so a stream's body writes skip the exception
    middlewares' ``send`` wrappers (one write per token and stream; gateway/sse.py).

    The generation endpoints are also served directly (``serve_directly``): a POST to one
    of their paths goes to its endpoint without FastAPI's middleware stack, router and
    dependency solving (12% of a gateway process's samples at 64 tokens a request, py-spy
    on the H100 host: docs/benchmarks.md, "Gateway CPU per output token"). Their routes stay
    registered, for the OpenAPI schema and for any other method. FastAPI's OpenTelemetry
    hooks are off (``_NO_TELEMETRY``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**_NO_TELEMETRY, **kwargs)
        self._direct: dict[str, Callable[[Request], Awaitable[Response]]] = {}

    def serve_directly(self, path: str, endpoint: Callable[[Request], Awaitable[Response]]) -> None:
        """Serve POSTs to ``path`` with ``endpoint`` itself. It must take the request alone,
        answer every error it expects as a response (an ``OpenAIError`` raised is still
        answered as such; anything else is a logged 500), and need no middleware."""
        self._direct[path] = endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[SERVER_SEND_KEY] = send
            endpoint = self._direct.get(scope["path"]) if scope["method"] == "POST" else None
            if endpoint is not None and not scope.get("root_path"):
                scope["app"] = self  # what Starlette sets, for ``request.app``
                try:
                    response = await endpoint(Request(scope, receive))
                except OpenAIError as exc:
                    response = exc.response()
                except Exception as exc:  # noqa: BLE001 - as FastAPI's handler of Exception
                    response = internal_error(exc, scope)
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def create_app(gateway: GatewaySettings, redis: RedisSettings, model: ModelSettings, source: ModelSource,
               *, tokenizer: Any = None, batch: BatchSettings | None = None) -> FastAPI:
    """Build the gateway app. The Redis client, relay reader and tokenizer threads start
    in the app's lifespan; ``tokenizer`` (optional) skips loading one from ``source``;
    ``batch`` configures ``/v1/files`` and ``/v1/batches`` (default: BatchSettings()).

    Raises:
        ValueError: no Redis URL, or no tokenizer.
    """
    if not redis.redis_url:
        raise ValueError("the gateway needs a Redis URL (redis://host:port/0, unix:///path, redis+sentinel://... "
                         "or redis+cluster://...)")
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(source)
    served_name = served_model_name(model, source)
    metrics = GatewayMetrics(served_name)
    keys = Keys(redis.namespace)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = connect(redis.redis_url, socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S)
        gateway_id = app.state.gateway_id
        queue = FairQueue(client, keys, served_name)
        placer = Placer(client, keys, served_name, gateway.dispatch_policy,  # type: ignore[arg-type]
                        gateway.placement_max_queued_steps)
        placer.on_refresh = metrics.set_workers
        relay = Relay(client, keys.gateway_channel(gateway_id),
                      on_orphans=lambda request_ids: state.publish_abort(request_ids, "orphaned"))
        tenants = Tenants(client, keys, gateway)
        state = GatewayState(
            settings=gateway, model_settings=model, served_model_name=served_name, source_name=source.name,
            keys=keys, gateway_id=gateway_id, redis=client, relay=relay,
            tokenizer=TokenizerWorker(tokenizer, source.config, num_encode_threads=gateway.num_tokenizer_threads,
                                      encode_timeout_s=gateway.tokenize_timeout_s),
            metrics=metrics, tasks=BackgroundTasks(),
            queue=queue, enqueuer=Enqueuer(queue, gateway.max_queue_len, placer),
            rate_limiter=RateLimiter(client, keys, served_name, gateway, metrics, tenants), tenants=tenants,
            created_unix_s=int(time.time()), workers=placer.view,
            own_max_model_len=max_model_len(source.config, model.max_model_len))
        app.state.inferq = state
        relay.start()
        failover = state.tasks.spawn(failover_loop(state), name="failover")
        queue_metrics = state.tasks.spawn(queue_metrics_loop(state), name="queue-metrics")
        placement = state.tasks.spawn(placer.refresh_loop(), name="placement-view")
        log.info("gateway %s serving %r from stream %s", gateway_id, served_name, state.stream)
        try:
            yield
        finally:
            failover.cancel()
            queue_metrics.cancel()
            placement.cancel()
            await relay.stop()
            await state.tasks.close()
            state.tokenizer.close()
            await client.aclose()

    app = GatewayApp(title="inferq", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.metrics = metrics
    app.state.gateway_id = secrets.token_hex(8)  # names this process's reply channel
    install_error_handlers(app)
    install_openapi(app)

    def get_state(request: Request) -> GatewayState:
        return request.app.state.inferq  # type: ignore[no-any-return]

    @app.post("/v1/completions", responses=generation_responses(Completion),
              openapi_extra=generation_extra(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await handle_generate(get_state(request), request, chat=False)

    app.serve_directly("/v1/completions", completions)

    @app.post("/v1/chat/completions", responses=generation_responses(ChatCompletion),
              openapi_extra=generation_extra(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await handle_generate(get_state(request), request, chat=True)

    app.serve_directly("/v1/chat/completions", chat_completions)

    @app.get("/v1/models", responses={200: {"model": ModelList}, **error_responses(401)})
    async def list_models(request: Request) -> Response:
        state = get_state(request)
        check_auth(state, request)
        return JSONResponse({"object": "list", "data": [model_card(state)]})

    # ``:path``: a served name may hold a slash ("HuggingFaceTB/SmolLM2-135M-Instruct").
    @app.get("/v1/models/{model_id:path}", responses={200: {"model": ModelCard}, **error_responses(401, 404)})
    async def retrieve_model(model_id: str, request: Request) -> Response:
        state = get_state(request)
        check_auth(state, request)
        if model_id != state.served_model_name:
            raise OpenAIError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found")
        return JSONResponse(model_card(state))

    @app.post("/tokenize", responses={200: {"model": TokenizeResponse}, **error_responses(400, 401, 404, 413, 503)},
              openapi_extra=body_extra(TokenizeRequest))
    async def tokenize(request: Request) -> Response:
        return await handle_tokenize(get_state(request), request)

    @app.post("/detokenize", responses={200: {"model": DetokenizeResponse},
                                        **error_responses(400, 401, 404, 413, 503)},
              openapi_extra=body_extra(DetokenizeRequest))
    async def detokenize(request: Request) -> Response:
        return await handle_detokenize(get_state(request), request)

    @app.get("/health", responses={200: {"model": Health}, **error_responses(503)})
    async def health(request: Request) -> Response:
        state = get_state(request)
        try:
            await asyncio.wait_for(state.redis.ping(), HEALTH_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - any failure means unhealthy
            return OpenAIError(503, f"Redis is unavailable: {exc!r}", code="redis_unavailable").response()
        return JSONResponse({"status": "ok", "relay_subscribed": state.relay.ready.is_set()})

    @app.get("/ready", responses={200: {"model": Readiness}, 503: {"model": Readiness}})
    async def ready(request: Request) -> Response:
        return await readiness(get_state(request), HEALTH_TIMEOUT_S)

    # /metrics takes the API key when keys are configured (docs/operations.md, "Metrics");
    # /health stays open for load balancers.
    # No response_class=PlainTextResponse: FastAPI would document the JSON 401 as text/plain.
    @app.get("/metrics", responses={
        200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
        **error_responses(401)})
    async def metrics_endpoint(request: Request) -> Response:
        check_auth(get_state(request), request)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/responses", include_in_schema=False)
    async def responses(request: Request) -> Response:
        return await handle_create(get_state(request), request)

    app.serve_directly("/v1/responses", responses)
    install_response_routes(app)
    install_file_routes(app, batch or BatchSettings())
    install_batch_routes(app, batch or BatchSettings())
    install_stats_route(app, batch or BatchSettings())
    install_generate_route(app)
    install_tgi_routes(app)
    return app


def model_card(state: GatewayState) -> dict[str, object]:
    """The served model as an OpenAI model object (``GET /v1/models``, ``/v1/models/{id}``),
    with vLLM's ``max_model_len``: the gateway's effective value (``GatewayState.max_model_len``)."""
    return {"id": state.served_model_name, "object": "model", "created": state.created_unix_s,
            "owned_by": "inferq", "root": state.source_name, "parent": None, "max_model_len": state.max_model_len}


def run(gateway: GatewaySettings, redis: RedisSettings, model: ModelSettings, source: ModelSource,
        *, sock: socket.socket | None = None, on_stop: Callable[[], None] | None = None,
        batch: BatchSettings | None = None, stop: threading.Event | None = None) -> None:
    """Serve the gateway with uvicorn until SIGINT or SIGTERM stops it (graceful shutdown
    of ``GRACEFUL_SHUTDOWN_S``), on ``sock`` (a bound TCP socket, e.g. one of several
    sharing the port: gateway/multiproc.py) or else on ``gateway.host:gateway.port``.
    ``on_stop()`` runs in the signal handler when the first stop signal comes; ``batch``
    configures the Batch API routes (default ``BatchSettings()``); ``stop``, set from any
    thread (before the server starts, too), stops it as SIGTERM does (``inferq serve``
    when its worker exits). Every
    response carries the header ``GATEWAY_ID_HEADER``: this process's gateway id.

    A stop signal ends in ``KeyboardInterrupt`` here (uvicorn raises the signal again
    after its shutdown), which ``run`` absorbs, when SIGTERM's handler is
    ``signal.default_int_handler`` (``gateway/cli.py`` installs it): ``run`` then returns.
    """
    import uvicorn

    app = create_app(gateway, redis, model, source, batch=batch)
    freeze_startup_heap()

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if not self.should_exit and on_stop is not None:
                on_stop()
            super().handle_exit(sig, frame)

    # uvicorn's own loggers follow the level the CLI gave the root logger (--log-level).
    # Connection timeouts: gateway/http_timeouts.py (headers, body) and uvicorn's keep-alive.
    config = uvicorn.Config(app, host=gateway.host, port=gateway.port,
                            log_level=logging.getLogger().getEffectiveLevel(),
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, access_log=gateway.access_log,
                            headers=[(GATEWAY_ID_HEADER, app.state.gateway_id)],
                            http=timed_protocol(gateway.header_timeout_s, gateway.body_timeout_s),
                            timeout_keep_alive=gateway.keep_alive_timeout_s)
    if sock is not None:
        host, port = sock.getsockname()[:2]
        log.info("gateway %s listening on %s:%d (pid %d)", app.state.gateway_id, host, port, os.getpid())
    server = Server(config)
    if stop is not None:
        def stop_when_set() -> None:
            stop.wait()
            server.handle_exit(signal.SIGTERM, None)  # the event loop sees it within 0.1 s

        threading.Thread(target=stop_when_set, name="gateway-stop", daemon=True).start()
    try:
        server.run(sockets=None if sock is None else [sock])
    except KeyboardInterrupt:
        pass
