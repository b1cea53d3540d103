"""Unit tests: registry expiry, policies, request validation, prefill body, error JSON."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import re
import socket
import time

import pytest

from proxy.errors import ProxyError, upstream_error_body
from proxy.openai_api import CHAT, COMPLETIONS, estimate_prompt_tokens, prefill_body, validate_body
from proxy.registry import RegistrationRefused, Registry
from proxy.request import RouteRequest
from proxy.routing.policies.factory import make_policy
from proxy.routing.policies.least_loaded import LeastLoaded
from proxy.routing.policies.round_robin import RoundRobin
from xpyd_wire import request_id
from xpyd_wire.discovery import GenerationDefaults, Load, OutputLimits, Registration, new_instance_key
from xpyd_wire.kv_events import EventsEndpoint


def reg(role: str, port: int, zmq: int | None = None, load: Load | None = None) -> Registration:
    return Registration(role, f"127.0.0.1:{port}", f"127.0.0.1:{zmq or port + 1000}", load)


REQ = RouteRequest(COMPLETIONS, b"{}", {}, 10, {})


def join(r: Registry, registration: Registration, now: float):
    """Register and admit, as the prober does once the instance has answered."""
    inst = r.upsert(registration, now=now)
    r.admit(inst)
    return inst

# ---------------------------------------------------------------- registry


def test_registry_upsert_and_zmq_update():
    r = Registry(heartbeat_timeout=10)
    a = r.upsert(reg("P", 1), now=0)
    # Pending until it answered: listed, never a candidate.
    assert a.pending and r.live("P") == [] and r.every() == [a] and r.count_pending("P") == 1
    r.admit(a)
    assert r.live("P") == [a] and r.live("D") == [] and r.count_pending("P") == 0
    b = r.upsert(reg("P", 1, zmq=5555), now=1)
    assert b is a and a.zmq_address == "127.0.0.1:5555" and a.last_heartbeat == 1
    assert r.count("P") == 1


def test_registry_same_address_different_roles_are_distinct():
    r = Registry(heartbeat_timeout=10)
    join(r, reg("P", 1), now=0)
    join(r, reg("D", 1), now=0)
    assert r.count("P") == 1 and r.count("D") == 1


def test_registry_expires_any_position():
    r = Registry(heartbeat_timeout=10)
    for port in (1, 2, 3):
        join(r, reg("D", port), now=0)
    r.upsert(reg("D", 1), now=8)
    r.upsert(reg("D", 3), now=8)
    gone = r.expire(now=12)  # the middle one is stale, the others are not
    assert [i.http_address for i in gone] == ["127.0.0.1:2"]
    assert [i.http_address for i in r.live("D")] == ["127.0.0.1:1", "127.0.0.1:3"]
    r.expire(now=19)
    assert r.count("D") == 0


def test_registry_heartbeat_keeps_load():
    r = Registry(heartbeat_timeout=10)
    r.upsert(reg("D", 1, load=Load(2, 3, 0.5, 0.75)), now=0)
    inst = r.upsert(reg("D", 1), now=1)  # a heartbeat without load keeps the last one
    assert inst.load == Load(2, 3, 0.5, 0.75)
    assert inst.to_json(now_wall=inst.last_heartbeat_wall)["load"] == {
        "running": 2,
        "waiting": 3,
        "waiting_for_kv": 0,
        "kv_usage": 0.5,
        "kv_buffer_usage": 0.75,
    }


def test_registry_static_instance_lives_by_its_health_check_never_by_heartbeats(caplog):
    caplog.set_level(logging.INFO, logger="xpyd.proxy.registry")
    r = Registry(heartbeat_timeout=10)
    joined: list = []
    r.listeners.append(lambda i: 1 / 0)  # a listener's bug never breaks the registry
    r.listeners.append(joined.append)
    ep = EventsEndpoint("tcp://127.0.0.1:23001")
    s = r.add_static("D", "127.0.0.1:9", "127.0.0.1:19", kv_events=ep)
    assert (s.role, s.http_address, s.zmq_address, s.url) == ("D", "127.0.0.1:9", "127.0.0.1:19", "http://127.0.0.1:9")
    assert s.static and s.healthy is False and not s.pending and not s.bound and s.kv_events == ep
    assert s.to_json(now_wall=s.last_heartbeat_wall + 2)["heartbeat_age_s"] == 2.0
    assert s.last_heartbeat == math.inf and abs(s.registered_at - time.time()) < 60
    assert r.live("D") == [] and r.every() == [s] and r.holds(s)
    r.set_healthy(s, True)
    assert s.healthy and r.live("D") == [s] and r.count("D") == 1 and joined == [s]
    r.set_healthy(s, True)  # no change: no second join
    assert joined == [s]
    # Never expired, never removed by discovery (a leave or a timeout): the prober decides.
    assert r.expire(now=1e12) == [] and r.remove("D", "127.0.0.1:9", "leave") is False
    assert r.live("D") == [s]
    assert "static instance kept role=D http=127.0.0.1:9 reason=leave" in [x.getMessage() for x in caplog.records]
    r.set_healthy(s, False)
    assert not s.healthy and r.live("D") == [] and r.every() == [s] and joined == [s]
    # An instance no longer held changes its flag, never the live list.
    other = r.upsert(reg("D", 2), now=0)
    r.admit(other)
    r.remove("D", other.http_address, "leave")
    r.set_healthy(other, False)
    r.set_healthy(other, True)
    assert r.live("D") == [] and joined == [s, other]
    lines = [x.getMessage() for x in caplog.records]
    for line in ("static instance added role=D http=127.0.0.1:9 zmq=127.0.0.1:19",
                 "instance healthy role=D http=127.0.0.1:9", "instance unhealthy role=D http=127.0.0.1:9",
                 "instance answered, now a candidate role=D http=127.0.0.1:2",
                 "registry listener failed instance=127.0.0.1:9"):
        assert line in lines, line
    assert "instance healthy role=D http=127.0.0.1:2" not in lines  # not held: nothing to say


def test_registry_static_instance_is_bound_by_its_first_registration(caplog):
    caplog.set_level(logging.INFO, logger="xpyd.proxy.registry")
    r = Registry(heartbeat_timeout=10)
    s = r.add_static("P", "10.0.0.5:8100", "10.0.0.5:1")
    key = new_instance_key()
    mine = Registration("P", "10.0.0.5:8100", "10.0.0.5:2", instance_key=key)
    assert r.upsert(mine, now=0.0, source="10.0.0.5") is s
    assert s.bound and s.source == "10.0.0.5" and s.key_digest == hashlib.sha256(key.encode()).digest()
    assert s.zmq_address == "10.0.0.5:2" and s.static and not s.pending
    assert ("static instance bound to its registration role=P http=10.0.0.5:8100 source=10.0.0.5 keyed=True"
            in [x.getMessage() for x in caplog.records])
    with pytest.raises(RegistrationRefused) as e:
        r.upsert(Registration("P", "10.0.0.5:8100", "10.0.0.5:3"), now=1.0, source="10.0.0.5")
    assert e.value.reason == "conflict" and str(e.value) == (
        "10.0.0.5:8100 belongs to another instance (source 10.0.0.5, keyed; this one: source 10.0.0.5, "
        "no key), heard from 1.0s ago")
    # Its owner silent for timeout / 2: a new owner rebinds it in place (never removed).
    stranger = Registration("P", "10.0.0.5:8100", "10.0.0.5:4")
    assert r.upsert(stranger, now=5.0, source="10.0.0.6") is s
    assert s.source == "10.0.0.6" and s.key_digest is None and s.bound is True and r.every() == [s]
    assert ("static instance bound to its registration role=P http=10.0.0.5:8100 source=10.0.0.6 keyed=False"
            in [x.getMessage() for x in caplog.records])


def test_registry_bounds_per_role_and_per_source_refuse_and_free_on_removal():
    r = Registry(heartbeat_timeout=10, max_per_role=3, max_per_source=2)
    r.upsert(reg("D", 1), now=0, source="10.0.0.1")
    r.upsert(reg("D", 2), now=0, source="10.0.0.1")
    with pytest.raises(RegistrationRefused) as e:
        r.upsert(reg("D", 3), now=0, source="10.0.0.1")
    assert e.value.reason == "source_limit" and str(e.value) == "2 instances registered from 10.0.0.1"
    r.upsert(reg("D", 3), now=0, source="10.0.0.2")  # another source: its own bound
    with pytest.raises(RegistrationRefused) as e:
        r.upsert(reg("D", 4), now=0)  # the role is full, whatever the source
    assert e.value.reason == "role_limit" and str(e.value) == "3 D instances registered already"
    r.upsert(reg("P", 4), now=0, source="10.0.0.2")  # the other role: its own bound
    assert r._per_role == {"P": 1, "D": 3} and r._per_source == {"10.0.0.1": 2, "10.0.0.2": 2}
    # A heartbeat of a known instance is never refused by the bounds.
    assert r.upsert(reg("D", 1), now=1, source="10.0.0.1").last_heartbeat == 1
    assert r.leave(Registration("D", "127.0.0.1:1", "x", leave=True), source="10.0.0.1")
    assert r.leave(Registration("D", "127.0.0.1:1", "x", leave=True), source="10.0.0.1") is False
    assert r._per_role == {"P": 1, "D": 2} and r._per_source == {"10.0.0.1": 1, "10.0.0.2": 2}
    r.upsert(reg("D", 5), now=1, source="10.0.0.1")
    assert r.remove("D", "127.0.0.1:5", "leave") and r.remove("D", "127.0.0.1:2", "leave")
    assert r._per_source == {"10.0.0.2": 2}  # no empty entries kept
    assert r.remove("X", "127.0.0.1:2", "leave") is False
    one = Registry(heartbeat_timeout=10, max_per_source=1)
    one.upsert(reg("D", 1), now=0, source="10.0.0.1")  # the first from a source: below its bound
    with pytest.raises(RegistrationRefused):
        one.upsert(reg("D", 2), now=0, source="10.0.0.1")


def test_registry_leave_from_another_owner_is_refused_and_counted(caplog):
    caplog.set_level(logging.INFO, logger="xpyd.proxy.registry")
    r = Registry(heartbeat_timeout=10)
    r.upsert(reg("P", 1), now=0, source="10.0.0.1")
    bye = Registration("P", "127.0.0.1:1", "x", leave=True)
    for n in (1, 2):
        with pytest.raises(RegistrationRefused) as e:
            r.leave(bye, source="10.0.0.2")
        assert e.value.reason == "conflict" and r.conflicts == n
        assert str(e.value) == "leave for 127.0.0.1:1 from another owner (source 10.0.0.2)"
    assert r.count_pending("P") == 1 and r.leave(bye, source="10.0.0.1") and r.every() == []
    assert "instance removed role=P http=127.0.0.1:1 reason=leave" in [x.getMessage() for x in caplog.records]


def test_registry_expiry_and_rebind_are_measured_from_the_last_heartbeat(caplog):
    caplog.set_level(logging.INFO, logger="xpyd.proxy.registry")
    r = Registry(heartbeat_timeout=10)
    assert r.rebind_after_s == 5
    a = join(r, reg("D", 1), now=100)
    assert r.expire(now=110) == [] and r.live("D") == [a]  # exactly the timeout: still there
    assert r.expire(now=110.01) == [a] and r.live("D") == [] and not r.holds(a)
    b = r.upsert(reg("D", 2), now=100, source="10.0.0.1")
    other = Registration("D", "127.0.0.1:2", "127.0.0.1:1002", instance_key=new_instance_key())
    with pytest.raises(RegistrationRefused) as e:
        r.upsert(other, now=104.75, source="10.0.0.2")
    assert r.conflicts == 1 and str(e.value) == (
        "127.0.0.1:2 belongs to another instance (source 10.0.0.1, no key; this one: source 10.0.0.2, "
        "keyed), heard from 4.8s ago")
    c = r.upsert(other, now=105, source="10.0.0.2")  # silent exactly timeout / 2: taken over
    assert c is not b and c.source == "10.0.0.2" and r._per_source == {"10.0.0.2": 1}
    assert ("instance address taken over by a new owner after 5.0s of silence (restart?) role=D "
            "http=127.0.0.1:2 source=10.0.0.1->10.0.0.2") in [x.getMessage() for x in caplog.records]
    assert "instance removed role=D http=127.0.0.1:2 reason=new_owner" in [x.getMessage() for x in caplog.records]
    # Without a time given, both read the monotonic clock.
    r = Registry(heartbeat_timeout=10)
    old, new = r.upsert(reg("P", 3), now=time.monotonic() - 11), r.upsert(reg("P", 4))
    assert r.expire() == [old] and r.holds(new) and not r.holds(old)


def test_registry_pending_listeners_pending_list_and_admission(caplog):
    r = Registry(heartbeat_timeout=10)
    seen: list = []
    r.pending_listeners.append(lambda i: 1 / 0)
    r.pending_listeners.append(seen.append)
    a = r.upsert(reg("P", 1), now=0)
    b = r.upsert(reg("D", 2), now=0)
    assert seen == [a, b] and r.pending() == [a, b] and r.count_pending("D") == 1
    assert [x.getMessage() for x in caplog.records if x.levelno == logging.ERROR] == [
        "registry listener failed instance=127.0.0.1:1", "registry listener failed instance=127.0.0.1:2"]
    b.probe_error = "connect"
    r.admit(b)
    assert b.pending is False and b.probe_error is None and r.live("D") == [b] and r.pending() == [a]
    r.admit(b)  # twice: nothing more
    assert r.live("D") == [b]
    r.remove("P", a.http_address, "leave")  # a pending one: never live, the lists stand
    assert r.every() == [b]
    r.admit(a)  # answered after it left: not a candidate
    assert not a.pending and r.live("P") == [] and r.all() == [b]


def test_registry_pools_and_models_follow_what_instances_serve(caplog):
    caplog.set_level(logging.INFO, logger="xpyd.proxy.registry")
    r = Registry(heartbeat_timeout=10)
    a, b, c = (join(r, reg("D", p), now=0) for p in (1, 2, 3))
    p = join(r, reg("P", 4), now=0)
    r.set_models(a, {"m1": {"id": "m1", "by": "a"}})
    r.set_models(b, {"m2": {"id": "m2"}, "m1": {"id": "m1", "by": "b"}})
    # c's models are not known yet: eligible for any model.
    assert r.pool("D", None) == [a, b, c] and r.pool("D", "m1") == [a, b, c] and r.pool("D", "m2") == [b, c]
    assert r.pool("D", "nope") == [c] and ("D", "nope") not in r._pools  # a client's name is not cached
    assert r.pool("D", "m2") is r.pool("D", "m2")
    r.set_models(c, {"m3": {"id": "m3"}})
    assert r.pool("D", "m2") == [b] and r.pool("D", "nope") == []
    assert list(r.models()) == ["m1", "m2", "m3"] and r.models()["m1"]["by"] == "a"
    assert r.models() is r.models()
    r.set_models(p, {"m0": {"id": "m0"}})
    assert list(r.models()) == ["m0", "m1", "m2", "m3"] and r.pool("P", "m0") == [p]
    r.set_models(a, {"m1": {"id": "m1", "by": "a2"}})  # the same ids: the card is replaced
    assert a.models == {"m1": {"id": "m1", "by": "a2"}} and r.pool("D", "m1") == [a, b]
    r.set_healthy(a, False)  # out of the live list: out of the pools and the models
    assert r.pool("D", "m1") == [b] and r.models()["m1"]["by"] == "b"
    r.set_models(b, {"m4": {"id": "m4"}})  # other ids: the cached pools and models are dropped
    assert r.pool("D", "m1") == [] and r.pool("D", "m2") == [] and list(r.models()) == ["m0", "m3", "m4"]
    lines = [x.getMessage() for x in caplog.records if x.getMessage().startswith("instance models")]
    assert lines[1] == "instance models role=D http=127.0.0.1:2 models=m1,m2" and len(lines) == 5


def test_instance_to_json_shows_its_state():
    r = Registry(heartbeat_timeout=10)
    ol, gen = OutputLimits(default=16, override=None, context=4096), GenerationDefaults((("temperature", 0.5),), True)
    i = r.upsert(Registration("D", "10.0.0.5:8200", "10.0.0.5:1", kv_transport_fallbacks=2,
                              output_limits=ol, generation=gen), now=0, source="10.0.0.5")
    i.probe_error, i.in_flight, i.in_flight_tokens, i.served = "timeout", 3, 40, 7
    j = i.to_json(now_wall=i.last_heartbeat_wall + 1.23456)
    assert j == {
        "role": "D", "http_address": "10.0.0.5:8200", "zmq_address": "10.0.0.5:1",
        "registered_at": i.registered_at, "last_heartbeat": i.last_heartbeat_wall, "heartbeat_age_s": 1.235,
        "in_flight": 3, "in_flight_tokens": 40, "early": 0, "served": 7, "cooling_down": False, "models": None,
        "static": False, "healthy": True, "kv_transport_fallbacks": 2, "pending": True,
        "probe_error": "timeout", "source": "10.0.0.5",
        "output_limits": {"default": 16, "override": None, "context": 4096},
        "generation": {"sampling": {"temperature": 0.5}, "reasoning_parser": True, "tool_parser": "none"},
        "load": None,
    }
    i.cooldown_until = time.monotonic() + 60
    r.set_models(i, {"b": {}, "a": {}})
    j = i.to_json(now_wall=i.last_heartbeat_wall - 5)  # a wall clock stepped back: age 0
    assert j["heartbeat_age_s"] == 0.0 and j["cooling_down"] is True and j["models"] == ["a", "b"]
    assert 0 < i.to_json(now_wall=i.last_heartbeat_wall + 0.5)["heartbeat_age_s"] < 1


def test_registry_heartbeat_refreshes_what_the_owner_reports(caplog):
    caplog.set_level(logging.INFO, logger="xpyd.proxy.registry")
    r = Registry(heartbeat_timeout=10)
    ol, gen, ep = OutputLimits(default=8), GenerationDefaults((("top_p", 0.9),)), EventsEndpoint("tcp://10.0.0.5:23001")
    first = Registration("D", "10.0.0.5:8200", "10.0.0.5:1", load=Load(1, 2), kv_transport_fallbacks=1,
                         kv_events=ep, output_limits=ol, generation=gen, instance_key=new_instance_key())
    before = time.time()
    i = r.upsert(first, now=3.0, source="10.0.0.5")
    assert (i.url, i.last_heartbeat, i.load, i.kv_transport_fallbacks) == ("http://10.0.0.5:8200", 3.0, Load(1, 2), 1)
    assert (i.kv_events, i.advertised_events, i.output_limits, i.generation) == (ep, ep, ol, gen)
    assert before <= i.registered_at == i.last_heartbeat_wall <= time.time() and i.pending and i.bound
    assert ("instance registered, pending until it answers role=D http=10.0.0.5:8200 zmq=10.0.0.5:1 "
            "source=10.0.0.5 keyed=True") in [x.getMessage() for x in caplog.records]
    registered = i.registered_at
    ol2, gen2 = OutputLimits(override=4), GenerationDefaults((), True)
    beat = dataclasses.replace(first, load=Load(5, 6), kv_transport_fallbacks=3, output_limits=ol2, generation=gen2)
    assert r.upsert(beat, now=4.0, source="10.0.0.5") is i
    assert (i.last_heartbeat, i.load, i.kv_transport_fallbacks, i.output_limits, i.generation) == (
        4.0, Load(5, 6), 3, ol2, gen2)
    assert i.registered_at == registered and i.last_heartbeat_wall >= registered and i.kv_events == ep
    # What it stopped reporting is not known any more (load is the exception: kept).
    r.upsert(dataclasses.replace(first, load=None, kv_transport_fallbacks=0, kv_events=None, output_limits=None,
                                 generation=None), now=5.0, source="10.0.0.5")
    assert (i.load, i.kv_transport_fallbacks, i.kv_events, i.advertised_events, i.output_limits, i.generation) == (
        Load(5, 6), 0, None, None, None, None)


def test_registry_logs_what_an_operator_greps_for(caplog):
    """Removal reasons and an owner's address change are lines of their own (the /instances
    page only shows the present)."""
    r = Registry(heartbeat_timeout=10)
    caplog.set_level(logging.INFO, logger="xpyd.proxy.registry")
    r.upsert(Registration("P", "10.0.0.9:8000", "10.0.0.9:1"), now=0, source="10.0.0.9")
    r.upsert(Registration("P", "10.0.0.9:8000", "10.0.0.9:2", kv_events=EventsEndpoint("tcp://10.0.0.9:23001")),
             now=1, source="10.0.0.9")
    r.upsert(Registration("P", "10.0.0.9:8000", "10.0.0.9:2"), now=2, source="10.0.0.9")
    r.expire(now=13)
    lines = [rec.getMessage() for rec in caplog.records]
    assert "instance addresses changed by its owner role=P http=10.0.0.9:8000 zmq=10.0.0.9:1->10.0.0.9:2 "\
           "kv_events=none->tcp://10.0.0.9:23001" in lines
    assert any(x.endswith("kv_events=tcp://10.0.0.9:23001->none") for x in lines)
    assert "instance removed role=P http=10.0.0.9:8000 reason=heartbeat_timeout" in lines


def test_an_event_endpoint_moved_to_the_source_host_is_said_once(caplog):
    r = Registry(heartbeat_timeout=10)
    far = EventsEndpoint("tcp://10.0.0.5:23001", "tcp://10.0.0.5:23002")
    r.upsert(Registration("P", "10.0.0.5:8000", "10.0.0.5:1", kv_events=far), now=0, source="10.0.0.9")
    r.upsert(Registration("P", "10.0.0.5:8000", "10.0.0.5:1", kv_events=far), now=1, source="10.0.0.9")
    near = EventsEndpoint("tcp://10.0.0.8:23001")
    same_host = Registration("P", "10.0.0.8:8000", "10.0.0.8:1", kv_events=near)
    assert r.upsert(same_host, source="10.0.0.8").kv_events is near
    assert [x.getMessage() for x in caplog.records if "moved" in x.getMessage()] == [
        "kv events endpoint moved to the registration's source host source=10.0.0.9 "
        "tcp://10.0.0.5:23001->tcp://10.0.0.9:23001"]


def _own_address(family: int, probe: str) -> str:
    """This machine's address on the route to a documentation address (no packet is sent)."""
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((probe, 9))
            return s.getsockname()[0]
    except OSError:
        pytest.skip(f"no route to {probe} from this machine")


