"""Connector building blocks without a peer: request ids, config, block layout, the
KV buffer, and the facade vLLM loads."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from connector import layout as kvlayout
from connector.p2p.buffer import KVBuffer, Payload
from connector.config import ConnectorConfig, output_limits
from xpyd_wire import request_id
from xpyd_wire.discovery import OutputLimits

KEY = "0123456789abcdef0123456789abcdef"
P_ADDR = "127.0.0.1:21001"
D_ADDR = "127.0.0.1:22001"
XID = f"___prefill_addr_{P_ADDR}___decode_addr_{D_ADDR}_{KEY}"


# ---------------------------------------------------------------- request_id


@pytest.mark.parametrize(
    "engine_id, index",
    [
        (f"cmpl-{XID}-0-1a2b3c4d", 0),  # /v1/completions
        (f"chatcmpl-{XID}-1a2b3c4d", 0),  # /v1/chat/completions
        (XID, 0),  # bare (VLLM_DISABLE_REQUEST_ID_RANDOMIZATION)
        (f"future-prefix-{XID}-7-deadbeef", 7),
    ],
)
def test_parse_completion_and_chat_ids(engine_id, index):
    tid = request_id.parse(engine_id)
    assert tid == request_id.TransferId(uuid=KEY, prompt_index=index, prefill_addr=P_ADDR, decode_addr=D_ADDR)
    assert tid.key == f"{KEY}-{index}"


def test_parse_same_key_on_both_instances():
    """vLLM appends a different random suffix on P and D: the key must not change."""
    p = request_id.parse(f"cmpl-{XID}-0-aaaaaaaa")
    d = request_id.parse(f"cmpl-{XID}-0-bbbbbbbb")
    assert p is not None and p == d


def test_parse_hostnames_and_ipv6():
    tid = request_id.parse(f"cmpl-___prefill_addr_p-host.local:9000___decode_addr_[::1]:9100_{KEY}-0-12345678")
    assert tid is not None
    assert (tid.prefill_addr, tid.decode_addr, tid.uuid) == ("p-host.local:9000", "[::1]:9100", KEY)


@pytest.mark.parametrize(
    "engine_id",
    [
        "cmpl-3f1c2a-0-1a2b3c4d",  # plain request
        "",
        f"cmpl-___prefill_addr_{P_ADDR}___decode_addr_{D_ADDR}_{KEY[:31]}-0-1a2b3c4d",  # short key
        f"cmpl-___prefill_addr_{P_ADDR}___decode_addr_{D_ADDR}_{KEY.upper()}-0-1a2b3c4d",  # not uuid hex
        f"cmpl-___prefill_addr_127.0.0.1___decode_addr_{D_ADDR}_{KEY}-0-1a2b3c4d",  # no port
        f"cmpl-___decode_addr_{D_ADDR}___prefill_addr_{P_ADDR}_{KEY}-0-1a2b3c4d",  # swapped
    ],
)
def test_parse_ids_without_the_pattern(engine_id):
    assert request_id.parse(engine_id) is None


def test_rank_address():
    assert request_id.rank_address("127.0.0.1:21001", 0) == "127.0.0.1:21001"
    assert request_id.rank_address("127.0.0.1:21001", 3) == "127.0.0.1:21004"
    assert request_id.rank_address("[::1]:21001", 1) == "[::1]:21002"
    assert request_id.rank_address("host.example:9", 2) == "host.example:11"


# ---------------------------------------------------------------- config


def _kvt(role="kv_producer", port=21001, **extra):
    return SimpleNamespace(kv_role=role, kv_port=port, kv_connector_extra_config=extra)


def test_config_defaults():
    cfg = ConnectorConfig.from_vllm(_kvt())
    assert cfg.role == "kv_producer" and cfg.is_producer and not cfg.is_consumer
    assert cfg.advertised_address == "127.0.0.1:21001"
    assert cfg.send_type == "PUT_ASYNC"
    assert cfg.kv_buffer_size == 10**9
    assert cfg.http_host == "127.0.0.1" and cfg.http_port is None
    assert cfg.proxies == ()
    assert cfg.transport == "auto"
    assert cfg.thread_affinity == "auto"
    assert cfg.allow_debug_corruption is False
    assert cfg.kv_load_timeout_s > 0 and cfg.send_timeout_s > 0 and cfg.buffer_ttl_s > 0


TINY_MODEL = Path(__file__).resolve().parents[2] / ".models" / "tiny-llama"


def test_output_limits_as_vllm_serves_them(tmp_path):
    """The limits the heartbeat advertises, from vLLM's own ModelConfig, and OutputLimits'
    arithmetic against vLLM's get_max_tokens (what its chat and completions servers call)."""
    pytest.importorskip("vllm")
    if not (TINY_MODEL / "config.json").exists():
        pytest.skip("the tiny model is made by scripts/setup.sh")
    from vllm.config import ModelConfig
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens

    gen = tmp_path / "gen"
    gen.mkdir()
    (gen / "generation_config.json").write_text('{"max_new_tokens": 5}')
    cases = [
        ({}, OutputLimits(context=4096)),  # the tiny model's generation config caps nothing
        ({"generation_config": "vllm"}, OutputLimits(context=4096)),
        ({"override_generation_config": {"max_new_tokens": 7}}, OutputLimits(7, 7, 4096)),
        ({"generation_config": str(gen)}, OutputLimits(5, 5, 4096)),  # a path: it caps every request
    ]
    for kwargs, want in cases:
        mc = ModelConfig(model=str(TINY_MODEL), max_model_len=4096, **kwargs)
        limits = output_limits(mc)
        assert limits == want, kwargs
        for requested in (None, 1, 3, 6, 100):
            for prompt in (10, 4090):
                vllm_says = get_max_tokens(4096, requested, prompt, mc.get_diff_sampling_param(), limits.override)
                ours = limits.limit(requested)
                assert vllm_says == min(4096 - prompt, ours if ours is not None else 4096), (kwargs, requested)
    assert output_limits(None) is None
    assert output_limits(SimpleNamespace()) is None  # not a ModelConfig vLLM would pass: unknown, not a crash
    # A value the proxy would refuse (and drop the whole heartbeat for) is not advertised.
    bad = SimpleNamespace(get_diff_sampling_param=lambda: {"max_tokens": 0}, generation_config="auto",
                          override_generation_config={}, max_model_len=4096)
    assert output_limits(bad) is None


