"""Operator tools shipped with the connector: ``xpyd doctor`` and the GPU benchmark (not loaded by vLLM)."""
