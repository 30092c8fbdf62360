"""Validate rendered Kubernetes manifests offline, as a user does before `kubectl apply`:

    python -m tools.kubernetes ... > imgserve.yaml
    python -m tools.kubernetes_check imgserve.yaml        # or `-` for standard input

Each object against Kubernetes' own schemas (kubernetes-validate, strict: an unknown field fails), or, for a
custom resource, against the schema shipped in tools/kubernetes_schemas/ (KEDA's ScaledObject). An object no
schema describes fails: kubernetes-validate's own command prints "Couldn't find schema" and exits 0, which would
pass a ScaledObject nobody checked. Exits 1 when any object fails, naming each; 0 when every one passed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

from tools.kubernetes import KUBERNETES_VERSION

SCHEMAS = Path(__file__).resolve().parent / "kubernetes_schemas"
# Custom resources: (apiVersion, kind) -> the schema file that describes them
CUSTOM_SCHEMAS = {("keda.sh/v1alpha1", "ScaledObject"): SCHEMAS / "scaledobject-keda-v1alpha1.json"}


def problems(manifest: Any, kubernetes_version: str = KUBERNETES_VERSION) -> list[str]:
    """What is wrong with one object (nothing: valid)."""
    if not isinstance(manifest, dict) or not {"apiVersion", "kind"} <= manifest.keys():
        return ["not a Kubernetes object (no apiVersion and kind)"]
    custom = CUSTOM_SCHEMAS.get((manifest["apiVersion"], manifest["kind"]))
    if custom is not None:
        validator = jsonschema.Draft202012Validator(json.loads(custom.read_text()))
        return [
            f"{'.'.join(str(part) for part in error.absolute_path) or '(top)'}: {error.message}"
            for error in validator.iter_errors(manifest)
        ]
    try:
        kubernetes_validate.validate(manifest, kubernetes_version, strict=True)
    except kubernetes_validate.SchemaNotFoundError as exc:
        return [f"no schema for it ({exc.message}; a custom resource needs one in {SCHEMAS.name}/)"]
    except kubernetes_validate.ValidationError as exc:
        return [f"{'.'.join(str(part) for part in exc.absolute_path) or '(top)'}: {exc.message}"]
    return []


def check(documents: Iterable[Any], kubernetes_version: str = KUBERNETES_VERSION) -> list[str]:
    """Every failure of `documents` (empty ones skipped, as kubectl does), each naming its object."""
    failures, seen = [], 0
    for index, manifest in enumerate(documents):
        if manifest is None:
            continue
        seen += 1
        name = _name(manifest, index)
        failures += [f"{name}: {problem}" for problem in problems(manifest, kubernetes_version)]
    if not seen:
        failures.append("no objects to validate")
    return failures


def _name(manifest: Any, index: int) -> str:
    if isinstance(manifest, dict):
        metadata = manifest.get("metadata")
        name = metadata.get("name") if isinstance(metadata, dict) else None
        return f"{manifest.get('kind', '?')}/{name or '?'} (document {index + 1})"
    return f"document {index + 1}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("manifests", help="the rendered file (python -m tools.kubernetes's output), or - for stdin")
    parser.add_argument("--kubernetes-version", default=KUBERNETES_VERSION, help="the schemas' Kubernetes version")
    args = parser.parse_args(argv)
    text = sys.stdin.read() if args.manifests == "-" else Path(args.manifests).read_text()
    try:
        documents = list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        print(f"{args.manifests}: not YAML: {exc}", file=sys.stderr)
        return 1
    failures = check(documents, args.kubernetes_version)
    for failure in failures:
        print(f"{args.manifests}: {failure}", file=sys.stderr)
    if failures:
        return 1
    objects = sum(document is not None for document in documents)
    print(f"{args.manifests}: {objects} objects valid (Kubernetes {args.kubernetes_version})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
