"""configs/k8s/ agrees with configs/topologies/ and with Kubernetes (no cluster needed).

The checks: the committed manifests are exactly what `python -m xpyd_deploy.k8s` renders (no
hand edits, no leftovers); every object passes the strict OpenAPI schema of the pinned
Kubernetes versions (kubernetes-validate), and the validator does reject broken objects;
the PodMonitor (a CRD) has the shape the Prometheus Operator reads and selects our pods;
`kubectl kustomize` renders each directory when kubectl is installed. Semantic checks read
the manifests as Kubernetes would, against the topology file and the real proxy/connector
code (not the renderer): engines register with the proxies' headless Service and its
discovery port, advertise their pod IP, carry the launcher's kv-transfer settings; GPU
requests equal the TP size; probes hit paths that exist on named ports that exist; label
selectors match pod labels; Service ports match container ports; every secret reference is in
the Secret example; termination grace covers the preStop sleep plus the drain. Each semantic
check is shown to fail on a mutated manifest.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]

from connector.config import ConnectorConfig  # noqa: E402
from proxy.config import ConfigError, load_config  # noqa: E402
from xpyd_deploy import k8s  # noqa: E402  (xpyd_deploy/k8s.py)
from xpyd_deploy.topology import Topology, load_topology  # noqa: E402  (xpyd_deploy/topology.py)

kubernetes_validate = pytest.importorskip("kubernetes_validate")

K8S_DIR = ROOT / "configs" / "k8s"
NOT_IN_KUSTOMIZATION = {"secrets-example.yaml", "monitoring.yaml", "autoscaling-keda.yaml", "autoscaling-hpa.yaml"}
# Paths the probes may use: the proxy's own routes are read from its app below; vLLM's health
# route is checked against the installed vLLM when there is one (test_vllm_accepts_...).
VLLM_PATHS = {"/health", "/metrics"}
POD_IP = "10.244.1.7"


def load_dir(name: str) -> dict[str, list[dict[str, Any]]]:
    return {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d is not None]
            for p in sorted((K8S_DIR / name).glob("*.yaml"))}


def _all_docs(files: dict[str, list[dict]]) -> list[dict]:
    return [d for docs in files.values() for d in docs]


def _find(files: dict[str, list[dict]], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in _all_docs(files) if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name)]


def _flag(args: list[str], flag: str) -> str | None:
    for n, a in enumerate(args):
        if a == flag:
            return args[n + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _proxy_paths() -> set[str]:
    from proxy.serving.app import create_app

    app = create_app(load_config(["--discovery-host", "127.0.0.1"], env={}))
    return {getattr(r, "path", None) for r in app.routes} - {None}


PROXY_PATHS = _proxy_paths()


# ---- the semantic checks (a list of problems; empty when the manifests are right) ------
def problems(topo: Topology, files: dict[str, list[dict]]) -> list[str]:  # noqa: C901 (one list of checks)
    out: list[str] = []
    docs = _all_docs(files)
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    if set(deployments) != {"xpyd-proxy", "xpyd-prefill", "xpyd-decode"}:
        return [f"deployments: {sorted(deployments)}"]

    def pod(dep: dict) -> dict:
        return dep["spec"]["template"]["spec"]

    def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
        return bool(selector) and all(labels.get(k) == v for k, v in selector.items())

    def pods_selected(selector: dict[str, str]) -> list[str]:
        return [n for n, d in deployments.items()
                if labels_match(selector, d["spec"]["template"]["metadata"]["labels"])]

    # Secrets: every reference is to the example Secret and one of its keys (or optional).
    (secret,) = _find(files, "Secret") or [None]
    if secret is None:
        return ["no Secret example"]
    secret_keys = set(secret.get("stringData", {})) | set(secret.get("data", {}))

    def env_of(c: dict) -> dict[str, dict]:
        return {e["name"]: e for e in c.get("env", [])}

    for name, dep in deployments.items():
        tmpl = dep["spec"]["template"]
        sel = dep["spec"]["selector"]["matchLabels"]
        if not labels_match(sel, tmpl["metadata"]["labels"]):
            out.append(f"{name}: selector {sel} does not match its pod labels")
        if pods_selected(sel) != [name]:
            out.append(f"{name}: selector also matches {pods_selected(sel)}")
        spec = pod(dep)
        if spec.get("enableServiceLinks") is not False:
            out.append(f"{name}: service links on (XPYD_* variables of Services reach the proxy's config)")
        (c,) = spec["containers"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        paths = PROXY_PATHS if name == "xpyd-proxy" else VLLM_PATHS
        for kind in ("livenessProbe", "readinessProbe", "startupProbe"):
            probe = c.get(kind)
            if probe is None:
                if kind != "startupProbe":
                    out.append(f"{name}: no {kind}")
                continue
            get = probe["httpGet"]
            if get["path"] not in paths:
                out.append(f"{name}: {kind} path {get['path']} is not served")
            if get["port"] not in ports and get["port"] not in ports.values():
                out.append(f"{name}: {kind} port {get['port']} is not a container port")
        ann = tmpl["metadata"].get("annotations", {})
        if (ann.get("prometheus.io/scrape"), ann.get("prometheus.io/path")) != ("true", "/metrics") \
                or ann.get("prometheus.io/port") != str(ports.get("http")):
            out.append(f"{name}: prometheus annotations {ann} do not point at /metrics on the http port")
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref and (ref["name"] != secret["metadata"]["name"]
                        or (ref["key"] not in secret_keys and not ref.get("optional"))):
                out.append(f"{name}: env {e['name']} refers to {ref['name']}/{ref['key']}, not in the Secret example")
        mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
        for v in spec.get("volumes", []):
            if v["name"] not in mounts:
                out.append(f"{name}: volume {v['name']} not mounted")
            claim = v.get("persistentVolumeClaim", {}).get("claimName")
            if claim and not _find(files, "PersistentVolumeClaim", claim):
                out.append(f"{name}: PVC {claim} is not defined")

    # PodDisruptionBudgets: each selects exactly one Deployment's pods.
    for pdb in _find(files, "PodDisruptionBudget"):
        if len(pods_selected(pdb["spec"]["selector"]["matchLabels"])) != 1:
            out.append(f"PDB {pdb['metadata']['name']} selects {pods_selected(pdb['spec']['selector']['matchLabels'])}")
    if len(_find(files, "PodDisruptionBudget")) != 3:
        out.append("a PodDisruptionBudget per Deployment expected")

    # ---- the proxy ----
    proxy_spec = topo.proxies[0]
    pdep = deployments["xpyd-proxy"]
    if pdep["spec"]["replicas"] < max(2, len(topo.proxies)):
        out.append(f"proxy: {pdep['spec']['replicas']} replicas")
    (pc,) = pod(pdep)["containers"]
    pports = {p["name"]: p["containerPort"] for p in pc["ports"]}
    args = pc["args"]
    env = {"XPYD_DISCOVERY_SECRET": "s3cret"}
    try:
        cfg = load_config(args, env=env)
    except (ConfigError, SystemExit) as e:
        out.append(f"proxy: its args do not load: {e}")
        return out
    if (cfg.port, cfg.discovery_port) != (proxy_spec.port, proxy_spec.discovery_port) \
            or (pports.get("http"), pports.get("discovery")) != (cfg.port, cfg.discovery_port):
        out.append(f"proxy: ports {cfg.port}/{cfg.discovery_port}, container ports {pports}, topology "
                   f"{proxy_spec.port}/{proxy_spec.discovery_port}")
    if cfg.discovery_host != "0.0.0.0" or cfg.discovery_secret != "s3cret":
        out.append(f"proxy: discovery on {cfg.discovery_host} must bind 0.0.0.0, signed with the env's secret")
    penv = env_of(pc)
    sref = penv.get("XPYD_DISCOVERY_SECRET", {}).get("valueFrom", {}).get("secretKeyRef", {})
    if sref.get("key") != "discovery-secret" or sref.get("optional"):
        out.append("proxy: XPYD_DISCOVERY_SECRET must come from the Secret, not optional")
    if "XPYD_KV_SECRET" in penv:
        out.append("proxy: holds the KV secret (only engines need it)")
    # Topology-only proxy flags reach the proxy (e.g. the policies).
    for a in proxy_spec.args:
        if a not in args:
            out.append(f"proxy: topology flag {a} missing")
    prestop = pc.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    sleep = int(prestop[1]) if prestop[:1] == ["sleep"] else None
    grace = pod(pdep).get("terminationGracePeriodSeconds", 30)
    if sleep is None:
        out.append("proxy: no preStop sleep")
    elif not grace > sleep + cfg.shutdown_grace_s:
        out.append(f"proxy: grace {grace}s <= preStop {sleep}s + drain {cfg.shutdown_grace_s}s")
    client = services.get("xpyd-proxy")
    headless = services.get("xpyd-proxy-discovery")
    if client is None or headless is None:
        out.append(f"services: {sorted(services)}")
        return out
    for svc, port_name, want in ((client, "http", cfg.port), (headless, "discovery", cfg.discovery_port)):
        if pods_selected(svc["spec"]["selector"]) != ["xpyd-proxy"]:
            out.append(f"service {svc['metadata']['name']} selects {pods_selected(svc['spec']['selector'])}")
        for sp in svc["spec"]["ports"]:
            target = sp.get("targetPort", sp["port"])
            number = pports.get(target) if isinstance(target, str) else target
            if number != want or sp["port"] != want or (isinstance(target, str) and target != port_name):
                out.append(f"service {svc['metadata']['name']}: port {sp} does not reach {port_name} {want}")
    if client["spec"].get("clusterIP") == "None":
        out.append("the clients' Service is headless")
    if headless["spec"].get("clusterIP") != "None" or headless["spec"].get("publishNotReadyAddresses") is not True:
        out.append("discovery Service must be headless and publish not-ready proxies")
    hname, hport = headless["metadata"]["name"], headless["spec"]["ports"][0]["port"]
    # The short name (resolved in the pod's namespace) or the full one.
    proxy_name = re.compile(rf"{re.escape(hname)}(\.[a-z0-9-]+\.svc\.cluster\.local)?:{hport}")

    # ---- the engines ----
    for role, dname in (("P", "xpyd-prefill"), ("D", "xpyd-decode")):
        dep = deployments[dname]
        inst = topo.by_role(role)[0]
        if dep["spec"]["replicas"] != len(topo.by_role(role)):
            out.append(f"{dname}: {dep['spec']['replicas']} replicas, topology has {len(topo.by_role(role))}")
        spec = pod(dep)
        (c,) = spec["containers"]
        eargs, eenv = c["args"], env_of(c)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        if eenv.get("POD_IP", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != "status.podIP":
            out.append(f"{dname}: POD_IP is not the downward API's status.podIP")
        for var, key in (("XPYD_DISCOVERY_SECRET", "discovery-secret"), ("XPYD_KV_SECRET", "kv-secret")):
            ref = eenv.get(var, {}).get("valueFrom", {}).get("secretKeyRef", {})
            if ref.get("key") != key or ref.get("optional"):
                out.append(f"{dname}: {var} must come from the Secret's {key}")
        if c["command"][-2:] != ["-m", "vllm.entrypoints.openai.api_server"]:
            out.append(f"{dname}: command {c['command']}")
        if int(_flag(eargs, "--port") or 0) != ports.get("http") or ports.get("http") != inst.port:
            out.append(f"{dname}: --port {_flag(eargs, '--port')}, container port {ports.get('http')}")
        if _flag(eargs, "--host") != "0.0.0.0":
            out.append(f"{dname}: binds {_flag(eargs, '--host')}")
        kvc = json.loads(_flag(eargs, "--kv-transfer-config"))
        extra = kvc["kv_connector_extra_config"]
        # What the launcher runs for this instance, but for the addresses.
        want = topo.kv_transfer_config(inst)
        address_keys = {"kv_ip", "http_host", "proxy_ip", "proxy_port", "proxies", "proxy_resolve_interval_s"}
        if {k: v for k, v in kvc.items() if k != "kv_connector_extra_config"} != \
                {k: v for k, v in want.items() if k != "kv_connector_extra_config"}:
            out.append(f"{dname}: kv-transfer-config differs from the launcher's: {kvc}")
        if {k: v for k, v in extra.items() if k not in address_keys} != \
                {k: v for k, v in want["kv_connector_extra_config"].items() if k not in address_keys}:
            out.append(f"{dname}: kv_connector_extra_config differs from the launcher's: {extra}")
        if extra.get("kv_ip") != "$(POD_IP)" or extra.get("http_host") != "$(POD_IP)":
            out.append(f"{dname}: advertises {extra.get('kv_ip')}/{extra.get('http_host')}, not $(POD_IP)")
        if not extra.get("proxies") or not all(proxy_name.fullmatch(p) for p in extra["proxies"]) \
                or "proxy_ip" in extra:
            out.append(f"{dname}: registers with {extra.get('proxies')} / {extra.get('proxy_ip')}, "
                       f"not the headless Service {hname}:{hport}")
        # The connector's own parser on it, as the pod would run it.
        os_env = {"XPYD_DISCOVERY_SECRET": "d", "XPYD_KV_SECRET": "k"}
        with pytest.MonkeyPatch.context() as mp:
            for k, v in os_env.items():
                mp.setenv(k, v)
            expanded = json.loads(_flag(eargs, "--kv-transfer-config").replace("$(POD_IP)", POD_IP))
            try:
                cc = ConnectorConfig.from_vllm(SimpleNamespace(
                    kv_role=expanded["kv_role"], kv_port=expanded["kv_port"],
                    kv_connector_extra_config=expanded["kv_connector_extra_config"]))
            except ValueError as e:
                out.append(f"{dname}: the connector rejects its config: {e}")
                continue
        if (cc.kv_ip, cc.http_host, cc.http_port) != (POD_IP, POD_IP, inst.port) \
                or (cc.discovery_secret, cc.kv_secret) != ("d", "k") or cc.role != inst.kv_role:
            out.append(f"{dname}: connector sees {cc}")
        kv_ports = {v for k, v in ports.items() if k.startswith("kv-")}
        if kv_ports != {cc.kv_port + r for r in range(inst.tp)}:
            out.append(f"{dname}: kv container ports {sorted(kv_ports)} for kv_port {cc.kv_port}, TP {inst.tp}")
        # KV events: what vLLM binds is what the container declares (the proxy subscribes there).
        events = json.loads(_flag(eargs, "--kv-events-config") or "null")
        bound = set() if events is None else {int(events[k].rsplit(":", 1)[1])
                                               for k in ("endpoint", "replay_endpoint")}
        declared = {v for k, v in ports.items() if k.startswith("events")}
        if bound != declared or (events is None) != (inst.events_port is None):
            out.append(f"{dname}: kv events ports {sorted(bound)}, container ports {sorted(declared)}")
        res = c.get("resources", {})
        gpus = {res.get("requests", {}).get("nvidia.com/gpu"), res.get("limits", {}).get("nvidia.com/gpu")}
        tp_flag = int(_flag(eargs, "--tensor-parallel-size") or 1)
        if topo.device == "cuda":
            if gpus != {inst.tp} or tp_flag != inst.tp:
                out.append(f"{dname}: GPUs {gpus}, --tensor-parallel-size {tp_flag}, topology TP {inst.tp}")
            if "model-cache" not in {m["name"] for m in c.get("volumeMounts", [])}:
                out.append(f"{dname}: no model volume")
        elif gpus != {None} or tp_flag != 1:
            out.append(f"{dname}: a CPU engine asks for GPUs {gpus} / TP {tp_flag}")
        shm = [v for v in spec.get("volumes", []) if v.get("emptyDir", {}).get("medium") == "Memory"]
        if not any(m["mountPath"] == "/dev/shm" and m["name"] in {v["name"] for v in shm}
                   for m in c.get("volumeMounts", [])):
            out.append(f"{dname}: /dev/shm is not a memory emptyDir")
        timeout = _flag(eargs, "--shutdown-timeout")
        if timeout is None or not spec.get("terminationGracePeriodSeconds", 30) > int(timeout):
            out.append(f"{dname}: grace {spec.get('terminationGracePeriodSeconds')}s vs --shutdown-timeout {timeout}")
    return out


# ---- drift -----------------------------------------------------------------------------
def test_committed_files_are_rendered_from_the_topologies():
    files = k8s.rendered_files()
    changed, extra = k8s.stale_files(files)
    assert (changed, extra) == ([], []), "rerun `python -m xpyd_deploy.k8s`"
    out = subprocess.run([sys.executable, "-m", "xpyd_deploy.k8s", "--check"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_drift_check_fails_on_an_edited_or_leftover_file(tmp_path, monkeypatch):
    shutil.copytree(K8S_DIR, tmp_path / "configs" / "k8s")
    shutil.copytree(ROOT / "configs" / "topologies", tmp_path / "configs" / "topologies")
    monkeypatch.setattr(k8s, "ROOT", tmp_path)
    assert k8s.main(["--check"]) == 0
    edited = tmp_path / "configs/k8s/1p1d/decode.yaml"
    edited.write_text(edited.read_text().replace("replicas: 1", "replicas: 3"))
    (tmp_path / "configs/k8s/1p1d/old.yaml").write_text("# GENERATED by `python -m xpyd_deploy.k8s` ...\n")
    assert k8s.main(["--check"]) == 1
    assert k8s.stale_files(k8s.rendered_files()) == (["configs/k8s/1p1d/decode.yaml"], ["configs/k8s/1p1d/old.yaml"])
    assert k8s.main([]) == 0  # rewrites the edited file, removes the generated leftover
    assert k8s.main(["--check"]) == 0


def test_rendered_topologies():
    rendered = sorted(p.name for p in K8S_DIR.iterdir() if p.is_dir())
    assert rendered == sorted(k8s.TOPOLOGIES)
    names = {load_topology(t).name for t in k8s.TOPOLOGIES}
    assert {"gpu-1p1d", "gpu-tp2", "1p1d", "2p2d"} <= names


# ---- schema ----------------------------------------------------------------------------
def _schema_docs() -> list[tuple[str, dict]]:
    return [(f"{t}/{f}", d) for t in k8s.TOPOLOGIES for f, docs in load_dir(t).items() for d in docs
            if d["kind"] not in ("Kustomization", "PodMonitor", "ScaledObject")]  # CRDs: test_deploy_autoscaling


@pytest.mark.parametrize("version", k8s.KUBERNETES_VERSIONS)
def test_every_manifest_passes_the_strict_schema(version: str):
    docs = _schema_docs()
    kinds = {d["kind"] for _, d in docs}
    assert {"Deployment", "Service", "PodDisruptionBudget", "Secret", "PersistentVolumeClaim"} <= kinds
    for where, doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{where} {doc['kind']}/{doc['metadata']['name']} invalid for Kubernetes {version}: {e}")


def _proxy_deployment() -> dict:
    return load_dir("gpu-tp2")["proxy.yaml"][0]


@pytest.mark.parametrize("mutate", [
    lambda d: d["spec"]["template"]["spec"]["containers"][0].update(readinesProbe={}),   # misspelt field
    lambda d: d["spec"].update(replicas="two"),                                           # wrong type
    lambda d: d["spec"]["template"]["spec"]["containers"][0].pop("name"),                # required field
    lambda d: d["spec"]["template"]["spec"]["containers"][0]["ports"][0].update(containerPort="8000"),
], ids=["unknown-field", "wrong-type", "missing-required", "port-as-string"])
def test_the_schema_validation_rejects_broken_manifests(mutate):
    doc = _proxy_deployment()
    kubernetes_validate.validate(doc, k8s.KUBERNETES_VERSIONS[-1], strict=True)
    mutate(doc)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, k8s.KUBERNETES_VERSIONS[-1], strict=True)


def test_pinned_kubernetes_versions_are_shipped_by_the_validator():
    shipped = set(kubernetes_validate.utils.all_versions())
    for v in k8s.KUBERNETES_VERSIONS:
        assert kubernetes_validate.utils.major_minor(v) in {kubernetes_validate.utils.major_minor(s) for s in shipped}
    assert k8s.KUBERNETES_VERSIONS[-1] == kubernetes_validate.latest_version()


# ---- PodMonitor (CRD: checked against its own shape) -----------------------------------
@pytest.mark.parametrize("topo_name", k8s.TOPOLOGIES)
def test_podmonitor_selects_every_pod_and_its_metrics_port(topo_name: str):
    files = load_dir(topo_name)
    (pm,) = files["monitoring.yaml"]
    assert (pm["apiVersion"], pm["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    assert set(pm) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(pm["spec"]) <= {"selector", "podMetricsEndpoints", "podTargetLabels", "namespaceSelector", "jobLabel"}
    sel = pm["spec"]["selector"]["matchLabels"]
    endpoints = pm["spec"]["podMetricsEndpoints"]
    assert endpoints and all(set(e) <= {"port", "path", "interval", "scrapeTimeout"} for e in endpoints)
    for dep in _find(files, "Deployment"):
        tmpl = dep["spec"]["template"]
        assert all(tmpl["metadata"]["labels"].get(k) == v for k, v in sel.items()), dep["metadata"]["name"]
        names = {p["name"] for p in tmpl["spec"]["containers"][0]["ports"]}
        paths = PROXY_PATHS if dep["metadata"]["name"] == "xpyd-proxy" else VLLM_PATHS
        for e in endpoints:
            assert e["port"] in names and e["path"] in paths
        for label in pm["spec"].get("podTargetLabels", []):
            assert label in tmpl["metadata"]["labels"]


# ---- kustomize -------------------------------------------------------------------------
@pytest.mark.parametrize("topo_name", k8s.TOPOLOGIES)
def test_kustomization_lists_the_manifests(topo_name: str):
    files = load_dir(topo_name)
    (kust,) = files["kustomization.yaml"]
    assert kust["kind"] == "Kustomization"
    assert set(kust["resources"]) == set(files) - NOT_IN_KUSTOMIZATION - {"kustomization.yaml"}
    assert NOT_IN_KUSTOMIZATION <= set(files)


KUBECTL = shutil.which("kubectl") or next(
    (p for p in ("/usr/bin/kubectl", "/usr/local/bin/kubectl") if os.access(p, os.X_OK)), None)


@pytest.mark.tool("kubectl")  # skipped without it; a failure where CI=true (tests/conftest.py)
@pytest.mark.parametrize("topo_name", k8s.TOPOLOGIES)
def test_kubectl_kustomize_renders(topo_name: str):
    out = subprocess.run([KUBECTL, "kustomize", str(K8S_DIR / topo_name)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
    files = load_dir(topo_name)
    (kust,) = files["kustomization.yaml"]
    want = [d for f in kust["resources"] for d in files[f]]
    assert sorted((d["kind"], d["metadata"]["name"]) for d in rendered) == \
        sorted((d["kind"], d["metadata"]["name"]) for d in want)
    assert not {"Secret", "PodMonitor"} & {d["kind"] for d in rendered}
    topo = load_topology(topo_name)
    images = {c["image"] for d in rendered if d["kind"] == "Deployment"
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert images == {k8s.IMAGES[topo.device]}
    # What kustomize emits is still a valid set of objects that pass the semantic checks.
    assert problems(topo, {"all.yaml": rendered + files["secrets-example.yaml"]}) == []


# ---- semantics -------------------------------------------------------------------------
@pytest.mark.parametrize("topo_name", k8s.TOPOLOGIES)
def test_manifests_agree_with_the_topology_and_the_code(topo_name: str):
    assert problems(load_topology(topo_name), load_dir(topo_name)) == []


def _c(files, dep: str) -> dict:
    return _find(files, "Deployment", dep)[0]["spec"]["template"]["spec"]["containers"][0]


def _set_kv(files, dep: str, **extra: Any) -> None:
    c = _c(files, dep)
    k = c["args"].index("--kv-transfer-config")
    cfg = json.loads(c["args"][k + 1])
    cfg["kv_connector_extra_config"].update(extra)
    c["args"][k + 1] = json.dumps(cfg)


MUTATIONS = {
    "gpu-not-tp": lambda f: _c(f, "xpyd-decode")["resources"]["limits"].update({"nvidia.com/gpu": 1}),
    "tp-flag": lambda f: _c(f, "xpyd-prefill")["args"].__setitem__(
        _c(f, "xpyd-prefill")["args"].index("--tensor-parallel-size") + 1, "4"),
    "events-port": lambda f: next(p for p in _c(f, "xpyd-decode")["ports"]
                                  if p["name"] == "events").update(containerPort=9),
    "wrong-proxy-name": lambda f: _set_kv(f, "xpyd-decode", proxies=["xpyd-proxy:30001"]),
    "wrong-discovery-port": lambda f: _set_kv(f, "xpyd-prefill", proxies=["xpyd-proxy-discovery:30002"]),
    "fixed-kv-ip": lambda f: _set_kv(f, "xpyd-decode", kv_ip="127.0.0.1"),
    "launcher-setting-lost": lambda f: _set_kv(f, "xpyd-decode", send_type="GET"),
    "probe-path": lambda f: _c(f, "xpyd-proxy")["readinessProbe"]["httpGet"].update(path="/readyz"),
    "probe-port": lambda f: _c(f, "xpyd-decode")["livenessProbe"]["httpGet"].update(port="metrics"),
    "selector": lambda f: _find(f, "Deployment", "xpyd-decode")[0]["spec"]["selector"]["matchLabels"].update(
        {"app.kubernetes.io/component": "prefill"}),
    "service-port": lambda f: _find(f, "Service", "xpyd-proxy-discovery")[0]["spec"]["ports"][0].update(
        targetPort="http"),
    "service-selector": lambda f: _find(f, "Service", "xpyd-proxy")[0]["spec"]["selector"].update(
        {"app.kubernetes.io/component": "decode"}),
    "not-headless": lambda f: _find(f, "Service", "xpyd-proxy-discovery")[0]["spec"].pop("publishNotReadyAddresses"),
    "secret-key": lambda f: _c(f, "xpyd-prefill")["env"][2]["valueFrom"]["secretKeyRef"].update(key="kv-secrets"),
    "no-discovery-secret": lambda f: _c(f, "xpyd-proxy")["env"].pop(0),
    "short-grace": lambda f: _find(f, "Deployment", "xpyd-proxy")[0]["spec"]["template"]["spec"].update(
        terminationGracePeriodSeconds=30),
    "engine-grace": lambda f: _find(f, "Deployment", "xpyd-decode")[0]["spec"]["template"]["spec"].update(
        terminationGracePeriodSeconds=20),
    "replicas": lambda f: _find(f, "Deployment", "xpyd-prefill")[0]["spec"].update(replicas=2),
    "one-proxy": lambda f: _find(f, "Deployment", "xpyd-proxy")[0]["spec"].update(replicas=1),
    "service-links": lambda f: _find(f, "Deployment", "xpyd-proxy")[0]["spec"]["template"]["spec"].pop(
        "enableServiceLinks"),
    "shm": lambda f: _find(f, "Deployment", "xpyd-decode")[0]["spec"]["template"]["spec"]["volumes"][0].update(
        emptyDir={}),
    "scrape-port": lambda f: _find(f, "Deployment", "xpyd-decode")[0]["spec"]["template"]["metadata"][
        "annotations"].update({"prometheus.io/port": "8000"}),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_semantic_checks_catch_a_mutated_manifest(mutation: str):
    topo = load_topology("gpu-tp2")
    files = copy.deepcopy(load_dir("gpu-tp2"))
    assert problems(topo, files) == []
    MUTATIONS[mutation](files)
    assert problems(topo, files) != []


def test_proxy_refuses_to_start_without_the_secret():
    """The secure default holds: discovery on 0.0.0.0 with no XPYD_DISCOVERY_SECRET fails."""
    args = _c(load_dir("1p1d"), "xpyd-proxy")["args"]
    with pytest.raises(ConfigError):
        load_config(args, env={})
    assert load_config(args, env={"XPYD_DISCOVERY_SECRET": "x"}).discovery_secret == "x"


# ---- the real vLLM parser, where vLLM is installed -------------------------------------
def test_vllm_accepts_the_engine_args_and_serves_the_probe_path():
    pytest.importorskip("vllm")
    import inspect

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.entrypoints.serve.instrumentator import health, metrics
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    assert "/health" in {r.path for r in health.router.routes}
    assert 'Mount("/metrics"' in inspect.getsource(metrics)
    for t in k8s.TOPOLOGIES:
        files = load_dir(t)
        for dep in ("xpyd-prefill", "xpyd-decode"):
            args = [a.replace("$(POD_IP)", POD_IP) for a in _c(files, dep)["args"]]
            ns = make_arg_parser(FlexibleArgumentParser()).parse_args(args)
            engine = AsyncEngineArgs.from_cli_args(ns)
            assert engine.kv_transfer_config.kv_load_failure_policy == "recompute"
            assert engine.kv_transfer_config.kv_connector_extra_config["kv_ip"] == POD_IP
            assert engine.shutdown_timeout == int(_flag(args, "--shutdown-timeout")) > 0
            assert engine.tensor_parallel_size == load_topology(t).by_role("P" if "prefill" in dep else "D")[0].tp


def test_images_and_cpu_model_path_are_what_the_dockerfiles_build():
    """The images are the compose file's (built from configs/docker/), both WORKDIR /xpyd; the CPU
    engines' relative model path is the one scripts/setup.sh makes inside the CPU image."""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    compose_images = {s.get("image") for s in services.values()}
    assert set(k8s.IMAGES.values()) <= compose_images
    for dockerfile in ("Dockerfile.cpu", "Dockerfile.gpu"):
        assert f"WORKDIR {k8s.WORKDIR}\n" in (ROOT / "configs/docker" / dockerfile).read_text()
    assert "scripts/setup.sh" in (ROOT / "configs/docker/Dockerfile.cpu").read_text()
    for t in k8s.TOPOLOGIES:
        topo = load_topology(t)
        for dep in ("xpyd-prefill", "xpyd-decode"):
            c = _c(load_dir(t), dep)
            assert c["workingDir"] == k8s.WORKDIR and _flag(c["args"], "--model") == topo.model
            if topo.device == "cpu":
                assert f"--out {topo.model}" in (ROOT / "scripts/setup.sh").read_text()
