"""Validate rendered Kubernetes manifests offline: ``python deploy/k8s/validate.py rendered.yaml ...``.

Run by deploy/k8s-checks.sh with the tools venv it creates (kubernetes-validate and the
prometheus-operator models are not project dependencies).

- Built-in kinds: strictly (unknown fields are errors) against the OpenAPI schemas that
  ``kubernetes-validate`` ships, for each version in KUBERNETES_VERSIONS: the oldest
  Kubernetes these manifests support (the preStop/HPA/PDB APIs used exist since 1.23; 1.30
  is the oldest release still maintained by the big providers) and the newest schemas shipped.
- Custom resources: kubernetes-validate has no schemas for CRDs. ServiceMonitor and KEDA's
  ScaledObject are validated with the pydantic models generated from the CRD schemas of the
  Prometheus Operator and KEDA (PyPI ``cloudcoil-models-prometheus-operator``,
  ``cloudcoil-models-keda``); those models ignore unknown fields, so the round trip is
  compared with the input to reject them here too. Any other kind without a schema is an
  error, so a new CRD cannot slip through unchecked.
"""

from __future__ import annotations

import sys
from pathlib import Path

import kubernetes_validate
import yaml

KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")


def unknown_fields(given, parsed, path: str = "") -> list[str]:
    """Keys of ``given`` that did not survive parsing (the model did not know them)."""
    if isinstance(given, dict):
        if not isinstance(parsed, dict):
            return [path or "."]
        return [p for k, v in given.items()
                for p in ([f"{path}.{k}"] if k not in parsed else unknown_fields(v, parsed[k], f"{path}.{k}"))]
    if isinstance(given, list) and isinstance(parsed, list):
        return [p for i, (g, q) in enumerate(zip(given, parsed)) for p in unknown_fields(g, q, f"{path}[{i}]")]
    return []


def check_custom_resource(model, doc: dict) -> list[str]:
    from pydantic import ValidationError

    try:
        parsed = model.model_validate(doc).model_dump(mode="json", by_alias=True, exclude_unset=True)
    except ValidationError as exc:
        return [str(exc)]
    return [f"unknown field {p}" for p in unknown_fields(doc, parsed)]


def service_monitor_model():
    from cloudcoil.models.prometheus_operator.v1 import ServiceMonitor

    return ServiceMonitor


def scaled_object_model():
    from cloudcoil.models.keda.v1alpha1 import ScaledObject

    return ScaledObject


CRD_MODELS = {("monitoring.coreos.com/v1", "ServiceMonitor"): service_monitor_model,
              ("keda.sh/v1alpha1", "ScaledObject"): scaled_object_model}


def check(doc: dict) -> list[str]:
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in CRD_MODELS:
        return check_custom_resource(CRD_MODELS[key](), doc)
    errors = []
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            errors.append(f"no schema for {key} in Kubernetes {version} and no CRD check here")
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            errors.append(f"Kubernetes {version}: {where}: {exc.message}")
    return errors


def main(paths: list[str]) -> int:
    failures = 0
    for path in paths:
        for doc in yaml.safe_load_all(Path(path).read_text()):
            if not doc:
                continue
            name = f"{path}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
            errors = check(doc)
            failures += bool(errors)
            print(f"{'FAIL' if errors else 'ok  '} {name}" + "".join(f"\n     {e}" for e in errors))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
