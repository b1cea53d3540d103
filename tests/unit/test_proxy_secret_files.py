"""Secrets out of argv (issue 36, part 5), proxy side: each secret has a ``*_file`` option (flag,
env, YAML), a secret given as a flag is warned about at start-up, and a proxy started with a
key file serves with that key while its command line holds only the path."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from proxy.config import ConfigError, load_config
from tests.support.proxy_helpers import free_port

# Over the 64 KiB a secret file may hold (a token, not a document).
TOO_BIG = 64 * 1024 + 1
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _file(tmp_path, name: str, text: str | bytes) -> str:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


def test_each_secret_comes_from_its_file_by_flag_env_or_yaml(tmp_path):
    key, disc, up = _file(tmp_path, "key", "k-1\n"), _file(tmp_path, "disc", "d-2"), _file(tmp_path, "up", "u-3\r\n")
    cfg = load_config(["--api-key-file", key, "--discovery-secret-file", disc, "--upstream-api-key-file", up], env={})
    assert (cfg.api_key, cfg.discovery_secret, cfg.upstream_api_key) == ("k-1", "d-2", "u-3")
    assert load_config([], env={"XPYD_API_KEY_FILE": key}).api_key == "k-1"
    yaml = _file(tmp_path, "proxy.yaml", f"discovery_secret_file: {disc}\n")
    assert load_config(["--config", yaml], env={}).discovery_secret == "d-2"
    assert "k-1" not in repr(cfg) and "d-2" not in repr(cfg)


@pytest.mark.parametrize("content, why", [
    ("", "is empty"), ("\n", "is empty"), (b"\xff\xfe", "not UTF-8"),
    ("x" * TOO_BIG, "not a secret"),
])
def test_a_bad_secret_file_is_a_configuration_error(tmp_path, content, why):
    with pytest.raises(ConfigError, match=why):
        load_config(["--api-key-file", _file(tmp_path, "key", content)], env={})


def test_a_missing_file_or_a_secret_set_twice_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(["--api-key-file", str(tmp_path / "nope")], env={})
    with pytest.raises(ConfigError, match="set twice"):
        load_config(["--api-key-file", _file(tmp_path, "key", "k")], env={"XPYD_API_KEY": "other"})


def test_a_secret_on_the_command_line_is_warned_about(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="xpyd.proxy.config"):
        load_config(["--api-key", "k-123", "--discovery-secret", "d-789"], env={})
    text = caplog.text
    assert "--api-key was given on the command line" in text and "--api-key-file" in text
    assert "--discovery-secret was given on the command line" in text
    assert "k-123" not in text and "d-789" not in text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="xpyd.proxy.config"):
        load_config(["--api-key-file", _file(tmp_path, "key", "k")], env={"XPYD_DISCOVERY_SECRET": "d"})
    assert "command line" not in caplog.text


def _get(url: str, key: str | None) -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_proxy_started_with_a_key_file_serves_with_it_and_argv_holds_only_the_path(tmp_path):
    secret = "sk-from-a-file-7f3a"
    path = _file(tmp_path, "api-key", secret + "\n")
    port, disc = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "--host", "127.0.0.1", "--port", str(port), "--discovery-port", str(disc),
         "--api-key-file", path],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("XPYD_")})
    try:
        url = f"http://127.0.0.1:{port}/instances"
        deadline = time.monotonic() + 240  # a loaded 2-core box imports FastAPI slowly (over 120 s at load 34)
        status = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                status = _get(url, None)
                break
            except OSError:
                time.sleep(0.2)
        assert status == 401, proc.stderr.read() if proc.poll() is not None else status
        assert _get(url, "wrong") == 401
        assert _get(url, secret) == 200
        with open(f"/proc/{proc.pid}/cmdline", "rb") as fh:
            cmdline = fh.read()
        assert path.encode() in cmdline and secret.encode() not in cmdline
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    assert "command line" not in (proc.stderr.read() or "")


def _in_thread(fn, unblock, timeout: float = 10.0):
    """fn()'s result or exception; a call still blocked after `timeout` is released with
    unblock() and fails the test (the old reader blocked forever on a FIFO)."""
    import threading

    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        unblock()
        t.join(timeout)
        pytest.fail(f"reading the secret file blocked for {timeout}s")
    return out


def test_a_fifo_or_directory_is_refused_at_once_not_waited_on(tmp_path):
    """A FIFO (nobody writing) would hold start-up forever in open(); a directory or device
    holds no secret: each is a configuration error naming the file."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def unblock():
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)

    out = _in_thread(lambda: load_config(["--api-key-file", str(fifo)], env={}), unblock)
    assert isinstance(out.get("error"), ConfigError) and "not a regular file" in str(out["error"]), out
    for path in (str(tmp_path), "/dev/zero"):
        with pytest.raises(ConfigError, match="not a regular file"):
            load_config(["--discovery-secret-file", path], env={})


def test_a_secret_file_others_may_read_is_warned_about(tmp_path, caplog):
    private, loose = _file(tmp_path, "private", "k-1"), _file(tmp_path, "loose", "k-2")
    os.chmod(private, 0o600)
    os.chmod(loose, 0o644)
    with caplog.at_level(logging.WARNING, logger="xpyd.proxy.config"):
        assert load_config(["--api-key-file", private], env={}).api_key == "k-1"
    assert "readable by" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="xpyd.proxy.config"):
        assert load_config(["--api-key-file", loose], env={}).api_key == "k-2"
    assert f"{loose} is readable by its group and everyone (mode 0644): chmod 600" in caplog.text and "k-2" not in caplog.text
