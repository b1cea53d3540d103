"""scripts/bench_load.py's arithmetic: medians per setup over rounds, the report's rows, and
guidellm's JSON report read into the same figures as vllm bench serve's (goodput at the same
SLO from its per-request records)."""

from scripts.bench_load import Profile, guidellm_metrics, medians, report, tight_goodput

P = Profile("long", 2048, 64, (0.5,), 3, slo_ttft_ms=1000, slo_tpot_ms=50)


def _point(ttft: float, goodput: float) -> dict[str, float]:
    return {"ttft_p50": ttft, "ttft_p99": 2 * ttft, "itl_p50": 5.0, "itl_p99": 9.0, "out_tok_s": 100.0,
            "goodput": goodput, "goodput_tight": goodput / 2}


def test_medians_are_per_setup_and_metric_over_rounds():
    res = {"vllm": {"long": {0.5: {"xpyd": [_point(10, 0.1), _point(30, 0.3), _point(20, 0.9)],
                                    "colocated": [_point(50, 0.2)], "vllm-router": []}}}}
    med = medians(res)["vllm"]["long"][0.5]
    assert med["xpyd"]["ttft_p50"] == 20 and med["xpyd"]["goodput"] == 0.3 and med["xpyd"]["ttft_p99"] == 40
    assert "vllm-router" not in med  # no round measured it
    class Args:
        rounds = 3
    lines = report(medians(res), [P], Args)
    assert "| 0.5 | xpyd | 20 | 40 | 5.0 | 9.0 | 100.0 | 0.30 | 0.15 |" in lines
    assert any("TTFT <= 1000 ms and TPOT <= 50 ms" in line for line in lines)
    assert not any("front cores" in line for line in lines)  # no CPU figures measured
    cpu = {"front_cores": 0.5, "p_cores": 0.9, "d_cores": 0.4, "front_wait": 2.0, "p_wait": 3.0, "d_wait": 4.0}
    res["vllm"]["long"][0.5]["xpyd"] = [_point(10, 0.1) | cpu | {"loads_ok": 3, "loads_failed": 1},
                                        _point(10, 0.1) | cpu | {"front_cores": 0.7, "loads_ok": 3}]
    lines = report(medians(res), [P], Args)
    assert "| 0.5 | xpyd | 0.600 | 0.90 | 0.40 | 2.0 / 3.0 / 4.0 | 0 / 0 | 6 / 1 |" in lines  # loads: summed


def test_ds_loads_are_read_from_its_metrics_ok_and_failed():
    """kv_loads: ok, and every other result but unneeded as failed, of the load role only."""
    import http.server
    import threading

    from scripts.bench_load import kv_loads

    text = "\n".join([
        '# HELP vllm:xpyd_kv_transfers_total x',
        'vllm:xpyd_kv_transfers_total{engine="0",model_name="m",role="load",result="ok"} 7.0',
        'vllm:xpyd_kv_transfers_total{engine="0",model_name="m",role="load",result="failed"} 2.0',
        'vllm:xpyd_kv_transfers_total{engine="0",model_name="m",role="load",result="missed"} 1.0',
        'vllm:xpyd_kv_transfers_total{engine="0",model_name="m",role="load",result="unneeded"} 5.0',
        'vllm:xpyd_kv_transfers_total{engine="0",model_name="m",role="send",result="failed"} 4.0',
        'vllm:xpyd_kv_failures_total{engine="0",model_name="m",role="load",reason="timeout"} 2.0', ""]).encode()

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        assert kv_loads(f"http://127.0.0.1:{srv.server_port}") == {"loads_ok": 7.0, "loads_failed": 3.0}
    finally:
        srv.shutdown()
        srv.server_close()


def test_guidellm_report_gives_the_same_figures():
    dist = {"median": 12.0, "percentiles": {"p99": 40.0}, "mean": 7.0}
    reqs = [{"time_to_first_token_ms": 900, "inter_token_latency_ms": 40},  # good
            {"time_to_first_token_ms": 1100, "inter_token_latency_ms": 40},  # TTFT over the SLO
            {"time_to_first_token_ms": 100, "inter_token_latency_ms": 60},  # TPOT over it
            {"time_to_first_token_ms": 500, "inter_token_latency_ms": 11}]  # good, also at the tight TPOT
    report_json = {"benchmarks": [{"duration": 2.0, "requests": {"successful": reqs}, "metrics": {
        name: {"successful": dist} for name in ("time_to_first_token_ms", "inter_token_latency_ms",
                                                 "output_tokens_per_second")}}]}
    m = guidellm_metrics(report_json, P)
    assert m == {"ttft_p50": 12.0, "ttft_p99": 40.0, "itl_p50": 12.0, "itl_p99": 40.0, "out_tok_s": 7.0,
                 "goodput": 1.0, "goodput_tight": 0.5}


def test_tight_goodput_counts_requests_within_ttft_and_the_tight_tpot():
    r = {"duration": 2.0, "ttfts": [0.5, 0.5, 1.5, 0.1], "itls": [[0.011, 0.012], [0.011, 0.020], [0.01], []]}
    # in; mean ITL 15.5 ms over 12; TTFT over 1 s; no ITL (one token): not counted
    assert tight_goodput(r, P) == 0.5


def test_a_sessions_threads_are_pinned_and_their_waits_read():
    """pin_sessions (--front-cpus) and session_waits on a real process in a session of its own."""
    import os
    import subprocess
    import sys

    from scripts.bench_load import pin_sessions, session_waits

    cpu = min(os.sched_getaffinity(0))
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        pin_sessions([proc.pid], {cpu})
        assert os.sched_getaffinity(proc.pid) == {cpu}
        waits = session_waits({"front": proc.pid, "gone": 2**22 + 1})
        assert set(waits) == {"front", "gone"} and waits["front"] >= 0 and waits["gone"] == 0
    finally:
        proc.kill()
        proc.wait()
