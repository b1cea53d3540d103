"""Autoscaling manifests per role, rendered with xpyd_deploy/k8s.py's into configs/k8s/<topology>/
(docs/deploying/autoscaling.md says which signal scales which role and why):

- autoscaling-keda.yaml: a KEDA ScaledObject (keda.sh/v1alpha1) per role, Prometheus triggers;
- autoscaling-hpa.yaml: the same signals as autoscaling/v2 HorizontalPodAutoscalers on External
  metrics, for clusters with an external-metrics adapter (prometheus-adapter: the rules are in
  the docs page).

Neither is in kustomization.yaml: pick one (a ScaledObject makes its own HPA, and two HPAs on one
Deployment fight), and each needs a component the cluster may lack (KEDA, the adapter).

The signals are the proxy's (proxy/metrics.py), which hears every engine's heartbeat: per role and
model, the requests vLLM has waiting (xpyd_role_requests) and its KV-cache use
(xpyd_role_kv_cache_usage), and the proxy's own queue for a role (xpyd_queue_depth). Every proxy
replica reports the same engines, so the queries take the max across replicas for those, and the
sum of the replicas' own queues.
"""

from __future__ import annotations

from typing import Any

from xpyd_deploy.k8s import COMPONENT, _meta
from xpyd_deploy.topology import Topology

# Where KEDA reaches Prometheus: the Prometheus Operator's default Service in a "monitoring"
# namespace. Edit it for yours (docs/deploying/autoscaling.md).
PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"
# Targets. P: requests waiting per P replica (vLLM's queue plus the proxy's own for P). D: the
# mean KV-cache use over the D replicas (a D whose cache is full queues or preempts), and requests
# waiting per D replica (what a full cache leaves waiting).
PREFILL_WAITING_PER_REPLICA = 4
DECODE_KV_USAGE = 0.8
DECODE_WAITING_PER_REPLICA = 2
MAX_REPLICAS_FACTOR = 4  # up to this many times the topology's count of a role
POLLING_S = 15  # the PodMonitor's scrape interval (xpyd_deploy/k8s.py render_podmonitor)
# An engine takes minutes to start (model load): scale down only after this long below target,
# so a dip between bursts does not drop a replica that the next burst needs again.
SCALE_DOWN_WINDOW_S = 600


def _selector(topo: Topology) -> str:
    """The proxy's series of this topology (the PodMonitor's pod labels), for one model."""
    return f'xpyd_topology="{topo.name}",model="{topo.served_model_name}"'


def signals(topo: Topology, role: str) -> list[dict[str, Any]]:
    """The role's signals: name, PromQL query (KEDA), external metric and selector (HPA), target
    kind (AverageValue: per replica; Value: the role's mean, as is) and target."""
    sel = _selector(topo)
    queue = {"name": "proxy-queue", "query": f'sum(xpyd_queue_depth{{role="{role}",xpyd_topology="{topo.name}"}})',
             "metric": "xpyd_queue_depth", "labels": {"role": role}}
    if role == "P":
        return [
            {"name": "waiting", "query": f'max(xpyd_role_requests{{role="P",state="waiting",{sel}}})',
             "metric": "xpyd_role_requests", "labels": {"role": "P", "state": "waiting"},
             "type": "AverageValue", "target": PREFILL_WAITING_PER_REPLICA},
            {**queue, "type": "AverageValue", "target": PREFILL_WAITING_PER_REPLICA},
        ]
    return [
        {"name": "kv-cache", "query": f'max(xpyd_role_kv_cache_usage{{role="D",{sel}}})',
         "metric": "xpyd_role_kv_cache_usage", "labels": {"role": "D"}, "type": "Value", "target": DECODE_KV_USAGE},
        {"name": "waiting", "query": f'max(xpyd_role_requests{{role="D",state="waiting",{sel}}})',
         "metric": "xpyd_role_requests", "labels": {"role": "D", "state": "waiting"},
         "type": "AverageValue", "target": DECODE_WAITING_PER_REPLICA},
        {**queue, "type": "AverageValue", "target": DECODE_WAITING_PER_REPLICA},
    ]


