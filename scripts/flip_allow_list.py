"""Flip each entry of the first-token allow-list (proxy/dispatch/first_token.py) alone and run its
unit tests: an entry whose flip no test notices is a rule nothing checks (issue 48).

    .venv/bin/python -m scripts.flip_allow_list            # every flip, then the survivors
    .venv/bin/python -m scripts.flip_allow_list n stop     # only the flips of these names

A flip is one of: a name dropped from a table (a field let through becomes unknown, so its
requests keep D's first token; a sampling default or a completion key is no longer carried); a
field let through only at neutral values let through at any value; one neutral value dropped.
Each flip runs tests/unit/test_proxy_first_token.py in this process (pytest.main, -x), with the
module's tables patched: ~20 s a flip, ~70 min in all on a loaded 2-core box. Not in CI: a
survivor is a finding for a person (a missing test, or an entry that changes nothing: EQUIVALENT)."""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from proxy.dispatch import first_token as ft

TESTS = ["tests/unit/test_proxy_first_token.py"]
# Flips that change nothing a request can show (no test can fail them), and why.
EQUIVALENT = {
    "_COMPLETION_KEYS drops max_tokens": "continuation() sets D's max_tokens itself",
    "_COMPLETION_KEYS drops kv_transfer_params": "continuation() sets them itself: the client's own and P's prompt length",
    "_COMPLETION_KEYS drops min_tokens": "continuation() sets it (less P's token) where the client's is positive; "
                                         "0 and absent mean the same to vLLM",
}
_SETS = ("_SAME", "_CHECKED_CHAT", "_CHECKED", "_CHAT_PROMPT_ONLY", "_SAMPLING_SAME", "_COMPLETION_KEYS")
_MAPS = ("_NEUTRAL", "_CHAT_NEUTRAL")


def flips() -> Iterator[tuple[str, Callable[[], None]]]:
    """(what, apply) for every flip; apply patches the module (restore() undoes it)."""
    for table in _SETS:
        for name in sorted(getattr(ft, table)):
            def drop(table: str = table, name: str = name) -> None:
                setattr(ft, table, frozenset(getattr(ft, table)) - {name})
            yield f"{table} drops {name}", drop
    for table in _MAPS:
        for name, allowed in sorted(getattr(ft, table).items()):
            def remove(table: str = table, name: str = name) -> None:
                setattr(ft, table, {k: v for k, v in getattr(ft, table).items() if k != name})
            yield f"{table} drops {name}", remove

            def any_value(name: str = name) -> None:
                ft._SAME = ft._SAME | {name}
            yield f"{table} lets {name} through at any value", any_value
            for value in allowed:
                def narrow(table: str = table, name: str = name, value: Any = value) -> None:
                    mapping = dict(getattr(ft, table))
                    mapping[name] = tuple(v for v in mapping[name] if not (v == value and type(v) is type(value)))
                    setattr(ft, table, mapping)
                yield f"{table} drops {name}={value!r}", narrow


_SAVED = {name: getattr(ft, name) for name in _SETS + _MAPS}


def restore() -> None:
    for name, value in _SAVED.items():
        setattr(ft, name, value)


def run_tests() -> int:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        return pytest.main(["-q", "-x", "-p", "no:cacheprovider", "-W", "ignore", *TESTS])


def main(argv: list[str]) -> int:
    wanted = set(argv)
    survivors: list[str] = []
    assert run_tests() == 0, "the tests fail unflipped"
    for what, apply in flips():
        if wanted and not any(w in what.split() for w in wanted):
            continue
        apply()
        try:
            code = run_tests()
        finally:
            restore()
        verdict = "caught" if code == 1 else "equivalent" if what in EQUIVALENT else "SURVIVED" if code == 0 \
            else f"exit {code}"
        print(f"{verdict:10} {what}", flush=True)
        if code == 0 and what not in EQUIVALENT:
            survivors.append(what)
    print(f"\n{len(survivors)} flip(s) no test noticed:" if survivors else "\nevery flip was caught")
    for what in survivors:
        print("  " + what)
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