def test_config_from_extra(monkeypatch):
    monkeypatch.delenv("XPYD_DISCOVERY_SECRET", raising=False)
    cfg = ConnectorConfig.from_vllm(
        _kvt(
            "kv_both",
            22001,
            kv_ip="10.0.0.5",
            http_port="8100",
            send_type="get",
            kv_buffer_size="5e8",
            kv_load_timeout_s=2,
            proxy_ip="10.0.0.1",
            proxy_port="30001",
            proxies=["10.0.0.1:30001", "10.0.0.2:30001"],
            discovery_secret="s3cret",
            allow_debug_corruption=True,
        )
    )
    assert cfg.is_producer and cfg.is_consumer
    assert cfg.advertised_address == "10.0.0.5:22001"
    assert cfg.http_host == "10.0.0.5" and cfg.http_port == 8100
    assert cfg.send_type == "GET"
    assert cfg.kv_buffer_size == 500_000_000
    assert cfg.kv_load_timeout_s == 2.0
    assert cfg.proxies == ("10.0.0.1:30001", "10.0.0.2:30001")  # deduplicated, upstream's first
    assert cfg.discovery_secret == "s3cret"
    assert cfg.allow_debug_corruption is True


def test_config_secret_from_env(monkeypatch):
    monkeypatch.setenv("XPYD_DISCOVERY_SECRET", "from-env")
    assert ConnectorConfig.from_vllm(_kvt()).discovery_secret == "from-env"


@pytest.mark.parametrize("value, expected", [(False, False), (True, True), ("false", False),
                                             ("0", False), ("no", False), ("", False),
                                             ("true", True), ("1", True), (1, True), (0, False)])
