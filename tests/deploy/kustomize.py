"""A small kustomize for the subset that deploy/k8s uses, so the tests render the overlays
without a kustomize binary.

Supported kustomization keys: ``resources`` (YAML files, one or more documents each, or
folders holding a kustomization.yaml), ``namespace``, ``configMapGenerator`` (``name`` and
``files``, with ``generatorOptions.disableNameSuffixHash: true``), ``patches`` (JSON 6902
operation lists ``add``/``replace``/``remove``, from ``path`` or inline ``patch``, aimed by a
``target`` of ``kind`` and ``name``) and ``images`` (``name`` -> ``newName``/``newTag``).
Anything else raises ``KustomizeError``: the renderer never quietly renders something that
kustomize would render differently. Where ``kubectl`` is installed the tests also compare this
output with ``kubectl kustomize``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

KEYS = {
    "apiVersion",
    "kind",
    "namespace",
    "resources",
    "configMapGenerator",
    "generatorOptions",
    "patches",
    "images",
}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume"}
OPS = {"add", "replace", "remove"}


class KustomizeError(Exception):
    """The kustomization uses something this renderer does not support, or is wrong."""


def render(root: Path) -> list[dict[str, Any]]:
    """The objects ``kustomize build root`` makes (same content; order not guaranteed)."""
    root = Path(root)
    kust = _kustomization(root)
    objects: list[dict[str, Any]] = []
    for entry in kust.get("resources", []):
        path = (root / entry).resolve()
        objects += render(path) if path.is_dir() else _documents(path)
    objects += [_config_map(root, gen, kust) for gen in kust.get("configMapGenerator", [])]
    for patch in kust.get("patches", []):
        _patch(root, patch, objects)
    if "namespace" in kust:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = kust["namespace"]
    for image in kust.get("images", []):
        _set_image(objects, image)
    _check_unique(objects)
    return objects


def _kustomization(root: Path) -> dict[str, Any]:
    path = root / "kustomization.yaml"
    if not path.is_file():
        raise KustomizeError(f"{root}: no kustomization.yaml")
    kust = yaml.safe_load(path.read_text()) or {}
    unknown = set(kust) - KEYS
    if unknown:
        raise KustomizeError(f"{path}: unsupported keys {sorted(unknown)}")
    return kust


def _documents(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise KustomizeError(f"resource not found: {path}")
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    for doc in docs:
        if not isinstance(doc, dict) or not {"apiVersion", "kind", "metadata"} <= set(doc):
            raise KustomizeError(f"{path}: every document needs apiVersion, kind and metadata")
    return docs


def _config_map(root: Path, gen: dict[str, Any], kust: dict[str, Any]) -> dict[str, Any]:
    if set(gen) - {"name", "files"}:
        raise KustomizeError(f"configMapGenerator: unsupported keys {sorted(set(gen))}")
    if not kust.get("generatorOptions", {}).get("disableNameSuffixHash"):
        raise KustomizeError("configMapGenerator needs generatorOptions.disableNameSuffixHash")
    data = {}
    for name in gen["files"]:
        if "=" in name:
            raise KustomizeError(f"configMapGenerator: key=file form not supported: {name}")
        data[Path(name).name] = (root / name).read_text()
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": gen["name"]},
        "data": data,
    }


def _patch(root: Path, patch: dict[str, Any], objects: list[dict[str, Any]]) -> None:
    target = patch.get("target", {})
    if set(target) - {"kind", "name"} or not {"kind", "name"} <= set(target):
        raise KustomizeError(f"patch target must have exactly kind and name: {target}")
    if ("path" in patch) == ("patch" in patch):
        raise KustomizeError("a patch needs exactly one of path and patch")
    text = (root / patch["path"]).read_text() if "path" in patch else patch["patch"]
    ops = yaml.safe_load(text)
    if not isinstance(ops, list):
        raise KustomizeError("only JSON 6902 patches (a list of operations) are supported")
    hits = [
        o for o in objects if (o["kind"], o["metadata"]["name"]) == (target["kind"], target["name"])
    ]
    if not hits:
        raise KustomizeError(f"patch target not found: {target}")
    for obj in hits:
        for op in ops:
            apply_op(obj, op)


def apply_op(doc: dict[str, Any], op: dict[str, Any]) -> None:
    """Apply one RFC 6902 ``add``, ``replace`` or ``remove`` operation to ``doc`` in place."""
    kind = op.get("op")
    if kind not in OPS:
        raise KustomizeError(f"unsupported patch operation {kind!r}")
    *parents, last = _pointer(op["path"])
    node: Any = doc
    for part in parents:
        node = node[_index(node, part)]
    if isinstance(node, list):
        if kind == "add":
            at = len(node) if last == "-" else _index(node, last, end_ok=True)
            node.insert(at, copy.deepcopy(op["value"]))
            return
        idx = _index(node, last)
        if kind == "remove":
            del node[idx]
        else:
            node[idx] = copy.deepcopy(op["value"])
        return
    if kind != "add" and last not in node:
        raise KustomizeError(f"{kind} {op['path']}: no such member")
    if kind == "remove":
        del node[last]
    else:
        node[last] = copy.deepcopy(op["value"])


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise KustomizeError(f"JSON pointer must start with '/': {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _index(node: Any, part: str, end_ok: bool = False) -> Any:
    if isinstance(node, list):
        if not part.isdigit() or int(part) > len(node) - (0 if end_ok else 1):
            raise KustomizeError(f"bad list index {part!r}")
        return int(part)
    if not isinstance(node, dict) or part not in node:
        raise KustomizeError(f"no member {part!r}")
    return part


def _set_image(objects: list[dict[str, Any]], image: dict[str, Any]) -> None:
    if set(image) - {"name", "newName", "newTag"}:
        raise KustomizeError(f"images: unsupported keys {sorted(set(image))}")
    for obj in objects:
        spec = obj.get("spec", {}).get("template", {}).get("spec", {})
        for container in spec.get("containers", []) + spec.get("initContainers", []):
            name, _, tag = container["image"].partition(":")
            if name != image["name"]:
                continue
            tag = image.get("newTag", tag)
            container["image"] = image.get("newName", name) + (f":{tag}" if tag else "")


def _check_unique(objects: list[dict[str, Any]]) -> None:
    seen: set[tuple[str, str]] = set()
    for obj in objects:
        key = (obj["kind"], obj["metadata"]["name"])
        if key in seen:
            raise KustomizeError(f"duplicate object {key}")
        seen.add(key)
