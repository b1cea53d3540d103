"""The request-id wire format: what the proxy builds, the connector parses back,
through every engine-id shape vLLM makes of it."""

from __future__ import annotations

import pytest

from xpyd_wire import request_id

P, D = "127.0.0.1:21001", "[::1]:22001"


def test_build_then_parse_round_trips():
    u = request_id.new_uuid()
    rid = request_id.build(P, D, u)
    tid = request_id.parse(rid)
    assert tid == request_id.TransferId(uuid=u, prompt_index=0, prefill_addr=P, decode_addr=D)
    assert tid.key == f"{u}-0"
    assert request_id.build(P, D) != request_id.build(P, D)  # fresh uuid each time


@pytest.mark.parametrize(
    "shape, index",
    [
        ("cmpl-{id}-0-1a2b3c4d", 0),  # completions, randomised (vLLM's default)
        ("cmpl-{id}-1-1a2b3c4d", 1),  # second prompt of a batch
        ("cmpl-{id}-12-00000000", 12),
        ("chatcmpl-{id}-1a2b3c4d", 0),  # chat
        ("chatcmpl-{id}-12345678", 0),  # chat whose random suffix is all digits
        ("cmpl-{id}-3", 3),  # VLLM_DISABLE_REQUEST_ID_RANDOMIZATION
        ("chatcmpl-{id}", 0),
        ("1_cmpl-{id}-2-deadbeef", 2),  # child 1 of n>1, prompt 2
        ("0_chatcmpl-{id}-deadbeef", 0),
        ("{id}", 0),  # the header itself
    ],
)
def test_engine_id_shapes(shape, index):
    u = request_id.new_uuid()
    tid = request_id.parse(shape.format(id=request_id.build(P, D, u)))
    assert tid is not None
    assert (tid.uuid, tid.prompt_index, tid.prefill_addr, tid.decode_addr) == (u, index, P, D)


def test_children_of_one_prompt_share_a_key_and_prompts_do_not():
    rid = request_id.build(P, D)
    keys = {request_id.parse(f"{c}_cmpl-{rid}-0-abcdef01").key for c in range(3)}
    assert len(keys) == 1
    assert request_id.parse(f"cmpl-{rid}-1-abcdef01").key not in keys


@pytest.mark.parametrize("rid", ["cmpl-plain-0-1a2b3c4d", "", "___prefill_addr_x:1___decode_addr_y:2_nothex",
                                 "___prefill_addr_x:1___decode_addr_y:2_" + "a" * 32 + "-0-1a2b3c4d-junk"])
def test_plain_or_malformed_ids_are_not_transfers(rid):
    assert request_id.parse(rid) is None




@pytest.mark.parametrize("rid, index", [("0_cmpl-x-0-1a2b3c4d", 0), ("12_chatcmpl-y-deadbeef", 12),
                                        ("cmpl-x-0-1a2b3c4d", None), ("cmpl-1_x-0-1a2b3c4d", None)])
def test_child_index(rid, index):
    assert request_id.child_index(rid) == index


def test_new_uuid_is_a_random_version_4_uuid():
    """The uuid is the transfer key P and D agree on: a valid RFC 4122 version-4 uuid whose
    122 random bits all vary (a fixed bit halves the key space; a stuck byte more)."""
    import uuid as std_uuid

    samples = [request_id.new_uuid() for _ in range(256)]
    assert len(set(samples)) == len(samples)
    for s in samples:
        u = std_uuid.UUID(hex=s)
        assert s == u.hex and u.version == 4 and u.variant == std_uuid.RFC_4122
    ints = [int(s, 16) for s in samples]
    fixed = std_uuid.UUID(int=0, version=4).int  # the version and variant bits
    fixed_mask = (0xF << 76) | (0x3 << 62)
    for bit in range(128):
        seen = {(i >> bit) & 1 for i in ints}
        if (fixed_mask >> bit) & 1:
            assert seen == {(fixed >> bit) & 1}, bit
        else:
            assert seen == {0, 1}, f"bit {bit} never varies"


def test_build_local_is_not_a_transfer_and_is_unique():
    u = request_id.new_uuid()
    assert request_id.build_local(u) == f"xpyd-local-{u}"
    assert request_id.parse(request_id.build_local(u)) is None
    a, b = request_id.build_local(), request_id.build_local()
    assert a != b and a.startswith("xpyd-local-") and len(a) == len("xpyd-local-") + 32


@pytest.mark.parametrize(
    "addr, rank, want",
    [
        ("127.0.0.1:21001", 0, "127.0.0.1:21001"),
        ("127.0.0.1:21001", 3, "127.0.0.1:21004"),
        ("[::1]:22001", 1, "[::1]:22002"),  # IPv6: split at the last colon
        ("p-0.svc.local:9000", 2, "p-0.svc.local:9002"),
    ],
)
def test_rank_address_is_the_advertised_port_plus_rank(addr, rank, want):
    assert request_id.rank_address(addr, rank) == want


def test_new_uuid_random_bits_are_not_copies_of_their_neighbours():
    """The version and variant bits are set over random bytes, not over copies of the next byte
    (that would leave 4 or 6 fewer random bits: more colliding transfer keys)."""
    raw = [bytes.fromhex(request_id.new_uuid()) for _ in range(256)]
    # independent nibbles agree 1 time in 16 (16 of 256 expected); copies agree every time
    assert sum((b[6] & 0x0F) == (b[7] & 0x0F) for b in raw) < 64
    assert sum((b[8] & 0x3F) == (b[9] & 0x3F) for b in raw) < 64


def test_an_early_transfer_is_marked_and_still_found_by_the_rest_of_the_pattern():
    """The proxy marks a D request sent before P answered; the mark is a prefix, so the transfer
    it names is the same, and a parser that predates it still finds it."""
    early = request_id.build("10.0.0.1:21001", "10.0.0.2:22001", "ab" * 16, early=True)
    plain = request_id.build("10.0.0.1:21001", "10.0.0.2:22001", "ab" * 16)
    assert early == request_id.EARLY + plain
    for engine_id in (f"cmpl-{early}-0-1a2b3c4d", f"chatcmpl-{early}-1a2b3c4d", f"resp_x", early):
        tid = request_id.transfer_of(engine_id, {"xpyd_transfer_id": early})
        assert tid is not None and tid.early and tid.key == f"{'ab' * 16}-0"
    tid = request_id.parse(f"cmpl-{plain}-0-1a2b3c4d")
    assert tid is not None and not tid.early
