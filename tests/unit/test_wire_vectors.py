"""Known-answer vectors for every signed or hashed format that crosses a process or a release.

The other wire tests sign their fixtures with the code under test, so a change of hash
(say HMAC-SHA3 for HMAC-SHA256) passes them while every deployed peer stops verifying.
Here the key, the message and the expected bytes are fixed constants: a change to any of
these formats must change this file too, on purpose, with a compatibility note.

Formats: the discovery registration's HMAC (xpyd_wire/discovery.py), the KV control
plane's key derivation and auth frames (connector/transport/auth.py), the proxy's chained
KV block keys (xpyd_wire/kv_events.py) and the shared-storage block keys, which name files
other instances and releases read (connector/shared_storage/keys.py).
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import msgpack

from connector.shared_storage import keys as ss_keys
from connector.transport import auth
from xpyd_wire import discovery
from xpyd_wire.kv_events import ROOT_KEY, EventsEndpoint, chain_block_key, chain_block_keys

SECRET = "xpyd-test-secret"

# ---------------------------------------------------------------- discovery

TS = 1767225600.5
NONCE = "00112233445566778899aabbccddeeff"
REG = discovery.Registration(
    "P", "127.0.0.1:8100", "127.0.0.1:8101", load=discovery.Load(3, 1, 0.25, 0.5), ts=TS, nonce=NONCE,
    kv_transport_fallbacks=2,
    kv_events=EventsEndpoint("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", "kv", 1024),
    output_limits=discovery.OutputLimits(default=256, context=4096))
# encode(REG, SECRET): msgpack, fields in this order, "hmac" last.
REG_MESSAGE = bytes.fromhex(
    "8aa474797065a150ac687474705f61646472657373ae3132372e302e302e313a38313030ab7a6d715f61646472657373ae"
    "3132372e302e302e313a38313031a46c6f616484a772756e6e696e6703a777616974696e6701a86b765f7573616765cb3f"
    "d0000000000000af6b765f6275666665725f7573616765cb3fe0000000000000b66b765f7472616e73706f72745f66616c"
    "6c6261636b7302a96b765f6576656e747384a8656e64706f696e74b47463703a2f2f3132372e302e302e313a35353537af"
    "7265706c61795f656e64706f696e74b47463703a2f2f3132372e302e302e313a35353538a5746f706963a26b76a6626c6f"
    "636b73cd0400ad6f75747075745f6c696d69747382a764656661756c74cd0100a7636f6e74657874cd1000a27473cb41da"
    "556e40200000a56e6f6e6365d9203030313132323333343435353636373738383939616162626363646465656666a4686d"
    "6163d94033376631356433653831663731303066346466316130346465363731376461323932653261313666336337373164"
    "666261643066363633633962633166336630")
REG_HMAC = "37f15d3e81f7100f4df1a04de6717da292e2a16f3c771dfbad0f663c9bc1f3f0"
MIN_FIELDS = {"type": "D", "http_address": "h:1", "zmq_address": "h:2", "ts": 1.0, "nonce": "ab" * 8}
MIN_HMAC = "cced89b3da166f693cbb79c2b20437cfaa3c53aa2bfede6317de872129929344"


def test_discovery_hmac_known_answer():
    assert discovery.sign(MIN_FIELDS, SECRET) == MIN_HMAC
    assert discovery.sign({**MIN_FIELDS, "hmac": "ignored"}, SECRET) == MIN_HMAC  # the MAC is not signed
    # The documented construction, from the standard library alone: HMAC-SHA256 keyed by the
    # secret over msgpack of the other fields with sorted keys.
    canonical = msgpack.packb({"http_address": "h:1", "nonce": "ab" * 8, "ts": 1.0, "type": "D", "zmq_address": "h:2"},
                              use_bin_type=True)
    assert hmac.new(SECRET.encode(), canonical, hashlib.sha256).hexdigest() == MIN_HMAC


def test_discovery_message_known_answer():
    assert discovery.encode(REG, SECRET) == REG_MESSAGE


def test_a_deployed_peers_message_verifies():
    """Bytes a peer of this release sends are accepted (and a one-bit change is not)."""
    got = discovery.decode(REG_MESSAGE, SECRET, now=TS + 1.0)
    assert got == REG
    tampered = REG_MESSAGE.replace(b"127.0.0.1:8100", b"127.0.0.1:8109")
    try:
        discovery.decode(tampered, SECRET, now=TS + 1.0)
    except discovery.ProtocolError as e:
        assert e.reason == discovery.UNAUTHORIZED
    else:
        raise AssertionError("a changed field still verified")


# ---------------------------------------------------------------- KV control plane

KV_KEY = "d20217fb829ed38594705906e470a5b3a96600bb1ea6b753286e72e9d411502c"
MAC_KEY = "00d720e669d7c62913ce919c859a7177bd176ae625a8ec23b1533a720a32f878"
CURVE_SERVER_PUBLIC = b"O<0q4]6A5Ezyr(4K&yvB-zXlDTEVf}-[9*(hlZ55"
CURVE_CLIENT_PUBLIC = b"mMqFF/):uXf>#lzK>3WRw#$GGWgo+8Bt/XX?uQg+"
NOW_NS = 1767225600_000_000_000
HEADER = bytes.fromhex("82a26f70a3707574a36b6579a16b")  # msgpack {"op": "put", "key": "k"}
LENS = [len(HEADER), 4096, 4096]
KV_NONCE = bytes(range(8)) + bytes(8)  # the transport's 8-byte prefix, then call 0
REQ_FRAME = bytes.fromhex(
    "c1784b56713118867251edfa00000001020304050607000000000000000087ba4637cd932d04654fc6932c4726f61e63f3"
    "3f200864102b4f3f66b56f19c1")
REP_FRAME = bytes.fromhex(
    "c1784b5672310001020304050607000000000000000098aa14a70200d3a9176afa20b3b48558b1fb6db81c47cf154414a1"
    "a0d131eeb3")


def test_kv_key_derivation_known_answer():
    assert auth.derive_kv_key(SECRET).hex() == KV_KEY
    assert hmac.digest(SECRET.encode(), b"xpyd-kv-v1", "sha256").hex() == KV_KEY  # documented form
    kv = auth.KVAuth.from_secret(SECRET)
    assert kv.mac_key.hex() == MAC_KEY
    assert hmac.digest(bytes.fromhex(KV_KEY), b"mac", "sha256").hex() == MAC_KEY
    assert kv.curve_server[0] == CURVE_SERVER_PUBLIC
    assert kv.curve_client[0] == CURVE_CLIENT_PUBLIC


def _mac(clock_ns: int = NOW_NS) -> auth.MacAuth:
    m = auth.MacAuth(auth.KVAuth.from_secret(SECRET), clock=lambda: clock_ns)
    m._prefix = bytes(range(8))  # the random per-transport prefix, fixed for the vector
    return m


def test_kv_request_and_reply_frames_known_answer():
    frame, nonce = _mac().sign_request(HEADER, LENS)
    assert (frame, nonce) == (REQ_FRAME, KV_NONCE)
    assert _mac().sign_reply(KV_NONCE, HEADER, LENS) == REP_FRAME
    # The documented construction: magic | ts u64 BE | nonce | HMAC-SHA256(mac key, magic,
    # ts, nonce, frame count u32 BE, each frame length u64 BE, header).
    stamp = struct.pack(">Q", NOW_NS) + KV_NONCE
    lens = struct.pack(">I3Q", 3, *LENS)
    tag = hmac.digest(bytes.fromhex(MAC_KEY), b"\xc1xKVq1" + stamp + lens + HEADER, "sha256")
    assert REQ_FRAME == b"\xc1xKVq1" + stamp + tag


def test_a_deployed_peers_kv_frames_verify():
    server = _mac(NOW_NS + 10**9)
    assert server.check_request(REQ_FRAME, HEADER, LENS) == (None, KV_NONCE)
    assert _mac().check_reply(KV_NONCE, REP_FRAME, HEADER, LENS) is None
    assert server.check_request(REQ_FRAME, HEADER, [LENS[0], 4096, 4097])[0] == "bad_mac"


# ---------------------------------------------------------------- chained KV block keys

def test_block_keys_known_answer():
    """The keys instances' events and the proxy's prompts meet on (proxy/routing/kv_index.py)."""
    assert chain_block_keys(list(range(10)), 4) == [0x864183D0961535E5, 0xF7AF58AC9696A18F]
    assert chain_block_keys(list(range(8)), 4, salt="adapter-a") == [0xF030086B4E1BA0EC, 0x4F112E49F95264F2]
    assert chain_block_key(ROOT_KEY, [1, 2, 3, 4]) == 0x6BBD5399E4C87BB3
    assert chain_block_key(0x0123456789ABCDEF, [7, 70000, 0xFFFFFFFF]) == 0x1B6E97839B71F0F3
    # The documented construction: blake2b-64(parent u64 BE, [0x01 salt], 0x00, tokens u32 BE).
    h = hashlib.blake2b(ROOT_KEY.to_bytes(8, "big") + b"\x01adapter-a\x00" + struct.pack(">4I", 0, 1, 2, 3),
                        digest_size=8)
    assert int.from_bytes(h.digest(), "big") == 0xF030086B4E1BA0EC


def test_shared_storage_keys_known_answer():
    """File names on shared storage: another instance or release must find the same blocks."""
    assert ss_keys.root("tiny-llama", 16).hex() == "c75b84feebbd9fbf5608f04e5c49f199512b06ed59ad0a8badfc02dbedc3e9da"
    seed = ss_keys.root("tiny-llama", 4, "lora-x", "salt")
    assert seed.hex() == "b4671b534f2900ea74c29548132bfdafad305e65f5641458a010d537cd045b71"
    chain = ss_keys.chain(seed, list(range(10)), 4)
    assert [ss_keys.name(k) for k in chain] == [
        "d9578080edb64bb1a634d7cd67c5c1018eaf91c6963f87a1b98ecfa0a95ab43b",
        "6c1753559791344f56f5e017c85ffdac605a3b02d28259fd9a2a481f8acc1f92"]
    assert ss_keys.chain(seed, list(range(10)), 4, start=1, prev=chain[0]) == chain[1:]
    # The documented construction: sha256(previous key, the block's ids as 8-byte LE).
    assert hashlib.sha256(seed + struct.pack("<4q", 0, 1, 2, 3)).digest() == chain[0]