def test_config_debug_corruption_flag_parsing(value, expected):
    """A JSON string "false" must not switch the test-only corruption hook on."""
    cfg = ConnectorConfig.from_vllm(_kvt(allow_debug_corruption=value))
    assert cfg.allow_debug_corruption is expected


@pytest.mark.parametrize("role, extra, sync", [
    ("kv_consumer", {}, True),  # the default: D loads KV that is already here synchronously
    ("kv_both", {}, True),
    ("kv_consumer", {"sync_load": "false"}, False),
    ("kv_consumer", {"send_type": "GET"}, False),  # D pulls only once the load is planned
    ("kv_producer", {}, False),
])
def test_config_synchronous_loads(role, extra, sync):
    assert ConnectorConfig.from_vllm(_kvt(role, **extra)).loads_sync is sync


@pytest.mark.parametrize("value, ms", [(None, 5.0), (0, 0.0), ("20", 20.0), (1000, 1000.0)])
def test_config_idle_wait(value, ms):
    extra = {} if value is None else {"idle_wait_ms": value}
    assert ConnectorConfig.from_vllm(_kvt(**extra)).idle_wait_ms == ms


@pytest.mark.parametrize("value", [-1, 1001, "soon", True, float("nan")])
def test_config_rejects_bad_idle_wait(value):
    with pytest.raises(ValueError, match="idle_wait_ms"):
        ConnectorConfig.from_vllm(_kvt(idle_wait_ms=value))


@pytest.mark.parametrize("role, extra, tcp, nccl", [
    ("kv_producer", {}, True, False),  # the default, auto: layer-wise over tcp, whole requests over nccl
    ("kv_producer", {"send_granularity": "layer"}, True, True),
    ("kv_producer", {"send_granularity": "LAYER"}, True, True),
    ("kv_both", {"send_granularity": "layer"}, True, True),
    ("kv_consumer", {"send_granularity": "layer"}, False, False),  # D sends nothing
    ("kv_producer", {"send_granularity": "request"}, False, False),
    ("kv_producer", {"send_type": "PUT"}, False, False),  # auto: the send is inside the step
    ("kv_producer", {"send_type": "GET"}, False, False),
])
def test_config_send_granularity(role, extra, tcp, nccl):
    cfg = ConnectorConfig.from_vllm(_kvt(role, **extra))
    assert (cfg.layerwise_on("tcp"), cfg.layerwise_on("nccl")) == (tcp, nccl)


@pytest.mark.parametrize("extra, match", [
    ({"send_granularity": "token"}, "send_granularity must be one of"),
    ({"send_granularity": "layer", "send_type": "PUT"}, "needs send_type PUT_ASYNC"),
    ({"send_granularity": "layer", "send_type": "GET"}, "needs send_type PUT_ASYNC"),
])
def test_config_rejects_bad_send_granularity(extra, match):
    with pytest.raises(ValueError, match=match):
        ConnectorConfig.from_vllm(_kvt("kv_producer", **extra))


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="send_type"):
        ConnectorConfig.from_vllm(_kvt(send_type="PUSH"))
    with pytest.raises(ValueError, match="kv_role"):
        ConnectorConfig.from_vllm(_kvt(role="kv_sideways"))
    with pytest.raises(ValueError, match="thread_affinity"):
        ConnectorConfig.from_vllm(_kvt(thread_affinity="pinned"))
    assert ConnectorConfig.from_vllm(_kvt(thread_affinity="OFF")).thread_affinity == "off"


# ---------------------------------------------------------------- layout


def _caches(n_layers=2, shape=(16, 2, 16, 64), dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(shape, generator=gen).to(dtype)
            for i in range(n_layers)}


def test_runs():
    assert kvlayout.runs([]) == []
    assert kvlayout.runs([5]) == [(5, 1)]
    assert kvlayout.runs([3, 4, 5, 9, 1, 2, 12]) == [(3, 3), (9, 1), (1, 2), (12, 1)]
    assert kvlayout.runs((7, 7)) == [(7, 1), (7, 1)]


