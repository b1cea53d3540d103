"""Every route vLLM 0.32 serves, and what the proxy does with it: one table, one place.

A reader can check it against vLLM's own routes (grep ``@router.`` and ``add_api_route`` under
``vllm/entrypoints/``; tests/unit/test_api_routes.py does, where vLLM is installed). A path that
is not here gets vLLM's own 404 (``{"detail": "Not Found"}``), as from one vLLM server.

How a route is served:
- ``P_THEN_D``: the prompt is computed on a P, its KV shipped to a D, which answers
  (proxy/dispatch/);
- ``ONE_INSTANCE``: nothing is generated (tokenize, render, pooling, scoring, ...): one instance
  serving the model answers it as it came, on the role --passthrough-role names;
- ``ONE_DECODE``: it generates, but is not split into a prefill and a decode (a batch of chats,
  transcription, the structured-decision and scoring APIs): one D answers it alone;
- ``STORED_RESPONSE``: a response stored by vLLM (Responses API with its store on): the D
  that holds it (proxy/routing/stored.py);
- ``ADMIN``: changes every instance (LoRA adapters): fanned out, under the admin credential;
- ``PROXY``: the proxy answers itself (health, readiness, its metrics, the union of models);
- ``REFUSED``: vLLM's admin, development and internal routes (sleep, weights, profiling, cache
  resets, RPC, scale-out aborts, ...): never forwarded; the client gets vLLM's 404, as from a
  server that does not enable them.
"""

from __future__ import annotations

from dataclasses import dataclass

P_THEN_D = "P then D"
ONE_INSTANCE = "one instance"
ONE_DECODE = "one D"
STORED_RESPONSE = "the D holding the response"
ADMIN = "every instance (admin)"
PROXY = "the proxy"
REFUSED = "refused (404)"

# The disaggregated routes, by path (the dispatch layers compare against these).
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
GENERATE = "/inference/v1/generate"


@dataclass(frozen=True, slots=True)
class ApiRoute:
    path: str  # as vLLM declares it; "{name}" is one path segment
    methods: tuple[str, ...]
    handling: str
    why: str


def _r(path: str, methods: str, handling: str, why: str) -> ApiRoute:
    return ApiRoute(path, tuple(methods.split()), handling, why)


