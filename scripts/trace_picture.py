#!/usr/bin/env python3
"""Draw one request's trace as a waterfall (docs/tracing.md's picture): a row per span (its service and
name, children under their parent), a bar from its start to its end on a common time axis, its events
as ticks, and the figures an operator reads first beside the bar.

The input is a trace as ``tests/support/otlp_receiver.save`` writes it (a JSON list of spans), e.g. the
one ``tests/e2e/test_e2e_routing.py::test_one_request_is_one_trace_across_the_proxy_p_and_d`` records
(it prints where):

    .venv/bin/python -m scripts.trace_picture TRACE.json docs/img/trace.png

Needs matplotlib (``pip install -e '.[bench]'`` or scripts/setup_bench.sh).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860")


def _kib(n: Any) -> str:
    return f"{int(n) / 1024:.0f} KiB"


def figures(name: str, a: dict[str, Any]) -> str:
    """The figures an operator reads first on a span (those it has)."""
    if name.startswith("POST "):
        parts = [a.get("xpyd.path"), "P {:.0f} ms".format(a["xpyd.prefill_ms"]) if "xpyd.prefill_ms" in a else None,
                 "D's first byte {:.0f} ms later".format(a["xpyd.decode_ttfb_ms"]) if "xpyd.decode_ttfb_ms" in a
                 else None]
    elif name == "llm_request":
        parts = [f"{a['gen_ai.usage.prompt_tokens']} prompt tokens" if "gen_ai.usage.prompt_tokens" in a else None,
                 "queued {:.0f} ms".format(a["gen_ai.latency.time_in_queue"] * 1e3)
                 if "gen_ai.latency.time_in_queue" in a else None,
                 f"{a['gen_ai.usage.completion_tokens']} out" if "gen_ai.usage.completion_tokens" in a else None]
    elif name in ("kv load", "kv send"):
        parts = [f"{a['xpyd.kv.blocks']} blocks" if "xpyd.kv.blocks" in a else None,
                 _kib(a["xpyd.kv.bytes"]) if "xpyd.kv.bytes" in a else None,
                 "waited for P {:.0f} ms".format(a["xpyd.kv.sender_wait_ms"]) if "xpyd.kv.sender_wait_ms" in a
                 else None,
                 ("applied in {:.2f} ms" if name == "kv load" else "sent in {:.1f} ms").format(a["xpyd.kv.ms"])
                 if "xpyd.kv.ms" in a else None,
                 None if a.get("xpyd.kv.result", "ok") == "ok" else a["xpyd.kv.result"]]
    else:
        parts = []
    return ", ".join(p for p in parts if p)


def ordered(spans: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """(depth, span), parents before their children; siblings grouped by service (in the order each
    service first appears), then by start."""
    ids = {s["span_id"] for s in spans}
    kids: dict[str, list[dict[str, Any]]] = {}
    for s in sorted(spans, key=lambda x: x["start_ns"]):
        kids.setdefault(s["parent_span_id"] if s["parent_span_id"] in ids else "", []).append(s)
    out: list[tuple[int, dict[str, Any]]] = []

    def walk(parent: str, depth: int) -> None:
        siblings = kids.get(parent, [])
        first = {}
        for s in siblings:
            first.setdefault(_service(s), s["start_ns"])
        for s in sorted(siblings, key=lambda x: (first[_service(x)], _service(x), x["start_ns"])):
            out.append((depth, s))
            walk(s["span_id"], depth + 1)

    walk("", 0)
    return out


def _service(s: dict[str, Any]) -> str:
    return s["resource"].get("service.name") or "?"


def draw(spans: list[dict[str, Any]], out: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("needs matplotlib (pip install -e '.[bench]')") from None
    rows = ordered(spans)
    t0 = min(s["start_ns"] for _, s in rows)
    end = max(s["end_ns"] for _, s in rows)
    total_ms = (end - t0) / 1e6
    services = list(dict.fromkeys(_service(s) for _, s in rows))
    color = {name: COLORS[i % len(COLORS)] for i, name in enumerate(services)}
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(rows) + 1.2))
    for y, (depth, s) in enumerate(rows):
        start, length = (s["start_ns"] - t0) / 1e6, (s["end_ns"] - s["start_ns"]) / 1e6
        failed = s.get("status_code") == 2
        ax.barh(y, max(length, total_ms / 400), left=start, height=0.6, color=color[_service(s)],
                edgecolor="#c00000" if failed else "none", linewidth=1.5)
        labelled = -1.0
        for e in sorted(s.get("events") or (), key=lambda e: e.get("time_ns") or 0):
            if e.get("time_ns"):
                at = (e["time_ns"] - t0) / 1e6
                ax.plot([at, at], [y - 0.36, y + 0.36], color="black", linewidth=1)
                # No label over another, nor at the bar's very start (the proxy's: where it chose P and D).
                if (labelled < 0 or at - labelled > total_ms * 0.08) and at - start > total_ms * 0.02:
                    ax.annotate(e["name"], (at, y - 0.3), textcoords="offset points", xytext=(2, 0), fontsize=6)
                    labelled = at
        text = f"{length:.0f} ms" + (f": {figures(s['name'], s['attributes'])}" if figures(s["name"], s["attributes"])
                                     else "")
        if length > total_ms * 0.45:  # a long bar: the text inside it
            ax.annotate(text, (start, y), textcoords="offset points", xytext=(4, -1), va="center", fontsize=7,
                        color="white")
        else:
            ax.annotate(text, (start + length, y), textcoords="offset points", xytext=(4, 0), va="center", fontsize=7)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{_service(s)}: {s['name']}" + "  " * d for d, s in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, total_ms * 1.02)
    ax.set_xlabel("ms since the request reached the proxy")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path, help="a trace as tests/support/otlp_receiver.save writes it (JSON)")
    ap.add_argument("out", type=Path, help="the picture (PNG or SVG, by its suffix)")
    ap.add_argument("--title", default="One request across the proxy, P and D (tracing on, tiny model, CPU build)")
    args = ap.parse_args()
    draw(json.loads(args.trace.read_text()), args.out, args.title)
    print(f"{args.out}: {args.out.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
