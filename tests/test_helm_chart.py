"""The Helm chart ``shared/deploy/helm/inferq`` renders, its manifests are valid Kubernetes
objects, and it agrees with the code. Offline, as no cluster runs here:

- rendering: Helm's own template engine (the Helm v4 Go SDK inside the ``helm-python-sdk``
  package), ``helm lint --strict`` included;
- schemas: every manifest against the Kubernetes JSON schemas of ``kubernetes-validate`` in
  their strict form (an unknown field is an error, as with ``kubeconform -strict`` and the API
  server's strict field validation), at the oldest Kubernetes the chart allows and the newest
  the package knows; the ScaledObject against ``SCALED_OBJECT_SCHEMA``, ours, of the fields
  KEDA's ScaledObject specification documents, as strict (Kubernetes' own types in it, the
  object's metadata and the HPA's behavior, from ``kubernetes-validate``);
- facts: the gateway's probes, GPUs per worker and the tensor-parallel size, the drain inside
  the grace period, the ScaledObject's target and query (metrics the gateway exports), scrape
  ports equal to the containers' ports, every ``INFERQ_*`` variable a setting of
  ``shared/settings.py``, the Grafana dashboard byte-for-byte the one in ``shared/deploy/``.
"""

from __future__ import annotations

import copy
import functools
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import referencing
import yaml  # type: ignore[import-untyped]

from gateway.metrics import exported_names as gateway_names
from shared.model_source import resolve_model, served_model_name
from shared.settings import ALL_SETTINGS, DEFAULT_MODEL_NAME, ModelSettings, env_name

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "shared" / "deploy"
CHART = DEPLOY / "helm" / "inferq"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "inferq.json"
RELEASE = "prod"  # not the chart's name, so that names are "prod-inferq-..."

#: The prometheus trigger's metadata keys in KEDA v2.20.2 (pkg/scalers/prometheus_scaler.go);
#: the schema types metadata as a free map, so a misspelt key would pass it.
PROMETHEUS_TRIGGER_KEYS = {"serverAddress", "query", "queryParameters", "threshold", "activationThreshold",
                           "namespace", "customHeaders", "ignoreNullValues", "unsafeSsl", "awsRegion", "timeout",
                           "identityOwner"}

MISSING = ("is a test dependency (pyproject.toml, extra `test`; `make setup` installs it): without it the Helm "
           "chart goes unchecked")

IMPORT_ERROR = ""
try:
    import helm_python as helm
    import kubernetes_validate  # type: ignore[import-untyped]
except ImportError as exc:  # a failure, not a skip (fixture `chart`): CI must check the chart
    helm = kubernetes_validate = None  # type: ignore[assignment]
    IMPORT_ERROR = f"{exc.name} {MISSING}"

#: Value sets that together reach every branch of the templates.
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "scale-to-zero": {"autoscaling": {"minReplicaCount": 0, "cooldownPeriodS": 600}},
    "fixed-workers": {"autoscaling": {"enabled": False}, "worker": {"replicas": 3}},
    "tensor-parallel": {"worker": {"gpus": 4}, "model": {"name": "/models/llama-3-70b",
                                                      "volume": {"persistentVolumeClaim": {"claimName": "models"}}}},
    "redis-url-secret": {"redis": {"urlSecret": {"name": "inferq-redis", "key": "url"}},
                         "files": {"existingClaim": "shared-files"}},
    "minimal": {"redis": {"url": "redis://redis:6379/0"}, "batchWorker": {"enabled": False},
                "files": {"persistence": {"enabled": False}}, "image": {"registry": "registry.example.com/ml/"},
                "monitoring": {"scrapeAnnotations": False,
                               "grafana": {"dashboard": {"enabled": False}, "datasource": {"enabled": False}}},
                "gateway": {"env": {"INFERQ_RATE_LIMIT_RPM": 600}, "extraEnv": [
                    {"name": "INFERQ_API_KEYS", "valueFrom": {"secretKeyRef": {"name": "keys", "key": "keys"}}}]},
                "worker": {"env": {"INFERQ_KV_CACHE_DTYPE": "fp8"}}},
}


