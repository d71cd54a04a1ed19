"""The Kubernetes manifests agree with the service and with each other.

Renders each overlay with ``kubectl kustomize`` (skips, saying so, without kubectl) and
checks what schemas cannot: settings the service accepts, the shutdown arithmetic, probes
on the right endpoints, selectors that select, an HPA metric the adapter serves from a
metric the service exports. Schema validation and the policy scan are deploy/k8s-checks.sh.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from deploy.fleet import CACHE_AWARE_ARGS
from service.metrics import Metrics
from service.settings import Settings

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
KUBECTL = shutil.which("kubectl")


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> dict[str, dict]:
    if KUBECTL is None:
        pytest.skip("kubectl is not installed (deploy/k8s-checks.sh installs one)")
    out = subprocess.run([KUBECTL, "kustomize", str(K8S / "overlays" / request.param)], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), "one object per kind expected"
    by_kind["overlay"] = request.param
    return by_kind


def container(objs) -> dict:
    (c,) = objs["Deployment"]["spec"]["template"]["spec"]["containers"]
    return c


def settings_env(objs) -> dict[str, str]:
    return objs["ConfigMap"]["data"]


def test_every_overlay_has_the_objects_the_issue_lists(rendered):
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "ServiceMonitor", "NetworkPolicy",
            "ServiceAccount", "Namespace"} <= set(rendered)
    # One autoscaler: our HPA (prometheus-adapter), or KEDA's ScaledObject, which makes its own HPA.
    assert len({"HorizontalPodAutoscaler", "ScaledObject"} & set(rendered)) == 1
    namespaces = {d["metadata"].get("namespace") for k, d in rendered.items() if k not in ("overlay", "Namespace")}
    assert namespaces == {rendered["Namespace"]["metadata"]["name"]}


def test_the_config_map_holds_valid_settings(rendered):
    env = settings_env(rendered)
    assert all(k.startswith("TSERVE_") for k in env)
    fields = {k.removeprefix("TSERVE_").lower(): v for k, v in env.items()}
    assert set(fields) <= set(Settings.model_fields), set(fields) - set(Settings.model_fields)
    Settings(_env_file=None, **fields)  # raises on a value the service would refuse
    assert "TSERVE_TORCH_THREADS" not in env and "TSERVE_API_KEY" not in env


def test_torch_threads_follow_the_cpu_limit_and_the_key_comes_from_a_secret(rendered):
    c = container(rendered)
    env = {e["name"]: e for e in c["env"]}
    ref = env["TSERVE_TORCH_THREADS"]["valueFrom"]["resourceFieldRef"]
    assert ref == {"containerName": c["name"], "resource": "limits.cpu", "divisor": "1"}
    assert c["resources"]["requests"]["cpu"] == c["resources"]["limits"]["cpu"]
    assert "secretKeyRef" in env["TSERVE_API_KEY"]["valueFrom"]
    assert c["envFrom"] == [{"configMapRef": {"name": rendered["ConfigMap"]["metadata"]["name"]}}]


def test_shutdown_fits_in_the_termination_grace_period(rendered):
    pod = rendered["Deployment"]["spec"]["template"]["spec"]
    pre_stop = container(rendered)["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    grace = float(settings_env(rendered)["TSERVE_SHUTDOWN_GRACE_S"])
    # preStop, then uvicorn's graceful wait (grace), then the engines' own wait (up to grace again)
    assert pod["terminationGracePeriodSeconds"] > float(pre_stop[1]) + 2 * grace


def k8s_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity (binary suffixes, or plain bytes) in bytes."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    number, suffix = re.fullmatch(r"(\d+)([KMGT]i)?", quantity).groups()
    return int(number) * units.get(suffix or "", 1)


def test_memory_covers_the_budget_on_cpu_replicas(rendered):
    """A CPU replica's memory limit holds TSERVE_MEMORY_BUDGET (weights + KV caches) x 1.2 for
    activations under load plus 1.5 GiB of the process's own (deployment.yaml gives the
    measurement), so a load on demand evicts models before the kubelet kills the pod; the
    request is at least the budget. (A GPU replica's budget counts device memory.)"""
    env = settings_env(rendered)
    if env["TSERVE_DEVICE"] != "cpu":
        return
    budget = Settings(_env_file=None, memory_budget=env["TSERVE_MEMORY_BUDGET"]).memory_budget
    resources = container(rendered)["resources"]
    assert budget is not None and k8s_bytes(resources["requests"]["memory"]) >= budget
    assert k8s_bytes(resources["limits"]["memory"]) >= 1.2 * budget + 1.5 * 2**30


def test_probes_use_the_service_endpoints(rendered):
    c = container(rendered)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == int(settings_env(rendered)["TSERVE_PORT"])
    for probe, path in (("startupProbe", "/ready"), ("readinessProbe", "/ready"), ("livenessProbe", "/health")):
        assert c[probe]["httpGet"] == {"path": path, "port": "http"}, probe
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120  # model loading + warm-up


def test_hardened_pod(rendered):
    pod = rendered["Deployment"]["spec"]["template"]["spec"]
    c = container(rendered)
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 10001
    assert c["securityContext"]["readOnlyRootFilesystem"] and not c["securityContext"]["allowPrivilegeEscalation"]
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    (tmp,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
    (vol,) = [v for v in pod["volumes"] if v["name"] == tmp["name"]]
    assert "emptyDir" in vol
    assert pod["automountServiceAccountToken"] is False


def matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_selectors_select(rendered):
    pod_labels = rendered["Deployment"]["spec"]["template"]["metadata"]["labels"]
    service = rendered["Service"]
    assert matches(rendered["Deployment"]["spec"]["selector"]["matchLabels"], pod_labels)
    assert matches(service["spec"]["selector"], pod_labels)
    assert matches(rendered["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"], pod_labels)
    assert matches(rendered["NetworkPolicy"]["spec"]["podSelector"]["matchLabels"], pod_labels)
    monitor = rendered["ServiceMonitor"]["spec"]
    assert matches(monitor["selector"]["matchLabels"], service["metadata"]["labels"])
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    assert {e["port"] for e in monitor["endpoints"]} <= service_ports
    assert all(e["path"] == "/metrics" for e in monitor["endpoints"])
    autoscaler = rendered.get("HorizontalPodAutoscaler") or rendered["ScaledObject"]
    target = autoscaler["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", rendered["Deployment"]["metadata"]["name"])


def exported_metrics() -> set[str]:
    return {m.name for m in Metrics().registry.collect()}


def base_hpa() -> dict:
    return yaml.safe_load((K8S / "base" / "horizontalpodautoscaler.yaml").read_text())["spec"]


def test_the_autoscaler_scales_on_an_exported_metric(rendered):
    if "HorizontalPodAutoscaler" in rendered:
        check_hpa_metric_is_served_by_the_adapter(rendered)
    else:
        check_keda_scales_on_the_same_metric_and_target_as_the_hpa(rendered)


def check_hpa_metric_is_served_by_the_adapter(rendered):
    hpa = rendered["HorizontalPodAutoscaler"]["spec"]
    assert hpa["minReplicas"] >= 2  # with the PDB's maxUnavailable 1, a drain never empties the service
    (metric,) = hpa["metrics"]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]
    rules = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())["rules"]["custom"]
    (rule,) = [r for r in rules if r["name"]["as"] == name]
    series = re.match(r"(\w+)\{", rule["seriesQuery"]).group(1)
    assert series in exported_metrics()
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}


