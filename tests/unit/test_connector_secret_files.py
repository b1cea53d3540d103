"""Secrets out of argv and logs (issue 36, part 5), the connector's side and the deployment files:
``kv_secret_file`` / ``discovery_secret_file`` (and ``XPYD_*_FILE``) in place of a secret in
kv_connector_extra_config, which vLLM prints in its start-up line; a warning when one is there
anyway; the launcher, compose and k8s manifests pass secrets through the environment only."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from connector.config import ConnectorConfig
from connector.transport import KVAuth, TcpTransport, TransportRefused
from tests.support.kv_engines import (
    SRC_IDS,
    assert_loaded,
    load_spec,
    plan_load,
    poll_until,
    rank0,
    save_spec,
    snapshot,
)

# Over the 64 KiB a secret file may hold (a token, not a document).
TOO_BIG = 64 * 1024 + 1
ROOT = Path(__file__).resolve().parents[2]
SECRET_ENV = ("XPYD_DISCOVERY_SECRET", "XPYD_KV_SECRET", "XPYD_DISCOVERY_SECRET_FILE", "XPYD_KV_SECRET_FILE")


@pytest.fixture
def no_secret_env(monkeypatch):
    for k in SECRET_ENV:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def _cfg(**extra) -> ConnectorConfig:
    return ConnectorConfig.from_vllm(SimpleNamespace(kv_role="kv_producer", kv_port=23001,
                                                     kv_connector_extra_config=extra))


def _file(tmp_path: Path, name: str, text: str | bytes) -> str:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


def test_secrets_from_files_named_in_the_extra_config(tmp_path, no_secret_env, caplog):
    kv, disc = _file(tmp_path, "kv", "kv-1\n"), _file(tmp_path, "disc", "disc-2")
    with caplog.at_level(logging.WARNING, logger="vllm.xpyd.connector.config"):
        cfg = _cfg(kv_secret_file=kv, discovery_secret_file=disc)
        assert (cfg.kv_secret, cfg.discovery_secret) == ("kv-1", "disc-2")
        assert _cfg(discovery_secret_file=disc).kv_secret == "disc-2"  # the KV secret falls back to it
    assert "non-default args" not in caplog.text  # nothing to warn about


def test_secrets_from_files_named_in_the_env(tmp_path, no_secret_env):
    no_secret_env.setenv("XPYD_KV_SECRET_FILE", _file(tmp_path, "kv", "kv-env\n"))
    no_secret_env.setenv("XPYD_DISCOVERY_SECRET_FILE", _file(tmp_path, "disc", "disc-env"))
    cfg = _cfg()
    assert (cfg.kv_secret, cfg.discovery_secret) == ("kv-env", "disc-env")
    no_secret_env.setenv("XPYD_KV_SECRET", "also")
    with pytest.raises(ValueError, match="both env XPYD_KV_SECRET and XPYD_KV_SECRET_FILE"):
        _cfg()


@pytest.mark.parametrize("extra, why", [
    ({"kv_secret": "x", "kv_secret_file": "/dev/null"}, "both kv_secret and kv_secret_file"),
    ({"kv_secret_file": "/nonexistent/kv"}, "cannot read"),
    ({"kv_secret_file": "EMPTY"}, "is empty"),
    ({"kv_secret_file": "BIG"}, "not a secret"),
])
def test_a_bad_secret_file_is_a_start_up_error(tmp_path, no_secret_env, extra, why):
    files = {"EMPTY": _file(tmp_path, "empty", "\n"), "BIG": _file(tmp_path, "big", "x" * TOO_BIG)}
    with pytest.raises(ValueError, match=why):
        _cfg(**{k: files.get(v, v) for k, v in extra.items()})


def test_a_secret_in_the_extra_config_is_warned_about_without_the_secret(no_secret_env, caplog):
    with caplog.at_level(logging.WARNING, logger="vllm.xpyd.connector.config"):
        cfg = _cfg(kv_secret="kv-in-argv-123", discovery_secret="disc-in-argv-456")
    assert (cfg.kv_secret, cfg.discovery_secret) == ("kv-in-argv-123", "disc-in-argv-456")
    lines = [r.getMessage() for r in caplog.records if "non-default args" in r.getMessage()]
    assert len(lines) == 2 and any("'kv_secret'" in x for x in lines) and any("'discovery_secret'" in x for x in lines)
    assert all("kv_secret_file" in x or "discovery_secret_file" in x for x in lines)
    assert "kv-in-argv-123" not in caplog.text and "disc-in-argv-456" not in caplog.text


def test_engines_keyed_from_one_file_move_kv_and_refuse_the_unsigned(tmp_path, no_secret_env, engines):
    """Two real engines whose kv_secret came from the same file: KV moves, signed; an unsigned
    call is refused. (The config is parsed as vLLM's worker parses it.)"""
    path = _file(tmp_path, "kv-secret", "one-file-secret\n")
    secret = _cfg(kv_secret_file=path).kv_secret
    cons = engines("kv_consumer", "PUT_ASYNC", seed=2, kv_secret=secret)
    prod = engines("kv_producer", "PUT_ASYNC", seed=1, kv_secret=secret)
    before = snapshot(cons.caches)
    prod.save(save_spec(prod, rank0(cons)))
    plan_load(cons, load_spec(rank0(prod), (7, 2, 11), 2))
    res, _ = poll_until(cons, lambda r: "D-req" in r.finished_recving)
    assert res.failed_recving == set()
    assert_loaded(cons, before, prod, (7, 2, 11), SRC_IDS[2:])
    with TcpTransport() as plain, pytest.raises(TransportRefused, match="handshake"):
        plain.call(rank0(cons), {"op": "ping"}, timeout_s=5)
    with TcpTransport(auth=KVAuth.from_secret("one-file-secret")) as signed:
        assert signed.call(rank0(cons), {"op": "ping"}, timeout_s=5)[0]["ok"] is True


# ---- deployment files -------------------------------------------------------------------

SECRET_FLAGS = ("--discovery-secret", "--api-key", "--upstream-api-key")


def test_compose_passes_secrets_from_the_shell_environment_only():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name, svc in compose["services"].items():
        command = [str(a) for a in svc.get("command", [])]
        assert not [a for a in command if a.split("=", 1)[0] in SECRET_FLAGS], name
        assert not any("kv_secret" in a or "discovery_secret" in a for a in command), name
        if name.endswith("proxy"):
            want = ("XPYD_DISCOVERY_SECRET", "XPYD_API_KEY")
        elif "prefill" in name or "decode" in name:
            want = ("XPYD_DISCOVERY_SECRET", "XPYD_KV_SECRET")
        else:
            continue
        env = svc.get("environment", {})
        for var in want:  # a key without a value: passed through from the shell when set there
            assert var in env and env[var] is None, (name, var)


def test_k8s_manifests_take_secrets_from_the_secret_through_env():
    for manifest in sorted((ROOT / "configs" / "k8s").glob("*/*.yaml")):
        for doc in yaml.safe_load_all(manifest.read_text()):
            if not doc or doc.get("kind") != "Deployment":
                continue
            for c in doc["spec"]["template"]["spec"]["containers"]:
                args = [str(a) for a in c.get("args", []) + c.get("command", [])]
                assert not [a for a in args if a.split("=", 1)[0] in SECRET_FLAGS], manifest
                assert not any("kv_secret" in a or "discovery_secret" in a for a in args), manifest
                for e in c.get("env", []):
                    if "SECRET" in e["name"] or "API_KEY" in e["name"]:
                        assert "value" not in e and "secretKeyRef" in e["valueFrom"], (manifest, e["name"])


def _launch():
    from xpyd_deploy import launch

    return launch


@pytest.mark.parametrize("where", ["proxy-flag", "kv-transfer", "topology-env"])
def test_the_launcher_refuses_a_secret_in_argv_or_the_topology(tmp_path, capsys, where):
    topo = yaml.safe_load((ROOT / "configs" / "topologies" / "1p1d.yaml").read_text())
    if where == "proxy-flag":
        topo["proxies"][0]["args"] = ["--api-key", "sk-in-the-topology"]
    elif where == "kv-transfer":
        topo["kv_transfer"]["kv_secret"] = "sk-in-the-topology"
    else:
        topo["instances"][0]["env"] = {"XPYD_KV_SECRET": "sk-in-the-topology"}
    path = tmp_path / "leaky.yaml"
    path.write_text(yaml.safe_dump(topo))
    assert _launch().main(["commands", str(path)]) == 2
    out = capsys.readouterr()
    assert "secrets belong in the environment" in out.err and "sk-in-the-topology" not in out.out + out.err



def test_a_fifo_is_refused_at_once_and_a_loose_file_warned_about(tmp_path, no_secret_env, caplog):
    """vLLM's start-up must not hang on a FIFO named as kv_secret_file (the old reader blocked
    in open()); a file its group may read is used, with a warning."""
    import os
    import threading

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    out: dict = {}

    def run():
        try:
            _cfg(kv_secret_file=str(fifo))
        except ValueError as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # releases the blocked reader
        t.join(10)
        pytest.fail("reading kv_secret_file blocked on a FIFO")
    assert "not a regular file" in str(out.get("error")), out
    loose = _file(tmp_path, "kv", "kv-1")
    os.chmod(loose, 0o640)
    with caplog.at_level(logging.WARNING, logger="vllm.xpyd.connector.config"):
        assert _cfg(kv_secret_file=loose).kv_secret == "kv-1"
    assert "is readable by its group (mode 0640)" in caplog.text