@pytest.mark.parametrize("family,probe,far", [(socket.AF_INET, "192.0.2.1", "203.0.113.9"),
                                              (socket.AF_INET6, "2001:db8::1", "2001:db8:ffff::9")])
def test_event_endpoint_on_a_local_non_loopback_address_stands_for_a_loopback_source(family, probe, far):
    """A registrant on this machine may name any address of this machine, loopback or not."""
    own = _own_address(family, probe)
    if own == far:
        pytest.skip("the far address is this machine's")
    r = Registry(heartbeat_timeout=10)
    host = f"[{own}]" if family == socket.AF_INET6 else own
    far_host = f"[{far}]" if family == socket.AF_INET6 else far
    for port, (advertised, expected) in enumerate(((host, host), (far_host, "127.0.0.1"))):
        ep = EventsEndpoint(f"tcp://{advertised}:23001")
        inst = r.upsert(Registration("P", f"127.0.0.1:{port}", "127.0.0.1:1", kv_events=ep), source="127.0.0.1")
        assert inst.kv_events == EventsEndpoint(f"tcp://{expected}:23001")
        assert inst.advertised_events == ep


# ---------------------------------------------------------------- policies


def _instances(n: int):
    r = Registry(heartbeat_timeout=10)
    for port in range(1, n + 1):
        join(r, reg("D", port), now=0)
    return r.live("D")


