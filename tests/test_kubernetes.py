"""deploy/kubernetes validates offline against the Kubernetes schemas, and says what the service needs: API
probes, GPU workers with a grace period, a migration Job, the same commands and settings as docker-compose."""

from __future__ import annotations

import shutil
import subprocess
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


# ---- the optional Ray cluster (deploy/kubernetes/ray: a kustomize component) ------------------------------------

RAY = MANIFESTS / "ray"
_INT32 = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
# KubeRay passes each value to `ray start --<key>=<value>` and its API takes strings only.
_START_PARAMS = {"type": "object", "additionalProperties": {"type": "string"}}
# The fields of KubeRay's RayCluster (ray.io/v1) and their types, as its API types declare them
# (ray-operator/apis/ray/v1/raycluster_types.go in KubeRay's sources). KubeRay's CRD is not vendored: it inlines
# every pod field, over a megabyte, and ships in no Python or npm package. Its pod templates are Kubernetes'
# PodTemplateSpec, which the test checks against the Kubernetes schemas instead (as a core v1 PodTemplate).
RAY_CLUSTER_V1 = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayCluster"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["headGroupSpec"],
            "properties": {
                "suspend": {"type": "boolean"},
                "managedBy": {"enum": ["ray.io/kuberay-operator", "kueue.x-k8s.io/multikueue"]},
                "autoscalerOptions": {"type": "object"},
                "headServiceAnnotations": {"type": "object", "additionalProperties": {"type": "string"}},
                "enableInTreeAutoscaling": {"type": "boolean"},
                "gcsFaultToleranceOptions": {"type": "object"},
                "rayVersion": {"type": "string"},
                "headGroupSpec": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["template", "rayStartParams"],
                    "properties": {
                        "template": {"type": "object"},
                        "headService": {"type": "object"},
                        "enableIngress": {"type": "boolean"},
                        "rayStartParams": _START_PARAMS,
                        "serviceType": {"enum": ["ClusterIP", "NodePort", "LoadBalancer", "ExternalName"]},
                    },
                },
                "workerGroupSpecs": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["groupName", "minReplicas", "maxReplicas", "rayStartParams", "template"],
                        "properties": {
                            "suspend": {"type": "boolean"},
                            "groupName": {"type": "string", "minLength": 1},
                            "replicas": _INT32,
                            "minReplicas": _INT32,
                            "maxReplicas": _INT32,
                            "idleTimeoutSeconds": _INT32,
                            "rayStartParams": _START_PARAMS,
                            "template": {"type": "object"},
                            "scaleStrategy": {"type": "object"},
                            "numOfHosts": _INT32,
                        },
                    },
                },
            },
        },
    },
}


def _ray_component() -> tuple[dict, dict, dict]:
    """The component's kustomization, its RayCluster and its ConfigMap patch."""
    component = yaml.safe_load((RAY / "kustomization.yaml").read_text())
    (cluster,) = [
        doc for name in component["resources"] for doc in yaml.safe_load_all((RAY / name).read_text())
    ]
    (patch,) = [yaml.safe_load((RAY / entry["path"]).read_text()) for entry in component["patches"]]
    return component, cluster, patch


def _ray_groups(cluster: dict) -> dict[str, dict]:
    spec = cluster["spec"]
    return {
        "head": spec["headGroupSpec"],
        **{group["groupName"]: group for group in spec["workerGroupSpecs"]},
    }


def _validate_ray_cluster(cluster: dict) -> None:
    import jsonschema

    jsonschema.validate(cluster, RAY_CLUSTER_V1)
    version = kubernetes_validate.latest_version()
    for name, group in _ray_groups(cluster).items():
        pod_template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"{cluster['metadata']['name']}-{name}"},
            "template": group["template"],
        }
        kubernetes_validate.validate(pod_template, version, strict=True)


def test_the_ray_cluster_validates_as_a_raycluster_with_kubernetes_pods():
    _, cluster, _ = _ray_component()
    _validate_ray_cluster(cluster)
    groups = _ray_groups(cluster)
    assert len(groups) == 1 + len(cluster["spec"]["workerGroupSpecs"]) >= 2  # group names are unique
    # KubeRay's own checks: replicas within the group's bounds; the Ray container is each pod's first.
    for name, group in groups.items():
        if name != "head":
            assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], name
        container = _container({"spec": group})
        # A probe on a named port needs that port declared on its container.
        declared = {port["name"] for port in container.get("ports", [])}
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"]["port"] in declared, (name, probe)


