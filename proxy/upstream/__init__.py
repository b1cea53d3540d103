"""Talking to P and D: the interface (base), the default native client (httpclient), and the
aiohttp/httpx clients, imported only when --upstream-client names them."""
