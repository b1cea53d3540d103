"""The HTTP side: the ASGI app and its routes, corked client connections, the edge limits, uvicorn."""
