"""Where the connector's threads run on a CPU-bound vLLM worker (and, for both connectors'
workers, AMX initialised before the first forward: ``init_cpu_amx``).

vLLM's CPU worker binds its OpenMP threads by default (``VLLM_CPU_OMP_THREADS_BIND``
unset means ``auto``): the worker's main thread ends up pinned to one core, and
every thread created from it afterwards inherits that single core — our sender,
server and GET threads and libzmq's I/O threads included. There they queue behind
the model's compute and the spinning OMP runtime: KV replies came seconds late and
connections were not accepted within the send deadline (measured: 3 of 8 requests
lost their KV on a 1P1D system started with vLLM's defaults).

So the connector's threads run on the CPUs the process was allowed before OpenMP
bound it (its parent's set, which vLLM leaves alone), minus the cores OpenMP owns
when that leaves any; otherwise on all of them, with a warning at start-up.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from connector.log import get_logger

logger = get_logger(__name__)


def parse_cpu_list(text: str) -> set[int]:
    """CPU ids in any of "0-3,6", "{0,1}", "0 1 2", "proclist=[0,1]" forms."""
    out: set[int] = set()
    for lo, hi in re.findall(r"(\d+)(?:-(\d+))?", text):
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _omp_cpus(env: dict[str, str]) -> set[int]:
    """The cores vLLM gave OpenMP, from the variables it sets for the worker."""
    for var in ("OMP_PLACES", "GOMP_CPU_AFFINITY"):
        if env.get(var):
            return parse_cpu_list(env[var])
    m = re.search(r"proclist=\[([^\]]*)\]", env.get("KMP_AFFINITY", ""))
    return parse_cpu_list(m.group(1)) if m else set()


def _allowed_cpus() -> set[int]:
    """The CPUs this process may use, before OpenMP pinned its main thread."""
    try:
        return set(os.sched_getaffinity(os.getppid()))
    except OSError:  # parent gone or not ours to inspect
        pass
    try:
        with open("/sys/fs/cgroup/cpuset.cpus.effective") as f:
            cpus = parse_cpu_list(f.read())
        if cpus:
            return cpus
    except OSError:
        pass
    return set(range(os.cpu_count() or 1))


@dataclass(frozen=True, slots=True)
class CpuPlan:
    cpus: frozenset[int]  # where the connector's threads run
    shared_with_omp: bool  # no core was left to us alone

    def describe(self) -> str:
        return ",".join(map(str, sorted(self.cpus)))


def plan(env: dict[str, str] | None = None, allowed: set[int] | None = None,
         main_thread: set[int] | None = None) -> CpuPlan | None:
    """The CPU set for the connector's threads, or None to leave affinity alone
    (not Linux, or nothing pinned the process)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    env = dict(os.environ) if env is None else env
    allowed = _allowed_cpus() if allowed is None else allowed
    main_thread = set(os.sched_getaffinity(0)) if main_thread is None else main_thread
    omp = _omp_cpus(env) & allowed
    if not omp and main_thread == allowed:
        return None  # nothing is bound (VLLM_CPU_OMP_THREADS_BIND=nobind, GPUs)
    owned = omp or main_thread
    free = allowed - owned
    if free:
        return CpuPlan(frozenset(free), shared_with_omp=False)
    return CpuPlan(frozenset(allowed), shared_with_omp=True)


def log_plan(p: CpuPlan | None) -> None:
    if p is None:
        return
    if p.shared_with_omp:
        logger.warning(
            "kv connector threads share CPUs %s with vLLM's OpenMP threads (no core left "
            "unbound); they run on all of them rather than on the main thread's core. "
            "For steadier transfers leave a core free: VLLM_CPU_OMP_THREADS_BIND with "
            "fewer cores, or VLLM_CPU_NUM_OF_RESERVED_CPU.", p.describe())
    else:
        logger.info("kv connector threads on CPUs %s (OpenMP keeps the rest)", p.describe())


def pin_current_thread(p: CpuPlan | None) -> None:
    """Move the calling thread (Linux: pid 0 is the thread) onto the plan's CPUs."""
    if p is None:
        return
    try:
        os.sched_setaffinity(0, p.cpus)
    except OSError as e:  # a cpuset changed under us: keep running where we are
        logger.warning("could not move kv connector thread to CPUs %s: %s", p.describe(), e)


def init_cpu_amx() -> None:
    """On CPU, initialise AMX before the first forward pass.

    With --enforce-eager and an explicit KV size vLLM skips its warm-up, and a
    decode instance's very first forward is a 1-token step after loading remote
    KV: the worker died with SIGILL there until AMX was initialised first.
    """
    import torch  # here: the thread placement above needs no torch

    init = getattr(torch.cpu, "_init_amx", None)
    if init is None:
        return
    try:
        init()
    except Exception as e:  # not every CPU has AMX; that is fine
        logger.debug("AMX init skipped: %s", e)