def test_round_robin_cycles():
    insts = _instances(3)
    rr = RoundRobin()
    picks = [rr.choose(insts, REQ).http_address[-1] for _ in range(6)]
    assert picks == ["1", "2", "3", "1", "2", "3"]


def test_least_loaded_prefers_fewer_in_flight_and_tokens():
    a, b, c = _instances(3)
    a.in_flight, b.in_flight, c.in_flight = 2, 0, 1
    ll = LeastLoaded()
    assert all(ll.choose([a, b, c], REQ) is b for _ in range(3))
    b.in_flight = 1
    b.in_flight_tokens = 5000  # same request count as c, far more prompt tokens
    assert ll.choose([a, b, c], REQ) is c


def test_least_loaded_uses_heartbeat_load():
    a, b = _instances(2)
    # b runs requests from other clients the proxy does not know about.
    b.load = Load(running=8, waiting=4, kv_usage=0.9)
    a.in_flight = 3
    assert LeastLoaded().choose([a, b], REQ) is a
    # ...and a heartbeat never lowers the load below what the proxy itself has in flight.
    a.load = Load(0, 0, 0.0)
    b.load = Load(0, 0, 0.0)
    assert LeastLoaded().choose([a, b], REQ) is b


def test_least_loaded_avoids_a_decode_whose_kv_buffer_is_full():
    """Its connector would refuse the transfer: as unattractive as a full KV cache."""
    a, b = _instances(2)
    a.load = Load(0, 0, kv_usage=0.1, kv_buffer_usage=1.0)
    b.load = Load(0, 0, kv_usage=0.5, kv_buffer_usage=0.0)
    assert all(LeastLoaded().choose([a, b], REQ) is b for _ in range(3))


