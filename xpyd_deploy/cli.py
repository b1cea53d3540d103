"""The ``xpyd`` console script (pyproject [project.scripts]): one command, a subcommand per tool.

    xpyd launch up 1p2d      # = python -m xpyd_deploy.launch up 1p2d
    xpyd doctor --json -     # = python -m connector.tools.doctor --json -

Each tool's module is imported only when its subcommand runs: ``xpyd launch`` needs neither torch
nor vLLM, ``xpyd doctor`` (connector/tools/doctor.py) brings its own imports.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

EXIT_USAGE = 2


def _launch(argv: list[str]) -> int:
    from xpyd_deploy.launch import main
    return main(argv, prog="xpyd launch")


def _doctor(argv: list[str]) -> int:
    from connector.tools.doctor import main
    return main(argv, prog="xpyd doctor")


# name -> (runner, one line of help)
COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "launch": (_launch, "run a topology on this machine: up, commands, list (xpyd launch --help)"),
    "doctor": (_doctor, "check this machine: environment, NCCL, transports, KV layouts, GPU figures"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    return "usage: xpyd {" + ",".join(COMMANDS) + "} ...\n\n" + "\n".join(
        f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else EXIT_USAGE
    if argv[0] not in COMMANDS:
        print(f"xpyd: unknown command {argv[0]!r} (known: {', '.join(COMMANDS)})", file=sys.stderr)
        return EXIT_USAGE
    return COMMANDS[argv[0]][0](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