def _replicas(topo: Topology, role: str) -> tuple[int, int]:
    n = len(topo.by_role(role))
    return n, n * MAX_REPLICAS_FACTOR


def _behavior() -> dict[str, Any]:
    return {"scaleDown": {"stabilizationWindowSeconds": SCALE_DOWN_WINDOW_S,
                          "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}]},
            "scaleUp": {"stabilizationWindowSeconds": 0,
                        "policies": [{"type": "Percent", "value": 100, "periodSeconds": 60}]}}


def _target(role: str) -> dict[str, str]:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"xpyd-{COMPONENT[role]}"}


def _quantity(x: float) -> str:
    """A Kubernetes quantity: whole numbers as is, fractions in milli-units (0.8 -> 800m)."""
    return str(int(x)) if float(x).is_integer() else f"{round(x * 1000)}m"


def render_keda(topo: Topology) -> list[dict[str, Any]]:
    docs = []
    for role in ("P", "D"):
        low, high = _replicas(topo, role)
        name = f"xpyd-{COMPONENT[role]}"
        docs.append({
            "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": _meta(name, COMPONENT[role], topo),
            "spec": {
                "scaleTargetRef": _target(role),
                "pollingInterval": POLLING_S, "cooldownPeriod": SCALE_DOWN_WINDOW_S,
                "minReplicaCount": low, "maxReplicaCount": high,
                "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior()}},
                "triggers": [{"type": "prometheus", "name": s["name"], "metricType": s["type"],
                              "metadata": {"serverAddress": PROMETHEUS, "query": s["query"],
                                           "threshold": str(s["target"]), "ignoreNullValues": "true"}}
                             for s in signals(topo, role)],
            },
        })  # fmt: skip
    return docs


def render_hpa(topo: Topology) -> list[dict[str, Any]]:
    docs = []
    for role in ("P", "D"):
        low, high = _replicas(topo, role)
        name = f"xpyd-{COMPONENT[role]}"
        metrics = []
        for s in signals(topo, role):
            labels = {**s["labels"], "xpyd_topology": topo.name}
            if s["metric"] != "xpyd_queue_depth":  # the proxy's queue is per role, not per model
                labels["model"] = topo.served_model_name
            target = ({"type": "AverageValue", "averageValue": _quantity(s["target"])} if s["type"] == "AverageValue"
                      else {"type": "Value", "value": _quantity(s["target"])})
            metrics.append({"type": "External", "external": {
                "metric": {"name": s["metric"], "selector": {"matchLabels": labels}}, "target": target}})
        docs.append({
            "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": _meta(name, COMPONENT[role], topo),
            "spec": {"scaleTargetRef": _target(role), "minReplicas": low, "maxReplicas": high, "metrics": metrics,
                     "behavior": _behavior()},
        })  # fmt: skip
    return docs


KEDA_COMMENT = ("# Optional: KEDA ScaledObjects (needs KEDA and Prometheus scraping the proxy: monitoring.yaml);\n"
                "# not in kustomization.yaml. Use this or autoscaling-hpa.yaml, not both.\n"
                "# kubectl apply -f autoscaling-keda.yaml -n xpyd   (docs/deploying/autoscaling.md)\n")
HPA_COMMENT = ("# Optional: HorizontalPodAutoscalers on External metrics (needs an external-metrics adapter serving\n"
               "# the proxy's series, e.g. prometheus-adapter with the rules in docs/deploying/autoscaling.md);\n"
               "# not in kustomization.yaml. Use this or autoscaling-keda.yaml, not both.\n")


def render_files(topo: Topology, header: str, dump_all) -> dict[str, str]:  # noqa: ANN001 (k8s._dump_all)
    """file name -> content: the two optional autoscaling files of one topology's directory."""
    return {"autoscaling-keda.yaml": header + KEDA_COMMENT + dump_all(render_keda(topo)),
            "autoscaling-hpa.yaml": header + HPA_COMMENT + dump_all(render_hpa(topo))}
