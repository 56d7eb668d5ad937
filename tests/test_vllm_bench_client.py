"""vLLM's own benchmark client drives our gateway: ``vllm bench serve --backend openai
--dataset-name random --random-input-len 256 --random-output-len 64 --ignore-eos``
(through its library API, as ``bench/vllm_paired.py`` runs it) gets every request
answered with exactly 64 tokens. The worker is the model-free ``sim`` backend (it echoes
the prompt, EOS included: ``--ignore-eos`` must reach it)."""

from __future__ import annotations

import pytest

from tests import processes

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_vllm_bench_serve_against_the_gateway(redis_server, smollm_source, tmp_path) -> None:
    from bench.vllm_paired import bench_serve

    log = tmp_path / "procs.log"
    worker = processes.start("worker", redis_server.url, "--backend", "sim", "--sim-step-time-ms", "1",
                             log_path=log)
    port = processes.free_port()
    gateway = processes.start("gateway", redis_server.url, "--port", str(port), log_path=log)
    try:
        url = f"http://127.0.0.1:{port}"
        processes.wait_for_gateway(url, gateway)
        processes.wait_for_workers(redis_server.url, 1, [worker])
        result = bench_serve(url, str(smollm_source.path), num_prompts=4, max_concurrency=4, input_len=256,
                             output_len=64, detailed=True)
    finally:
        processes.stop(gateway)
        assert processes.stop(worker) == 0, log.read_text()[-3000:]
    assert result["failed"] == 0 and result["completed"] == 4, result["errors"]
    assert result["total_output_tokens"] == 4 * 64 and result["output_lens"] == [64] * 4
    assert all(250 <= n <= 262 for n in result["input_lens"])  # the gateway re-tokenizes vLLM's random text
