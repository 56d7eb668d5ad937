"""The installed package, not the checkout: a wheel built from this repository carries
every file that the CPU extension build reads (``kernels/cpu_extension.py``), and the
extension builds from the installed copy (what both Dockerfiles run)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "kernels" / "csrc"

# Runs in the installed copy: prints where `kernels` came from and whether the build worked.
_BUILD_FROM_INSTALLED = textwrap.dedent("""
    import logging, sys
    logging.basicConfig(level=logging.WARNING)
    from kernels import cpu_extension
    print("CSRC", cpu_extension.CSRC)
    module = cpu_extension.load()
    print("BUILT", module is not None)
    sys.exit(0 if module is not None else 1)
""")


def _copy_project(dest: Path) -> Path:
    """The files ``pip wheel`` reads (pyproject.toml, README.md and the packages that
    pyproject's ``packages.find`` includes), copied so the build's ``build/`` and
    ``*.egg-info`` land outside the checkout."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    for pattern in meta["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*")
        shutil.copytree(ROOT / package, dest / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args], check=True,
                   timeout=300)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="needs a C++ compiler")
def test_installed_wheel_builds_the_cpu_extension(tmp_path: Path) -> None:
    project = _copy_project(tmp_path / "src")
    _pip("wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(tmp_path / "dist"), str(project))
    [wheel] = (tmp_path / "dist").glob("inferq-*.whl")
    in_wheel = {name for name in zipfile.ZipFile(wheel).namelist() if name.startswith("kernels/csrc/")}
    in_repo = {f"kernels/csrc/{p.relative_to(CSRC).as_posix()}" for p in CSRC.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    assert in_repo and in_repo <= in_wheel, f"missing from the wheel: {sorted(in_repo - in_wheel)}"

    site = tmp_path / "site"
    _pip("install", "--no-deps", "--target", str(site), str(wheel))
    env = {**os.environ, "PYTHONPATH": str(site), "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions"),
           # ninja comes with the package's dependencies, into the interpreter's bin folder.
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    run = subprocess.run([sys.executable, "-c", _BUILD_FROM_INSTALLED], check=False, cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert f"CSRC {site / 'kernels' / 'csrc'}" in out, out  # the installed copy, not the checkout
    assert run.returncode == 0 and "BUILT True" in out, out
    assert list((tmp_path / "torch_extensions").glob("inferq_cpu_kernels_*/*.so")), out
