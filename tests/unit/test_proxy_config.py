"""Config loading: CLI flag > XPYD_* env > YAML file > default; validation; entry points."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import fields

import pytest

from proxy.config import ConfigError, ProxyConfig, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# Every default as documented (docs/reference/flags.md, and the pages that say why): a
# default that changes, or a field that is added, must change this table on purpose (and the
# docs: scripts/gen_flags.py). Comparing ProxyConfig() with itself cannot fail.
DOCUMENTED_DEFAULTS = {
    "host": "127.0.0.1",
    "port": 8000,
    "discovery_host": "127.0.0.1",
    "discovery_port": 30001,
    "discovery_secret": None,
    "discovery_secret_file": None,
    "allow_unauthenticated_discovery": False,
    "heartbeat_timeout": 10.0,
    "discovery_max_per_role": 1024,
    "discovery_max_per_source": 64,
    "discovery_cpu_share": 0.2,
    "discovery_max_source_rate": 200,
    "discovery_max_connections": 2112,
    "discovery_max_connections_per_source": 128,
    "prefill_policy": "round_robin",
    "decode_policy": "round_robin",
    "cache_aware_chunk_tokens": 16,
    "cache_aware_capacity_tokens": 500_000,
    "cache_aware_min_match": 0.5,
    "cache_aware_balance_abs": 8.0,
    "cache_aware_balance_rel": 1.5,
    "kv_index_max_blocks": 262_144,
    "kv_events_silence": 10.0,
    "tokenizer": None,
    "tokenize_max_bytes": 1024 * 1024,
    "tokenize_max_pending": 8,
    "tokenize_timeout": 1.0,
    "trust_request_chat_template": False,
    "send_only_missing": True,
    "api_key": None,
    "api_key_file": None,
    "metrics_require_api_key": False,
    "expose_routing_headers": False,
    "enable_request_id_headers": False,
    "upstream_api_key": None,
    "upstream_api_key_file": None,
    "forward_client_auth": False,
    "admin_api_key": None,
    "admin_api_key_file": None,
    "max_adapters": 64,
    "adapter_timeout": 120.0,
    "forward_debug_params": False,
    "max_body_bytes": 16 * 1024 * 1024,
    "max_held_body_bytes": 1024 * 1024 * 1024,
    "max_body_values": 1024 * 1024,
    "max_body_containers": 64 * 1024,
    "max_header_bytes": 32 * 1024,
    "header_timeout": 10.0,
    "body_timeout": 60.0,
    "max_connections": 4096,
    "max_response_bytes": 64 * 1024 * 1024,
    "connect_timeout": 5.0,
    "prefill_timeout": 600.0,
    "decode_ttfb_timeout": 600.0,
    "stream_idle_timeout": 120.0,
    "prefill_retries": 2,
    "decode_retries": 1,
    "dispatch": "concurrent",
    "decode_max_early": 8,
    "first_token": "prefill",
    "local_prefill_threshold": 128,
    "fallback_to_decode": True,
    "failure_cooldown": 2.0,
    "prefill_max_in_flight": 0,
    "decode_max_in_flight": 0,
    "queue_size": 1024,
    "queue_timeout": 30.0,
    "prefill": (),
    "decode": (),
    "health_interval": 2.0,
    "probe_timeout": 5.0,
    "models_refresh_interval": 30.0,
    "passthrough_role": "P",
    "passthrough_routes": (),
    "response_holders": 100_000,
    "response_holders_ttl": 86_400.0,
    "probe_concurrency": 32,
    "shutdown_grace_s": 30.0,
    "log_level": "info",
    "tracing": False,
    "upstream_client": "native",
    "loop": "auto",
    "http": "auto",
}


def test_defaults():
    cfg = load_config([], env={})
    assert cfg == ProxyConfig()
    assert {f.name: getattr(cfg, f.name) for f in fields(ProxyConfig)} == DOCUMENTED_DEFAULTS
    # Flipping these four at once passed this file when it compared the defaults with themselves.
    assert (cfg.first_token, cfg.fallback_to_decode, cfg.local_prefill_threshold, cfg.send_only_missing) == (
        "prefill", True, 128, True)


def _other_value(f, tmp_path) -> tuple[str, object]:
    """(env text, value the field must then have), different from its default."""
    special = {
        "host": ("127.0.0.2", "127.0.0.2"),
        "discovery_host": ("127.0.0.3", "127.0.0.3"),
        "prefill_policy": ("least_loaded", "least_loaded"),
        "decode_policy": ("power_of_two", "power_of_two"),
        "dispatch": ("sequential", "sequential"),
        "decode_max_early": ("3", 3),
        "first_token": ("decode", "decode"),
        "passthrough_role": ("D", "D"),
        "passthrough_routes": ("/v1/new_route", ("/v1/new_route",)),
        "log_level": ("debug", "debug"),
        "upstream_client": ("httpx", "httpx"),
        "loop": ("asyncio", "asyncio"),
        "http": ("h11", "h11"),
        "prefill": ("http://127.0.0.1:9001;http://127.0.0.1:9002", ("http://127.0.0.1:9001", "http://127.0.0.1:9002")),
        "decode": ("http://127.0.0.1:9003", ("http://127.0.0.1:9003",)),
    }
    if f.name in special:
        return special[f.name]
    if f.name.endswith("_file"):
        path = tmp_path / f.name
        path.write_text(f"from-{f.name}\n")
        return str(path), None  # checked on the secret it names
    default = f.default
    if isinstance(default, bool):
        return str(not default).lower(), not default
    if isinstance(default, int):
        return str(default + 3), default + 3
    if isinstance(default, float):
        return str(default + 0.25), default + 0.25
    return f"set-{f.name}", f"set-{f.name}"  # optional strings: secrets, tokenizer


def test_every_field_is_read_from_its_env_variable(tmp_path):
    """Each XPYD_<NAME> alone sets its field (and nothing else), for every field."""
    for f in fields(ProxyConfig):
        text, want = _other_value(f, tmp_path)
        cfg = load_config([], env={"XPYD_" + f.name.upper(): text})
        changed = {g.name for g in fields(ProxyConfig) if getattr(cfg, g.name) != DOCUMENTED_DEFAULTS[g.name]}
        if f.name.endswith("_file"):
            secret = f.name.removesuffix("_file")
            assert getattr(cfg, secret) == f"from-{f.name}", f.name
            assert changed <= {f.name, secret}, (f.name, changed)
        else:
            assert getattr(cfg, f.name) == want, f.name
            assert changed == {f.name}, (f.name, changed)


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


def test_every_field_has_a_flag():
    from proxy.config import build_parser

    flags = {a.dest for a in build_parser()._actions}
    for f in fields(ProxyConfig):
        assert f.name in flags  # (env: test_every_field_is_read_from_its_env_variable)


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
        timeout=240,  # a proxy's start took over 120 s at load 34
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


@pytest.mark.parametrize("host, api_key, warned", [
    ("0.0.0.0", None, True), ("::", None, True), ("10.1.2.3", None, True),
    ("0.0.0.0", "k", False), ("127.0.0.1", None, False), ("localhost", None, False), ("::1", None, False),
])  # fmt: skip
def test_serving_a_wider_address_without_an_api_key_is_warned_about(host, api_key, warned, caplog):
    """The API binds loopback by default (docs/security.md says so); a wider --host without
    --api-key serves anyone who reaches it, and the proxy says so once at start-up."""
    from proxy.serving.server import ProxyServer

    assert ProxyConfig().host == "127.0.0.1" and load_config([], env={}).host == "127.0.0.1"
    cfg = ProxyConfig(host=host, port=0, api_key=api_key).validate()
    with caplog.at_level(logging.WARNING, logger="xpyd.proxy"):
        ProxyServer(cfg, handle_signals=False)
    said = [r.getMessage() for r in caplog.records if "without --api-key" in r.getMessage()]
    assert bool(said) is warned, said
