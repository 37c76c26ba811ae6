"""Render deploy/ overlays without the kustomize binary: the small subset of kustomize they use.

    python deploy/render.py deploy/overlays/gpu      # multi-document YAML on stdout

Supported, with kustomize's semantics:

- ``resources``: YAML files (one or more documents) and directories holding a kustomization.yaml
  (rendered recursively, so an overlay can build on another overlay);
- ``patches`` entries with a ``path``:
  - a mapping is a strategic-merge patch, applied to the resource of its kind and
    ``metadata.name`` (or of ``target``). Maps merge recursively; ``null`` deletes a key; lists
    merge item by item on the Kubernetes API's patch merge key for the lists our patches touch
    (``MERGE_KEYS``), every other list is replaced, as in the API (e.g. tolerations, args);
  - a list is a JSON 6902 patch (RFC 6902 ``add``/``remove``/``replace``/``test``), which needs a
    ``target`` (group, version, kind, name).

Anything else in a kustomization.yaml (namePrefix, labels, images, generators, components, ...)
is refused rather than ignored, and so is a patch that matches no resource or more than one, or two
resources with the same kind and name. tests/deploy/test_manifests.py compares the output with
``kubectl kustomize`` where that binary exists.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml

SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "patches"}
# patchMergeKey of the Kubernetes API (PodSpec, Container) for the lists our patches merge into.
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
              "volumeMounts": "mountPath"}


class RenderError(Exception):
    pass


def load_yaml_documents(path: Path) -> list[dict]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def build(directory: str | Path) -> list[dict]:
    """The resources of the kustomization in ``directory``, patched, in resource order."""
    directory = Path(directory)
    kfile = directory / "kustomization.yaml"
    if not kfile.is_file():
        raise RenderError(f"{directory}: no kustomization.yaml")
    spec = yaml.safe_load(kfile.read_text()) or {}
    unknown = set(spec) - SUPPORTED_KEYS
    if unknown:
        raise RenderError(f"{kfile}: unsupported kustomization fields {sorted(unknown)}")
    if spec.get("kind", "Kustomization") != "Kustomization":
        raise RenderError(f"{kfile}: kind {spec.get('kind')!r} is not Kustomization")
    resources: list[dict] = []
    for entry in spec.get("resources") or []:
        path = (directory / entry).resolve()
        docs = build(path) if path.is_dir() else load_yaml_documents(path)
        for doc in docs:
            if _id(doc) in {_id(r) for r in resources}:
                raise RenderError(f"{kfile}: duplicate resource {doc['kind']}/{doc['metadata']['name']}")
            resources.append(copy.deepcopy(doc))
    for entry in spec.get("patches") or []:
        unknown = set(entry) - {"path", "target"}
        if unknown or "path" not in entry:
            raise RenderError(f"{kfile}: patch entries need `path` (and optionally `target`); got {sorted(entry)}")
        docs = load_yaml_documents(directory / entry["path"])
        if len(docs) != 1:
            raise RenderError(f"{entry['path']}: one patch per file")
        patch, target = docs[0], entry.get("target")
        if isinstance(patch, list):
            if not target:
                raise RenderError(f"{entry['path']}: a JSON 6902 patch needs a target")
            doc = _select(resources, target, entry["path"])
            resources[resources.index(doc)] = json6902(doc, patch)
        elif isinstance(patch, dict):
            target = target or {"kind": patch.get("kind"), "name": (patch.get("metadata") or {}).get("name")}
            doc = _select(resources, target, entry["path"])
            resources[resources.index(doc)] = strategic_merge(doc, patch)
        else:
            raise RenderError(f"{entry['path']}: a patch is a mapping (strategic merge) or a list (JSON 6902)")
    return resources


def _gvk(doc: dict) -> tuple[str, str, str]:
    group, _, version = doc.get("apiVersion", "").rpartition("/")
    return group, version, doc.get("kind", "")


def _id(doc: dict) -> tuple[str, str, str]:
    return _gvk(doc)[0], doc.get("kind", ""), doc["metadata"]["name"]


def _select(resources: list[dict], target: dict, what: str) -> dict:
    unknown = set(target) - {"group", "version", "kind", "name"}
    if unknown:
        raise RenderError(f"{what}: unsupported target selectors {sorted(unknown)}")
    matches = []
    for r in resources:
        group, version, kind = _gvk(r)
        want = {"group": group, "version": version, "kind": kind, "name": r["metadata"]["name"]}
        if all(target[k] == want[k] for k in target if target[k] is not None):
            matches.append(r)
    if len(matches) != 1:
        raise RenderError(f"{what}: target {target} matches {len(matches)} resources, not one")
    return matches[0]


def strategic_merge(base: Any, patch: Any, key: str | None = None) -> Any:
    """``patch`` merged into a copy of ``base`` (kustomize/kubectl strategic merge, subset)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for k, v in patch.items():
            if k.startswith("$"):
                raise RenderError(f"strategic-merge directive {k!r} is not supported")
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = strategic_merge(out[k], v, k)
            else:
                out[k] = copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and key in MERGE_KEYS:
        merge_key = MERGE_KEYS[key]
        out = copy.deepcopy(base)
        for item in patch:
            if not isinstance(item, dict) or merge_key not in item:
                raise RenderError(f"items of {key!r} in a patch need their merge key {merge_key!r}")
            same = [i for i, b in enumerate(out) if isinstance(b, dict) and b.get(merge_key) == item[merge_key]]
            if same:
                out[same[0]] = strategic_merge(out[same[0]], item)
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)


def json6902(doc: dict, ops: list[dict]) -> dict:
    """RFC 6902 add / remove / replace / test on a copy of ``doc``."""
    out = copy.deepcopy(doc)
    for op in ops:
        kind, pointer = op.get("op"), op.get("path", "")
        if kind not in ("add", "remove", "replace", "test"):
            raise RenderError(f"JSON 6902 op {kind!r} is not supported")
        parts = [p.replace("~1", "/").replace("~0", "~") for p in pointer.split("/")[1:]]
        if not parts:
            raise RenderError("JSON 6902 patches of the whole document are not supported")
        parent = out
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent[p]
        last = parts[-1]
        if isinstance(parent, list):
            index = len(parent) if last == "-" else int(last)
            if kind == "add":
                parent.insert(index, copy.deepcopy(op["value"]))
            elif kind == "remove":
                del parent[index]
            elif kind == "replace":
                parent[index] = copy.deepcopy(op["value"])
            elif parent[index] != op["value"]:
                raise RenderError(f"JSON 6902 test failed at {pointer}")
        else:
            if kind in ("remove", "replace", "test") and last not in parent:
                raise RenderError(f"JSON 6902 {kind}: {pointer} does not exist")
            if kind == "remove":
                del parent[last]
            elif kind == "test":
                if parent[last] != op["value"]:
                    raise RenderError(f"JSON 6902 test failed at {pointer}")
            else:
                parent[last] = copy.deepcopy(op["value"])
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python deploy/render.py DIR", file=sys.stderr)
        return 2
    try:
        docs = build(argv[0])
    except RenderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    yaml.safe_dump_all(docs, sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
