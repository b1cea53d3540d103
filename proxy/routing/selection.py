"""Choosing an instance of a role for one request: live candidates, then the role's policy.

The router never touches the registry's in-flight counters itself: acquire() and release()
own them, so the load the policies see is exactly what the proxy has outstanding."""

from __future__ import annotations

import logging
import time
from collections.abc import Collection

import orjson

from proxy.config import ConfigError, ProxyConfig
from proxy.errors import ProxyError
from proxy.metrics import Metrics
from proxy.registry import Instance, Registry
from proxy.request import RouteRequest
from proxy.routing.admission import Limits, WaitQueue
from proxy.routing.kv_events import KVEvents
from proxy.routing.policies.base import Policy
from proxy.routing.policies.factory import make_policy

log = logging.getLogger("xpyd.proxy.selection")

class Selector:
    def __init__(self, cfg: ProxyConfig, registry: Registry, metrics: Metrics,
                 events: KVEvents | None = None) -> None:
        self.registry = registry
        self.metrics = metrics
        # Admission control, per role; absent (no cost at all) where the limit is 0.
        self.queues: dict[str, WaitQueue] = {}
        for role, limit in (("P", cfg.prefill_max_in_flight), ("D", cfg.decode_max_in_flight)):
            if limit > 0:
                limits = Limits(limit, cfg.queue_size, cfg.queue_timeout)
                self.queues[role] = WaitQueue(role, limits, registry, metrics, self)
        if self.queues:
            registry.listeners.append(self._joined)
        self.policies: dict[str, Policy] = {
            "P": make_policy(cfg.prefill_policy, cfg, events, metrics, "P"),
            "D": make_policy(cfg.decode_policy, cfg, events, metrics, "D"),
        }
        # Exact prompt token ids, only for the precise policies (loading one costs ~1 s),
        # tokenized on their own thread within a budget (proxy/routing/prompt_keys.py Tokenizing).
        self.prompts = None
        if "precise" in (cfg.prefill_policy, cfg.decode_policy) and cfg.tokenizer:
            from proxy.routing.prompt_keys import PromptTokenizer, TokenizeBudget, Tokenizing

            try:
                tokenizer = PromptTokenizer(cfg.tokenizer)
            except Exception as e:  # a missing directory, an unknown name, a broken file
                raise ConfigError(f"--tokenizer {cfg.tokenizer!r} could not be loaded: {e}") from None
            budget = TokenizeBudget(cfg.tokenize_max_bytes, cfg.tokenize_max_pending, cfg.tokenize_timeout)
            self.prompts = Tokenizing(tokenizer, budget, cfg.trust_request_chat_template)

    async def prepare(self, req: RouteRequest) -> None:
        """Compute what the policies need before any choice: the prompt's exact token ids
        for the precise policies (a batch: its first prompt, as routing_key keys it).
        Past the tokenizing budget the policies use their guess (xpyd_prompt_ids says why)."""
        prompts = self.prompts
        if prompts is None or req.prompt_ids is not None:
            return
        from proxy.routing.prompt_keys import TemplateRefused

        try:
            ids, result = await prompts.first_ids(req.path, req.body, len(req.raw))
        except TemplateRefused as e:  # vLLM's own answer, word for word
            error = {"message": str(e), "type": "BadRequestError", "param": None, "code": 400}
            raise ProxyError(400, str(e), 400, raw=orjson.dumps({"error": error})) from None
        self.metrics.prompt_ids.labels(result).inc()
        if ids is None:
            log.debug("prompt not tokenized (%s): the policies use their guess", result)
            return
        req.prompt_ids = ids

    def close(self) -> None:
        if self.prompts is not None:
            self.prompts.close()

    def available(self, role: str, model: str | None = None) -> bool:
        return len(self.registry.pool(role, model)) > 0

    def check_model(self, req: RouteRequest) -> bool:
        """False for a model no live instance lists (the request then goes to one D for
        vLLM's own 404, which names the models it serves); 400 for a request without
        `model` when instances serve several (P and D must agree)."""
        served = self.registry.models()
        if req.model is None:
            if len(served) > 1:
                raise ProxyError(400, "'model' is required: this proxy serves "
                                 + ", ".join(served), "missing_model", "model")  # fmt: skip
            return True
        if req.model in served:
            return True
        if any(i.models is None for i in self.registry.all()):
            return True  # an instance whose models are not known yet may serve it
        # Nothing is live: the dispatcher answers 503, not a false 404.
        return not self.registry.all()

    def candidates(
        self, role: str, exclude: Collection[Instance] = (), model: str | None = None
    ) -> list[Instance]:
        live = self.registry.pool(role, model)
        if not live:
            return live
        now = time.monotonic()
        ok = [i for i in live if i.cooldown_until <= now and i not in exclude]
        if ok:
            return ok
        # Everything is cooling down or already tried: better a doubtful instance than none.
        return [i for i in live if i not in exclude]

    async def acquire(
        self, role: str, req: RouteRequest, exclude: Collection[Instance] = ()
    ) -> Instance | None:
        """Pick an instance for `req` and count it as in flight there; None if none is left.

        With an in-flight limit, waits (FIFO, bounded) while every candidate is full;
        raises ProxyError 429 when the queue is full or the wait times out."""
        candidates = self.candidates(role, exclude, req.model)
        if not candidates:
            return None
        queue = self.queues.get(role)
        if queue is not None:
            limit = queue.limit
            open_ = [i for i in candidates if i.in_flight < limit]
            if not open_:
                # One that is cooling down but has room beats waiting.
                open_ = [i for i in self.registry.pool(role, req.model)
                         if i.in_flight < limit and i not in exclude]  # fmt: skip
                if not open_:
                    return await queue.wait(req, exclude)
            candidates = open_
        inst = self.policies[role].choose(candidates, req)
        self.take(inst, req)
        return inst

    def take(self, inst: Instance, req: RouteRequest) -> None:
        inst.in_flight += 1
        inst.in_flight_tokens += req.tokens

    def _joined(self, inst: Instance) -> None:
        queue = self.queues.get(inst.role)
        if queue is not None:
            queue.offer(inst)

    def cached_tokens(self, role: str, inst: Instance, req: RouteRequest) -> int:
        """How much of the prompt `inst` likely holds in its prefix cache, as far as the
        role's policy tracks it (0 when it does not)."""
        estimate = getattr(self.policies[role], "cached_tokens", None)
        return estimate(inst, req) if estimate is not None else 0

    def decode_holds(self, d: Instance, req: RouteRequest) -> int:
        """Leading prompt tokens D's own KV events say it holds (the precise decode policy
        only; 0 otherwise): P need not ship them."""
        held = getattr(self.policies["D"], "events_held", None)
        return held(d, req) if held is not None else 0

    def uncached_tokens(self, role: str, inst: Instance, req: RouteRequest) -> int | None:
        """Prompt tokens `inst` would still compute, when its policy knows it holds part of
        the prompt (the precise policies: the real figure); None when nothing is known held."""
        exact = getattr(self.policies[role], "uncached_tokens", None)
        if exact is not None:
            return exact(inst, req)
        cached = self.cached_tokens(role, inst, req)
        return req.tokens - cached if cached else None

    def release(self, inst: Instance, req: RouteRequest) -> None:
        inst.in_flight -= 1
        inst.in_flight_tokens -= req.tokens
        if self.queues:
            queue = self.queues.get(inst.role)
            if queue is not None and queue.waiters:
                queue.offer(inst)
