"""The installed package, not the checkout: a wheel built from this repository carries
every file that the CPU extension build reads (``kernels/cpu_extension.py``): in the
installed copy (what both Dockerfiles run) the build tag hashes every source, and every
local ``#include "..."`` of a source resolves inside the package. The compile itself is
tested from the checkout (tests/test_cpu_attention.py, ``test_kernel_builds_here``); doing
it again from the installed copy cost a minute of CI for the same compiler run."""

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

# Runs in the installed copy: where `kernels` came from, the build tag (it reads every
# source), and each local include of each source that is missing from the package.
_CHECK_INSTALLED = textwrap.dedent("""
    import re, sys
    from kernels import cpu_extension
    print("CSRC", cpu_extension.CSRC)
    print("TAG", cpu_extension._build_tag())
    for source in cpu_extension.SOURCES:
        for header in re.findall(r'#include "([^"]+)"', (cpu_extension.CSRC / source).read_text()):
            if not (cpu_extension.CSRC / header).is_file():
                print("MISSING", source, header)
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
def test_installed_wheel_carries_what_the_cpu_extension_build_reads(tmp_path: Path) -> None:
    project = _copy_project(tmp_path / "src")
    _pip("wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(tmp_path / "dist"), str(project))
    [wheel] = (tmp_path / "dist").glob("inferq-*.whl")
    in_wheel = {name for name in zipfile.ZipFile(wheel).namelist() if name.startswith("kernels/csrc/")}
    in_repo = {f"kernels/csrc/{p.relative_to(CSRC).as_posix()}" for p in CSRC.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    assert in_repo and in_repo <= in_wheel, f"missing from the wheel: {sorted(in_repo - in_wheel)}"

    site = tmp_path / "site"
    _pip("install", "--no-deps", "--target", str(site), str(wheel))
    run = subprocess.run([sys.executable, "-c", _CHECK_INSTALLED], check=False, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True, timeout=120)
    out = run.stdout + run.stderr
    assert f"CSRC {site / 'kernels' / 'csrc'}" in out, out  # the installed copy, not the checkout
    assert run.returncode == 0 and "TAG " in out and "MISSING" not in out, out
