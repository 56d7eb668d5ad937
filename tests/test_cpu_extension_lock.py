"""A CPU-kernel build killed midway leaves torch's build lock file behind; the next load
must clear it instead of waiting on it forever (kernels/cpu_extension.py, ``_build_lock``)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from kernels import cpu_extension

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="no C++ compiler on this machine")


def test_build_lock_removes_a_stale_torch_lock(tmp_path) -> None:
    build_dir = tmp_path / "inferq_cpu_kernels_x"
    build_dir.mkdir()
    (build_dir / "lock").touch()
    with cpu_extension._build_lock(build_dir):
        assert not (build_dir / "lock").exists()
    assert (tmp_path / "inferq_cpu_kernels_x.flock").exists()


def test_load_after_a_killed_build_does_not_hang() -> None:
    assert cpu_extension.available(), "the CPU kernels must build where g++ exists"
    build_dir = cpu_extension._build_dir(f"inferq_cpu_kernels_{cpu_extension._build_tag()}")
    if build_dir is None:
        pytest.skip("torch does not expose its extension build directory")
    (build_dir / "lock").touch()  # what a process killed mid-build leaves
    try:
        done = subprocess.run([sys.executable, "-c",
                               "from kernels import cpu_extension; assert cpu_extension.load() is not None"],
                              check=False, timeout=120, capture_output=True, text=True)
    finally:
        (build_dir / "lock").unlink(missing_ok=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "stale CPU-kernel build lock" in done.stderr