def test_least_loaded_ties_spread_round_robin():
    insts = _instances(3)
    ll = LeastLoaded()
    picks = {ll.choose(insts, REQ).http_address for _ in range(3)}
    assert len(picks) == 3


def test_make_policy():
    assert make_policy("round_robin").name == "round_robin"
    assert make_policy("least_loaded").name == "least_loaded"
    with pytest.raises(ValueError):
        make_policy("random")


def test_estimate_prompt_tokens_counts_text_beyond_ascii_as_more_tokens():
    """~1 token a CJK character (a 600-character Chinese prompt is ~600 tokens, not 150: the
    local threshold would send it to D alone), 0.75 for two-byte characters, 1.75 an emoji."""
    assert estimate_prompt_tokens({"prompt": "今" * 600}) == 751
    assert estimate_prompt_tokens({"prompt": "д" * 400}) == 301
    assert estimate_prompt_tokens({"prompt": "\U0001f600" * 40}) == 71
    assert estimate_prompt_tokens({"prompt": "x" * 396 + "今" * 4}) == 100 + 1 + 4
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "今" * 100}]}]}
    assert estimate_prompt_tokens(chat, CHAT) == 126
    assert estimate_prompt_tokens({"prompt": "\ud800" * 8}) > 2  # a lone surrogate (JSON allows it) is counted, not an error


