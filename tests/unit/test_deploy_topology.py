"""Topologies as data (configs/topologies/*.yaml): loading, validation, and the command
lines and kv-transfer configs derived from them. No servers started."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]

from xpyd_deploy.launch import main as launch_main  # noqa: E402  (xpyd_deploy/launch.py)
from xpyd_deploy.topology import TopologyError, all_topologies, load_topology, topology_from_dict  # noqa: E402

BASE = yaml.safe_load((ROOT / "configs/topologies/1p1d.yaml").read_text())


def _with(**changes) -> dict:
    d = json.loads(json.dumps(BASE))
    d.update(changes)
    return d


def _kv(cmd: list[str]) -> dict:
    return json.loads(cmd[cmd.index("--kv-transfer-config") + 1])


def test_shipped_topologies_load_with_their_shapes():
    shapes = {t.name: (t.shape, t.device) for t in all_topologies()}
    assert shapes["1p1d"] == ("1P1D", "cpu")
    assert shapes["1p2d"] == ("1P2D", "cpu")
    assert shapes["2p2d"] == ("2P2D", "cpu")
    assert shapes["gpu-tp2"] == ("1P1D", "cuda")
    assert shapes["multinode"] == ("1P1D", "cpu")


def test_vllm_command_carries_role_ports_and_proxy():
    topo = load_topology("1p2d")
    d1 = topo.instances[2]
    cmd = topo.vllm_command(d1, "python")
    assert cmd[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--port") + 1] == "8201" and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    kv = _kv(cmd)
    assert kv["kv_role"] == "kv_consumer" and kv["kv_port"] == 22011
    assert kv["kv_connector_module_path"] == "connector"
    extra = kv["kv_connector_extra_config"]
    assert (extra["proxy_ip"], extra["proxy_port"]) == ("127.0.0.1", 30001)
    assert (extra["kv_ip"], extra["http_port"]) == ("127.0.0.1", 8201)
    assert extra["send_type"] == "PUT_ASYNC"  # shared kv_transfer settings


def test_two_proxies_become_a_proxies_list():
    topo = load_topology("multinode")
    extra = _kv(topo.vllm_command(topo.instances[0]))["kv_connector_extra_config"]
    assert extra["proxies"] == ["127.0.0.11:30001", "127.0.0.12:30001"] and "proxy_ip" not in extra
    assert extra["kv_ip"] == extra["http_host"] == "127.0.0.13"


def test_gpu_tp2_pins_devices_and_tensor_parallel():
    topo = load_topology("gpu-tp2")
    p, d = topo.instances
    assert topo.vllm_env(p)["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert topo.vllm_env(d)["CUDA_VISIBLE_DEVICES"] == "2,3"
    cmd = topo.vllm_command(d)
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    assert d.kv_ports == (22001, 22002)


def test_port_offset_shifts_every_port_and_the_proxy_address():
    topo = load_topology("1p1d").with_port_offset(500)
    assert topo.proxies[0].port == 8500 and topo.proxies[0].discovery_port == 30501
    extra = _kv(topo.vllm_command(topo.instances[0]))["kv_connector_extra_config"]
    assert extra["proxy_port"] == 30501 and extra["http_port"] == 8600


@pytest.mark.parametrize("change,message", [
    (dict(instances=[{"name": "p", "role": "P", "port": 8100, "kv_port": 21001}]), "at least one P and one D"),
    (dict(instances=[{"name": "p", "role": "P", "port": 8100, "kv_port": 21001},
                     {"name": "d", "role": "D", "port": 8100, "kv_port": 22001}]), "already used by p http"),
    (dict(instances=[{"name": "p", "role": "P", "port": 8100, "kv_port": 8000},
                     {"name": "d", "role": "D", "port": 8200, "kv_port": 22001}]), "already used by proxy http"),
    (dict(instances=[{"name": "p", "role": "X", "port": 8100, "kv_port": 21001},
                     {"name": "d", "role": "D", "port": 8200, "kv_port": 22001}]), "at least one P"),
    (dict(instances=[{"name": "p", "role": "P", "port": 8100, "kv_port": 21001, "devices": [0]},
                     {"name": "d", "role": "D", "port": 8200, "kv_port": 22001}]), "only for device: cuda"),
    (dict(device="cuda", instances=[{"name": "p", "role": "P", "port": 8100, "kv_port": 21001, "devices": [0]},
                                    {"name": "d", "role": "D", "port": 8200, "kv_port": 22001, "devices": [0]}]),
     "GPU 0 on 127.0.0.1 already given to p"),
    (dict(device="cuda", instances=[{"name": "p", "role": "P", "port": 8100, "kv_port": 21001, "devices": [0, 1]},
                                    {"name": "d", "role": "D", "port": 8200, "kv_port": 21002, "devices": [2]}]),
     "already used by p kv rank 1"),
    (dict(kv_transfer={"proxy_ip": "10.0.0.1"}), "derived from the layout"),
    (dict(prxies=[]), "unknown keys"),
    (dict(proxies=[]), "at least one proxy"),
])
def test_invalid_topologies_are_refused_with_the_reason(change, message):
    with pytest.raises(TopologyError, match=message):
        topology_from_dict(_with(**change))


def test_same_port_on_different_hosts_is_fine():
    d = _with(instances=[{"name": "p", "role": "P", "host": "127.0.0.2", "port": 8000, "kv_port": 21001},
                         {"name": "d", "role": "D", "host": "127.0.0.3", "port": 8000, "kv_port": 21001}])
    assert topology_from_dict(d).shape == "1P1D"


def test_cli_commands_and_errors(capsys):
    assert launch_main(["commands", "1p2d", "--only", "decode-1"]) == 0
    out = capsys.readouterr().out
    assert "# decode-1 (D)" in out and "prefill-0" not in out and "--port 8201" in out
    assert launch_main(["commands", "no-such-topology"]) == 2
    assert "no topology file" in capsys.readouterr().err
    assert launch_main(["up", "1p1d", "--only", "nobody"]) == 2


def test_every_shipped_instance_publishes_kv_events_with_replay():
    """Events are on in every shipped topology: vLLM binds tcp://*:events_port (and the replay
    ROUTER on the next port); the connector advertises them to the proxy."""
    for topo in all_topologies():
        for inst in topo.instances:
            cmd = topo.vllm_command(inst)
            assert inst.events_port is not None, f"{topo.name}/{inst.name}"
            ev = json.loads(cmd[cmd.index("--kv-events-config") + 1])
            # Bound on the instance's own address (loopback here), not on every interface.
            assert ev == {"enable_kv_cache_events": True, "publisher": "zmq",
                          "endpoint": f"tcp://[::ffff:{inst.host}]:{inst.events_port}",
                          "replay_endpoint": f"tcp://[::ffff:{inst.host}]:{inst.events_port + 1}"}
            compose = json.loads((lambda a: a[a.index("--kv-events-config") + 1])(
                topo.vllm_args_for(inst, bind_host="0.0.0.0")))
            assert compose["endpoint"] == f"tcp://*:{inst.events_port}"


def test_events_ports_clash_on_every_interface():
    data = _with()
    data["instances"][1]["events_port"] = data["instances"][0]["events_port"] + 1  # its replay port
    with pytest.raises(TopologyError, match="kv events"):
        topology_from_dict(data).validate()
    data["instances"][1]["events_port"] = data["instances"][0]["kv_port"]  # same host
    with pytest.raises(TopologyError, match="already used"):
        topology_from_dict(data).validate()
    data["instances"][1].pop("events_port")
    topo = topology_from_dict(data).validate()
    assert "--kv-events-config" not in topo.vllm_command(topo.instances[1])
