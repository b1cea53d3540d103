"""What D's connector advertises of its vLLM's sampling defaults, reasoning parser and tool
parser (the heartbeat's ``generation`` and ``tool_parser`` fields): read from vLLM's own
ModelConfig and the server's command line, checked on the wire both ways, kept on the proxy's
instance record."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import msgpack
import pytest

from connector.config import generation_defaults
from connector.server_args import tool_parser_adjusts
from xpyd_wire.discovery import GenerationDefaults, ProtocolError, Registration, check_generation, decode, encode

TINY_MODEL = Path(__file__).resolve().parents[2] / ".models" / "tiny-llama"


def test_sampling_defaults_as_vllm_applies_them(tmp_path):
    """vLLM's ModelConfig.get_diff_sampling_param: the generation config's values (a path, or
    the model's own with 'auto'), then --override-generation-config; max_new_tokens is the
    output limits' business, not this field's."""
    pytest.importorskip("vllm")
    if not (TINY_MODEL / "config.json").exists():
        pytest.skip("the tiny model is made by scripts/setup.sh")
    from vllm.config import ModelConfig

    gen = tmp_path / "gen"
    gen.mkdir()
    (gen / "generation_config.json").write_text('{"presence_penalty": 1.5, "temperature": 0.6, "max_new_tokens": 9}')
    cases = [
        ({}, GenerationDefaults()),  # the tiny model's generation config sets no sampling value
        ({"generation_config": "vllm"}, GenerationDefaults()),
        ({"generation_config": str(gen)}, GenerationDefaults((("presence_penalty", 1.5), ("temperature", 0.6)))),
        ({"override_generation_config": {"frequency_penalty": 0.2, "top_k": 5}},
         GenerationDefaults((("frequency_penalty", 0.2), ("top_k", 5.0)))),
    ]
    for kwargs, want in cases:
        mc = ModelConfig(model=str(TINY_MODEL), max_model_len=4096, **kwargs)
        assert generation_defaults(mc, None) == want, kwargs
    mc = ModelConfig(model=str(TINY_MODEL), max_model_len=4096)
    assert generation_defaults(mc, "deepseek_r1") == GenerationDefaults(reasoning_parser=True)
    assert generation_defaults(None, None) is None
    assert generation_defaults(SimpleNamespace(), None) is None  # not a ModelConfig: not advertised, no crash


def test_generation_round_trips_and_absent_is_unknown():
    base = Registration("D", "127.0.0.1:1", "127.0.0.1:2")
    assert "generation" not in msgpack.unpackb(encode(base)) and decode(encode(base)).generation is None
    for gen in (GenerationDefaults(), GenerationDefaults((("presence_penalty", 1.5),), True)):
        assert decode(encode(Registration("D", "127.0.0.1:1", "127.0.0.1:2", generation=gen))).generation == gen


@pytest.mark.parametrize("value", [
    [1], {"other": 1}, {"sampling": [1]}, {"sampling": {"Presence": 1.0}}, {"sampling": {"x" * 33: 1.0}},
    {"sampling": {"top_k": "5"}}, {"sampling": {"top_k": True}}, {"sampling": {"top_k": float("nan")}},
    {"sampling": {"top_k": float("inf")}}, {"sampling": {f"k{'a' * i}": 1.0 for i in range(17)}},
    {"reasoning_parser": "yes"},
])
def test_a_generation_field_the_wire_does_not_allow_is_refused(value):
    with pytest.raises(ProtocolError):
        check_generation(value)


def test_tool_parser_rides_beside_generation_and_absent_is_unknown():
    """A field of its own (an older proxy refuses unknown keys inside ``generation``, and drops
    unknown top-level fields); absent, the proxy does not know which chat requests a parser adjusts."""
    for value in ("none", "tool_choice", "always"):
        reg = Registration("D", "127.0.0.1:1", "127.0.0.1:2", generation=GenerationDefaults(tool_parser=value))
        wire = msgpack.unpackb(encode(reg))
        assert wire["tool_parser"] == value and set(wire["generation"]) == {"sampling", "reasoning_parser"}
        assert decode(encode(reg)).generation == GenerationDefaults(tool_parser=value)
    older = Registration("D", "127.0.0.1:1", "127.0.0.1:2", generation=GenerationDefaults(tool_parser=None))
    assert "tool_parser" not in msgpack.unpackb(encode(older))
    assert decode(encode(older)).generation == GenerationDefaults(tool_parser=None)
    assert check_generation({}) == GenerationDefaults((), False, None)
    fields = msgpack.unpackb(encode(Registration("D", "127.0.0.1:1", "127.0.0.1:2", generation=GenerationDefaults())))
    for bad in ("sometimes", 1, True, ""):
        with pytest.raises(ProtocolError, match="^tool_parser must be one of none, tool_choice, always"):
            decode(msgpack.packb({**fields, "tool_parser": bad}))


@pytest.mark.parametrize("argv, want", [
    ([], "none"),
    (["--model", "m", "--tool-call-parser", "hermes"], "none"),  # without --enable-auto-tool-choice: no parser
    (["--model", "m", "--tool-call-parser", "hermes", "--enable-auto-tool-choice"], "tool_choice"),
    (["serve", "--enable-auto-tool-choice", "m", "--tool_call_parser=hermes"], "tool_choice"),
    (["--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--tool-call-parser", "hf"], "always"),  # the last
    (["--tool-call-parser", "muse_glimmer", "--enable-auto-tool-choice"], "tool_choice"),
    (["--tool-call-parser", "mistral", "--enable-auto-tool-choice"], "always"),  # its grammar: every request
    (["--tool-call-parser", "a_plugin_not_loaded_here", "--enable-auto-tool-choice"], "always"),
])
def test_which_chat_requests_a_tool_parser_adjusts(argv, want):
    """vLLM 0.32's online renderer calls the parser's adjust_request when tool_choice is not "none"
    (null included), or always for a response-template parser, a Mistral parser with its grammar or
    a Harmony model; vLLM uses --tool-call-parser only with --enable-auto-tool-choice."""
    pytest.importorskip("vllm")
    assert tool_parser_adjusts(argv) == want


def test_tool_parser_from_a_config_file_and_a_harmony_model(tmp_path):
    pytest.importorskip("vllm")
    config = tmp_path / "serve.yaml"
    config.write_text("tool_call_parser: hermes\nenable-auto-tool-choice: true\n")
    assert tool_parser_adjusts(["--config", str(config)]) == "tool_choice"
    assert tool_parser_adjusts([f"--config={config}", "--tool-call-parser", "hf"]) == "always"  # the command line wins
    assert tool_parser_adjusts(["--config", str(tmp_path / "missing.yaml")]) is None  # not known
    harmony = SimpleNamespace(hf_config=SimpleNamespace(model_type="gpt_oss"))
    assert tool_parser_adjusts(["--tool-call-parser", "hermes", "--enable-auto-tool-choice"], harmony) == "always"


def test_generation_defaults_carry_the_tool_parser():
    pytest.importorskip("vllm")
    if not (TINY_MODEL / "config.json").exists():
        pytest.skip("the tiny model is made by scripts/setup.sh")
    from vllm.config import ModelConfig

    mc = ModelConfig(model=str(TINY_MODEL), max_model_len=4096)
    argv = ["--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
    assert generation_defaults(mc, None, argv) == GenerationDefaults(tool_parser="tool_choice")
    assert generation_defaults(mc, None, []) == GenerationDefaults(tool_parser="none")
