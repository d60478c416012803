"""deploy/kserve/ checked offline: every field against the Kubernetes API's own models (the
``kubernetes`` package), the InferenceService's KServe fields against KServe v1beta1's, and the
container's command against ``packrat serve``'s real argument parser.  No cluster runs here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from packrat_plugin.cli import build_parser
from serving_harness.torchserve import read_properties

k8s = pytest.importorskip("kubernetes.client")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
# KServe v1beta1's PredictorSpec is a Kubernetes PodSpec plus these component fields (and the
# model-format shortcuts, which a custom container does not use).
KSERVE_COMPONENT_FIELDS = {
    "minReplicas": "int", "maxReplicas": "int", "scaleTarget": "int", "scaleMetric": "str",
    "scaleMetricType": "str", "containerConcurrency": "int", "timeout": "int", "canaryTrafficPercent": "int",
    "labels": "dict(str, str)", "annotations": "dict(str, str)", "logger": "object", "batcher": "object",
    "deploymentStrategy": "object", "autoScaling": "object", "storageUris": "object",
}  # fmt: skip
INFERENCE_SERVICE_SPEC = {"predictor", "transformer", "explainer"}


def check(value, type_name: str, path: str) -> None:
    """``value`` against the kubernetes package's OpenAPI type: unknown fields and wrong types fail."""
    if type_name.startswith(("List[", "Dict[")):  # the package's newer spelling of list[…] and dict(…)
        inner = type_name[5:-1]
        type_name = f"list[{inner}]" if type_name[0] == "L" else f"dict({inner})"
    if type_name.startswith("list["):
        assert isinstance(value, list), f"{path}: expected a list"
        for i, item in enumerate(value):
            check(item, type_name[5:-1], f"{path}[{i}]")
    elif type_name.startswith("dict("):
        assert isinstance(value, dict), f"{path}: expected a mapping"
        inner = type_name[5:-1].split(", ", 1)[1]
        for key, item in value.items():
            check(item, inner, f"{path}.{key}")
    elif type_name == "str":
        assert isinstance(value, str), f"{path}: expected a string, got {value!r}"
    elif type_name == "int":
        assert isinstance(value, int) and not isinstance(value, bool), f"{path}: expected an integer, got {value!r}"
    elif type_name == "bool":
        assert isinstance(value, bool), f"{path}: expected a boolean, got {value!r}"
    elif type_name in ("object", "float", "datetime"):
        pass  # IntOrString, Quantity and the like: any scalar
    else:
        model = getattr(k8s, type_name)
        assert isinstance(value, dict), f"{path}: expected a {type_name} object"
        fields = {json_name: attr for attr, json_name in model.attribute_map.items()}
        unknown = sorted(set(value) - set(fields))
        assert not unknown, f"{path}: {type_name} has no field(s) {unknown}"
        for key, item in value.items():
            check(item, model.openapi_types[fields[key]], f"{path}.{key}")
        # The models' constructors enforce required fields (a container's name, a volume's name, ...).
        k8s.ApiClient()._ApiClient__deserialize(value, type_name)


def documents() -> dict[str, dict]:
    docs = {}
    for path in sorted((DEPLOY / "kserve").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[doc["kind"]] = doc
    return docs


def test_the_manifests_validate_against_the_kubernetes_and_kserve_schemas():
    docs = documents()
    assert set(docs) == {"ConfigMap", "InferenceService"}
    check(docs["ConfigMap"], "V1ConfigMap", "ConfigMap")
    isvc = docs["InferenceService"]
    assert (isvc["apiVersion"], set(isvc)) == ("serving.kserve.io/v1beta1", {"apiVersion", "kind", "metadata", "spec"})
    check(isvc["metadata"], "V1ObjectMeta", "InferenceService.metadata")
    assert set(isvc["spec"]) <= INFERENCE_SERVICE_SPEC, isvc["spec"].keys()
    predictor = dict(isvc["spec"]["predictor"])
    for field, type_name in KSERVE_COMPONENT_FIELDS.items():
        if field in predictor:
            check(predictor.pop(field), type_name, f"predictor.{field}")
    check(predictor, "V1PodSpec", "InferenceService.spec.predictor")


def test_the_pod_is_guaranteed_whole_cores_and_runs_packrat_serve_with_flags_it_has():
    docs = documents()
    predictor = docs["InferenceService"]["spec"]["predictor"]
    (container,) = predictor["containers"]
    resources = container["resources"]
    assert resources["requests"] == resources["limits"], "Guaranteed QoS: requests equal limits"
    assert str(resources["limits"]["cpu"]).isdigit(), "whole cores, so the static CPU manager may pin them"
    assert container["command"] == ["packrat", "serve"]
    args = build_parser().parse_args(["serve", *container["args"]])  # a flag packrat lacks fails here
    mount = next(m for m in container["volumeMounts"] if args.config.is_relative_to(m["mountPath"]))
    volume = next(v for v in predictor["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    assert args.config.name in docs["ConfigMap"]["data"]
    annotations = docs["InferenceService"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == args.status_port and args.status_host == "0.0.0.0"


def test_the_pods_torchserve_listens_where_kserve_sends_requests(tmp_path):
    docs = documents()
    (container,) = docs["InferenceService"]["spec"]["predictor"]["containers"]
    config = tmp_path / "config.properties"
    config.write_text(docs["ConfigMap"]["data"]["config.properties"])
    props = read_properties(config)
    assert props["inference_address"] == f"http://0.0.0.0:{container['ports'][0]['containerPort']}"
    assert all(props[k].startswith("http://127.0.0.1:") for k in ("management_address", "metrics_address"))
    assert container["readinessProbe"]["httpGet"]["port"] == container["ports"][0]["containerPort"]


def test_the_dockerfile_builds_the_image_the_manifest_names():
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    (container,) = documents()["InferenceService"]["spec"]["predictor"]["containers"]
    assert f"-t {container['image']}" in dockerfile
    assert "pip install --no-cache-dir -r requirements.txt" in dockerfile and "openjdk-17" in dockerfile


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c.update(containerPorts=c.pop("ports")), "V1Container has no field(s) ['containerPorts']"),
        (lambda c: c["ports"][0].update(containerPort="8080"), "containerPort: expected an integer"),
        (lambda c: c.pop("name"), "name"),
        (lambda c: c["resources"].update(limit=c["resources"].pop("limits")), "has no field(s) ['limit']"),
    ],
)
def test_the_check_catches_a_misspelt_field_a_wrong_type_and_a_missing_required_one(edit, message):
    predictor = documents()["InferenceService"]["spec"]["predictor"]
    pod = {k: v for k, v in predictor.items() if k not in KSERVE_COMPONENT_FIELDS}
    edit(pod["containers"][0])
    with pytest.raises((AssertionError, ValueError), match=re.escape(message)):
        check(pod, "V1PodSpec", "predictor")