def test_estimate_prompt_tokens():
    assert estimate_prompt_tokens({"prompt": "x" * 400}) == 101
    assert estimate_prompt_tokens({"prompt": [1, 2, 3]}) == 3
    assert estimate_prompt_tokens({"prompt": [[1, 2], [3]]}) == 3
    assert estimate_prompt_tokens({"prompt": ["abcd", "abcd"]}) == 4
    chat = {
        "messages": [
            {"role": "user", "content": "x" * 40},
            {"role": "user", "content": [{"type": "text", "text": "y" * 40}]},
        ]
    }
    assert estimate_prompt_tokens(chat) == 21


# ---------------------------------------------------------------- validation and bodies


@pytest.mark.parametrize(
    "kind, body, param",
    [
        (COMPLETIONS, [], None),
        (COMPLETIONS, "text", None),
        (COMPLETIONS, {"model": "m"}, "prompt"),
        (COMPLETIONS, {"prompt": []}, "prompt"),
        (COMPLETIONS, {"prompt": 5}, "prompt"),
        (COMPLETIONS, {"prompt": [1, "a"]}, "prompt"),
        (COMPLETIONS, {"prompt": [[1], []]}, "prompt"),
        (COMPLETIONS, {"prompt": [True]}, "prompt"),
        (COMPLETIONS, {"prompt": "a", "max_tokens": 0}, "max_tokens"),
        (COMPLETIONS, {"prompt": "a", "max_tokens": "5"}, "max_tokens"),
        (COMPLETIONS, {"prompt": "a", "max_tokens": 1.5}, "max_tokens"),
        (COMPLETIONS, {"prompt": "a", "stream": "yes"}, "stream"),
        (CHAT, {"model": "m"}, "messages"),
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {"messages": ["hi"]}, "messages"),
        (
            CHAT,
            {"messages": [{"role": "user"}], "max_completion_tokens": -1},
            "max_completion_tokens",
        ),
    ],
)
def test_validate_rejects(kind, body, param):
    with pytest.raises(ProxyError) as exc:
        validate_body(kind, body)
    assert exc.value.status == 400
    assert exc.value.param == param
    err = json.loads(exc.value.body())["error"]
    assert set(err) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    "kind, body",
    [
        (COMPLETIONS, {"prompt": "a"}),
        (COMPLETIONS, {"prompt": ["a", "b"], "max_tokens": None, "stream": None}),
        (COMPLETIONS, {"prompt": [1, 2, 3], "max_tokens": 5, "stream": True}),
        (COMPLETIONS, {"prompt": [[1, 2], [3]]}),
        (COMPLETIONS, {"prompt_embeds": "base64..."}),
        (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3}),
    ],
)
def test_validate_accepts(kind, body):
    validate_body(kind, body)


