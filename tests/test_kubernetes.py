"""deploy/kubernetes validates offline against the Kubernetes schemas, and says what the service needs: API
probes, GPU workers with a grace period, a migration Job, the same commands and settings as docker-compose."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = ROOT / "deploy" / "kubernetes"


def _resources() -> dict[tuple[str, str], dict]:
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    found = {}
    for name in kustomization["resources"]:
        for resource in yaml.safe_load_all((MANIFESTS / name).read_text()):
            found[resource["kind"], resource["metadata"]["name"]] = resource
    return found


def test_every_manifest_validates_against_the_kubernetes_schemas():
    version = kubernetes_validate.latest_version()
    resources = _resources()
    assert len(resources) == 8
    for resource in resources.values():
        kubernetes_validate.validate(resource, version, strict=True)


def test_a_broken_manifest_is_caught():
    deployment = _resources()["Deployment", "fusetune-api"]
    broken = {**deployment, "spec": {**deployment["spec"], "replicas": "two"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


def _container(resource: dict) -> dict:
    return resource["spec"]["template"]["spec"]["containers"][0]


def test_the_deployment_matches_compose_and_what_the_service_needs():
    resources = _resources()
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    api, worker = (
        _container(resources["Deployment", "fusetune-api"]),
        _container(resources["Deployment", "fusetune-worker"]),
    )
    migrate = _container(resources["Job", "fusetune-migrate"])
    assert api["command"] == compose["api"]["command"] and worker["command"] == compose["worker"]["command"]
    assert migrate["command"] == compose["migrate"]["command"]
    assert api["readinessProbe"]["httpGet"]["path"] == api["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert worker["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert (
        resources["Deployment", "fusetune-worker"]["spec"]["template"]["spec"][
            "terminationGracePeriodSeconds"
        ]
        > 0
    )
    # Every setting compose gives the services comes from the ConfigMap or the Secret, but the address each
    # worker advertises for its chat completions server: its own pod's, from the downward API.
    settings = set(resources["ConfigMap", "fusetune-config"]["data"]) | set(
        resources["Secret", "fusetune-secrets"]["stringData"]
    )
    per_pod = {entry["name"]: entry for entry in worker.get("env", [])}
    assert per_pod["FUSETUNE_SERVING_PUBLIC_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert set(compose["worker"]["environment"]) <= settings | set(per_pod)
    serving_port = int(resources["ConfigMap", "fusetune-config"]["data"]["FUSETUNE_SERVING_PORT"])
    assert {"name": "serving", "containerPort": serving_port} in worker["ports"]
    for container in (api, worker, migrate):
        sources = {ref.get("configMapRef", ref.get("secretRef"))["name"] for ref in container["envFrom"]}
        assert sources == {"fusetune-config", "fusetune-secrets"}
