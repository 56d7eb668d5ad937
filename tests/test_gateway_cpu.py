"""What keeps the gateway's CPU per streamed token down (issue 13; docs/operations.md,
"Gateway CPU per token"): uvicorn runs on uvloop with the httptools parser (declared
dependencies, shipped to GPU machines too), and ``run`` freezes the startup heap
before it serves. No Redis, no model: the speed itself is measured in bench/."""

from __future__ import annotations

import gc
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAST_SERVER_PACKAGES = ("uvloop", "httptools")


def test_uvicorn_picks_uvloop_and_httptools() -> None:
    """``make setup`` installs both, so uvicorn's "auto" choices are the fast ones."""
    import uvloop
    from uvicorn.loops.auto import auto_loop_factory
    from uvicorn.protocols.http.auto import AutoHTTPProtocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    assert AutoHTTPProtocol is HttpToolsProtocol
    loop = auto_loop_factory()()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()


def test_fast_server_packages_are_declared_and_shipped() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {d.split(";")[0].split(">")[0].split("=")[0].split("<")[0].strip() for d in deps}
    wheels = (ROOT / "bench" / "gpu_wheels.sh").read_text()
    for package in FAST_SERVER_PACKAGES:
        assert package in names, f"{package} is not a dependency in pyproject.toml"
        assert f" {package}" in wheels, f"bench/gpu_wheels.sh does not download {package}"


def test_run_freezes_the_startup_heap_before_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn
    from fastapi import FastAPI

    import gateway.app as gateway_app
    from shared.settings import GatewaySettings, ModelSettings, RedisSettings

    def small_app(*args: object, **kwargs: object) -> FastAPI:
        app = FastAPI()
        app.state.gateway_id = "test"
        return app

    frozen_at_serve: list[int] = []
    monkeypatch.setattr(gateway_app, "create_app", small_app)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: frozen_at_serve.append(gc.get_freeze_count()))
    gc.unfreeze()
    try:
        gateway_app.run(GatewaySettings(), RedisSettings(redis_url="redis://127.0.0.1:1/0"), ModelSettings(),
                        source=None)  # type: ignore[arg-type]
    finally:
        gc.unfreeze()  # this test process's heap goes back to the collector
    assert frozen_at_serve and frozen_at_serve[0] > 1000  # the imported modules at least
