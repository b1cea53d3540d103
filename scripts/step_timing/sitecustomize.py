"""Times the parts of vLLM's engine step in D's EngineCore, for scripts/bench_waiting.py --step-timing.

Not part of the connector: bench_waiting puts this folder on D's PYTHONPATH (Python imports a
``sitecustomize`` module at start-up) with XPYD_STEP_TIMING_DIR set, and only then does it wrap,
as vLLM 0.32's modules are imported: ``EngineCore.step``, ``Scheduler.schedule``,
``Scheduler._get_local_prefix_cache_hit`` (run for every waiting request every step, before the
connector is asked), ``Scheduler.update_from_output``, the connector's
``get_num_new_matched_tokens`` and the executor's wait for the worker (``FutureWrapper.result``).
Only steps that compute exactly one token (the benchmark's one stream, decoding) are counted,
keyed by how many requests wait; the totals (count, seconds) go to DIR/steps-PID.json every 50
counted steps. A name vLLM no longer has is left alone (nothing is timed for it).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys
import time

_DIR = os.environ.get("XPYD_STEP_TIMING_DIR")


def _install(out_dir: str) -> None:
    totals: dict[str, list[float]] = {}
    step: dict[str, object] = {"waiting": 0, "tokens": 0, "parts": {}}
    counted = [0]

    def timed(cls: type, name: str, part: str) -> None:
        inner = getattr(cls, name, None)
        if inner is None:
            return

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                parts = step["parts"]
                parts[part] = parts.get(part, 0.0) + time.perf_counter() - t0

        setattr(cls, name, wrapper)

    def patch_scheduler(mod) -> None:
        cls = mod.Scheduler
        timed(cls, "_get_local_prefix_cache_hit", "prefix_hit")
        timed(cls, "update_from_output", "update_from_output")
        timed(cls, "schedule", "schedule")
        inner = cls.schedule

        def schedule(self, *args, **kwargs):
            out = inner(self, *args, **kwargs)
            step["waiting"] = len(self.waiting) + len(self.kv_holding_waiting)
            step["tokens"] = out.total_num_scheduled_tokens
            return out

        cls.schedule = schedule

    def patch_connector(mod) -> None:
        timed(mod.XpydConnectorBase, "get_num_new_matched_tokens", "connector")

    def patch_executor(mod) -> None:
        timed(mod.FutureWrapper, "result", "worker_wait")

    def patch_core(mod) -> None:
        inner = mod.EngineCore.step

        def engine_step(self, *args, **kwargs):
            step["parts"] = {}
            step["tokens"] = 0
            t0 = time.perf_counter()
            out = inner(self, *args, **kwargs)
            if step["tokens"] == 1:
                n = step["waiting"]
                for part, s in [("step", time.perf_counter() - t0), *step["parts"].items()]:
                    total = totals.setdefault(f"{n}:{part}", [0, 0.0])
                    total[0] += 1
                    total[1] += s
                counted[0] += 1
                if counted[0] % 50 == 0:
                    with open(os.path.join(out_dir, f"steps-{os.getpid()}.json"), "w") as f:
                        json.dump(totals, f)
            return out

        mod.EngineCore.step = engine_step

    targets = {"vllm.v1.core.sched.scheduler": patch_scheduler, "connector.base": patch_connector,
               "vllm.v1.executor.multiproc_executor": patch_executor, "vllm.v1.engine.core": patch_core}

    class Finder(importlib.abc.MetaPathFinder):
        """Runs a target's patch right after its module is executed."""

        def find_spec(self, name, path, target=None):
            if name not in targets:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None:
                return spec
            patch, exec_module = targets[name], spec.loader.exec_module

            def exec_and_patch(module):
                exec_module(module)
                patch(module)

            spec.loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, Finder())


if _DIR:
    _install(_DIR)
