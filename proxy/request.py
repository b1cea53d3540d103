"""One client request as the routing layers see it: parsed once, read by every layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson

from proxy.openai_api import decode_responses_body, routing_key
from xpyd_wire import request_id


@dataclass(slots=True)
class RouteRequest:
    path: str  # one of api_routes.DISAGGREGATED_PATHS
    raw: bytes  # the client's body, relayed to D byte for byte
    body: dict  # the same, parsed
    tokens: int  # estimated prompt tokens
    headers: dict[str, str]  # what is forwarded upstream (x-request-id set per attempt)
    model: str | None = None
    # Not a request the proxy can read (openai_api.validate_body, or a model no instance
    # lists): one D answers it alone, so the client gets vLLM's own verdict.
    verdict: bool = False
    _key: str | list[int] | None = field(default=None, repr=False)
    # The prompt's token ids as vLLM computes them (proxy/routing/prompt_keys.py), set before
    # selection when a `precise` policy needs them; None: not computed or not reproducible.
    prompt_ids: list[int] | None = field(default=None, repr=False)
    # Their chained block keys per (block size, LoRA), computed once for P's and D's choice.
    block_keys: dict[tuple[int, str | None], list[int]] = field(default_factory=dict, repr=False)
    # The Responses API: the id of the response (vLLM names the engine request after it, and
    # stores the response under it), and the stored response this one follows, if any.
    response_id: str | None = None
    previous_response_id: str | None = None
    # The client's own request id, which vLLM names its answer after (openai_api.client_request_id);
    # None: the answer gets a neutral id (proxy/dispatch/rewrite.py).
    client_id: str | None = None

    def raw_for(self, rid: str) -> bytes:
        """The body D is sent with request id `rid`: the client's, byte for byte; for the
        Responses API with the response id set and the transfer carried (see openai_api)."""
        if self.response_id is None:
            return self.raw
        transfer = rid if request_id.parse(rid) is not None else None
        return orjson.dumps(decode_responses_body(self.body, self.response_id, transfer))

    @property
    def key(self) -> str | list[int]:
        """Routing key for prefix-aware policies, computed on first use only."""
        if self._key is None:
            self._key = routing_key(self.body)
        return self._key
