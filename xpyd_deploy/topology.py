"""xPyD layouts as data: one YAML file under configs/topologies/ describes the proxies and
the X prefill + Y decode vLLM instances (addresses, ports, roles, devices, kv-transfer
settings). The launcher, the compose files and the docs are all derived from it.

    topo = load_topology("configs/topologies/1p2d.yaml")
    topo.vllm_command(topo.instances[0])   # argv of one vLLM server
    topo.kv_transfer_config(inst)          # its --kv-transfer-config
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# The checkout the layouts, models and generated files live in: the one this package sits in
# (in-tree or `pip install -e`), else, for an installed wheel, the current directory.
_PACKAGE_PARENT = Path(__file__).resolve().parent.parent
ROOT = _PACKAGE_PARENT if (_PACKAGE_PARENT / "configs" / "topologies").is_dir() else Path.cwd()
TOPOLOGY_DIR = ROOT / "configs" / "topologies"
ROLES = {"P": "kv_producer", "D": "kv_consumer"}
DEVICES = ("cpu", "cuda")
# kv_connector_extra_config keys the topology writes itself (per instance).
_DERIVED_KV_KEYS = {"kv_ip", "http_host", "http_port", "proxy_ip", "proxy_port", "proxies"}


class TopologyError(ValueError):
    """A topology file that is malformed or inconsistent (clashing ports, unknown role...)."""


@dataclass(frozen=True, slots=True)
class ProxySpec:
    name: str
    host: str  # address the HTTP API and the discovery socket bind to, and instances dial
    port: int
    discovery_port: int
    args: tuple[str, ...] = ()  # extra xpyd-proxy flags

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    name: str
    role: str  # "P" | "D"
    host: str  # vLLM's HTTP server and the KV engine bind and advertise this address
    port: int
    kv_port: int  # rank r of a TP group listens on kv_port + r
    devices: tuple[int, ...] = ()  # CUDA device ids; tensor parallel size = len(devices)
    args: tuple[str, ...] = ()  # extra vLLM flags for this instance only
    env: Mapping[str, str] = field(default_factory=dict)
    kv_transfer: Mapping[str, Any] = field(default_factory=dict)  # per-instance extra-config overrides
    # vLLM's KV-event publisher (PUB) port; the replay ROUTER is events_port + 1 (bound on
    # `host` when it is an IPv4 literal, else on every interface); None: events off.
    events_port: int | None = None

    @property
    def tp(self) -> int:
        return max(1, len(self.devices))

    @property
    def kv_role(self) -> str:
        return ROLES[self.role]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def kv_ports(self) -> tuple[int, ...]:
        return tuple(self.kv_port + r for r in range(self.tp))

    @property
    def events_ports(self) -> tuple[int, ...]:
        return () if self.events_port is None else (self.events_port, self.events_port + 1)

    def events_bind(self, bind_host: str | None = None) -> str:
        """What vLLM binds its event sockets to: it binds only wildcard and "::" endpoints, so
        one IPv4 address is given IPv4-mapped ([::ffff:127.0.0.1]: ZMQ binds 127.0.0.1 only);
        0.0.0.0 and DNS names get the wildcard."""
        host = bind_host or self.host
        if host != "0.0.0.0" and _is_ipv4(host):
            return f"[::ffff:{host}]"
        return "*"

    def kv_events_config(self, bind_host: str | None = None) -> dict[str, Any] | None:
        """The instance's --kv-events-config (the connector advertises it to the proxy)."""
        if self.events_port is None:
            return None
        host = self.events_bind(bind_host)
        return {"enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": f"tcp://{host}:{self.events_port}",
                "replay_endpoint": f"tcp://{host}:{self.events_port + 1}"}


