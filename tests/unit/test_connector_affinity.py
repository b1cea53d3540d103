"""Where the connector's threads run when vLLM's OpenMP binding pinned the worker's
main thread (vLLM's default on CPU): the plan, and the real threads it moves."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from connector import affinity
from connector.affinity import CpuPlan

linux_only = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux affinity calls")


@pytest.mark.parametrize("text, cpus", [("0-3,6", {0, 1, 2, 3, 6}), ("{0,1}", {0, 1}), ("0 1 2", {0, 1, 2}),
                                        ("granularity=fine,explicit,proclist=[4,5]", {4, 5}), ("", set())])
def test_parse_cpu_list(text, cpus):
    assert affinity.parse_cpu_list(text) == cpus


def test_plan_uses_the_cores_openmp_does_not_own():
    p = affinity.plan(env={"OMP_PLACES": "{0,1}", "OMP_PROC_BIND": "true"}, allowed={0, 1, 2, 3}, main_thread={0})
    assert p == CpuPlan(frozenset({2, 3}), shared_with_omp=False)


def test_plan_spreads_over_all_cpus_when_openmp_owns_them_all():
    """vLLM's default on a 2-core machine with a connector: OMP gets {0,1}, the main
    thread sits on 0. Our threads must not inherit core 0 alone."""
    p = affinity.plan(env={"OMP_PLACES": "{0,1}"}, allowed={0, 1}, main_thread={0})
    assert p == CpuPlan(frozenset({0, 1}), shared_with_omp=True)


@pytest.mark.parametrize("env", [{"GOMP_CPU_AFFINITY": "0 1"}, {"KMP_AFFINITY": "granularity=fine,proclist=[0,1]"}])
def test_plan_reads_gomp_and_iomp_bindings(env):
    assert affinity.plan(env=env, allowed={0, 1, 2}, main_thread={0}).cpus == {2}


def test_plan_without_omp_variables_falls_back_to_the_main_threads_binding():
    assert affinity.plan(env={}, allowed={0, 1, 2}, main_thread={1}).cpus == {0, 2}


def test_plan_leaves_an_unbound_process_alone():
    """nobind, or a GPU worker: nothing pinned, nothing to fix."""
    assert affinity.plan(env={}, allowed={0, 1}, main_thread={0, 1}) is None


def _thread_cpus(tid: int) -> set[int]:
    for line in Path(f"/proc/self/task/{tid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return affinity.parse_cpu_list(line.split(":", 1)[1])
    raise AssertionError("no Cpus_allowed_list")


@linux_only
def test_pin_current_thread_moves_only_that_thread():
    me = set(os.sched_getaffinity(0))
    target = {min(me)}
    seen: dict[str, set[int]] = {}

    def run() -> None:
        affinity.pin_current_thread(CpuPlan(frozenset(target), shared_with_omp=False))
        seen["thread"] = _thread_cpus(threading.get_native_id())

    t = threading.Thread(target=run)
    t.start()
    t.join(5)
    assert seen["thread"] == target
    assert set(os.sched_getaffinity(0)) == me  # the caller keeps its own set
    affinity.pin_current_thread(None)  # no plan: a no-op


@linux_only
def test_transport_threads_follow_the_plan():
    """libzmq's I/O threads and the server thread run on the plan's CPUs, although the
    thread that created the transport is pinned elsewhere (as vLLM's main thread is)."""
    from connector.transport.tcp import TcpTransport

    me = sorted(os.sched_getaffinity(0))
    if len(me) < 2:
        pytest.skip("needs two CPUs")
    plan = CpuPlan(frozenset({me[-1]}), shared_with_omp=False)
    before = set(os.listdir("/proc/self/task"))
    out: dict[str, object] = {}

    def create_from_a_pinned_thread() -> None:
        os.sched_setaffinity(0, {me[0]})
        t = TcpTransport(cpus=plan)
        t.start("127.0.0.1", 0, lambda h, ts: ({"ok": True}, []))
        out["transport"] = t

    th = threading.Thread(target=create_from_a_pinned_thread)
    th.start()
    th.join(5)
    t = out["transport"]
    try:
        reply, _ = t.call(f"127.0.0.1:{t.bound_port}", {"op": "ping"}, timeout_s=5)
        assert reply["ok"]
        new = set(os.listdir("/proc/self/task")) - before
        names = {tid: Path(f"/proc/self/task/{tid}/comm").read_text().strip() for tid in new}
        ours = [tid for tid, name in names.items() if name.startswith(("ZMQbg", "xpyd-tcp"))]
        assert any(names[tid].startswith("ZMQbg/IO") for tid in ours), names
        assert all(_thread_cpus(int(tid)) == {me[-1]} for tid in ours), {names[t]: _thread_cpus(int(t)) for t in ours}
    finally:
        t.close()
