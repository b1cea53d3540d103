"""The help text of every proxy flag (proxy/config.py's ProxyConfig fields): what `--help` prints and what
scripts/gen_flags.py writes into docs/reference/flags.md. Kept apart from config.py so that the dataclass and
its checks stay one readable module; re-exported as proxy.config.HELP."""

from __future__ import annotations

from types import MappingProxyType

HELP = MappingProxyType(
    {
        "host": "address to serve the OpenAI API on (a non-loopback one without --api-key is warned about)",
        "port": "HTTP port (0 picks a free one)",
        "discovery_host": "address the ZMQ discovery ROUTER binds to",
        "discovery_port": "ZMQ discovery port instances register on",
        "discovery_secret": "shared secret; registrations without a valid HMAC are dropped",
        "discovery_secret_file": "file holding the discovery secret (keeps it out of the command line)",
        "allow_unauthenticated_discovery": "allow a non-loopback --discovery-host without "
        "--discovery-secret",
        "heartbeat_timeout": "seconds without a heartbeat before an instance is removed",
        "discovery_max_per_role": "discovered instances (live or pending) held per role; "
        "registrations beyond are refused",
        "discovery_max_per_source": "discovered instances held per source host (the "
        "registering connection's peer address); registrations beyond are refused",
        "discovery_cpu_share": "share of each second (of one core) discovery may spend on messages; past it, it waits "
        "for the next second (messages queue in ZMQ, their senders are held back)",
        "discovery_max_source_rate": "discovery messages per second from one source host; beyond: dropped undecoded, "
        "counted as rate_limited",
        "discovery_max_connections": "discovery connections held (also at most a quarter of the fd limit); "
        "new ones beyond are shut down as they come",
        "discovery_max_connections_per_source": "discovery connections held per source host; new ones beyond are shut down",
        "prefill_policy": "P selection policy",
        "decode_policy": "D selection policy",
        "cache_aware_chunk_tokens": "cache_aware: prefix index granularity, tokens (4 chars each)",
        "cache_aware_capacity_tokens": "cache_aware: tokens remembered per instance (LRU), "
        "about what its KV cache holds",
        "cache_aware_min_match": "cache_aware: fraction of the prompt an instance must hold "
        "to be preferred; below it, the least loaded instance",
        "cache_aware_balance_abs": "cache_aware: ignore the cache when its holder's load "
        "exceeds the least loaded's by more than this (requests) ...",
        "cache_aware_balance_rel": "cache_aware: ... and by more than this factor",
        "kv_index_max_blocks": "KV-event index: blocks held per instance when its registration "
        "does not give its KV capacity",
        "kv_events_silence": "seconds without KV events or a replay answer before an "
        "instance's block index counts as unknown",
        "send_only_missing": "with --decode-policy precise, P ships only the KV blocks D's events "
        "say it lacks (the connector's xpyd_skip_tokens)",
        "tokenizer": "the served model's tokenizer (directory or Hugging Face name), needed by "
        "the precise policies to tokenize prompts exactly as vLLM does",
        "tokenize_max_bytes": "precise: longest prompt (bytes) tokenized; longer ones are routed by the guess",
        "tokenize_max_pending": "precise: prompts queued or in work on the tokenizer thread; beyond, the guess",
        "tokenize_timeout": "precise: seconds a request waits for its token ids; then the guess",
        "trust_request_chat_template": "let requests carry their own chat template (else 400, as vLLM); "
        "the proxy never renders it",
        "api_key": "require 'Authorization: Bearer KEY' from clients",
        "api_key_file": "file holding the API key (keeps it out of the command line)",
        "metrics_require_api_key": "/metrics requires the API key too",
        "expose_routing_headers": "show instance addresses (response headers, /instances) "
        "and vLLM's internal request ids to clients",
        "enable_request_id_headers": "add X-Request-Id to every response, as vLLM's --enable-request-id-headers does "
                                     "(the client's own, else a random one); off: none, as vLLM by default",
        "upstream_api_key": "API key sent to P/D instances (vLLM --api-key)",
        "upstream_api_key_file": "file holding the upstream API key (keeps it out of the command line)",
        "forward_client_auth": "forward the client's Authorization header to instances",
        "admin_api_key": "require 'Authorization: Bearer KEY' on /v1/load_lora_adapter and /v1/unload_lora_adapter "
        "(unset: those routes are refused); never the client --api-key",
        "admin_api_key_file": "file holding the admin API key (keeps it out of the command line)",
        "max_adapters": "LoRA adapters loaded through the proxy that it keeps (and loads on instances that join later)",
        "adapter_timeout": "seconds one instance may take to load or unload a LoRA adapter",
        "forward_debug_params": "test hook: pass a client's kv_transfer_params xpyd_debug_* fields to the "
        "instances (engines honour them only with allow_debug_corruption); off: stripped",
        "max_body_bytes": "largest accepted request body (413 above)",
        "max_held_body_bytes": "bytes all request bodies may hold at once, from their first byte to the end of their "
        "request (queued ones too), counted at about their parsed size; past it: 503 + Retry-After",
        "max_body_values": "JSON values one request body may hold (counted before it is parsed); past it: 413",
        "max_body_containers": "JSON arrays and objects one request body may hold (counted before it is parsed); "
        "past it: 413",
        "max_header_bytes": "largest request line + headers (431 above)",
        "header_timeout": "seconds to receive a request's headers (408 after), from the connection "
        "or the request's first byte",
        "body_timeout": "seconds to receive a request body once its headers are in (408 after)",
        "max_connections": "client connections held at once; new ones get 503 (at most half the fd limit)",
        "max_response_bytes": "largest non-streamed upstream answer buffered (502 above)",
        "connect_timeout": "seconds to connect to an instance",
        "prefill_timeout": "seconds for P to answer the prefill request",
        "decode_ttfb_timeout": "seconds to D's first body byte (non-streaming: whole answer)",
        "stream_idle_timeout": "max seconds between two chunks of D's stream",
        "prefill_retries": "extra attempts on another P after a connect error or timeout",
        "decode_retries": "extra attempts on another D (new P/D pair) when D fails before answering",
        "dispatch": "concurrent: D is asked with P and computes the first token itself; sequential: D is asked "
                    "after P answered",
        "decode_max_early": "concurrent dispatch: requests a D may hold that wait for P's prefill; beyond, D is "
                            "asked after P answered (0: no limit)",
        "first_token": "prefill: P's token goes to the client as soon as P answers and D continues from it "
                       "(streaming completions whose parameters allow it; sequential dispatch, or a one-token "
                       "answer); decode: D computes the first token",
        "local_prefill_threshold": "prompts under this many estimated tokens (4 ASCII characters each, about 1 a CJK character) skip P while D relays no other answer of this proxy (0: never)",
        "fallback_to_decode": "true: with no P live or reachable, D prefills alone (else 503)",
        "failure_cooldown": "seconds to avoid an instance that refused a connection",
        "prefill_max_in_flight": "requests in flight per P before new ones queue (0: no limit)",
        "decode_max_in_flight": "requests in flight per D before new ones queue (0: no limit)",
        "queue_size": "requests that may wait for a free instance; beyond: 429",
        "passthrough_role": "role (P or D) that answers the routes which generate nothing (tokenize, render, "
                            "embeddings, score, rerank, ...); the other role when it has no instance",
        "passthrough_routes": "paths (repeatable) of generation-free routes a later vLLM adds, forwarded to one "
                              "instance as the table's are (any other path gets vLLM's 404)",
        "response_holders": "stored responses whose D the proxy remembers (oldest forgotten first); "
                            "a forgotten one is looked up on every D",
        "response_holders_ttl": "seconds a stored response's D is remembered",
        "queue_timeout": "seconds a request may wait for a free instance; then 429",
        "prefill": "static P instance URL[,kv=HOST:PORT][,events=tcp://HOST:PORT][,replay=tcp://HOST:PORT] "
        "(repeatable; kv default: URL host:14579; events: its vLLM KV-event publisher)",
        "decode": "static D instance URL[,kv=HOST:PORT][,events=...][,replay=...] (repeatable)",
        "health_interval": "seconds between /health checks of static instances",
        "probe_timeout": "deadline of one /health or /v1/models probe, seconds",
        "models_refresh_interval": "seconds between re-reading each instance's /v1/models",
        "probe_concurrency": "probes of newly registered (pending) instances in flight at once",
        "shutdown_grace_s": "on SIGTERM, seconds to let in-flight requests finish",
        "log_level": "logging level",
        "tracing": "one OpenTelemetry span per request, its context passed to P and D (W3C traceparent) so vLLM's "
                   "spans join it; exported over OTLP as the OTEL_EXPORTER_OTLP_* variables say (pip install "
                   "'xpyd[tracing]')",
        "upstream_client": "HTTP client for P/D requests: native (fastest), aiohttp, httpx",
        "loop": "event loop implementation",
        "http": "HTTP/1.1 server parser",
    }
)