@pytest.fixture(scope="module")
def chart() -> Iterator[Any]:
    """The chart, loaded by Helm. Fails (not skips) without the tools."""
    if helm is None:
        pytest.fail(IMPORT_ERROR)
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render(chart: Any, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every object the chart renders with ``values`` over its defaults (``helm template``).

    Raises:
        helm_python.HelmError: a template fails (a ``fail``/``required`` included).
    """
    manifests = chart.render(copy.deepcopy(values or {}), name=RELEASE, namespace="inferq", is_install=True)
    return [doc for path, text in sorted(manifests.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """The rendered object of ``kind`` named ``{release}-inferq-{name}``."""
    full = f"{RELEASE}-inferq-{name}"
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == full]
    return doc


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(only)


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    """A container's env as ``{name: value or valueFrom}``; a name given twice is an error."""
    names = [e["name"] for e in c.get("env", [])]
    assert len(names) == len(set(names)), f"{c['name']}: a variable is set twice: {names}"
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


# -- schemas ---------------------------------------------------------------------------------

def kube_versions() -> list[str]:
    """The chart's oldest Kubernetes (Chart.yaml ``kubeVersion``) and the newest with schemas."""
    floor = re.fullmatch(r">=\s*(\d+\.\d+\.\d+)(-0)?", yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"])
    assert floor, "Chart.yaml kubeVersion must read >=X.Y.Z-0"
    return [floor.group(1), kubernetes_validate.utils.latest_version()] if kubernetes_validate else []


#: Where kubernetes-validate's schemas define Kubernetes' own types (``$id`` of ``_definitions.json``).
KUBERNETES_TYPES = "https://kubernetes.io/api/_definitions.json#/$defs/io.k8s."
INT32_MAX = 2**31 - 1
NAME = {"type": "string", "minLength": 1}


def closed(required: tuple[str, ...] = (), **properties: Any) -> dict[str, Any]:
    """An object schema of exactly ``properties``: an unknown field is an error, as with the
    API server's strict field validation."""
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


def int32(minimum: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "maximum": INT32_MAX}


def one_of(*values: str) -> dict[str, Any]:
    return {"type": "string", "enum": list(values)}


#: A ScaledObject (``keda.sh/v1alpha1``): the fields of KEDA's ScaledObject specification
#: (keda.sh/docs/2.20/reference/scaledobject-spec/), types as KEDA's API types declare them
#: (int32 counts and seconds, string scalingModifiers targets). Closed at every level but a
#: trigger's ``metadata`` (each scaler's own keys, all strings) and Kubernetes' own types.
SCALED_OBJECT_SCHEMA = closed(
    ("apiVersion", "kind", "metadata", "spec"),
    apiVersion={"const": "keda.sh/v1alpha1"},
    kind={"const": "ScaledObject"},
    metadata={"type": "object", "required": ["name"],
              "$ref": KUBERNETES_TYPES + "apimachinery.pkg.apis.meta.v1.ObjectMeta"},
    spec=closed(
        ("scaleTargetRef", "triggers"),
        scaleTargetRef=closed(("name",), name=NAME, kind=NAME, apiVersion=NAME, envSourceContainerName=NAME),
        pollingInterval=int32(1),  # seconds, as are the two cooldowns
        cooldownPeriod=int32(0),
        initialCooldownPeriod=int32(0),
        idleReplicaCount=int32(0),
        minReplicaCount=int32(0),
        maxReplicaCount=int32(1),
        fallback=closed(("failureThreshold", "replicas"), failureThreshold=int32(0), replicas=int32(0),
                        behavior=one_of("static", "currentReplicas", "currentReplicasIfHigher",
                                        "currentReplicasIfLower", "scalingModifiers")),
        advanced=closed(
            restoreToOriginalReplicaCount={"type": "boolean"},
            horizontalPodAutoscalerConfig=closed(
                name=NAME, behavior={"$ref": KUBERNETES_TYPES + "api.autoscaling.v2.HorizontalPodAutoscalerBehavior"}),
            scalingModifiers=closed(("formula", "target"), formula=NAME, target=NAME, activationTarget=NAME,
                                    metricType=one_of("AverageValue", "Value")),
        ),
        triggers={"type": "array", "minItems": 1, "items": closed(
            ("type", "metadata"),
            type=NAME,
            name=NAME,
            metadata={"type": "object", "additionalProperties": {"type": "string"}},
            authenticationRef=closed(("name",), name=NAME,
                                     kind=one_of("TriggerAuthentication", "ClusterTriggerAuthentication")),
            metricType=one_of("AverageValue", "Value", "Utilization"),
            useCachedMetrics={"type": "boolean"},
        )},
    ),
)


@functools.cache
def keda_validator(kube_version: str) -> jsonschema.Draft202012Validator:
    """Validator of ScaledObjects against ``SCALED_OBJECT_SCHEMA``, Kubernetes' own types from
    kubernetes-validate's strict schemas of ``kube_version`` (X.Y.Z, a version it ships).

    Raises:
        kubernetes_validate.utils.VersionNotSupportedError: no schemas for ``kube_version``.
    """
    types = kubernetes_validate.utils.schema_contents(
        f"kubernetes-json-schema/v{kube_version}-local-strict/_definitions.json", kube_version)
    registry = referencing.Registry().with_resource(types["$id"], referencing.Resource.from_contents(types))
    jsonschema.Draft202012Validator.check_schema(SCALED_OBJECT_SCHEMA)
    return jsonschema.Draft202012Validator(SCALED_OBJECT_SCHEMA, registry=registry)


def schema_errors(doc: dict[str, Any], kube_version: str) -> list[str]:
    """What is wrong with ``doc`` against its schema (nothing: ``[]``). A kind without a schema
    is an error, not a pass."""
    where = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    if doc.get("apiVersion") == "keda.sh/v1alpha1":
        if doc.get("kind") != "ScaledObject":
            return [f"{where}: no schema for {doc.get('kind')} of keda.sh/v1alpha1"]
        keda = keda_validator(kube_version)
        return [f"{where}: {'.'.join(map(str, e.absolute_path))}: {e.message}" for e in keda.iter_errors(doc)]
    try:
        kubernetes_validate.validate(doc, kube_version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{where} (Kubernetes {kube_version}): {'.'.join(map(str, e.path))}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [f"{where}: {e.message}"]
    return []


def test_chart_lints_clean() -> None:
    if helm is None:
        pytest.fail(IMPORT_ERROR)
    report = helm.lint(CHART, strict=True, kube_version=f"v{kube_versions()[0]}")
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, problems


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_manifests_match_their_schemas(chart: Any, value_set: str) -> None:
    docs = render(chart, VALUE_SETS[value_set])
    errors = [err for version in kube_versions() for doc in docs for err in schema_errors(doc, version)]
    assert not errors, "\n".join(errors)


def test_schema_check_rejects_broken_manifests(chart: Any) -> None:
    """The check above is not vacuous: each of these breakages of a rendered object is found."""
    docs = render(chart)
    version = kube_versions()[-1]

    def broken(kind: str, name: str, change: Any) -> list[str]:
        doc = copy.deepcopy(find(docs, kind, name))
        change(doc)
        return schema_errors(doc, version)

    def rename_port_field(d: dict[str, Any]) -> None:
        port = d["spec"]["template"]["spec"]["containers"][0]["ports"][0]
        port["containerport"] = port.pop("containerPort")

    assert broken("Deployment", "worker", rename_port_field)  # a misspelt field
    assert broken("Deployment", "gateway", lambda d: d["spec"]["template"]["spec"].pop("containers"))  # required
    assert broken("Service", "gateway", lambda d: d["spec"]["ports"][0].update(port="http"))  # wrong type
    assert broken("ScaledObject", "worker", lambda d: d["spec"].update(cooldownPeriodS=d["spec"].pop("cooldownPeriod")))  # misspelt
    assert broken("ScaledObject", "worker", lambda d: d["spec"].pop("scaleTargetRef"))  # required
    assert broken("ScaledObject", "worker", lambda d: d["spec"].update(maxReplicaCount="8"))  # wrong type
    assert broken("ScaledObject", "worker", lambda d: d["spec"]["triggers"][0].pop("type"))
    assert broken("ScaledObject", "worker", lambda d: d["spec"]["scaleTargetRef"].update(deployment="x"))
    assert broken("ScaledObject", "worker", lambda d: d["spec"]["scaleTargetRef"].pop("name"))  # no target
    assert broken("ScaledObject", "worker", lambda d: d["metadata"].pop("name"))
    assert broken("ScaledObject", "worker", lambda d: d["spec"]["triggers"][0]["metadata"].update(threshold=8))
    assert broken("ScaledObject", "worker", lambda d: d["spec"]["fallback"].update(behavior="current"))
    hpa = "horizontalPodAutoscalerConfig"  # its behavior is Kubernetes' HPA type: checked as strictly
    assert broken("ScaledObject", "worker", lambda d: d["spec"]["advanced"][hpa]["behavior"].update(scaledown={}))
    unknown = {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledJob", "metadata": {"name": "x"}}
    assert schema_errors(unknown, version)  # no schema is no pass


@pytest.mark.parametrize(("values", "message"), [
    ({"worker": {"gpus": 0}}, "worker.gpus must be at least 1"),
    ({"autoscaling": {"minReplicaCount": 5, "maxReplicaCount": 2}}, "maxReplicaCount must be at least"),
    ({"autoscaling": {"minReplicaCount": -1}}, "minReplicaCount must not be negative"),
    ({"autoscaling": {"requestsPerWorker": -4}}, "requestsPerWorker must be above 0"),
    ({"redis": {"sentinel": {"hosts": []}}}, "set redis.sentinel.hosts, redis.url or redis.urlSecret.name"),
    ({"worker": {"drainMarginS": 0}}, "drainMarginS must be at least 1"),
])
def test_bad_values_fail_with_the_reason(chart: Any, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        render(chart, values)


# -- facts that tie the chart to the code ------------------------------------------------------

def test_gateway_probes_and_service(chart: Any) -> None:
    docs = render(chart)
    deployment, service = find(docs, "Deployment", "gateway"), find(docs, "Service", "gateway")
    gateway = container(deployment)
    ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}  # a worker serves the model
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert gateway["startupProbe"]["httpGet"]["path"] == "/health"
    assert int(env_of(gateway)["INFERQ_PORT"]) == ports["http"] == 8000
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]


def test_scale_to_zero_keeps_gateways_in_their_service(chart: Any) -> None:
    """With no worker, /ready says 503: the gateways would leave their Service, no request
    could queue, and KEDA would never start a worker. So readiness is /health there."""
    docs = render(chart, VALUE_SETS["scale-to-zero"])
    assert container(find(docs, "Deployment", "gateway"))["readinessProbe"]["httpGet"]["path"] == "/health"
    spec = find(docs, "ScaledObject", "worker")["spec"]
    assert spec["minReplicaCount"] == 0 and spec["cooldownPeriod"] == 600


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_worker_requests_its_gpus_and_splits_over_them(chart: Any, gpus: int) -> None:
    deployment = find(render(chart, {"worker": {"gpus": gpus}}), "Deployment", "worker")
    spec, worker = deployment["spec"]["template"]["spec"], container(deployment)
    resources = worker["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == gpus
    assert int(env_of(worker)["INFERQ_TENSOR_PARALLEL_SIZE"]) == gpus
    shm = [v for v in spec["volumes"] if v["name"] == "shm"]
    assert bool(shm) == (gpus > 1)  # NCCL's shared memory between ranks
    if shm:
        assert shm[0]["emptyDir"]["medium"] == "Memory"
        assert {"name": "shm", "mountPath": "/dev/shm"} in worker["volumeMounts"]


def test_worker_drains_inside_its_grace_period(chart: Any) -> None:
    for values in ({}, {"worker": {"drainTimeoutS": 600, "drainMarginS": 15}}):
        pod = find(render(chart, values), "Deployment", "worker")["spec"]["template"]["spec"]
        drain_s = float(env_of(pod["containers"][0])["INFERQ_DRAIN_TIMEOUT_S"])
        assert pod["terminationGracePeriodSeconds"] >= drain_s + 1
        assert pod["terminationGracePeriodSeconds"] == drain_s + values.get("worker", {}).get("drainMarginS", 30)
        assert pod["shareProcessNamespace"] is True  # the worker is not PID 1: SIGTERM is never ignored


def test_scaledobject_scales_the_worker_deployment_on_the_queue(chart: Any) -> None:
    docs = render(chart)
    worker, scaled = find(docs, "Deployment", "worker"), find(docs, "ScaledObject", "worker")
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": worker["apiVersion"], "kind": worker["kind"],
                                      "name": worker["metadata"]["name"]}
    assert "replicas" not in worker["spec"]  # KEDA owns the count; an upgrade must not reset it
    assert 1 == spec["minReplicaCount"] <= spec["maxReplicaCount"] == 8  # the CRD's CEL rule: min <= max
    assert spec["pollingInterval"] == 15 and spec["cooldownPeriod"] == 300
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"  # fallback needs it
    meta = trigger["metadata"]
    assert set(meta) <= PROMETHEUS_TRIGGER_KEYS and {"serverAddress", "query", "threshold"} <= set(meta)
    assert meta["ignoreNullValues"] == "false"  # no series is an error (fallback), never "no load"
    names = set(re.findall(r"inferq:[A-Za-z0-9_:]+", meta["query"]))
    assert names == {"inferq:queue_depth", "inferq:num_pending_entries"}
    assert names <= set(gateway_names())
    served = env_of(container(find(docs, "Deployment", "gateway")))["INFERQ_MODEL"]
    assert meta["query"].count(f'model_name="{served}"') == 2
    assert float(meta["threshold"]) == float(env_of(container(worker))["INFERQ_MAX_NUM_SEQS"])
    assert spec["fallback"]["replicas"] >= 1


@pytest.mark.parametrize(("folder", "served"), [("llama-3-70b", ""), ("llama-3-70b/", ""), ("qwen", "chat")])
def test_query_selects_the_served_model_name(chart: Any, tmp_path: Path, folder: str, served: str) -> None:
    """The query's ``model_name`` is the name the gateway serves (and labels its metrics with)
    for a model folder, as ``shared/model_source.py`` resolves it."""
    (tmp_path / folder.rstrip("/")).mkdir()
    (tmp_path / folder.rstrip("/") / "config.json").write_text("{}")
    model = ModelSettings(model=f"{tmp_path}/{folder}", served_model_name=served)
    expected = served_model_name(model, resolve_model(model.model))
    values = {"model": {"name": model.model, "servedModelName": served}}
    query = find(render(chart, values), "ScaledObject", "worker")["spec"]["triggers"][0]["metadata"]["query"]
    assert set(re.findall(r'model_name="([^"]*)"', query)) == {expected}
    assert chart.values["model"]["name"] == DEFAULT_MODEL_NAME


def test_fixed_worker_count_without_keda(chart: Any) -> None:
    docs = render(chart, VALUE_SETS["fixed-workers"])
    assert not [d for d in docs if d["kind"] == "ScaledObject"]
    assert find(docs, "Deployment", "worker")["spec"]["replicas"] == 3


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_scrape_annotations_name_the_metrics_port(chart: Any, value_set: str) -> None:
    docs = render(chart, VALUE_SETS[value_set])
    scraped = {}
    for name, port_variable in (("gateway", "INFERQ_PORT"), ("worker", "INFERQ_METRICS_PORT")):
        deployment = find(docs, "Deployment", name)
        annotations = deployment["spec"]["template"]["metadata"].get("annotations", {})
        scraped[name] = annotations.get("prometheus.io/scrape") == "true"
        if scraped[name]:
            c = container(deployment)
            assert int(annotations["prometheus.io/port"]) in {p["containerPort"] for p in c["ports"]}
            assert annotations["prometheus.io/port"] == env_of(c)[port_variable]
            assert annotations["prometheus.io/path"] == "/metrics"
    assert scraped == {"gateway": value_set != "minimal", "worker": value_set != "minimal"}


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_variable_is_a_setting(chart: Any, value_set: str) -> None:
    settings = {env_name(f) for cls in ALL_SETTINGS for f in cls.__dataclass_fields__.values()}
    used = {name for d in render(chart, VALUE_SETS[value_set]) if d["kind"] == "Deployment"
            for name in env_of(container(d)) if name.startswith("INFERQ_")}
    assert used - settings == set(), "not a setting in shared/settings.py"
    assert {"INFERQ_REDIS_URL", "INFERQ_NAMESPACE"} <= used


@pytest.mark.parametrize(("values", "expected"), [
    ({}, "redis+sentinel://redis:26379/mymaster/0"),
    ({"redis": {"sentinel": {"hosts": ["s1:26379", "s2:26379", "s3:26379"], "masterSet": "queue", "db": 2}}},
     "redis+sentinel://s1:26379,s2:26379,s3:26379/queue/2"),
    ({"redis": {"url": "redis://redis:6379/0"}}, "redis://redis:6379/0"),
    ({"redis": {"url": "redis://redis:6379/0", "urlSecret": {"name": "r", "key": "url"}}},
     {"secretKeyRef": {"name": "r", "key": "url"}}),
])
def test_every_process_gets_the_same_redis_url(chart: Any, values: dict[str, Any], expected: Any) -> None:
    deployments = [d for d in render(chart, values) if d["kind"] == "Deployment"]
    assert len(deployments) == 3
    assert [env_of(container(d))["INFERQ_REDIS_URL"] for d in deployments] == [expected] * 3


def test_batch_worker_reaches_the_gateway_and_shares_its_files(chart: Any) -> None:
    docs = render(chart)
    batch, gateway = find(docs, "Deployment", "batch-worker"), find(docs, "Deployment", "gateway")
    service = find(docs, "Service", "gateway")
    assert container(batch)["command"] == ["inferq", "batch-worker"]
    assert env_of(container(batch))["INFERQ_BATCH_GATEWAY_URL"] == (
        f"http://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}")
    claim = find(docs, "PersistentVolumeClaim", "files")
    for d in (batch, gateway):
        pod = d["spec"]["template"]["spec"]
        (files,) = [v for v in pod["volumes"] if v["name"] == "files"]
        assert files["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        mount = [m["mountPath"] for m in container(d)["volumeMounts"] if m["name"] == "files"]
        assert mount == [env_of(container(d))["INFERQ_FILES_DIR"]]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


def test_dashboard_is_the_one_in_shared_deploy(chart: Any) -> None:
    copy_in_chart = CHART / "dashboards" / DASHBOARD.name
    assert copy_in_chart.read_bytes() == DASHBOARD.read_bytes(), (
        f"the chart's dashboard differs from its source: cp {DASHBOARD.relative_to(ROOT)} "
        f"{copy_in_chart.relative_to(ROOT)}")
    docs = render(chart)
    assert find(docs, "ConfigMap", "dashboard")["data"]["inferq.json"] == DASHBOARD.read_text()
    provisioned = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (source,) = yaml.safe_load(find(docs, "ConfigMap", "datasource")["data"]["inferq-datasource.yaml"])["datasources"]
    assert source["uid"] == provisioned["datasources"][0]["uid"]  # the uid the dashboard's panels name
    assert source["url"] == chart.values["monitoring"]["prometheusUrl"]


def test_app_version_is_the_package_version() -> None:
    package = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"] == package
