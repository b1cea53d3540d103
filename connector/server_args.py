"""What this instance's OpenAI server decides of a chat answer from its own command line, which
vLLM keeps out of the engine's config: whether a tool parser adjusts chat requests.

The connector's scheduler half runs in vLLM's engine process, a child of the API server that
inherits its ``sys.argv`` (fork, or multiprocessing's spawn, which restores it). The arguments
are read the way vLLM's FlexibleArgumentParser reads them where it matters here: ``--name value``
and ``--name=value``, ``_`` for ``-`` in names, the last occurrence winning, and ``--config FILE``
(YAML) underneath the command line. Anything else (no readable config file) is "not known", and
the proxy then keeps chat requests on D's first token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml

from connector.log import get_logger

logger = get_logger(__name__)

_PARSER = "tool-call-parser"
_AUTO = "enable-auto-tool-choice"
# vLLM's --tool-call-parser hf (a response template): its parser adjusts every chat request.
_ALWAYS = frozenset({"hf"})


def _options(argv: Sequence[str]) -> dict[str, Any] | None:
    """The --options of a command line (names with "-"), under its --config file's; None: a
    config file that cannot be read."""
    given: dict[str, Any] = {}
    config: str | None = None
    args = list(argv)
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        name, eq, value = arg[2:].partition("=")
        name = name.replace("_", "-")
        if not eq and name == _AUTO:  # a flag (store_true): takes no value
            value = True
        elif not eq:
            following = args[i + 1] if i + 1 < len(args) else None
            value = following if following is not None and not following.startswith("-") else True
        if name == "config":
            config = value if isinstance(value, str) else None
        else:
            given[name] = value
    if config is None:
        return given
    try:
        with open(config) as f:
            loaded = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        logger.warning("server arguments: --config %s not readable (%s)", config, e)
        return None
    if not isinstance(loaded, dict):
        return None
    return {**{str(k).replace("_", "-"): v for k, v in loaded.items()}, **given}


def _truthy(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"))


def tool_parser_adjusts(argv: Sequence[str], model_config: Any = None) -> str | None:
    """When vLLM's chat renderer lets a tool parser adjust a request (xpyd_wire.discovery's
    ``tool_parser``): "none" without one (vLLM uses --tool-call-parser only with
    --enable-auto-tool-choice), "always" where it adjusts every chat request (a response-template
    parser, a Mistral one with its grammar, a Harmony model), else "tool_choice" (requests whose
    tool_choice is not "none"; vLLM 0.32's online renderer). None: not known."""
    options = _options(argv)
    if options is None:
        return None
    name = options.get(_PARSER)
    if not isinstance(name, str) or not _truthy(options.get(_AUTO, False)):
        return "none"
    if name in _ALWAYS:
        return "always"
    model_type = getattr(getattr(model_config, "hf_config", None), "model_type", None)
    if model_type == "gpt_oss":  # Harmony: every render path calls the parser's adjust_request
        return "always"
    try:
        from vllm.tool_parsers import ToolParserManager
        from vllm.utils.mistral import is_mistral_tool_parser

        parser = ToolParserManager.get_tool_parser(name)
    except Exception as e:  # noqa: BLE001 - a plugin not imported here, another vLLM: not known
        logger.warning("tool parser %r not classified here (%s: %s): taken to adjust every chat request",
                       name, type(e).__name__, e)
        return "always"
    return "always" if is_mistral_tool_parser(parser) else "tool_choice"
