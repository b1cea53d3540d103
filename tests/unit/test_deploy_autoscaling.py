"""configs/k8s/<topology>/autoscaling-{keda,hpa}.yaml (xpyd_deploy/k8s_autoscaling.py; issue 50 §2) agree
with the role Deployments, with the proxy's real /metrics and with Kubernetes (no cluster needed).

The HPAs pass the strict autoscaling/v2 schema of the pinned Kubernetes versions (kubernetes-validate;
tests/deploy/test_deploy_k8s.py's schema test covers them too). The ScaledObjects (a CRD) are checked against the
fields KEDA's keda.sh/v1alpha1 CRD defines. Semantics, read from the manifests: each role's Deployment
has one ScaledObject and one HPA targeting it, from its replicas up; every query and external metric
names a series the proxy exports (its /metrics, rendered by the real app) with labels that series
carries or the PodMonitor adds, for this topology and its served model. Each check is shown to fail
on a mutated manifest.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from proxy.config import load_config
from proxy.serving.app import create_app
from xpyd_deploy import k8s
from xpyd_deploy.topology import Topology, load_topology
from xpyd_wire.discovery import Load

kubernetes_validate = pytest.importorskip("kubernetes_validate")

K8S_DIR = Path(__file__).resolve().parents[2] / "configs" / "k8s"


def load_dir(name: str) -> dict[str, list[dict[str, Any]]]:
    """file name -> its YAML documents, for one topology's directory."""
    return {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d is not None]
            for p in sorted((K8S_DIR / name).glob("*.yaml"))}


# KEDA 2.x ScaledObjectSpec and ScaleTriggers fields (keda.sh/v1alpha1 CRD).
KEDA_SPEC = {"scaleTargetRef", "pollingInterval", "initialCooldownPeriod", "cooldownPeriod", "idleReplicaCount",
             "minReplicaCount", "maxReplicaCount", "advanced", "triggers", "fallback"}
KEDA_TRIGGER = {"type", "name", "metadata", "metricType", "authenticationRef", "useCachedMetrics"}
KEDA_METRIC_TYPES = {"AverageValue", "Value", "Utilization"}
# Prometheus trigger metadata (KEDA's prometheus scaler).
PROMETHEUS_METADATA = {"serverAddress", "query", "threshold", "activationThreshold", "namespace",
                       "customHeaders", "ignoreNullValues", "queryParameters", "unsafeSsl", "timeout"}
SERIES = re.compile(r"\b(xpyd_[a-z_]+)\{([^}]*)\}")
MATCHER = re.compile(r'(\w+)="([^"]*)"')


def proxy_series() -> dict[str, set[str]]:
    """Series name -> its label names, from the /metrics of a real proxy app that holds one live P
    and one live D (their heartbeat loads and models set as discovery sets them)."""
    state = create_app(load_config(["--port", "0"], env={})).state.proxy
    for role in ("P", "D"):
        inst = state.registry.add_static(role, f"127.0.0.1:{8100 + len(role)}", "127.0.0.1:21001")
        state.registry.set_healthy(inst, True)
        state.registry.set_models(inst, {"tiny-llama": {"id": "tiny-llama"}})
        inst.load = Load(running=1, waiting=2, kv_usage=0.5)
    text = state.metrics.render().decode()
    series: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            series.setdefault(s.name, set()).update(s.labels)
    return series


SERIES_LABELS = proxy_series()


def pod_target_labels(files: dict[str, list[dict]]) -> set[str]:
    """The labels Prometheus adds from the PodMonitor's podTargetLabels (sanitised as it does)."""
    (pm,) = files["monitoring.yaml"]
    return {re.sub(r"[^a-zA-Z0-9_]", "_", label) for label in pm["spec"].get("podTargetLabels", [])}


def _series_problems(where: str, name: str, labels: dict[str, str], topo: Topology, extra: set[str]) -> list[str]:
    out = []
    if name not in SERIES_LABELS:
        return [f"{where}: the proxy exports no {name}"]
    unknown = set(labels) - SERIES_LABELS[name] - extra
    if unknown:
        out.append(f"{where}: {name} has no label {sorted(unknown)}")
    if labels.get("xpyd_topology", topo.name) != topo.name:
        out.append(f"{where}: another topology's series ({labels['xpyd_topology']})")
    if "xpyd_topology" not in labels:
        out.append(f"{where}: {name} not narrowed to this topology")
    if labels.get("model", topo.served_model_name) != topo.served_model_name:
        out.append(f"{where}: model {labels['model']!r}, the topology serves {topo.served_model_name!r}")
    return out


