"""Loggers for the connector.

The connector runs inside vLLM's processes, where only the ``vllm`` logger tree
has handlers. Hanging ours under it makes our lines appear in the server log
with vLLM's process prefix and level settings, without configuring logging.
"""

import logging


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(f"vllm.xpyd.{name}")
