"""The small kustomize renderer the manifest tests rely on: exact results and loud refusals."""

from __future__ import annotations

import pytest

from tests.deploy.kustomize import KustomizeError, apply_op, render


def test_json_patch_operations():
    doc = {"spec": {"replicas": 1, "items": ["a", "c"], "limits": {"cpu": "1"}}}
    apply_op(doc, {"op": "replace", "path": "/spec/replicas", "value": 3})
    apply_op(doc, {"op": "add", "path": "/spec/items/1", "value": "b"})
    apply_op(doc, {"op": "add", "path": "/spec/items/-", "value": "d"})
    apply_op(doc, {"op": "add", "path": "/spec/limits/nvidia.com~1gpu", "value": "1"})
    apply_op(doc, {"op": "remove", "path": "/spec/limits/cpu"})
    apply_op(doc, {"op": "remove", "path": "/spec/items/0"})
    assert doc == {
        "spec": {"replicas": 3, "items": ["b", "c", "d"], "limits": {"nvidia.com/gpu": "1"}}
    }


@pytest.mark.parametrize(
    "op",
    [
        {"op": "move", "from": "/a", "path": "/b"},
        {"op": "replace", "path": "/missing", "value": 1},
        {"op": "remove", "path": "/list/5"},
        {"op": "add", "path": "/nope/deeper", "value": 1},
        {"op": "add", "path": "no-slash", "value": 1},
    ],
)
def test_bad_or_unsupported_operations_raise(op):
    with pytest.raises(KustomizeError):
        apply_op({"a": 1, "list": [0]}, op)


def _tree(tmp_path, kustomization: str) -> None:
    (tmp_path / "svc.yaml").write_text(
        "apiVersion: v1\nkind: Service\nmetadata: {name: s}\nspec: {ports: [{port: 80}]}\n"
    )
    (tmp_path / "kustomization.yaml").write_text(kustomization)


def test_renders_resources_generator_patch_namespace(tmp_path):
    (tmp_path / "app.yaml").write_text("a: 1\n")
    _tree(
        tmp_path,
        "namespace: ns\nresources: [svc.yaml]\n"
        "configMapGenerator: [{name: cfg, files: [app.yaml]}]\n"
        "generatorOptions: {disableNameSuffixHash: true}\n"
        "patches:\n- target: {kind: Service, name: s}\n"
        "  patch: '[{op: add, path: /spec/type, value: NodePort}]'\n",
    )
    assert render(tmp_path) == [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "s", "namespace": "ns"},
            "spec": {"ports": [{"port": 80}], "type": "NodePort"},
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "cfg", "namespace": "ns"},
            "data": {"app.yaml": "a: 1\n"},
        },
    ]


@pytest.mark.parametrize(
    "kustomization",
    [
        "resources: [svc.yaml]\ncommonLabels: {a: b}\n",  # unsupported key
        "resources: [svc.yaml]\nconfigMapGenerator: [{name: c, files: [svc.yaml]}]\n",  # hash
        "resources: [svc.yaml]\npatches: [{target: {kind: Service, name: x}, patch: '[]'}]\n",
        "resources: [svc.yaml]\npatches: [{target: {kind: Service, name: s}, patch: '{a: 1}'}]\n",
        "resources: [svc.yaml, svc.yaml]\n",  # duplicate object
    ],
)
def test_unsupported_or_wrong_kustomizations_raise(tmp_path, kustomization):
    _tree(tmp_path, kustomization)
    with pytest.raises(KustomizeError):
        render(tmp_path)