ROUTES: tuple[ApiRoute, ...] = (
    # ---- generation, disaggregated
    _r(COMPLETIONS, "POST", P_THEN_D, "OpenAI completions"),
    _r(CHAT, "POST", P_THEN_D, "OpenAI chat completions"),
    _r(RESPONSES, "POST", P_THEN_D, "OpenAI Responses (a follow-up on a stored response: its D, alone)"),
    _r(MESSAGES, "POST", P_THEN_D, "Anthropic Messages"),
    _r(GENERATE, "POST", P_THEN_D, "tokens in, tokens out (vLLM's --enable-scale-out)"),
    # ---- stored responses
    _r("/v1/responses/{response_id}", "GET", STORED_RESPONSE, "a stored response (or its events, ?stream=true)"),
    _r("/v1/responses/{response_id}/cancel", "POST", STORED_RESPONSE, "cancel a background response"),
    # ---- generation on one D
    _r("/v1/chat/completions/batch", "POST", ONE_DECODE, "several chats in one request, answered together"),
    _r("/v1/audio/transcriptions", "POST", ONE_DECODE, "speech to text (multipart)"),
    _r("/v1/audio/translations", "POST", ONE_DECODE, "speech to English text (multipart)"),
    _r("/v1/systemone", "POST", ONE_DECODE, "structured decisions"),
    _r("/generative_scoring", "POST", ONE_DECODE, "scores from generation"),
    _r("/cohere/v2/chat", "POST", ONE_DECODE, "Cohere chat"),
    _r("/invocations", "POST", ONE_DECODE, "SageMaker: any request type, by its body"),
    # ---- no generation: one instance
    _r("/tokenize", "POST", ONE_INSTANCE, "text or messages to token ids"),
    _r("/detokenize", "POST", ONE_INSTANCE, "token ids to text"),
    _r("/tokenizer_info", "GET", ONE_INSTANCE, "the tokenizer's configuration (--enable-tokenizer-info-endpoint)"),
    _r("/v1/messages/count_tokens", "POST", ONE_INSTANCE, "Anthropic token count"),
    _r("/v1/completions/render", "POST", ONE_INSTANCE, "the prompt a completion would compute"),
    _r("/v1/chat/completions/render", "POST", ONE_INSTANCE, "the prompt a chat would compute"),
    _r("/v1/responses/render", "POST", ONE_INSTANCE, "the prompt a response would compute"),
    _r("/v1/messages/render", "POST", ONE_INSTANCE, "the prompt a message would compute"),
    _r("/v1/completions/derender", "POST", ONE_INSTANCE, "generate's token chunks as completion chunks"),
    _r("/v1/chat/completions/derender", "POST", ONE_INSTANCE, "generate's token chunks as chat chunks"),
    _r("/v1/embeddings", "POST", ONE_INSTANCE, "OpenAI embeddings"),
    _r("/v2/embed", "POST", ONE_INSTANCE, "Cohere embed"),
    _r("/pooling", "POST", ONE_INSTANCE, "pooled hidden states"),
    _r("/classify", "POST", ONE_INSTANCE, "classification"),
    _r("/score", "POST", ONE_INSTANCE, "pair scores"),
    _r("/v1/score", "POST", ONE_INSTANCE, "pair scores"),
    _r("/rerank", "POST", ONE_INSTANCE, "Jina/Cohere rerank"),
    _r("/v1/rerank", "POST", ONE_INSTANCE, "Jina/Cohere rerank"),
    _r("/v2/rerank", "POST", ONE_INSTANCE, "Cohere rerank v2"),
    _r("/version", "GET", ONE_INSTANCE, "vLLM's version"),
    # ---- every instance, under the admin credential
    _r("/v1/load_lora_adapter", "POST", ADMIN, "load a LoRA adapter on every P and D"),
    _r("/v1/unload_lora_adapter", "POST", ADMIN, "unload it everywhere"),
    # ---- the proxy's own
    _r("/health", "GET", PROXY, "the proxy is up"),
    _r("/ping", "GET POST", PROXY, "SageMaker's health check: the proxy is up"),
    _r("/v1/models", "GET", PROXY, "every model and adapter a live instance serves"),
    _r("/metrics", "GET", PROXY, "the proxy's Prometheus metrics (each instance has its own)"),
    # ---- never forwarded
    *(_r(p, "GET POST", REFUSED, "admin, development or internal") for p in (
        "/sleep", "/wake_up", "/is_sleeping", "/release_kv_cache_memory", "/collective_rpc",
        "/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache", "/server_info",
        "/start_profile", "/stop_profile", "/pause", "/resume", "/is_paused", "/get_world_size",
        "/update_weights", "/init_weight_transfer_engine", "/start_weight_update", "/finish_weight_update",
        "/start_draft_weight_update", "/shutdown_weight_transfer_engine", "/update_weight_version",
        "/weight_checker", "/weight_info", "/abort_requests", "/inference/v1/abort_requests",
        "/scale_elastic_ep", "/is_scaling_elastic_ep", "/fault_tolerance/status", "/fault_tolerance/apply",
        "/load", "/kv_event_sources", "/adapters", "/adapters/{adapter_name}",
        "/v1/realtime", "/docs", "/openapi.json",
    )),
)  # fmt: skip

DISAGGREGATED_PATHS = frozenset(r.path for r in ROUTES if r.handling == P_THEN_D)


def by_handling(handling: str) -> list[ApiRoute]:
    return [r for r in ROUTES if r.handling == handling]