def test_detect_contiguous_cpu_layout():
    lay = kvlayout.detect(None, _caches())
    assert lay.layout == "unknown"  # no vllm config
    assert lay.dtype == "bfloat16"
    assert lay.block_shape == (2, 16, 64)
    assert lay.contiguous_blocks
    assert lay.describe() == {"layout": "unknown", "dtype": "bfloat16", "block_shape": [2, 16, 64]}


def test_detect_uses_vllm_resolved_layout_name():
    cfg = SimpleNamespace(cache_config=SimpleNamespace(
        get_resolved_kv_cache_layout=lambda: SimpleNamespace(name="LBHNC")))
    assert kvlayout.detect(cfg, _caches()).layout == "LBHNC"


def test_detect_strided_view_and_errors():
    # A logical view over a physically permuted tensor: blocks are not byte runs.
    phys = torch.zeros(2, 16, 16, 64, dtype=torch.bfloat16)  # [heads, blocks, tokens, content]
    lay = kvlayout.detect(None, {"a": phys.transpose(0, 1)})
    assert lay.block_shape == (2, 16, 64) and not lay.contiguous_blocks
    with pytest.raises(ValueError):
        kvlayout.detect(None, {})
    mixed = _caches()
    mixed["other"] = torch.zeros(16, 2, 16, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="other"):
        kvlayout.detect(None, mixed)
    mixed["other"] = torch.zeros(16, 2, 16, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="other"):
        kvlayout.detect(None, mixed)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


@pytest.mark.parametrize("strided", [False, True])
def test_gather_scatter_roundtrip(strided):
    src = next(iter(_caches().values()))
    if strided:
        src = src.transpose(0, 1).contiguous().transpose(0, 1)  # same values, strided blocks
    lay = kvlayout.detect(None, {"l": src})
    assert lay.contiguous_blocks is not strided
    ids = [3, 4, 5, 9, 1, 2, 12]
    parts = kvlayout.gather(src, ids, lay)
    if not strided:
        assert [p.shape[0] for p in parts] == [3, 1, 2, 1]
        assert all(p.data_ptr() == src[b].data_ptr() for p, b in zip(parts, (3, 9, 1, 12)))  # views
    else:
        assert len(parts) == 1 and parts[0].shape[0] == len(ids)
    blocks = torch.cat(parts)
    for i, b in enumerate(ids):
        assert _same(blocks[i], src[b])

    dst = torch.zeros(16, 2, 16, 64, dtype=torch.bfloat16)
    dst_ids = [15, 0, 7, 8, 2, 11, 6]
    kvlayout.scatter(dst, dst_ids, blocks)
    for d, s in zip(dst_ids, ids):
        assert _same(dst[d], src[s])
    untouched = sorted(set(range(16)) - set(dst_ids))
    assert not dst[untouched].any()


# ---------------------------------------------------------------- buffer


def _payload(nbytes: int, created: float | None = None) -> Payload:
    p = Payload({"op": "put"}, [torch.zeros(nbytes, dtype=torch.uint8)], nbytes)
    if created is not None:
        p.created = created
    return p


def test_buffer_put_pop_and_accounting():
    buf = KVBuffer("t", capacity_bytes=100, ttl_s=60)
    assert buf.put("a", _payload(60)) is None
    assert buf.used_bytes == 60 and len(buf) == 1 and buf.contains("a")
    assert "duplicate" in buf.put("a", _payload(10))
    assert "full" in buf.put("b", _payload(41))  # 60 + 41 > 100
    assert "full" in buf.failure("b")  # a load waiting for "b" fails at once
    assert buf.put("c", _payload(40)) is None  # exactly full is fine
    assert buf.used_bytes == 100
    assert buf.pop("a").nbytes == 60
    assert buf.pop("a") is None
    assert buf.used_bytes == 40 and len(buf) == 1
    buf.pop("c")
    assert buf.used_bytes == 0 and len(buf) == 0


