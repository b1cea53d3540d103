"""`xpyd-launch` / `python -m deploy`: run an xPyD topology from configs/topologies/.

    xpyd-launch up 1p2d                      # proxy + 1 P + 2 D, until Ctrl-C / SIGTERM
    xpyd-launch up 1p1d --once               # answer one request through the proxy, then stop
    xpyd-launch up multinode --only prefill-0  # this host's share of a multi-host layout
    xpyd-launch commands 1p2d                # print every process's command line
    xpyd-launch list                         # the named topologies
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from deploy.launcher import Launcher, LaunchOptions
from deploy.topology import ROOT, TopologyError, all_topologies, load_topology


def _topology(args: argparse.Namespace):
    topo = load_topology(args.topology)
    return topo.with_port_offset(args.port_offset) if args.port_offset else topo


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="xpyd-launch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("up", "start the topology and keep it running"),
                        ("commands", "print the command line and env of every process")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("topology", help="a file, or a name under configs/topologies/ (1p1d, 1p2d, ...)")
        p.add_argument("--port-offset", type=int, default=0, help="shift every port (a second copy on one host)")
        p.add_argument("--only", default=None, help="comma-separated proxy/instance names to start here")
    up = sub.choices["up"]
    up.add_argument("--log-dir", default=None, help="one log per process (default .logs/<topology>)")
    up.add_argument("--timeout", type=float, default=600, help="seconds for all instances to become healthy")
    up.add_argument("--stop-grace", type=float, default=30, help="seconds between SIGTERM and SIGKILL")
    up.add_argument("--once", action="store_true", help="send one completion through the proxy, then stop")
    up.add_argument("--python", default=sys.executable, help="interpreter that runs vLLM and the proxy")
    sub.add_parser("list", help="the topologies under configs/topologies/")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "list":
            for t in all_topologies():
                print(f"{t.name:10s} {t.shape:5s} {t.device:4s} {t.description}")
            return 0
        topo = _topology(args)
        names = [n for n in (args.only or "").split(",") if n]
        if args.cmd == "commands":
            proxies, insts = topo.select(names) if names else (topo.proxies, topo.instances)
            for p in proxies:
                print(f"# {p.name}\n{shlex.join(topo.proxy_command(p, 'python'))}")
            for i in insts:
                env = " ".join(f"{k}={shlex.quote(v)}" for k, v in topo.vllm_env(i).items())
                print(f"# {i.name} ({i.role})\n{env + ' ' if env else ''}{shlex.join(topo.vllm_command(i, 'python'))}")
            return 0
        log_dir = Path(args.log_dir) if args.log_dir else ROOT / ".logs" / topo.name
        opts = LaunchOptions(log_dir=log_dir, timeout=args.timeout, stop_grace=args.stop_grace, once=args.once,
                             python=args.python, names=names or None)
        return Launcher(topo, opts).run()
    except TopologyError as e:
        print(f"xpyd-launch: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
