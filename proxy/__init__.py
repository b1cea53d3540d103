"""xPyD proxy: an OpenAI-compatible prefill/decode router with ZMQ discovery."""
