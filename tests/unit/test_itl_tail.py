"""scripts/itl_tail.py: each inter-token gap placed on the client's clock and told what overlapped it."""

from scripts.itl_tail import gaps_of


def test_each_gap_is_told_what_overlapped_it():
    # A: sent at 0, first token at 0.1, gaps 0.01 then 0.05 (0.11-0.16), then 0.01 (0.16-0.17).
    # B: sent at 0.12 (inside A's second gap), first token at 0.165 (inside A's third gap).
    point = {"start_times": [0.0, 0.12], "ttfts": [0.1, 0.045], "itls": [[0.01, 0.05, 0.01], [0.02]]}
    a = gaps_of(point)[:3]
    assert [(round(g, 3), i, kind) for g, i, kind, _ in a] == [
        (0.01, 0, "neither"), (0.05, 1, "sent"), (0.01, 2, "first token")]
    # B's own send and first token do not count for its own gap (0.165-0.185): nothing else then.
    assert gaps_of(point)[3][2] == "neither"
    # Whether B was before its first token (0.12-0.165) during each gap: A's first gap (0.10-0.11) no,
    # the next two yes; B's own window does not count for B.
    assert [w for *_, w in gaps_of(point)] == [False, True, True, False]


def test_the_tables_of_a_raw_file(tmp_path, capsys, monkeypatch):
    """main() on a --raw file of two points: one row per (profile, rate, setup) in each table."""
    import json
    import sys

    from scripts import itl_tail

    point = {"profile": "short", "rate": 1.0, "start_times": [0.0, 0.12], "ttfts": [0.1, 0.045],
             "itls": [[0.01, 0.05, 0.01], [0.02]]}
    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps({**point, "setup": s}) + "\n" for s in ("xpyd", "vllm-router")))
    monkeypatch.setattr(sys, "argv", ["itl_tail", str(raw)])
    itl_tail.main()
    rows = [x for x in capsys.readouterr().out.splitlines() if x.startswith("| short |")]
    assert len(rows) == 4, rows
    # The split: 2 gaps inside B's window (10 and 50 ms: p50 30.00), 2 outside (10 and 20 ms: p50 15.00).
    assert rows[2].startswith("| short | 1 | vllm-router | 2, 30.00 / ") and "| 2, 15.00 / " in rows[2], rows[2]