def check_keda_scales_on_the_same_metric_and_target_as_the_hpa(rendered):
    spec, hpa = rendered["ScaledObject"]["spec"], base_hpa()
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    (target,) = [m["pods"] for m in hpa["metrics"]]
    assert target["metric"]["name"] in exported_metrics()
    assert re.search(rf"\b{target['metric']['name']}\{{namespace=\"{rendered['Namespace']['metadata']['name']}\"}}",
                     trigger["metadata"]["query"])
    assert float(trigger["metadata"]["threshold"]) == float(target["target"]["averageValue"])
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (hpa["minReplicas"], hpa["maxReplicas"])
    assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == hpa["behavior"]


def test_every_checkov_skip_says_why(rendered):
    for kind, obj in rendered.items():
        if kind == "overlay":
            continue
        for key, value in obj["metadata"].get("annotations", {}).items():
            if key.startswith("checkov.io/skip"):
                check, _, reason = value.partition("=")
                assert re.fullmatch(r"CKV2?_K8S_\d+", check) and len(reason) > 20, f"{kind}: {value}"


def test_gpu_overlay(rendered):
    c = container(rendered)
    env = settings_env(rendered)
    if rendered["overlay"] != "gpu":
        assert env["TSERVE_DEVICE"] == "cpu" and "nvidia.com/gpu" not in c["resources"]["limits"]
        return
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert (env["TSERVE_DEVICE"], env["TSERVE_DTYPE"]) == ("cuda", "bfloat16")
    assert "cu" in c["image"].rsplit(":", 1)[1]  # the CUDA build of the image