def test_prefill_body_completions():
    body = {
        "prompt": "a",
        "max_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 10,
        "n": 2,
        "temperature": 0.5,
        "seed": 5,
    }
    pre = prefill_body(COMPLETIONS, body)
    # n samples share one prompt: P computes it once (n dropped), D fans out; P's
    # discarded token needs no seed.
    assert pre == {"prompt": "a", "max_tokens": 1, "stream": False, "temperature": 0.5}
    assert body["max_tokens"] == 50 and body["stream"] is True  # original untouched


def test_prefill_body_chat():
    body = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 9}
    pre = prefill_body(CHAT, body)
    assert pre["max_tokens"] == 1 and pre["max_completion_tokens"] == 1
    assert pre["stream"] is False


def test_prefill_body_skip_tokens_only_from_the_proxy():
    body = {"prompt": "a", "kv_transfer_params": {"xpyd_skip_tokens": 4096, "other": 1}}
    # A client's own value never reaches P; the proxy's does, beside the client's other params.
    assert prefill_body(COMPLETIONS, body)["kv_transfer_params"] == {"other": 1}
    assert prefill_body(COMPLETIONS, body, 256)["kv_transfer_params"] == {"other": 1, "xpyd_skip_tokens": 256}
    assert prefill_body(COMPLETIONS, {"prompt": "a"}, 128)["kv_transfer_params"] == {"xpyd_skip_tokens": 128}
    assert "kv_transfer_params" not in prefill_body(COMPLETIONS, {"prompt": "a"})
    assert body["kv_transfer_params"]["xpyd_skip_tokens"] == 4096  # the client's body is not changed


