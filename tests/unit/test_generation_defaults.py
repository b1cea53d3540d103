"""What D's connector advertises of its vLLM's sampling defaults and reasoning parser (the
heartbeat's ``generation`` field): read from vLLM's own ModelConfig, checked on the wire
both ways, kept on the proxy's instance record."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import msgpack
import pytest

from connector.config import generation_defaults
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
