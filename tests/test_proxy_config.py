"""Config loading: CLI flag > XPYD_* env > YAML file > default; validation; entry points."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from proxy.config import ConfigError, ProxyConfig, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_defaults():
    cfg = load_config([], env={})
    assert cfg == ProxyConfig()
    assert cfg.heartbeat_timeout == 10.0
    assert cfg.prefill_policy == "round_robin"


def test_precedence_cli_over_env_over_yaml_over_default(tmp_path):
    path = tmp_path / "proxy.yaml"
    path.write_text(
        "port: 9001\n"
        "discovery-port: 9101\n"  # dashes accepted too
        "heartbeat_timeout: 3\n"
        "decode_policy: least_loaded\n"
        "api_key: from-file\n"
    )
    env = {"XPYD_PORT": "9002", "XPYD_HEARTBEAT_TIMEOUT": "4.5"}
    cfg = load_config(["--config", str(path), "--port", "9003"], env=env)
    assert cfg.port == 9003  # CLI
    assert cfg.heartbeat_timeout == 4.5  # env beats file
    assert cfg.discovery_port == 9101  # file
    assert cfg.decode_policy == "least_loaded"  # file
    assert cfg.api_key == "from-file"
    assert cfg.prefill_policy == "round_robin"  # default


def test_config_file_from_env(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("prefill_policy: least_loaded\n")
    cfg = load_config([], env={"XPYD_CONFIG": str(path), "XPYD_API_KEY": "k"})
    assert cfg.prefill_policy == "least_loaded"
    assert cfg.api_key == "k"


def test_every_field_has_flag_and_env():
    from dataclasses import fields

    from proxy.config import build_parser

    flags = {a.dest for a in build_parser()._actions}
    for f in fields(ProxyConfig):
        assert f.name in flags
        env_cfg = load_config([], env={})  # sanity: defaults load
        assert getattr(env_cfg, f.name) == f.default


def test_example_config_loads():
    cfg = load_config(["--config", os.path.join(ROOT, "configs", "proxy.yaml")], env={})
    assert isinstance(cfg, ProxyConfig)


@pytest.mark.parametrize(
    "argv, env, text",
    [
        (["--port", "70000"], {}, "port"),
        (["--heartbeat-timeout", "0"], {}, "heartbeat_timeout"),
        ([], {"XPYD_PORT": "abc"}, "XPYD_PORT"),
        ([], {"XPYD_PREFILL_POLICY": "random"}, "prefill_policy"),
        ([], {"XPYD_MAX_BODY_BYTES": "-1"}, "max_body_bytes"),
        ([], {"XPYD_UPSTREAM_CLIENT": "requests"}, "upstream_client"),
    ],
)
def test_invalid_values_rejected(argv, env, text):
    with pytest.raises(ConfigError, match=text):
        load_config(argv, env=env)


def test_unknown_yaml_key_rejected(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("prot: 1\n")
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(["--config", str(path)], env={})


def test_yaml_must_be_mapping(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(["--config", str(path)], env={})


@pytest.mark.parametrize("name", ["api_key", "discovery_secret", "upstream_api_key"])
def test_empty_secret_is_a_startup_error(name, tmp_path):
    flag = "--" + name.replace("_", "-")
    assert getattr(load_config([flag, "x"], env={}), name) == "x"
    path = tmp_path / "c.yaml"
    path.write_text(f'{name}: ""\n')
    # An empty key from any source must not mean "authentication off".
    for argv, env in (([flag, ""], {}), ([flag, "  "], {}), ([], {"XPYD_" + name.upper(): ""}),
                      (["--config", str(path)], {})):
        with pytest.raises(ConfigError, match="must not be empty"):
            load_config(argv, env=env)


def test_discovery_beyond_loopback_needs_a_secret_or_an_explicit_opt_in():
    assert load_config([], env={}).discovery_host == "127.0.0.1"
    for host in ("127.0.0.1", "127.0.0.11", "::1", "[::1]", "localhost"):
        assert load_config(["--discovery-host", host], env={}).discovery_host == host
    for host in ("0.0.0.0", "10.1.2.3", "::", "node-a"):
        with pytest.raises(ConfigError, match="allow-unauthenticated-discovery"):
            load_config(["--discovery-host", host], env={})
        signed = load_config(["--discovery-host", host, "--discovery-secret", "s"], env={})
        assert signed.discovery_secret == "s"
        opted = load_config(["--discovery-host", host, "--allow-unauthenticated-discovery"], env={})
        assert opted.allow_unauthenticated_discovery is True


def test_bool_flag_alone_means_true_and_takes_a_value():
    assert load_config(["--expose-routing-headers"], env={}).expose_routing_headers is True
    assert load_config(["--fallback-to-decode", "false"], env={}).fallback_to_decode is False
    assert load_config([], env={"XPYD_FORWARD_CLIENT_AUTH": "1"}).forward_client_auth is True


def test_cli_config_error_exit_code():
    proc = subprocess.run(
        [sys.executable, "-m", "proxy", "--port", "99999"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert "port" in proc.stderr


def test_console_script_declared():
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        meta = tomllib.load(fh)
    assert meta["project"]["scripts"]["xpyd-proxy"] == "proxy.__main__:main"


def test_secrets_stay_out_of_the_config_repr():
    cfg = load_config(["--api-key", "k-123", "--upstream-api-key", "u-456", "--discovery-secret", "d-789"], env={})
    text = repr(cfg)
    for secret in ("k-123", "u-456", "d-789"):
        assert secret not in text
    assert "discovery_port=30001" in text  # the rest is still there