def test_haproxy_waits_longer_than_the_service_times_out():
    cfg = (ROOT / "deploy" / "lb" / "haproxy.cfg").read_text()
    env = dict(line.split("=", 1) for line in (K8S / "base" / "settings.env").read_text().splitlines()
               if line and not line.startswith("#"))
    timeout = float(env["TSERVE_REQUEST_TIMEOUT_S"])
    for side in ("client", "server"):
        seconds = int(re.search(rf"^\s*timeout {side} (\d+)s$", cfg, re.M).group(1))
        assert seconds > timeout, side


def test_the_gateway_finds_and_reaches_the_replicas():
    """deploy/k8s/gateway (applied beside an overlay): SMG's discovery selects the replicas' pods
    on their HTTP port, in their namespace, with read-only access to pods; its probes and the
    replicas' health check are the endpoints that exist."""
    if KUBECTL is None:
        pytest.skip("kubectl is not installed (deploy/k8s-checks.sh installs one)")
    out = subprocess.run([KUBECTL, "kustomize", str(K8S / "gateway")], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    replicas = subprocess.run([KUBECTL, "kustomize", str(K8S / "overlays" / "cpu")], capture_output=True, text=True,
                              timeout=60, check=True).stdout
    replica = {d["kind"]: d for d in yaml.safe_load_all(replicas) if d}
    pod_labels = replica["Deployment"]["spec"]["template"]["metadata"]["labels"]
    (replica_port,) = [p["containerPort"] for p in container(replica)["ports"] if p["name"] == "http"]
    assert {d["metadata"]["namespace"] for d in docs} == {replica["Namespace"]["metadata"]["name"]}
    (gateway,) = [d for d in docs if d["kind"] == "Deployment"]
    (c,) = gateway["spec"]["template"]["spec"]["containers"]
    args = c["args"]

    def arg(flag: str) -> str:
        return args[args.index(flag) + 1]

    assert "--service-discovery" in args and arg("--service-discovery-namespace") == "$(POD_NAMESPACE)"
    assert matches(dict(kv.split("=", 1) for kv in [arg("--selector")]), pod_labels)
    assert int(arg("--service-discovery-port")) == replica_port
    assert arg("--health-check-endpoint") == "/ready" and arg("--policy") == "cache_aware"
    # The cache-aware flags the routing test measured (deploy/fleet.py), here as in the compose file.
    compose = (ROOT / "docker-compose.yml").read_text()
    for flag, value in zip(CACHE_AWARE_ARGS[::2], CACHE_AWARE_ARGS[1::2], strict=True):
        assert arg(flag) == value, flag
        assert f"{flag} {value} " in compose.replace("\n", " "), flag
    assert c["readinessProbe"]["httpGet"]["path"] == "/readiness"
    assert c["livenessProbe"]["httpGet"]["path"] == "/liveness"
    (role,) = [d for d in docs if d["kind"] == "Role"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    (headless,) = [d for d in docs if d["kind"] == "Service" and d["spec"].get("clusterIP") == "None"]
    assert matches(headless["spec"]["selector"], pod_labels)
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    (to_replicas,) = [e for e in policy["spec"]["egress"] if "to" in e]
    assert matches(to_replicas["to"][0]["podSelector"]["matchLabels"], pod_labels)
    assert to_replicas["ports"] == [{"port": replica_port, "protocol": "TCP"}]
