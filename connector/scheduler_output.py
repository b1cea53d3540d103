"""What both connectors' scheduler halves read alike from vLLM's ``SchedulerOutput`` (vLLM's
types only under TYPE_CHECKING: nothing here imports vLLM)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput


def tokens_computed_before(scheduler_output: "SchedulerOutput") -> dict[str, int]:
    """Each scheduled request's computed tokens before this step (new and running ones)."""
    out = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    out.update(zip(cached.req_ids, cached.num_computed_tokens))
    return out
