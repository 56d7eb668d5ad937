# Sourced on a GPU machine without a package index, in the repository root, after the
# carried `.whl` and `.tokenizer` folders arrived (docs/operations.md, "On a GPU machine
# without a package index"):
#
#   source bench/gpu_session.sh && gpu_install && gpu_step tests 300 "python3 -m pytest -q -o addopts= tests/test_gemv.py"
#
# Sets the environment every process there needs (the working tree first on PYTHONPATH,
# offline Hugging Face, NVLink multicast off for NCCL), and defines:
#   gpu_install            the wheels into /tmp/site, the tokenizer files into
#                          /tmp/tokenizer, a Qwen2.5-7B-shaped model folder in /tmp/m
#                          (bench/model_folder.py), then the GPU's name and memory in use;
#   gpu_step NAME S CMD    CMD under a limit of S seconds, its output in $OUT/NAME.log,
#                          then its exit status, seconds and last 25 lines;
#   gpu_pack NAME          everything under $OUT into one $OUT/NAME.tgz: the device returns at
#                          most 8 files a call, and a call of several runs writes more;
#   VLLM_ENV               the variables that vLLM's processes take (../shared/gpu/VLLM.md):
#                          `env $VLLM_ENV python3 -P ...`.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH="$PWD:/tmp/site"
export INFERQ_TOKENIZER_DIR="$PWD/.tokenizer"
export VLLM_ENV="PYTHONPATH=/tmp/vsite HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0"

gpu_install() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl > /tmp/gpu_install.log 2>&1 || { tail -5 /tmp/gpu_install.log; return 1; }
    mkdir -p /tmp/tokenizer && cp .tokenizer/* /tmp/tokenizer/
    python3 -c "from pathlib import Path; from bench.model_folder import build_model_folder; \
build_model_folder('Qwen2.5-7B', Path('/tmp/m'), Path('/tmp/tokenizer'))" || return 1
    nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
}

gpu_step() {
    local name=$1 limit=$2 t0 rc
    shift 2
    t0=$(date +%s)
    timeout -k 10 "$limit" bash -c "$*" > "$OUT/$name.log" 2>&1
    rc=$?
    echo "== $name rc=$rc $(( $(date +%s) - t0 ))s"
    tail -n 25 "$OUT/$name.log"
}

gpu_pack() {
    local name=$1
    tar czf "/tmp/$name.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "/tmp/$name.tgz" "$OUT/" \
        && echo "== packed $OUT/$name.tgz"
}