def problems(topo: Topology, files: dict[str, list[dict]]) -> list[str]:  # noqa: C901 (one list of checks)
    out: list[str] = []
    deployments = {d["metadata"]["name"]: d for docs in files.values() for d in docs if d.get("kind") == "Deployment"}
    roles = {k8s.COMPONENT[r]: f"xpyd-{k8s.COMPONENT[r]}" for r in ("P", "D")}
    extra = pod_target_labels(files)
    for fname, kind, low_key, high_key in (("autoscaling-keda.yaml", "ScaledObject", "minReplicaCount",
                                            "maxReplicaCount"),
                                           ("autoscaling-hpa.yaml", "HorizontalPodAutoscaler", "minReplicas",
                                            "maxReplicas")):  # fmt: skip
        docs = files.get(fname, [])
        targets = sorted(d["spec"]["scaleTargetRef"]["name"] for d in docs if d.get("kind") == kind)
        if targets != sorted(roles.values()):
            out.append(f"{fname}: {kind}s target {targets}, not one per role Deployment {sorted(roles.values())}")
        for d in docs:
            spec, where = d["spec"], f"{fname} {d['metadata']['name']}"
            ref = spec["scaleTargetRef"]
            dep = deployments.get(ref["name"])
            if (ref.get("apiVersion"), ref.get("kind")) != ("apps/v1", "Deployment") or dep is None:
                out.append(f"{where}: scaleTargetRef {ref} is no Deployment here")
                continue
            if spec[low_key] != dep["spec"]["replicas"] or spec[high_key] < spec[low_key]:
                out.append(f"{where}: replicas {spec[low_key]}..{spec[high_key]}, the Deployment has "
                           f"{dep['spec']['replicas']}")
            if kind == "ScaledObject":
                out += _keda_problems(where, spec, topo, extra)
            else:
                for m in spec["metrics"]:
                    metric = m["external"]["metric"]
                    out += _series_problems(where, metric["name"], metric["selector"]["matchLabels"], topo, extra)
    return out


def _keda_problems(where: str, spec: dict[str, Any], topo: Topology, extra: set[str]) -> list[str]:
    out = []
    if set(spec) - KEDA_SPEC:
        out.append(f"{where}: fields KEDA does not define: {sorted(set(spec) - KEDA_SPEC)}")
    for t in spec["triggers"]:
        if set(t) - KEDA_TRIGGER or t["type"] != "prometheus" or t.get("metricType") not in KEDA_METRIC_TYPES:
            out.append(f"{where}: trigger {t.get('name')} is no prometheus trigger KEDA reads")
            continue
        meta = t["metadata"]
        if set(meta) - PROMETHEUS_METADATA or not meta["serverAddress"].startswith("http"):
            out.append(f"{where}: trigger {t.get('name')} metadata {sorted(meta)}")
        try:
            if float(meta["threshold"]) <= 0:
                out.append(f"{where}: trigger {t.get('name')} threshold {meta['threshold']}")
        except (KeyError, ValueError):
            out.append(f"{where}: trigger {t.get('name')} has no numeric threshold")
        found = SERIES.findall(meta.get("query", ""))
        if not found:
            out.append(f"{where}: trigger {t.get('name')} queries no xpyd series")
        for name, matchers in found:
            out += _series_problems(f"{where} {t.get('name')}", name, dict(MATCHER.findall(matchers)), topo, extra)
    return out


@pytest.mark.parametrize("topo_name", k8s.TOPOLOGIES)
def test_autoscalers_scale_each_role_on_the_proxys_series(topo_name: str):
    files = load_dir(topo_name)
    assert problems(load_topology(topo_name), files) == []
    kinds = [d["kind"] for f in ("autoscaling-keda.yaml", "autoscaling-hpa.yaml") for d in files[f]]
    assert kinds == ["ScaledObject"] * 2 + ["HorizontalPodAutoscaler"] * 2


@pytest.mark.parametrize("version", k8s.KUBERNETES_VERSIONS)
def test_the_hpas_pass_the_strict_schema(version: str):
    hpas = [d for t in k8s.TOPOLOGIES for d in load_dir(t)["autoscaling-hpa.yaml"]]
    assert len(hpas) == 2 * len(k8s.TOPOLOGIES)
    for d in hpas:
        kubernetes_validate.validate(d, version, strict=True)


def _doc(files, fname: str, name: str) -> dict:
    return next(d for d in files[fname] if d["metadata"]["name"] == name)


def _keda_d(files) -> dict:
    return _doc(files, "autoscaling-keda.yaml", "xpyd-decode")


def _hpa_p(files) -> dict:
    return _doc(files, "autoscaling-hpa.yaml", "xpyd-prefill")


MUTATIONS = {
    "target-not-a-deployment": lambda f: _keda_d(f)["spec"]["scaleTargetRef"].update(name="xpyd-decoder"),
    "min-below-the-topology": lambda f: _hpa_p(f)["spec"].update(minReplicas=0),
    "max-below-min": lambda f: _keda_d(f)["spec"].update(maxReplicaCount=0),
    "unknown-keda-field": lambda f: _keda_d(f)["spec"].update(minReplicas=1),
    "not-prometheus": lambda f: _keda_d(f)["spec"]["triggers"][0].update(type="prometheus-typo"),
    "no-threshold": lambda f: _keda_d(f)["spec"]["triggers"][0]["metadata"].pop("threshold"),
    "unknown-series": lambda f: _keda_d(f)["spec"]["triggers"][0]["metadata"].update(
        query='max(xpyd_role_kv_usage{role="D",xpyd_topology="2p2d"})'),
    "unknown-label": lambda f: _hpa_p(f)["spec"]["metrics"][0]["external"]["metric"]["selector"]["matchLabels"]
    .update(pod="x"),
    "other-model": lambda f: _hpa_p(f)["spec"]["metrics"][0]["external"]["metric"]["selector"]["matchLabels"]
    .update(model="llama"),
    "other-topology": lambda f: _keda_d(f)["spec"]["triggers"][0]["metadata"].update(
        query='max(xpyd_role_kv_cache_usage{role="D",xpyd_topology="1p1d"})'),
    "one-role-unscaled": lambda f: f["autoscaling-hpa.yaml"].pop(),
}


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_the_checks_catch_a_mutated_manifest(mutation: str):
    files = copy.deepcopy(load_dir("2p2d"))
    assert problems(load_topology("2p2d"), files) == []
    MUTATIONS[mutation](files)
    assert problems(load_topology("2p2d"), files)
