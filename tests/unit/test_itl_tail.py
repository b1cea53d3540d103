"""scripts/itl_tail.py: each inter-token gap placed on the client's clock and told what overlapped it."""

from scripts.itl_tail import gaps_of


def test_each_gap_is_told_what_overlapped_it():
    # A: sent at 0, first token at 0.1, gaps 0.01 then 0.05 (0.11-0.16), then 0.01 (0.16-0.17).
    # B: sent at 0.12 (inside A's second gap), first token at 0.165 (inside A's third gap).
    point = {"start_times": [0.0, 0.12], "ttfts": [0.1, 0.045], "itls": [[0.01, 0.05, 0.01], [0.02]]}
    a = gaps_of(point)[:3]
    assert [(round(g, 3), i, kind) for g, i, kind in a] == [
        (0.01, 0, "neither"), (0.05, 1, "sent"), (0.01, 2, "first token")]
    # B's own send and first token do not count for its own gap (0.165-0.185): nothing else then.
    assert gaps_of(point)[3][2] == "neither"