@dataclass(frozen=True, slots=True)
class Topology:
    name: str
    device: str  # "cpu" | "cuda"
    model: str  # a local path (relative to the repo root) or a hub model id
    served_model_name: str
    proxies: tuple[ProxySpec, ...]
    instances: tuple[InstanceSpec, ...]
    vllm_args: tuple[str, ...] = ()
    kv_transfer: Mapping[str, Any] = field(default_factory=dict)  # shared kv_connector_extra_config
    env: Mapping[str, str] = field(default_factory=dict)
    description: str = ""
    source: Path | None = None

    # ---- views -------------------------------------------------------------------------
    def by_role(self, role: str) -> tuple[InstanceSpec, ...]:
        return tuple(i for i in self.instances if i.role == role)

    @property
    def shape(self) -> str:
        return f"{len(self.by_role('P'))}P{len(self.by_role('D'))}D"

    def model_path(self) -> str:
        """The model as vLLM gets it: local paths resolved against the repo root."""
        local = ROOT / self.model
        return str(local) if not Path(self.model).is_absolute() and local.exists() else self.model

    # ---- what each process is started with ---------------------------------------------
    def kv_transfer_config(self, inst: InstanceSpec, *, kv_host: str | None = None,
                           http_host: str | None = None,
                           proxy_hosts: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The instance's --kv-transfer-config. kv_host/http_host/proxy_hosts override the
        advertised addresses (containers advertise their service names)."""
        extra: dict[str, Any] = {**self.kv_transfer, **inst.kv_transfer}
        extra["kv_ip"] = kv_host or inst.host
        extra["http_host"] = http_host or inst.host
        extra["http_port"] = inst.port
        addrs = [f"{(proxy_hosts or {}).get(p.name, p.host)}:{p.discovery_port}" for p in self.proxies]
        if len(addrs) == 1:  # the upstream P2pNcclConnector keys
            host, port = addrs[0].rsplit(":", 1)
            extra["proxy_ip"], extra["proxy_port"] = host, int(port)
        elif addrs:
            extra["proxies"] = addrs
        return {
            "kv_connector": "P2pNcclConnector",
            "kv_connector_module_path": "connector",
            "kv_role": inst.kv_role,
            "kv_port": inst.kv_port,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }

    def vllm_args_for(self, inst: InstanceSpec, *, bind_host: str | None = None, model: str | None = None,
                      **kv_overrides: Any) -> list[str]:
        """vLLM server flags (without the interpreter / entry point)."""
        args = ["--model", model or self.model_path(), "--served-model-name", self.served_model_name,
                "--host", bind_host or inst.host, "--port", str(inst.port), *self.vllm_args, *inst.args]
        if inst.tp > 1:
            args += ["--tensor-parallel-size", str(inst.tp)]
        args += ["--kv-transfer-config", json.dumps(self.kv_transfer_config(inst, **kv_overrides),
                                                    separators=(",", ":"))]
        events = inst.kv_events_config(bind_host)
        if events is not None:
            args += ["--kv-events-config", json.dumps(events, separators=(",", ":"))]
        return args

    def vllm_command(self, inst: InstanceSpec, python: str = sys.executable) -> list[str]:
        # `python -m ...api_server`, not the `vllm` console script: that one fails on the CPU build.
        return [python, "-m", "vllm.entrypoints.openai.api_server", *self.vllm_args_for(inst)]

    def vllm_env(self, inst: InstanceSpec) -> dict[str, str]:
        env = {**self.env, **inst.env}
        if self.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in inst.devices)
        return env

    def proxy_args(self, proxy: ProxySpec, *, bind_host: str | None = None) -> list[str]:
        host = bind_host or proxy.host
        return ["--host", host, "--port", str(proxy.port), "--discovery-host", host,
                "--discovery-port", str(proxy.discovery_port), *proxy.args]

    def proxy_command(self, proxy: ProxySpec, python: str = sys.executable) -> list[str]:
        return [python, "-m", "proxy", *self.proxy_args(proxy)]

    # ---- derived topologies ------------------------------------------------------------
    def with_port_offset(self, offset: int) -> Topology:
        """Every port shifted by offset: a second copy of a layout on the same hosts."""
        if offset == 0:
            return self
        proxies = tuple(dataclasses.replace(p, port=p.port + offset, discovery_port=p.discovery_port + offset)
                        for p in self.proxies)
        insts = tuple(dataclasses.replace(i, port=i.port + offset, kv_port=i.kv_port + offset,
                                          events_port=None if i.events_port is None else i.events_port + offset)
                      for i in self.instances)
        return dataclasses.replace(self, proxies=proxies, instances=insts).validate()

    def select(self, names: Iterable[str]) -> tuple[list[ProxySpec], list[InstanceSpec]]:
        """The proxies and instances with these names (one host's share of a multi-node layout)."""
        wanted = set(names)
        known = {p.name for p in self.proxies} | {i.name for i in self.instances}
        unknown = wanted - known
        if unknown:
            raise TopologyError(f"unknown names {sorted(unknown)}; this topology has {sorted(known)}")
        return ([p for p in self.proxies if p.name in wanted], [i for i in self.instances if i.name in wanted])

    # ---- checks ------------------------------------------------------------------------
    def validate(self) -> Topology:
        if self.device not in DEVICES:
            raise TopologyError(f"device must be one of {DEVICES}, got {self.device!r}")
        if not self.proxies:
            raise TopologyError("a topology needs at least one proxy")
        if not self.by_role("P") or not self.by_role("D"):
            raise TopologyError("a topology needs at least one P and one D instance")
        names = [p.name for p in self.proxies] + [i.name for i in self.instances]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise TopologyError(f"duplicate names: {dup}")
        used: dict[tuple[str, int], str] = {}

        def claim(host: str, port: int, what: str) -> None:
            if not 0 < port < 65536:
                raise TopologyError(f"{what}: port {port} out of range")
            # 0.0.0.0 clashes with every address on the host; a real address only with itself.
            for (h, p), other in used.items():
                if p == port and (h == host or "0.0.0.0" in (h, host)):
                    raise TopologyError(f"{what}: {host}:{port} already used by {other}")
            used[(host, port)] = what

        for p in self.proxies:
            claim(p.host, p.port, f"{p.name} http")
            claim(p.host, p.discovery_port, f"{p.name} discovery")
        gpus: dict[tuple[str, int], str] = {}
        for i in self.instances:
            if i.role not in ROLES:
                raise TopologyError(f"{i.name}: role must be P or D, got {i.role!r}")
            claim(i.host, i.port, f"{i.name} http")
            for r, kp in enumerate(i.kv_ports):
                claim(i.host, kp, f"{i.name} kv rank {r}")
            for kind, ep in zip(("kv events", "kv events replay"), i.events_ports):
                claim("0.0.0.0" if i.events_bind() == "*" else i.host, ep, f"{i.name} {kind}")
            if self.device == "cuda":
                if not i.devices:
                    raise TopologyError(f"{i.name}: a cuda topology needs a device list per instance")
                for d in i.devices:
                    if (i.host, d) in gpus:
                        raise TopologyError(f"{i.name}: GPU {d} on {i.host} already given to {gpus[(i.host, d)]}")
                    gpus[(i.host, d)] = i.name
            elif i.devices:
                raise TopologyError(f"{i.name}: devices are only for device: cuda")
            bad = _DERIVED_KV_KEYS & set(i.kv_transfer)
            if bad:
                raise TopologyError(f"{i.name}: kv_transfer must not set {sorted(bad)} (derived from the layout)")
        bad = _DERIVED_KV_KEYS & set(self.kv_transfer)
        if bad:
            raise TopologyError(f"kv_transfer must not set {sorted(bad)} (derived from the layout)")
        return self


def _is_ipv4(host: str) -> bool:
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True


# ---- loading ---------------------------------------------------------------------------
def _strs(value: Any, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise TopologyError(f"{what} must be a list")
    return tuple(str(v) for v in value)


def _mapping(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TopologyError(f"{what} must be a mapping")
    return dict(value)


def _int(d: dict[str, Any], key: str, what: str) -> int:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise TopologyError(f"{what}: {key} must be an integer, got {v!r}")
    return v


def _check_keys(d: dict[str, Any], allowed: set[str], what: str) -> None:
    unknown = set(d) - allowed
    if unknown:
        raise TopologyError(f"{what}: unknown keys {sorted(unknown)} (allowed: {sorted(allowed)})")


def topology_from_dict(data: Any, source: Path | None = None) -> Topology:
    if not isinstance(data, dict):
        raise TopologyError("a topology file must hold a mapping")
    _check_keys(data, {"name", "description", "device", "model", "served_model_name", "vllm_args",
                       "kv_transfer", "env", "proxies", "instances"}, "topology")
    proxies = []
    for n, p in enumerate(data.get("proxies") or []):
        p = _mapping(p, f"proxies[{n}]")
        _check_keys(p, {"name", "host", "port", "discovery_port", "args"}, f"proxies[{n}]")
        proxies.append(ProxySpec(name=str(p.get("name", f"proxy-{n}")), host=str(p.get("host", "127.0.0.1")),
                                 port=_int(p, "port", f"proxies[{n}]"),
                                 discovery_port=_int(p, "discovery_port", f"proxies[{n}]"),
                                 args=_strs(p.get("args"), f"proxies[{n}].args")))
    instances = []
    for n, i in enumerate(data.get("instances") or []):
        i = _mapping(i, f"instances[{n}]")
        what = f"instances[{n}] ({i.get('name', '?')})"
        _check_keys(i, {"name", "role", "host", "port", "kv_port", "events_port", "devices", "args", "env",
                        "kv_transfer"}, what)
        if "name" not in i or "role" not in i:
            raise TopologyError(f"{what}: name and role are required")
        devices = i.get("devices") or []
        if not isinstance(devices, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in devices):
            raise TopologyError(f"{what}: devices must be a list of GPU ids")
        instances.append(InstanceSpec(
            name=str(i["name"]), role=str(i["role"]).upper(), host=str(i.get("host", "127.0.0.1")),
            port=_int(i, "port", what), kv_port=_int(i, "kv_port", what), devices=tuple(devices),
            args=_strs(i.get("args"), f"{what}.args"),
            env={k: str(v) for k, v in _mapping(i.get("env"), f"{what}.env").items()},
            kv_transfer=_mapping(i.get("kv_transfer"), f"{what}.kv_transfer"),
            events_port=_int(i, "events_port", what) if i.get("events_port") is not None else None))
    for key in ("model", "served_model_name"):
        if not data.get(key):
            raise TopologyError(f"topology: {key} is required")
    return Topology(
        name=str(data.get("name") or (source.stem if source else "topology")),
        description=str(data.get("description", "")),
        device=str(data.get("device", "cpu")),
        model=str(data["model"]),
        served_model_name=str(data["served_model_name"]),
        proxies=tuple(proxies), instances=tuple(instances),
        vllm_args=_strs(data.get("vllm_args"), "vllm_args"),
        kv_transfer=_mapping(data.get("kv_transfer"), "kv_transfer"),
        env={k: str(v) for k, v in _mapping(data.get("env"), "env").items()},
        source=source,
    ).validate()


def resolve(name_or_path: str | Path) -> Path:
    """A topology by file path, or by name under configs/topologies/ ("1p2d")."""
    p = Path(name_or_path)
    if p.exists():
        return p
    named = TOPOLOGY_DIR / f"{name_or_path}.yaml"
    if named.exists():
        return named
    choices = ", ".join(sorted(f.stem for f in TOPOLOGY_DIR.glob("*.yaml")))
    raise TopologyError(f"no topology file {name_or_path!r} (named ones: {choices})")


def load_topology(name_or_path: str | Path) -> Topology:
    path = resolve(name_or_path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise TopologyError(f"{path} is not valid YAML: {e}") from None
    try:
        return topology_from_dict(data, source=path)
    except TopologyError as e:
        raise TopologyError(f"{path}: {e}") from None


def all_topologies() -> list[Topology]:
    return [load_topology(p) for p in sorted(TOPOLOGY_DIR.glob("*.yaml"))]