def test_request_id_format():
    r = Registry(heartbeat_timeout=10)
    p = r.upsert(Registration("P", "10.0.0.1:8100", "10.0.0.1:21001"), now=0)
    d = r.upsert(Registration("D", "10.0.0.2:8200", "10.0.0.2:22001"), now=0)
    rid = request_id.build(p.zmq_address, d.zmq_address)
    assert re.fullmatch(
        r"___prefill_addr_10\.0\.0\.1:21001___decode_addr_10\.0\.0\.2:22001_[0-9a-f]{32}", rid
    )
    assert request_id.build(p.zmq_address, d.zmq_address) != rid


# ---------------------------------------------------------------- upstream errors


def test_upstream_error_passthrough_and_wrapping():
    vllm = json.dumps(
        {"error": {"message": "bad", "type": "BadRequestError", "param": None, "code": 400}}
    ).encode()
    assert upstream_error_body(400, vllm, "prefill", "h:1") == vllm
    flat = json.dumps(
        {"object": "error", "message": "old", "type": "X", "param": None, "code": 400}
    ).encode()
    assert json.loads(upstream_error_body(400, flat, "prefill", "h:1"))["error"]["message"] == "old"
    html = b"<html><body>Internal Server Error</body></html>"
    err = json.loads(upstream_error_body(500, html, "decode", "h:2"))["error"]
    assert "decode instance h:2 answered HTTP 500" in err["message"]
    assert err["type"] == "server_error" and err["code"] == "decode_error"
    detail = json.loads(upstream_error_body(404, b'{"detail":"Not Found"}', "prefill", "h"))
    assert "Not Found" in detail["error"]["message"]


def test_protocol_rejects_non_finite_ts():
    import math

    import msgpack

    from xpyd_wire.discovery import ProtocolError, decode, sign

    fields = {"type": "P", "http_address": "h:1", "zmq_address": "h:2", "ts": math.nan}
    fields["hmac"] = sign(fields, "k")
    with pytest.raises(ProtocolError, match="finite"):
        decode(msgpack.packb(fields), secret="k")


# ---------------------------------------------------------------- relay


class _BrokenStream:
    """D's side of a stream that breaks off inside an SSE event."""

    status = 200
    content_type = "text/event-stream"

    def at_eof(self) -> bool:
        return False

    async def chunks(self):
        from proxy.upstream.base import UpstreamError

        yield b'data: {"choices": [{"text": " to'
        raise UpstreamError("disconnect", "instance closed the connection")


