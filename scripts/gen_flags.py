#!/usr/bin/env python3
"""Writes docs/reference/flags.md from the configuration definitions themselves.

Proxy flags come from proxy/config.py: the ProxyConfig dataclass (names, types, defaults),
its HELP texts (proxy/config_help.py) and the argparse parser built from them (flag names, choices). The
connector's kv_connector_extra_config keys are found by reading the source of
connector/config.py and connector/shared_storage/config.py (every ``extra.get("key", d)``,
``extra["key"]`` and helper call that takes ``extra`` and a key), with defaults evaluated in
the module's own namespace. Their meanings are kept here (the code has none), and the
generator refuses to run while a key in the code has no meaning here or a meaning names a
key the code no longer reads: a new or removed key cannot go unnoticed.

    python -m scripts.gen_flags            # rewrite docs/reference/flags.md
    python -m scripts.gen_flags --check    # exit 1 when the file differs from what it renders

tests/unit/test_docs.py runs the check.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "reference" / "flags.md"
WIDTH = 120  # wrap meanings so no line of the page runs past ~200 characters

# Where the connector reads its extra-config keys: (module, page section title).
CONNECTOR_SOURCES = (
    ("connector.config", "P2P connector (`connector.P2pNcclConnector`)"),
    ("connector.shared_storage.config", "Shared-storage connector (`connector.SharedStorageConnector`)"),
)
# Helpers in those modules called as helper(extra, "key", ...): which argument is the default.
_HELPER_DEFAULT_ARG = {"_choice": None, "_secret": None, "_positive_int": None, "_positive_seconds": 2}

# The meaning of every kv_connector_extra_config key. ``{NAME}`` is filled in from the
# module that reads the key (its constants), so a changed constant shows here.
CONNECTOR_MEANINGS: dict[str, str] = {
    "kv_ip": "address this instance's KV engine binds and advertises (set it for multi-node; never auto-detected)",
    "http_host": "the instance's OpenAI server host, announced to the proxy",
    "http_port": "the instance's OpenAI server port, announced to the proxy",
    "proxy_ip": "proxy to register with (with `proxy_port`; vLLM's upstream keys)",
    "proxy_port": "the discovery port of `proxy_ip`",
    "proxies": "proxies to register with, `[\"host:port\", ...]` for several; a DNS name is resolved to all its "
    "addresses (every replica behind a headless Service)",
    "send_type": "`PUT` (send inside the step), `PUT_ASYNC` (sender thread; blocks held until sent), "
    "`GET` (P keeps a copy, D pulls)",
    "send_granularity": "P, `PUT_ASYNC`: `layer` ships each layer's blocks as soon as that layer's attention ran "
    "(vLLM's `save_kv_layer`), while the later layers compute; `request` ships the prompt's KV once, after the forward "
    "pass; `auto`: `layer` over tcp (measured, see the connector's *Layer-wise sends*), `request` over nccl "
    "(not yet measured on a GPU). `layer` with `PUT` or `GET` is a start-up error",
    "kv_buffer_size": "bytes of KV a side may hold in its receive (D) or send (P, GET) buffer; reserved before a "
    "payload's bytes move, so a burst cannot exceed it",
    "kv_load_timeout_s": "D waits at most this long for KV, then reports the load failed "
    "(vLLM recomputes or fails, per `kv_load_failure_policy`)",
    "kv_prefill_wait_s": "D: a request the proxy sent before P answered (concurrent dispatch: its transfer id is "
    "marked early) whose prefill has not begun sending to D (no reservation, part, refusal or abort seen on D's "
    "arrival board) waits in vLLM's queue holding no KV-cache blocks and with no load deadline running, at most this "
    "long (any other request: `kv_load_timeout_s`); then D computes the prompt itself and reports the load failed. "
    "`kv_load_timeout_s` counts from when the sender began, so a queued or slow P does not fail D's load. Needs the "
    "arrival board (`sync_load`, PUT modes, D's ranks on its scheduler's host); without it the deadline counts from "
    "D's admission",
    "sync_load": "D: when the prompt's KV is already in D's buffer as the scheduler plans the load (the usual case "
    "with sequential dispatch), load it before the forward pass of the step that schedules the request (vLLM's "
    "synchronous load) instead of one engine step later; `false`: always asynchronously. A synchronous load that "
    "fails reports its blocks to vLLM, and `kv_load_failure_policy` decides, as for an asynchronous one",
    "idle_wait_ms": "in an engine step that computes nothing (a request waits for KV or for P to begin sending it, or "
    "finished requests' blocks wait for their send), wait up to this long for a transfer to move (or begin) "
    "instead of returning into vLLM's next, equally empty step; a request that reaches the engine meanwhile starts at most this much later; `0`: vLLM's own "
    "behaviour (see the proxy's *Concurrent dispatch* for why); at most {MAX_IDLE_WAIT_MS:g}",
    "send_timeout_s": "P gives up a send to an unresponsive D after this, frees the blocks, tells D, and fails further "
    "sends to that D at once until it answers again",
    "buffer_ttl_s": "KV received for a request that never comes is dropped after this",
    "heartbeat_interval_s": "discovery heartbeat period",
    "proxy_resolve_interval_s": "how often a proxy given by DNS name is resolved again to follow its replicas "
    "(a number of seconds > 0)",
    "discovery_secret": "sign heartbeats (HMAC-SHA256, with a nonce against replays) for a proxy started with "
    "`--discovery-secret`; empty is an error",
    "discovery_secret_file": "a file holding `discovery_secret` (or env `XPYD_DISCOVERY_SECRET_FILE`): the "
    "secret stays out of vLLM's command line and its start-up log",
    "kv_secret": "authenticate the KV control sockets (see Security); the same value on every P and D; "
    "falls back to `discovery_secret`; empty is an error",
    "kv_secret_file": "a file holding `kv_secret` (or env `XPYD_KV_SECRET_FILE`): the secret stays out of "
    "vLLM's command line and its start-up log",
    "kv_auth": "with a secret: `mac` (a MAC on every call, and each zmq connection proves the key at its handshake: "
    "same throughput, +0.1 ms per call) or `curve` (ZMQ CURVE: authenticated and encrypted, 2.5–5× slower transfers)",
    "allow_unauthenticated_kv": "allow a KV port on a non-loopback `kv_ip` without `kv_secret` (else a start-up "
    "error): anyone who reaches it can put KV for a transfer, which vLLM's prefix cache then serves to other "
    "requests; for a network only trusted peers reach",
    "kv_max_connections": "zmq connections one KV port holds; new ones beyond are shut down as they come",
    "kv_max_connections_per_host": "zmq connections one KV port holds from one host; new ones beyond are shut down",
    "thread_affinity": "on CPU, move the connector's and libzmq's threads off the core vLLM's OpenMP binding pinned "
    "the worker to (`off`: leave them, e.g. when you pin threads yourself)",
    "transport": "`auto`: `nccl` when the KV cache is on CUDA and an NCCL library loads (vLLM's libnccl, else the one "
    "torch ships; set `XPYD_NCCL_LIBRARY` to force a path), else `tcp`; `nccl` fails at start-up without them; "
    "`tcp`: any host, through host memory",
    "byte_stream": "tcp (and the nccl transport's control calls): once a peer's zmq reply says where, calls and KV go "
    "over plain TCP connections to a second port that peer's engine binds (any free port on `kv_ip`, named in its "
    "signed replies), and KV arrives in receive memory reused from payload to payload (up to `kv_buffer_size`, "
    "resident once touched) instead of a fresh allocation each; `false`: zmq alone, e.g. behind a firewall that "
    "passes only the KV ports. Never with `kv_auth: curve` (it would bypass the encryption). A stream port that "
    "does not answer within 2 s is logged once and not tried again until that peer restarts",
    "nccl_num_channels": "NCCL channels of the KV communicators only (their `ncclConfig_t`; the process environment "
    "and vLLM's own communicators are untouched); unset: NCCL's choice",
    "mem_pool_size_gb": "GPU decode: pinned host pool (GiB) for received KV beyond `kv_buffer_size` of device memory "
    "(exactly this size, allocated and pinned in the background at start-up); a transfer is refused only when both "
    "are full. Unset: by role, {DEFAULT_POOL_GB}",
    "allow_debug_corruption": "test hook: honour `kv_transfer_params[\"xpyd_debug_corrupt_kv\"]` on load; "
    "off unless set, so clients cannot corrupt a production instance",
    "shared_storage_path": "the shared directory (tmpfs, local disk, NFS...); required",
    "shared_storage_max_bytes": "eviction limit in bytes (`0`: none); approximate across instances "
    "(each rescans every 30 s)",
    "shared_storage_model_id": "names the model in keys and files (unset: the model's path@revision); set it when "
    "instances load the same checkpoint from different paths",
    "shared_storage_queue_bytes": "writer queue bound in bytes",
    "shared_storage_queue_wait_s": "how long a step may wait on a full writer queue, then the store is dropped",
    "shared_storage_verify": "CRC check on load",
    "shared_storage_fsync": "fsync each file before its rename",
}


@dataclasses.dataclass(frozen=True)
class Key:
    name: str
    default: str  # as the page shows it
    env: str | None = None
    choices: tuple[str, ...] = ()


def _literal(node: ast.AST | None, namespace: dict[str, Any]) -> Any:
    """A default expression's value in the reading module's namespace (None: no default)."""
    if node is None:
        return None
    try:
        return eval(compile(ast.Expression(node), "<default>", "eval"), dict(namespace))  # noqa: S307 - our source
    except NameError:  # a default taken from another key (``extra.get("http_host", kv_ip)``)
        return _Expr(ast.unparse(node))


class _Expr(str):
    """A default that is another value of the config, shown as the code names it."""


def _show(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1e6:
        return "`" + f"{value:g}".replace("e+0", "e").replace("e+", "e") + "`"
    if isinstance(value, int) and value >= 2**20 and value % 2**20 == 0:
        size = f"{value // 2**30} GiB" if value % 2**30 == 0 else f"{value // 2**20} MiB"
        return f"`{value}` ({size})"
    return f"`{value}`"


def connector_keys(module_name: str) -> list[Key]:
    """Every extra-config key the module reads, in the order of its source."""
    module = importlib.import_module(module_name)
    namespace = vars(module)
    tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
    found: dict[str, Key] = {}

    def is_extra(node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id == "extra"

    def key_at(args: list[ast.expr], i: int) -> str | None:
        if len(args) > i and isinstance(args[i], ast.Constant) and isinstance(args[i].value, str):
            return args[i].value
        return None

    nodes = sorted(ast.walk(tree), key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0)))
    for node in nodes:
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "get" and is_extra(func.value):
                name = key_at(node.args, 0)
                if name:
                    default = _literal(node.args[1] if len(node.args) > 1 else None, namespace)
                    found.setdefault(name, Key(name, _show(default)))
            elif isinstance(func, ast.Name) and func.id in _HELPER_DEFAULT_ARG and node.args and is_extra(node.args[0]):
                name = key_at(node.args, 1)
                if not name:
                    continue
                if func.id == "_choice":
                    allowed = tuple(_literal(node.args[2], namespace))
                    key = Key(name, _show(allowed[0]), choices=allowed)
                elif func.id == "_secret":
                    key = Key(name, "—", env=key_at(node.args, 2))
                else:
                    i = _HELPER_DEFAULT_ARG[func.id]
                    key = Key(name, _show(_literal(node.args[i] if i is not None and len(node.args) > i else None,
                                                   namespace)))
                found[name] = key  # a helper knows more than a plain get of the same key
        elif isinstance(node, ast.Subscript) and is_extra(node.value):
            sub = node.slice
            if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                found.setdefault(sub.value, Key(sub.value, "—"))
    return list(found.values())


def _wrap(text: str, indent: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent,
                         break_long_words=False, break_on_hyphens=False)


def proxy_section() -> list[str]:
    config = importlib.import_module("proxy.config")
    parser = config.build_parser()
    actions = {a.dest: a for a in parser._actions}  # argparse keeps no public list
    lines = [
        "## Proxy (`xpyd-proxy`, `python -m proxy`)",
        "",
        "Source: `proxy/config.py` (`ProxyConfig`) and `proxy/config_help.py` (`HELP`).",
        "Every flag is also a key of the YAML `--config` file (snake_case) and an environment variable",
        f"(`{config.ENV_PREFIX}<NAME>`, e.g. `{config.ENV_PREFIX}HEARTBEAT_TIMEOUT=5`; the file itself: "
        f"`{config.ENV_PREFIX}CONFIG`).",
        "Precedence: flag > env > file > default.",
        "Boolean flags take `true`/`false` (`1`/`0`, `yes`/`no`, `on`/`off`); the flag alone means true.",
        "List flags repeat on the command line, are a YAML list in the file and `;`- or space-separated in the env.",
        "",
    ]
    for f in dataclasses.fields(config.ProxyConfig):
        action = actions[f.name]
        kind = "list" if config._is_list(f) else str(f.type).replace(" | None", "")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        shown = "—" if default in ((), None) else _show(default)
        if f.metadata.get("secret") or not f.repr:
            shown += " (secret: never logged)"
        lines.append(f"### `{action.option_strings[0]}`")
        lines.append("")
        lines.append(f"- env `{config.ENV_PREFIX}{f.name.upper()}`, YAML `{f.name}`, type `{kind}`, default {shown}")
        if action.choices:
            lines.append("- one of " + ", ".join(f"`{c}`" for c in action.choices))
        help_text = config.HELP.get(f.name)
        if not help_text:
            raise SystemExit(f"proxy/config_help.py: {f.name} has no HELP text (the flag reference is built from it)")
        wrapped = _wrap(help_text[0].upper() + help_text[1:] + ".", "  ")
        lines += ["- " + wrapped[0].lstrip()] + wrapped[1:]
        lines.append("")
    return lines


def connector_section() -> list[str]:
    lines = [
        "## Connector (`kv_connector_extra_config`)",
        "",
        "The keys each connector reads from `kv_connector_extra_config` in vLLM's `--kv-transfer-config`.",
        "`kv_role`, `kv_port` and `kv_load_failure_policy` are vLLM's own top-level keys (set `recompute`).",
        "Boolean keys take JSON booleans or the strings `true`/`false` (`1`/`0`, `yes`/`no`, `on`/`off`).",
        "",
    ]
    seen: set[str] = set()
    missing: list[str] = []
    for module_name, title in CONNECTOR_SOURCES:
        module = importlib.import_module(module_name)
        keys = [k for k in connector_keys(module_name) if k.name not in seen]
        source = Path(module.__file__).relative_to(ROOT)
        lines += [f"### {title}", "", f"Source: `{source}`.", ""]
        if module_name != CONNECTOR_SOURCES[0][0]:
            lines += ["It also reads every key of the P2P connector above that concerns registration, "
                      "`kv_load_timeout_s` and `thread_affinity`.", ""]
        order = list(CONNECTOR_MEANINGS)
        for key in sorted(keys, key=lambda k: order.index(k.name) if k.name in order else len(order)):
            seen.add(key.name)
            meaning = CONNECTOR_MEANINGS.get(key.name)
            if meaning is None:
                missing.append(f"{source}: {key.name}")
                continue
            meaning = meaning.format(**{k: v for k, v in vars(module).items() if k.isupper()})
            lines += [f"#### `{key.name}`", ""]
            facts = [f"default {key.default}"]
            if key.env:
                facts.append(f"env `{key.env}`")
            if key.choices:
                facts.append("one of " + ", ".join(f"`{c}`" for c in key.choices))
            lines.append("- " + "; ".join(facts))
            wrapped = _wrap(meaning[0].upper() + meaning[1:] + ".", "  ")
            lines += ["- " + wrapped[0].lstrip()] + wrapped[1:]
            lines.append("")
    if missing:
        raise SystemExit("keys read by the connector with no meaning in scripts/gen_flags.py: " + ", ".join(missing)
                         + ". Add each to CONNECTOR_MEANINGS there, then run python -m scripts.gen_flags")
    stale = sorted(set(CONNECTOR_MEANINGS) - seen)
    if stale:
        raise SystemExit("scripts/gen_flags.py describes keys the connector no longer reads: " + ", ".join(stale)
                         + ". Remove them from CONNECTOR_MEANINGS there, then run python -m scripts.gen_flags")
    return lines


def render() -> str:
    lines = [
        "# Flag reference",
        "",
        "<!-- Generated by scripts/gen_flags.py from proxy/config.py and the connector's config modules.",
        "     Do not edit: run `python -m scripts.gen_flags`; tests/unit/test_docs.py fails when this file is stale. -->",
        "",
        "Generated from the configuration definitions; the pages [The proxy](../proxy/index.md) and",
        "[The connector](../connector/index.md) say why the defaults are what they are.",
        "",
    ]
    lines += proxy_section()
    lines += connector_section()
    while lines and lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale, write nothing")
    parser.add_argument("-o", "--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is stale: run python -m scripts.gen_flags", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
