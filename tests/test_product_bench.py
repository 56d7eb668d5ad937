"""bench/product_bench.py: the pass-through of serve flags, the model folder and its padded
tokenizer, and one tiny run end to end on the CPU (offline engine, real `inferq serve`
with embedded Redis and the CPU engine, the load client): the JSON's structure, and that
its ratios and per-token CPU figures are computed from the throughputs and CPU seconds it
records. No speed is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import product_bench
from bench.model_folder import build_model_folder, export_tokenizer, pad_tokenizer_vocab
from bench.step_trace import breakdown, load


def test_passthrough_flags_become_settings_variables() -> None:
    env = product_bench.passthrough_env(["--max-num-batched-tokens", "4096", "--no-enable-prefix-caching",
                                         "--enforce-eager", "--num-tokenizer-threads=2"])
    assert env == {"INFERQ_MAX_NUM_BATCHED_TOKENS": "4096", "INFERQ_ENABLE_PREFIX_CACHING": "false",
                   "INFERQ_ENFORCE_EAGER": "true", "INFERQ_NUM_TOKENIZER_THREADS": "2"}
    for bad, why in ((["--no-such-flag", "1"], "unknown flag"), (["--max-num-seqs", "8"], "set by the benchmark"),
                     (["--max-num-batched-tokens"], "needs a value")):
        with pytest.raises(ValueError, match=why):
            product_bench.passthrough_env(bad)


@pytest.mark.slow
def test_model_folder_pads_the_tokenizer_to_the_config_vocab(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from shared.model_source import DUMMY_CONFIGS

    assert 1e6 < export_tokenizer(tmp_path / "tok") < 10e6  # a few MB to carry to a GPU machine
    original = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    folder, num_fillers = build_model_folder("Qwen2.5-7B", tmp_path / "models", tmp_path / "tok")
    vocab_size = DUMMY_CONFIGS["Qwen2.5-7B"]["vocab_size"]
    assert folder.name == "Qwen2.5-7B" and json.loads((folder / "config.json").read_text())["vocab_size"] == vocab_size
    assert num_fillers == vocab_size - len(original)
    padded = AutoTokenizer.from_pretrained(str(folder))
    assert len(padded) == vocab_size
    # Every id the model can sample decodes to text of its own; encoding is unchanged.
    assert all(padded.decode([i]) for i in (len(original), vocab_size // 2, vocab_size - 1))
    assert len({padded.decode([i]) for i in range(len(original), len(original) + 1000)}) == 1000
    text = "The capital of France is Paris. ~abc 123"
    assert padded.encode(text) == original.encode(text)
    assert pad_tokenizer_vocab(folder / "tokenizer.json", vocab_size) == 0  # already large enough


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tiny_cpu_run_writes_ratios_from_recorded_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert product_bench.main(["--export-tokenizer", str(tmp_path / "tok")]) == 0
    out = tmp_path / "product.json"
    num_prompts, output_len = 6, 4
    # Concurrency 6 with max_num_seqs capped at 2, the load client in 2 processes (3 streams each).
    code = product_bench.main(["--model", "SmolLM2-135M", "--device", "cpu", "--tokenizer-dir", str(tmp_path / "tok"),
                               "--num-prompts", str(num_prompts), "--input-len", "16", "--output-len", str(output_len),
                               "--concurrency", "6", "--max-num-seqs", "2", "--client-processes", "2",
                               "--max-num-batched-tokens", "512", "--step-trace", "--out", str(out),
                               "--log-dir", str(tmp_path / "logs")])
    printed = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert code == 0, (res, [p.read_text()[-3000:] for p in (tmp_path / "logs").glob("*.log")])
    assert res["command"].startswith("python -m bench.product_bench --model SmolLM2-135M")
    assert res["device"] and res["host_cpu"] and res["date"] and res["stopped_early"] is None
    assert res["settings"]["passthrough"] == {"INFERQ_MAX_NUM_BATCHED_TOKENS": "512"}
    assert list(res["offline"]) == ["2"]
    offline = res["offline"]["2"]
    assert offline["total_output_tokens"] == num_prompts * output_len
    assert offline["output_tok_s"] == pytest.approx(offline["total_output_tokens"] / offline["wall_s"])
    assert offline["engine"]["steps"] >= output_len * num_prompts // 2  # 2 sequences a step at most
    assert res["settings"]["client_processes"] == 2
    assert [(r["concurrency"], r["max_num_seqs"]) for r in res["serve"]] == [(6, 2)]
    for run in res["serve"]:
        assert run["startup_s"] > 0 and run["serve_exit_code"] == 0 and "error" not in run
        assert [(p["pass"], p["first_after_start"], p["seed"]) for p in run["passes"]] == [(1, True, 0), (2, False, 1)]
        for p in run["passes"]:
            assert p["completed"] == num_prompts and p["failed"] == 0 and p["errors"] == []
            assert p["total_output_tokens"] == num_prompts * output_len
            assert p["output_tok_s"] == pytest.approx(p["total_output_tokens"] / p["duration_s"])
            # The worker's engine counters, scraped around the pass: its steps ran inside it.
            assert p["engine"]["steps"] >= output_len and 0 < p["engine"]["busy_fraction"] <= 1.0
            # The worker's step trace covers the same steps (bench/step_trace.py splits the pass's wall time).
            split = breakdown(load(tmp_path / "logs" / "steps-c6.jsonl"), *p["monotonic_s"])
            assert split["steps"] == p["engine"]["steps"] and split["in_step"] <= split["wall_s"]
            # The worker's KV gauges, sampled while requests ran (bench/kv_sampler.py).
            kv = p["kv"]
            assert kv["failed_scrapes"] == 0
            for name in ("kv_usage", "internal_fragmentation", "contiguous_waste_ratio") if kv["samples"] else ():
                assert 0 <= kv[name]["mean"] <= kv[name]["max"] <= 1
            assert p["offline_output_tok_s"] == offline["output_tok_s"]
            assert p["ratio_to_offline"] == pytest.approx(p["output_tok_s"] / offline["output_tok_s"])
            for name in ("ttft_ms", "itl_ms", "tpot_ms"):
                assert set(p[name]) == {"mean", "median", "p99"} and p[name]["p99"] >= p[name]["median"] > 0
            # serve's process tree: its gateway process(es), one worker, one redis-server.
            assert p["num_processes"]["worker"] == 1 and p["num_processes"]["redis"] == 1
            assert p["num_processes"]["gateway"] >= 1
            assert set(p["cpu_s"]) == {"gateway", "worker", "redis", "client"}
            assert p["cpu_s"]["worker"] > 0 and p["cpu_s"]["gateway"] > 0 and p["cpu_s"]["client"] > 0
            for role, seconds in p["cpu_s"].items():
                assert p["cpu_s_per_1k_output_tokens"][role] == pytest.approx(seconds * 1000 / p["total_output_tokens"])
    first = res["serve"][0]["passes"][0]
    assert f"| 6 | 1 (first after start) | {first['output_tok_s']:,.0f} |" in printed
    assert f"| {first['ratio_to_offline']:.2f} |" in printed
