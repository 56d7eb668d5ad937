"""Fuzz the gateway's published OpenAPI schema with schemathesis (issue 4): against the
live harness gateway (fixtures: gateway_harness.py), no request may get a 5xx, hang,
or an answer that its operation does not document; negative (schema-violating) requests
must be refused. Generated headers use every Latin-1 character, so non-ASCII
``X-Request-Id`` and other header values are sent too, and the parameterless GETs are
fuzzed through their one input, the ``Authorization`` header, with an API key configured.

Schemathesis calls the server with blocking ``requests``, so the Hypothesis test runs on
a thread while uvicorn, the relay and the FakeWorker keep the test's event loop. Bodies
that pass validation are enqueued and answered by the FakeWorker; half of the generated
bodies get the served model's name, or nearly all would stop at the 404.
"""

from __future__ import annotations

import asyncio
import importlib
import pkgutil

import pytest
import schemathesis
from hypothesis import given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from shared.settings import GatewaySettings
from tests.gateway_harness import MODEL

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
#: The GETs have one input (the credential): a few cases cover it.
MAX_GET_EXAMPLES = 15
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
#: Generated header values: every character HTTP/1.1 can carry, not only ASCII.
HEADER_CODEC = "latin-1"
API_KEY = "sk-fuzz"


async def _schema(base_url: str):
    schema = await asyncio.to_thread(schemathesis.openapi.from_url, f"{base_url}/openapi.json")
    schema.config.generation.update(codec=HEADER_CODEC)
    return schema


def fuzz(operation, base_url: str, mode: GenerationMode, **fixed: object) -> None:
    """Run ``MAX_EXAMPLES`` generated calls of one operation through the checks
    (deterministic: the same cases every run); ``fixed`` (``body=...``) is not generated."""
    checks = [*CHECKS, negative_data_rejection] if mode == GenerationMode.NEGATIVE else CHECKS

    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None)
    @given(case=operation.as_strategy(generation_mode=mode, **fixed), served_model=st.booleans())
    def run(case, served_model: bool) -> None:
        # Only a valid model (a string) is replaced: where a negative case removed it or gave
        # it another type, putting the served name back would make the body valid.
        if served_model and isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
            case.body["model"] = MODEL
        response = case.call(base_url=base_url, timeout=CALL_TIMEOUT_S)
        case.validate_response(response, checks=checks)

    run()


@pytest.mark.parametrize("path,method,mode", [
    ("/v1/completions", "POST", GenerationMode.POSITIVE),
    ("/v1/completions", "POST", GenerationMode.NEGATIVE),
    ("/v1/chat/completions", "POST", GenerationMode.POSITIVE),
    ("/v1/chat/completions", "POST", GenerationMode.NEGATIVE),
])
async def test_fuzz_openapi(harness, path: str, method: str, mode: GenerationMode) -> None:
    schema = await _schema(harness.base_url)
    await asyncio.to_thread(fuzz, schema[path][method], harness.base_url, mode)


async def test_fuzz_headers_of_a_valid_request(harness) -> None:
    """Negative headers only (the body is valid, so the gateway must refuse the header):
    X-Request-Ids with non-ASCII and other characters outside its pattern are 400s."""
    schema = await _schema(harness.base_url)
    await asyncio.to_thread(fuzz, schema["/v1/completions"]["POST"], harness.base_url, GenerationMode.NEGATIVE,
                            body={"model": MODEL, "prompt": "x", "max_tokens": 1})


def _credentials() -> st.SearchStrategy[str | None]:
    # An HTTP field value: visible ASCII, space and obs-text (0x80-0xFF, the non-ASCII part);
    # no control characters, which uvicorn refuses before the app sees the request.
    text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=40)
    sendable = text.filter(lambda v: v == v.strip())
    return st.one_of(st.none(), st.just(f"Bearer {API_KEY}"), sendable.map("Bearer {}".format), sendable,
                     st.sampled_from(["Bearer", f"Bearer  {API_KEY}", f"bearer {API_KEY}x", f"Basic {API_KEY}"]))


def fuzz_credentials(operation, base_url: str) -> None:
    """Call a parameterless GET with generated (often non-ASCII) credentials."""

    @settings(max_examples=MAX_GET_EXAMPLES, deadline=None, derandomize=True, database=None)
    @given(case=operation.as_strategy(), authorization=_credentials())
    def run(case, authorization: str | None) -> None:
        if authorization is not None:
            case.headers = {**(case.headers or {}), "Authorization": authorization}
        response = case.call(base_url=base_url, timeout=CALL_TIMEOUT_S)
        case.validate_response(response, checks=CHECKS)

    run()


@pytest.mark.parametrize("gateway_settings", [GatewaySettings(api_keys=(API_KEY,), request_timeout_s=10.0)])
@pytest.mark.parametrize("path", ["/v1/models", "/health", "/ready", "/metrics"])
async def test_fuzz_gets_with_credentials(harness, path: str) -> None:
    schema = await _schema(harness.base_url)
    await asyncio.to_thread(fuzz_credentials, schema[path]["GET"], harness.base_url)


async def test_openapi_documents_the_api(harness) -> None:
    r = await harness.http.get("/openapi.json")
    assert r.status_code == 200
    doc = r.json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/ready", "/metrics"} <= set(
        doc["paths"])
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
