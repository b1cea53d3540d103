"""vLLM 0.32's LoRA admin routes as the fake instance (tests/support/fake_vllm.py) serves them.

POST /v1/load_lora_adapter and /v1/unload_lora_adapter with vLLM's answers word for word
(vllm/entrypoints/serve/lora/api_router.py, entrypoints/openai/models/serving.py; checked
against a real server by tests/e2e/test_e2e_lora.py): the success text with no content
type, its 400 for a second load and a name taken by the base model, its 404 for an adapter
directory that does not exist and for unloading an adapter it does not hold, its 400 for a
body that is not JSON. A loaded adapter is listed in /v1/models with its parent, as vLLM.
"""

from __future__ import annotations

import json
import os
from typing import Any

LOAD = "/v1/load_lora_adapter"
UNLOAD = "/v1/unload_lora_adapter"


def _error(status: int, message: str, kind: str, param: str | None = None) -> tuple[int, bytes, str]:
    error = {"message": message, "type": kind, "param": param, "code": status}
    return status, json.dumps({"error": error}, separators=(",", ":")).encode(), "application/json"


def adapter_card(name: str, path: str, parent: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "vllm", "root": path,
            "parent": parent, "max_model_len": None}  # fmt: skip


def answer(adapters: dict[str, str], base: str, path: str, content_type: str, body: Any) -> tuple[int, bytes, str]:
    """(status, body, content type: "" for none) of vLLM's answer; `adapters` (name -> path)
    is the instance's state, changed here as vLLM changes its own."""
    if content_type.split(";")[0].strip().lower() != "application/json":
        return _error(400, "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
                      "Bad Request")
    if not isinstance(body, dict) or not isinstance(body.get("lora_name"), str):
        return _error(400, "1 validation error: body.lora_name Field required", "Bad Request", "body.lora_name")
    name = body["lora_name"]
    if path == UNLOAD:
        if name not in adapters:
            return _error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del adapters[name]
        return 200, f"Success: LoRA adapter '{name}' removed successfully.".encode(), ""
    where = body.get("lora_path")
    if not isinstance(where, str):
        return _error(400, "1 validation error: body.lora_path Field required", "Bad Request", "body.lora_path")
    if name == base:
        return _error(400, f"The lora adapter '{name}' conflicts with a served base model.", "InvalidUserInput")
    if name in adapters and body.get("load_inplace") is not True:
        return _error(400, f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                      "in place, set 'load_inplace' to True.", "InvalidUserInput")
    if not os.path.isdir(where):
        return _error(404, f"Loading lora {name} failed: No adapter found for <path>", "NotFoundError")
    adapters[name] = where
    return 200, f"Success: LoRA adapter '{name}' added successfully.".encode(), ""
