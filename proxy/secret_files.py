"""Secrets kept out of the command line: ``--api-key-file`` and its kin, and a warning when a
secret is given as a flag anyway (any local user reads ``/proc/<pid>/cmdline``).

Each secret field ``NAME`` of the config has a ``NAME_file`` beside it (flag, ``XPYD_NAME_FILE``
env or YAML key): the file's content, less one trailing newline, is the secret. The env
(``XPYD_NAME``) and the YAML file are the other ways that stay out of argv.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from xpyd_wire.secret_file import read_secret_file as _read

logger = logging.getLogger("xpyd.proxy.config")

SECRET_FIELDS = ("api_key", "discovery_secret", "upstream_api_key", "admin_api_key")


def read_secret_file(path: str, what: str) -> str:
    """The secret in ``path`` (one trailing newline dropped); ValueError says why not."""
    text = _read(path, what, logger.warning)
    if not text.strip():
        raise ValueError(f"{what}: {path} is empty (leave the option unset to turn it off)")
    return text


def resolve(values: dict[str, Any], from_cli: Mapping[str, Any]) -> None:
    """Fill each secret from its ``*_file`` (in ``values``, the resolved settings), and warn
    for each secret given on the command line (``from_cli``: the parsed flags)."""
    for name in SECRET_FIELDS:
        flag = "--" + name.replace("_", "-")
        if from_cli.get(name) is not None:
            logger.warning("%s was given on the command line, where any local user can read it "
                           "(/proc/<pid>/cmdline, ps): use %s-file or XPYD_%s instead", flag, flag, name.upper())
        path = values.get(name + "_file")
        if path is None:
            continue
        if values.get(name) is not None:
            raise ValueError(f"{name} is set twice: by {flag} (or XPYD_{name.upper()} / the config file) "
                             f"and by {flag}-file; keep one")
        values[name] = read_secret_file(path, f"{flag}-file")