def test_a_broken_ray_cluster_is_caught():
    import jsonschema

    _, cluster, _ = _ray_component()
    head = cluster["spec"]["headGroupSpec"]
    worker = cluster["spec"]["workerGroupSpecs"][0]

    def with_spec(**changes) -> dict:
        return {**cluster, "spec": {**cluster["spec"], **changes}}

    # A number where `ray start` takes a string, a misspelt field of KubeRay's, a misspelt field of the pod.
    with pytest.raises(jsonschema.ValidationError):
        _validate_ray_cluster(with_spec(headGroupSpec={**head, "rayStartParams": {"num-gpus": 0}}))
    with pytest.raises(jsonschema.ValidationError):
        _validate_ray_cluster(with_spec(workerGroupSpecs=[{**worker, "maxReplica": 4}]))
    container = {**_container({"spec": worker})}
    container["envFromm"] = container.pop("envFrom")
    template = {**worker["template"], "spec": {**worker["template"]["spec"], "containers": [container]}}
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate_ray_cluster(with_spec(workerGroupSpecs=[{**worker, "template": template}]))


def test_the_ray_cluster_runs_the_worker_image_and_settings_and_the_service_points_at_it():
    """An optional component: the RayCluster kind exists only where KubeRay's operator is installed. Its nodes run
    the worker's image with the worker's settings (each stages runs into its own scratch and reads its own models),
    GPUs on the worker group only, and it sets FUSETUNE_RAY_ADDRESS to the Job Submission API of its head's
    Service for the API and the workers."""
    component, cluster, patch = _ray_component()
    assert component["kind"] == "Component"
    base = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    assert base["resources"] == ["config.yaml", "migrate-job.yaml", "api.yaml", "worker.yaml", "redis.yaml"]
    assert "components" not in base
    resources = _resources()
    worker_pod = resources["Deployment", "fusetune-worker"]["spec"]["template"]["spec"]
    worker = worker_pod["containers"][0]
    config = resources["ConfigMap", "fusetune-config"]["data"]
    groups = _ray_groups(cluster)
    for name, group in groups.items():
        container = _container({"spec": group})
        assert container["image"] == worker["image"] and container["envFrom"] == worker["envFrom"], name
        assert "command" not in container and "args" not in container  # KubeRay writes the `ray start`
        mounts = {mount["mountPath"] for mount in container["volumeMounts"]}
        assert config["FUSETUNE_DATA_DIR"] in mounts, name
        gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu", 0)
        if name == "head":
            assert gpus == 0 and "nvidia.com/gpu" not in container["resources"].get("requests", {})
            continue
        assert gpus >= 1 and container["resources"]["requests"]["nvidia.com/gpu"] == gpus
        assert config["FUSETUNE_MODELS_DIR"] in mounts
        claims = {
            volume["persistentVolumeClaim"]["claimName"]
            for pod in (worker_pod, group["template"]["spec"])
            for volume in pod["volumes"]
            if "persistentVolumeClaim" in volume
        }
        assert claims == {"fusetune-models"}
    head = groups["head"]
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"  # README's `ray start --head` command
    service_lock = (ROOT / "requirements-service.lock").read_text()
    assert f"\nray=={cluster['spec']['rayVersion']} " in service_lock  # the image's Ray
    # The address: KubeRay's Service for the head (<name>-head-svc), at the head's dashboard port.
    assert (patch["kind"], patch["metadata"]["name"]) == ("ConfigMap", "fusetune-config")
    assert "FUSETUNE_RAY_ADDRESS" not in config  # without the component, jobs train on the workers' hosts
    dashboard = next(p for p in _container({"spec": head})["ports"] if p["name"] == "dashboard")
    address = f"http://{cluster['metadata']['name']}-head-svc:{dashboard['containerPort']}"
    assert patch["data"] == {"FUSETUNE_RAY_ADDRESS": address} and dashboard["containerPort"] == 8265
    from fusetune.config import Settings

    assert Settings(ray_address=patch["data"]["FUSETUNE_RAY_ADDRESS"]).ray_address == address


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (its built-in kustomize) not installed")
def test_the_ray_component_builds_with_kustomize(tmp_path):
    """`components: [ray]` added to the base gives the base's resources, the RayCluster, and the address in the
    ConfigMap; built by kubectl's own kustomize, offline."""

    def build(directory: Path) -> dict[tuple[str, str], dict]:
        result = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        return {(doc["kind"], doc["metadata"]["name"]): doc for doc in yaml.safe_load_all(result.stdout)}

    # What the README says to do: the base's kustomization.yaml with `components: [ray]`.
    copy = shutil.copytree(MANIFESTS, tmp_path / "kubernetes")
    kustomization = yaml.safe_load((copy / "kustomization.yaml").read_text())
    (copy / "kustomization.yaml").write_text(yaml.safe_dump({**kustomization, "components": ["ray"]}))
    base, with_ray = build(MANIFESTS), build(copy)
    _, cluster, patch = _ray_component()
    assert with_ray.pop(("RayCluster", cluster["metadata"]["name"])) == cluster
    config = with_ray.pop(("ConfigMap", "fusetune-config"))
    assert config["data"] == {**base.pop(("ConfigMap", "fusetune-config"))["data"], **patch["data"]}
    assert with_ray == base
