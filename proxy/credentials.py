"""Which Authorization header the proxy sends to P and D: one rule for every upstream call.

- ``--upstream-api-key KEY``: "Authorization: Bearer KEY" on every request to an instance
  (completions, prefill, /v1/models, /health); it wins over the client's header.
- ``--forward-client-auth``: the client's own Authorization header is passed on (requests
  the proxy makes by itself then carry ``--api-key``, the key clients present).
- neither: instances never see an Authorization header (the client's key stays with us).
"""

from __future__ import annotations

from proxy.config import ProxyConfig


def upstream_key_header(cfg: ProxyConfig) -> str | None:
    """The Authorization value for every upstream request, or None (then see the client's)."""
    return "Bearer " + cfg.upstream_api_key if cfg.upstream_api_key else None


def forwards_client_auth(cfg: ProxyConfig) -> bool:
    """Whether the client's own Authorization header goes upstream (the key wins over it)."""
    return cfg.forward_client_auth and upstream_key_header(cfg) is None


def probe_headers(cfg: ProxyConfig) -> dict[str, str]:
    """Headers for requests the proxy makes on its own (probes: /health, /v1/models)."""
    value = upstream_key_header(cfg)
    if value is None and cfg.forward_client_auth and cfg.api_key:
        value = "Bearer " + cfg.api_key
    return {"authorization": value} if value is not None else {}


def on_behalf_headers(cfg: ProxyConfig, client_auth: str | None) -> dict[str, str]:
    """Headers for a request made on a client's behalf (given its Authorization, if any)."""
    value = client_auth if forwards_client_auth(cfg) else upstream_key_header(cfg)
    return {"authorization": value} if value is not None else {}
