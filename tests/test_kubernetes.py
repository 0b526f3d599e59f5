"""deploy/kubernetes: both overlays render (`kubectl kustomize`), every resource validates offline against
the Kubernetes schemas (kubernetes-validate, strict) and the workers' ScaledObject against our schema of
KEDA's ScaledObject in deploy/kubernetes/schemas; and the manifests run the launcher's commands with compose's settings,
defaults and ports."""

from __future__ import annotations

import copy
import functools
import json
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import jsonschema
import pytest
import yaml

from common.keys import Keys
from common.settings import env_names
from common.settings_engine import OWN_ENGINE_SLOTS
from llmserve.launcher import SERVICE_COMMANDS
from tests.test_compose import compose

ROOT = Path(__file__).resolve().parent.parent
KUBE = ROOT / "deploy" / "kubernetes"
# Not in the ConfigMap: API_KEYS is in the Secret, WORKER_THREADS follows each worker's CPU limit.
NOT_IN_CONFIGMAP = {"API_KEYS", "WORKER_THREADS"}

needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None,
                                   reason="no kubectl to render with (Debian: apt-get install kubernetes-client)")


def base(folder: Path = KUBE / "base") -> list[dict]:
    """The base's resources as written (a folder named among them is a kustomization too), without kubectl."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    return [doc for name in kustomization["resources"]
            for doc in (base(folder / name) if (folder / name).is_dir()
                        else yaml.safe_load_all((folder / name).read_text())) if doc]


@functools.cache
def rendered(overlay: str) -> tuple[dict, ...]:
    result = subprocess.run(["kubectl", "kustomize", str(KUBE / "overlays" / overlay)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def find(resources: list[dict] | tuple[dict, ...], kind: str, name: str) -> dict:
    return next(r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name)


def container(resources: list[dict] | tuple[dict, ...], name: str) -> dict:
    return find(resources, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]


def settings() -> dict[str, str]:
    return find(base(), "ConfigMap", "llmserve-settings")["data"]


def compose_defaults() -> dict[str, str]:
    return {key: re.fullmatch(r"\$\{\w+:-(.*)\}", value).group(1)
            for key, value in compose()["x-settings"].items()}


def keda_schema() -> dict:
    return closed(json.loads((KUBE / "schemas" / "scaledobject.json").read_text()))


def closed(schema: dict) -> dict:
    """The schema with unknown fields rejected wherever it lists the known ones, as the API server
    does for a custom resource (it prunes them) and `kubectl apply --validate=strict` reports."""
    schema = dict(schema)
    if "properties" in schema:
        schema["properties"] = {k: closed(v) for k, v in schema["properties"].items()}
        schema.setdefault("additionalProperties", False)
    if isinstance(schema.get("items"), dict):
        schema["items"] = closed(schema["items"])
    return schema


@needs_kubectl
@pytest.mark.parametrize("overlay", ["cpu", "gpu", "second-model"])
def test_overlays_render_and_validate_against_the_kubernetes_and_keda_schemas(overlay: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    resources = rendered(overlay)
    versions = kubernetes_validate.utils.all_versions()
    for resource in resources:
        if resource["kind"] == "ScaledObject":
            jsonschema.validate(resource, keda_schema())
            continue
        for version in (versions[0], versions[-1]):  # the oldest and newest Kubernetes it knows
            kubernetes_validate.validate(resource, version, strict=True)
    kinds = sorted(r["kind"] for r in resources)
    workers = ["Deployment", "PodDisruptionBudget", "ScaledObject"] * (2 if overlay == "second-model" else 1)
    assert kinds == sorted(["Namespace", "ConfigMap", "Secret", "Deployment", "Service", "Deployment", "Service",
                            "PodDisruptionBudget", "HorizontalPodAutoscaler", "Deployment", "PodDisruptionBudget",
                            *workers])
    assert {r["metadata"].get("namespace") for r in resources if r["kind"] != "Namespace"} == {"llmserve"}
    # The validators are not blind: an unknown field fails each of them.
    broken = copy.deepcopy(find(resources, "Deployment", "worker"))
    broken["spec"]["template"]["spec"]["terminationGracePeriod"] = 40
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, versions[-1], strict=True)
    broken = copy.deepcopy(find(resources, "ScaledObject", "worker"))
    broken["spec"]["advanced"]["scalingModifier"] = {}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, keda_schema())


def test_the_services_run_the_launcher_commands_from_the_compose_images() -> None:
    services = compose()["services"]
    for name, command in SERVICE_COMMANDS.items():
        spec = container(base(), name)
        assert spec["command"] == command, name
        assert spec["image"] == services[name]["image"], name


def test_one_configmap_holds_every_setting_with_compose_defaults_and_a_secret_the_api_keys() -> None:
    data = settings()
    assert set(data) == set(env_names()) - NOT_IN_CONFIGMAP
    defaults = compose_defaults()
    for key, value in data.items():
        assert value == defaults[key], key
    assert set(find(base(), "Secret", "llmserve-secrets")["stringData"]) == {"API_KEYS"}
    for name in SERVICE_COMMANDS:
        sources = [next(iter(s.values()))["name"] for s in container(base(), name)["envFrom"]]
        assert sources == ["llmserve-settings", "llmserve-secrets"], name
    threads = container(base(), "worker")["env"]
    assert threads == [{"name": "WORKER_THREADS", "valueFrom": {"resourceFieldRef": {
        "containerName": "worker", "resource": "limits.cpu", "divisor": "1"}}}]


def test_ports_probes_and_grace_match_the_settings() -> None:
    data, resources = settings(), base()
    ports = {"gateway": data["GATEWAY_PORT"], "scheduler": data["SCHEDULER_METRICS_PORT"],
             "worker": data["WORKER_METRICS_PORT"]}
    for name, port in ports.items():
        spec = container(resources, name)
        assert [str(p["containerPort"]) for p in spec["ports"]] == [port], name
        annotations = find(resources, "Deployment", name)["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == port, name
    gateway = container(resources, "gateway")
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "tcpSocket" in gateway["livenessProbe"], "a Redis outage (/health 503) must not restart gateways"
    assert find(resources, "Deployment", "gateway")["spec"]["replicas"] == 2
    assert find(resources, "Deployment", "scheduler")["spec"]["replicas"] == 2
    assert "replicas" not in find(resources, "Deployment", "worker")["spec"], "KEDA owns the worker count"
    grace = find(resources, "Deployment", "worker")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > float(data["DRAIN_TIMEOUT"])
    assert float(compose()["services"]["worker"]["stop_grace_period"].rstrip("s")) > float(data["DRAIN_TIMEOUT"])
    for kind in ("gateway", "scheduler", "worker"):
        find(resources, "PodDisruptionBudget", kind)
    assert find(resources, "HorizontalPodAutoscaler", "gateway")["spec"]["minReplicas"] == 2


def test_redis_runs_as_compose_runs_it() -> None:
    redis = container(base(), "redis")
    compose_args = compose()["services"]["redis"]["command"]
    assert redis["args"] == [arg.replace("${REDIS_MAXMEMORY:-1gb}", "$(REDIS_MAXMEMORY)") for arg in compose_args]
    assert redis["image"] == compose()["services"]["redis"]["image"]
    url = urlparse(settings()["REDIS_URL"])
    assert find(base(), "Service", url.hostname)["spec"]["ports"][0]["port"] == url.port


def test_the_scaled_object_reads_this_deployments_stream_and_gateway() -> None:
    data = settings()
    namespace = yaml.safe_load((KUBE / "base" / "kustomization.yaml").read_text())["namespace"]
    scaled = find(base(), "ScaledObject", "worker")["spec"]
    assert scaled["scaleTargetRef"]["name"] == "worker" and scaled["minReplicaCount"] == 0
    slots = int(data["WORKER_SLOTS"]) or OWN_ENGINE_SLOTS  # 0: the own engine's default
    assert scaled["advanced"]["scalingModifiers"]["target"] == str(slots)
    triggers = {t["name"]: t for t in scaled["triggers"]}
    assert set(re.findall(r"\w+", scaled["advanced"]["scalingModifiers"]["formula"])) == set(triggers)
    redis_url = urlparse(data["REDIS_URL"])
    waiting = triggers["waiting"]["metadata"]
    assert waiting["stream"] == Keys(data["NAMESPACE"]).requests
    assert waiting["address"] == f"{redis_url.hostname}.{namespace}.svc.cluster.local:{redis_url.port}"
    assert waiting["databaseIndex"] == redis_url.path.strip("/")
    assert "consumerGroup" not in waiting, "the stream's length, not the group's pending entries"
    running = triggers["running"]["metadata"]
    assert running["url"] == f"http://gateway.{namespace}.svc.cluster.local:{data['GATEWAY_PORT']}/health"


@needs_kubectl
def test_the_gpu_overlay_gives_each_worker_a_gpu_and_the_cuda_image() -> None:
    resources = rendered("gpu")
    worker = container(resources, "worker")
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    gpu_compose = yaml.safe_load((ROOT / "docker-compose.gpu.yml").read_text())
    assert worker["image"] == gpu_compose["services"]["worker"]["image"]
    assert find(resources, "ConfigMap", "llmserve-settings")["data"]["WORKER_DEVICE"] == "cuda"
    cpu = container(rendered("cpu"), "worker")
    assert cpu["image"] == compose()["services"]["worker"]["image"]
    assert "nvidia.com/gpu" not in cpu["resources"]["limits"]


@needs_kubectl
def test_each_model_has_its_own_workers_scaled_on_its_own_requests() -> None:
    resources = rendered("second-model")
    data = find(resources, "ConfigMap", "llmserve-settings")["data"]
    models = {"worker": data["MODEL"]}
    second_env = {e["name"]: e.get("value") for e in container(resources, "worker-second")["env"]}
    models["worker-second"] = second_env["SERVED_MODEL_NAME"]
    assert second_env["MODEL"] and models["worker-second"] in data["MODELS"].split(",")
    assert container(resources, "worker-second")["resources"] == container(resources, "worker")["resources"]
    selectors = {name: find(resources, "Deployment", name)["spec"]["selector"]["matchLabels"] for name in models}
    assert selectors["worker"] != selectors["worker-second"]
    for name, model in models.items():
        assert find(resources, "PodDisruptionBudget", name)["spec"]["selector"]["matchLabels"] == selectors[name]
        scaled = find(resources, "ScaledObject", name)["spec"]
        assert scaled["scaleTargetRef"]["name"] == name and scaled["minReplicaCount"] == 0
        triggers = {t["name"]: t["metadata"] for t in scaled["triggers"]}
        assert set(triggers) == {"waiting", "running"}
        for field, trigger in triggers.items():
            assert trigger["url"] == f"http://gateway.llmserve.svc.cluster.local:{data['GATEWAY_PORT']}" \
                f"/health?model={model}" and trigger["valueLocation"] == field