def test_buffer_discard_tombstones_the_key():
    buf = KVBuffer("t", capacity_bytes=100, ttl_s=10)
    buf.put("a", _payload(30))
    buf.discard("a")
    assert buf.used_bytes == 0 and not buf.contains("a")
    assert buf.put("a", _payload(30)) == "request already gone"
    buf.discard("never-seen")  # a key whose payload has not arrived yet
    assert buf.put("never-seen", _payload(1)) == "request already gone"
    assert buf.used_bytes == 0
    # Tombstones live one TTL, then the key is usable again.
    assert buf.expire(time.monotonic() + 11) == []
    assert buf.put("a", _payload(30)) is None


def test_buffer_ttl_expiry():
    buf = KVBuffer("t", capacity_bytes=100, ttl_s=5)
    buf.put("old", _payload(10, created=0.0))
    buf.put("new", _payload(20, created=4.0))
    assert buf.expire(now=4.5) == []
    assert buf.expire(now=6.0) == ["old"]
    assert buf.used_bytes == 20 and buf.contains("new") and not buf.contains("old")
    assert buf.expire(now=9.5) == ["new"]
    assert buf.used_bytes == 0 and len(buf) == 0


def test_buffer_reservation_bounds_memory_before_the_bytes_come():
    buf = KVBuffer("t", capacity_bytes=100, ttl_s=60)
    assert buf.reserve("a", 70) is None
    assert buf.reserved_bytes == 70 and buf.used_bytes == 0
    assert "full" in buf.reserve("b", 31)  # 70 promised + 31 > 100, refused before any byte
    assert "full" in buf.failure("b")
    assert "duplicate" in buf.reserve("a", 1)
    assert buf.put("a", _payload(70)) is None  # fills its reservation
    assert (buf.reserved_bytes, buf.used_bytes) == (0, 70)
    assert buf.failure("a") is None


def test_buffer_payload_must_match_its_reservation():
    buf = KVBuffer("t", capacity_bytes=100, ttl_s=60)
    buf.reserve("a", 10)
    assert "does not match" in buf.put("a", _payload(11))
    assert buf.reserved_bytes == 0 and buf.used_bytes == 0
    assert "does not match" in buf.failure("a")


def test_buffer_fail_is_ignored_once_the_payload_is_here():
    buf = KVBuffer("t", capacity_bytes=100, ttl_s=60)
    buf.put("here", _payload(10))
    assert buf.fail("here", "sender gave up") is False
    assert buf.failure("here") is None and buf.contains("here")
    buf.reserve("coming", 20)
    assert buf.fail("coming", "sender gave up: timeout") is True
    assert buf.reserved_bytes == 0 and buf.failure("coming") == "sender gave up: timeout"
    assert "already failed" in buf.put("coming", _payload(20))  # a late payload is not kept


def test_buffer_expiry_records_why():
    buf = KVBuffer("t", capacity_bytes=100, ttl_s=5, reservation_ttl_s=1)
    now = time.monotonic()
    buf.put("old", _payload(10, created=now - 10))
    buf.reserve("stalled", 10)
    assert sorted(buf.expire(now + 2)) == ["old", "stalled"]
    assert "TTL" in buf.failure("old")
    assert "never came" in buf.failure("stalled")
    assert (buf.used_bytes, buf.reserved_bytes) == (0, 0)
    buf.expire(now + 20)  # failure records live one TTL
    assert buf.failure("old") is None


# ---------------------------------------------------------------- facade


def test_facade_imports_and_is_a_vllm_connector():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from connector import P2pNcclConnector

    assert issubclass(P2pNcclConnector, KVConnectorBase_V1)
    # Nothing abstract left: vLLM's factory can instantiate it.
    assert not getattr(P2pNcclConnector, "__abstractmethods__", frozenset())
    import connector

    with pytest.raises(AttributeError):
        connector.NoSuchThing  # noqa: B018


def test_facade_declines_sleep_mode():
    """vLLM 0.33 asks; sleep mode would free the caches our engine serves from."""
    from connector import P2pNcclConnector

    assert P2pNcclConnector.supports_sleep_mode(None) is False
