"""Settings validation raises ``SettingsError`` naming the flag, the variable, the value and
what is allowed (also under ``python -O``), and the CLI prints it without a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shared.cli import load_commands

app = load_commands()
from shared.settings import EngineSettings, ModelSettings, SettingsError, WorkerSettings, build

ROOT = Path(__file__).resolve().parents[1]

# (settings class, field, a value that is not allowed, what the message says is allowed)
INVALID = [
    (ModelSettings, "load_format", "safetensors", "must be one of auto, dummy"),
    (ModelSettings, "dtype", "fp8", "must be one of auto, float32, bfloat16, float16"),
    (ModelSettings, "device", "tpu", "must be one of auto, cpu, cuda"),
    (ModelSettings, "max_model_len", -1, "must be at least 0"),
    (EngineSettings, "block_size", 0, "must be at least 1"),
    (EngineSettings, "max_num_seqs", 0, "must be at least 1"),
    (EngineSettings, "max_num_batched_tokens", -3, "must be at least 1"),
    (EngineSettings, "num_kv_blocks", -1, "must be at least 0"),
    (EngineSettings, "cpu_threads", -2, "must be at least 0"),
    (EngineSettings, "gpu_memory_utilization", 0.0, "must be above 0 and at most 1"),
    (EngineSettings, "gpu_memory_utilization", 1.5, "must be above 0 and at most 1"),
    (EngineSettings, "attention_backend", "flash", "must be one of auto, torch, cpu, triton"),
    (EngineSettings, "sim_step_time_ms", -1.0, "must be at least 0.0"),
    (WorkerSettings, "engine_stall_timeout_s", -0.5, "must be at least 0.0"),
    (WorkerSettings, "fault_hang_after_steps", -1, "must be at least 0"),
]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@pytest.mark.parametrize("cls,name,value,allowed", INVALID, ids=[f"{row[1]}={row[2]}" for row in INVALID])
def test_invalid_value_names_flag_variable_value_and_what_is_allowed(cls: type, name: str, value: object,
                                                                     allowed: str) -> None:
    with pytest.raises(SettingsError) as err:
        cls(**{name: value})
    assert str(err.value) == f"{_flag(name)} (INFERQ_{name.upper()}) = {value!r}: {allowed}"
    assert err.value.field_name == name and isinstance(err.value, ValueError)


def test_boundary_values_are_allowed() -> None:
    EngineSettings(block_size=1, max_num_seqs=1, max_num_batched_tokens=1, num_kv_blocks=0, cpu_threads=0,
                   gpu_memory_utilization=1.0, sim_step_time_ms=0.0)
    ModelSettings(max_model_len=1, dtype="float16", device="cpu", load_format="dummy")
    WorkerSettings(engine_stall_timeout_s=0.0, fault_hang_after_steps=0)


def test_checks_survive_python_dash_o() -> None:
    """``assert`` would vanish under ``-O``; the checks must not."""
    code = "from shared.settings import EngineSettings; EngineSettings(max_num_seqs=0)"
    run = subprocess.run([sys.executable, "-O", "-c", code], check=False, cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 1
    assert "SettingsError: --max-num-seqs (INFERQ_MAX_NUM_SEQS) = 0: must be at least 1" in run.stderr


@pytest.mark.parametrize("raw,expected", [("abc", "must parse as int"), ("4.5", "must parse as int"),
                                          ("0", "must be at least 1")])
def test_bad_environment_value_raises_settings_error(raw: str, expected: str) -> None:
    with pytest.raises(SettingsError, match=rf"^--max-num-seqs \(INFERQ_MAX_NUM_SEQS\) = .*{expected}"):
        build(EngineSettings, {}, {"INFERQ_MAX_NUM_SEQS": raw})


@pytest.mark.parametrize("raw,expected", [("1", True), ("Yes", True), ("on", True), ("false", False),
                                          ("OFF", False), ("0", False), ("", False)])
def test_switch_variables_parse(raw: str, expected: bool) -> None:
    assert build(EngineSettings, {}, {"INFERQ_ENFORCE_EAGER": raw}).enforce_eager is expected


def test_unparsable_switch_variable_is_an_error() -> None:
    """``maybe`` used to read as False without a word."""
    with pytest.raises(SettingsError, match=r"^--enforce-eager \(INFERQ_ENFORCE_EAGER\) = 'maybe': must parse as bool"):
        build(EngineSettings, {}, {"INFERQ_ENFORCE_EAGER": "maybe"})


def test_cli_bad_flag_exits_2_with_the_message_and_no_traceback() -> None:
    """The real entry point: ``python -m shared.cli worker --max-num-seqs 0``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERQ_")}
    run = subprocess.run([sys.executable, "-m", "shared.cli", "worker", "--max-num-seqs", "0"], check=False,
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip() == "Error: --max-num-seqs (INFERQ_MAX_NUM_SEQS) = 0: must be at least 1"
    assert "Traceback" not in run.stdout + run.stderr


def test_cli_bad_variable_exits_2_with_the_message() -> None:
    result = CliRunner().invoke(app, ["gateway"], env={"INFERQ_DTYPE": "fp8"})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert "Error: --dtype (INFERQ_DTYPE) = 'fp8': must be one of auto, float32, bfloat16, float16" in result.output
    assert "Traceback" not in result.output
