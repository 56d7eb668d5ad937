"""Fuzz the gateway's published OpenAPI schema with schemathesis (issue 4): against the
live harness gateway (fixtures: test_gateway_harness.py), no request may get a 5xx, hang,
or an answer that its operation does not document.

Schemathesis calls the server with blocking ``requests``, so the Hypothesis test runs on
a thread while uvicorn, the relay and the FakeWorker keep the test's event loop. Bodies
that pass validation are enqueued and answered by the FakeWorker; half of the generated
bodies get the served model's name, or nearly all would stop at the 404.
"""

# ruff: noqa: F811 - pytest fixtures imported from the harness are redefined as parameters
from __future__ import annotations

import asyncio
import importlib
import pkgutil

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.test_gateway_harness import (  # noqa: F401 - fixtures are used by name
    MODEL,
    gateway_settings,
    harness,
    redis_server,
    source,
    tokenizer,
)

pytestmark = pytest.mark.timeout(90)


def _import_eagerly() -> None:
    """Import schemathesis's and hypothesis's lazily loaded modules now, on the main thread.

    pytest rewrites the modules of plugin packages (both are plugins) with ``ast`` when they
    are first imported. CPython 3.11 before 3.11.8 keeps the AST recursion depth in
    interpreter-wide state, so a first import on the fuzz thread while the event loop's
    thread also builds an AST can fail with "SystemError: AST constructor recursion depth
    mismatch" (cpython gh-106905; seen in CI on 3.11.7).
    """
    for info in pkgutil.walk_packages(schemathesis.__path__, "schemathesis."):
        try:
            importlib.import_module(info.name)
        except ImportError:  # optional integrations (allure)
            pass
    for name in ("hypothesis.internal.conjecture.optimiser", "hypothesis.strategies._internal.flatmapped",
                 "hypothesis.strategies._internal.random", "hypothesis.strategies._internal.regex"):
        importlib.import_module(name)


_import_eagerly()

#: Per call, s: a request that takes longer counts as a hang (the harness deadline is 10 s).
CALL_TIMEOUT_S = 15
MAX_EXAMPLES = 60
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def fuzz(operation, base_url: str, mode: GenerationMode) -> None:
    """Run ``MAX_EXAMPLES`` generated calls of one operation through the checks
    (deterministic: the same cases every run)."""

    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode), served_model=st.booleans())
    def run(case, served_model: bool) -> None:
        if served_model and isinstance(case.body, dict):
            case.body["model"] = MODEL
        response = case.call(base_url=base_url, timeout=CALL_TIMEOUT_S)
        case.validate_response(response, checks=CHECKS)

    run()


@pytest.mark.parametrize("path,method,mode", [
    ("/v1/completions", "POST", GenerationMode.POSITIVE),
    ("/v1/completions", "POST", GenerationMode.NEGATIVE),
    ("/v1/chat/completions", "POST", GenerationMode.POSITIVE),
    ("/v1/chat/completions", "POST", GenerationMode.NEGATIVE),
    ("/v1/models", "GET", GenerationMode.POSITIVE),
    ("/health", "GET", GenerationMode.POSITIVE),
    ("/metrics", "GET", GenerationMode.POSITIVE),
])
async def test_fuzz_openapi(harness, path: str, method: str, mode: GenerationMode) -> None:
    schema = await asyncio.to_thread(schemathesis.openapi.from_url, f"{harness.base_url}/openapi.json")
    await asyncio.to_thread(fuzz, schema[path][method], harness.base_url, mode)


async def test_openapi_documents_the_api(harness) -> None:
    r = await harness.http.get("/openapi.json")
    assert r.status_code == 200
    doc = r.json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= set(doc["paths"])
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CompletionRequest"}
    assert {"model", "prompt"} <= set(doc["components"]["schemas"]["CompletionRequest"]["required"])
    assert set(doc["paths"]["/v1/chat/completions"]["post"]["responses"]) >= {
        "200", "400", "401", "404", "409", "413", "429", "503", "504"}
    assert (await harness.http.get("/docs")).status_code == 404


@pytest.mark.parametrize("extra,param", [
    (b'"seed": 18446744073709551616', "seed"),  # found by fuzzing: was an OverflowError (500) at the XADD
    (b'"top_k": 1180591620717411303424', "top_k"),
    (b'"stop_token_ids": [18446744073709551616]', "stop_token_ids"),
    (b'"repetition_penalty": Infinity', "repetition_penalty"),  # not JSON, but pydantic parses it
    (b'"temperature": NaN', "temperature"),
])
async def test_values_beyond_the_wire_are_400(harness, extra: bytes, param: str) -> None:
    body = b'{"model": "%s", "prompt": "x", %s}' % (MODEL.encode(), extra)
    r = await harness.http.post("/v1/completions", content=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