async def test_relay_error_event_starts_on_an_event_boundary():
    from proxy.asgi import Flight
    from proxy.dispatch.relay import Answer, Relay
    from proxy.metrics import Metrics

    registry = Registry(heartbeat_timeout=10)
    d = registry.upsert(reg("D", 1), now=0)
    resp = _BrokenStream()
    chunks = resp.chunks()
    first = b'data: {"choices": [{"text": " a"}]}\n\n'
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    await Relay(Metrics(registry), 5.0)(Answer(resp, first, True, chunks), d, send, Flight(None))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    events = body.split(b"\n\n")
    # The broken event stays broken, but the error is an event of its own that parses.
    error = [e for e in events if e.startswith(b"data: {\"error\"")]
    assert len(error) == 1 and json.loads(error[0][6:])["error"]["code"] == "decode_midstream"
    assert sent[-1]["more_body"] is False


# ---------------------------------------------------------------- a stream's lead

_ROLE = (b'data: {"id":"chatcmpl-x","object":"chat.completion.chunk","created":1,"model":"m",'
         b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
         b'"finish_reason":null}]}\n\n')  # fmt: skip
_KV_FAILED = (b'{"error": {"message": "Internal server error", "type": "InternalServerError", '
              b'"param": null, "code": 500}}')  # fmt: skip
_DONE = b"data: [DONE]\n\n"


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _choice(**kw) -> bytes:
    return _event({"choices": [{"index": 0, "finish_reason": None, **kw}]})


def _error(**kw) -> bytes:
    return _event({"error": {"message": "m", "param": None, **kw}})


@pytest.mark.parametrize(
    "buf,verdict",
    [
        # vLLM 0.32, a failed KV load: completions first, chat after the role chunk.
        (b"data: " + _KV_FAILED + b"\n\n" + _DONE, (500, _KV_FAILED)),
        (_ROLE + b"data: " + _KV_FAILED + b"\n\n" + _DONE, (500, _KV_FAILED)),
        (_ROLE.replace(b"\n", b"\r\n") + b"data: " + _KV_FAILED + b"\r\n\r\n", (500, _KV_FAILED)),
        (_error(type="ServiceUnavailableError", code=503), 503),
        (_error(type="InternalServerError"), 500),  # no status: a server error type
        (_error(type="weird", code="502"), 502),
        # D's verdict on the request, relayed.
        (_error(type="BadRequestError", code=400), True),
        (_error(type="BadRequestError"), True),
        (_error(type="InternalServerError", code=429), True),
        (_error(type="invalid_request_error", code="context_length_exceeded"), True),
        (_event({"error": "boom"}), True),
        # Content, an end, or anything not understood: relayed at once.
        (_ROLE + _choice(delta={"content": " t0"}), True),
        (_choice(text=" t0"), True),
        (_choice(text="", finish_reason="length"), True),
        (_choice(delta={"tool_calls": [{"index": 0}]}), True),
        (_choice(delta={"role": "assistant"}, logprobs={"content": []}), True),
        (_ROLE + _DONE, True),
        (b"data: not json\n\n", True),
        (b"data: [1]\n\n", True),
        (_event({"object": "x"}), True),
        # Nothing generated yet: hold on.
        (_ROLE, False),
        (_ROLE + _ROLE.replace(b'"index":0', b'"index":1'), False),  # n = 2
        (_choice(delta={"role": "assistant", "content": "", "reasoning_content": None}), False),
        (_event({"choices": [], "usage": {"prompt_tokens": 5}}), False),
        (b": keep-alive\n\n" + _ROLE, False),
        (_ROLE + b'data: {"error": {"mess', False),  # an event not complete yet
    ],
)
def test_judge_lead(buf, verdict):
    from proxy.dispatch.relay import StreamError, judge_lead

    got, start = judge_lead(buf)
    if isinstance(verdict, tuple):
        assert got == StreamError(*verdict)
    elif isinstance(verdict, int) and not isinstance(verdict, bool):
        assert isinstance(got, StreamError) and got.status == verdict
    else:
        assert got is verdict
    if got is False:  # where to go on from: after the last complete event
        assert buf[start:] in (b"", b'data: {"error": {"mess')


def test_judge_lead_parses_no_more_than_its_cap():
    from proxy.dispatch.relay import LEAD_MAX_BYTES, judge_lead

    big = _choice(delta={"role": "assistant", "content": ""}, pad="x" * LEAD_MAX_BYTES)
    assert judge_lead(big) == (True, 0)  # past the cap: relayed as without the hold
    # Resumes where the previous call stopped.
    got, start = judge_lead(_ROLE)
    assert (got, start) == (False, len(_ROLE))
    assert judge_lead(_ROLE + b"data: " + _KV_FAILED + b"\n\n", start)[0].status == 500
