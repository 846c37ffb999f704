"""Ports for one node's world (executor/transport.py): below the kernel's ephemeral range, free, and
distinct within a plan; the kernel's own choice when there is no room below that range."""

from __future__ import annotations

import socket

from deltaserve.executor import transport


def test_free_ports_sit_below_the_ephemeral_range_and_can_be_bound():
    low, high = transport.ephemeral_port_range()
    assert transport.LISTEN_PORTS_START < low <= high
    taken: set[int] = set()
    ports = [transport.free_port(taken=taken) for _ in range(20)]
    assert len(set(ports)) == 20 and taken == set(ports)
    assert all(transport.LISTEN_PORTS_START <= p < low for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))


def test_a_port_in_use_is_never_chosen(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        monkeypatch.setattr(transport, "LISTEN_PORTS_START", port)
        monkeypatch.setattr(transport, "ephemeral_port_range", lambda: (port + 1, port + 2))
        chosen = transport.free_port(attempts=8)  # every candidate is the busy port: the kernel's choice
        assert chosen != port


def test_without_room_below_the_range_the_kernel_chooses(monkeypatch):
    monkeypatch.setattr(transport, "ephemeral_port_range", lambda: (transport.LISTEN_PORTS_START, 60999))
    assert transport.free_port() > 0


def test_the_default_range_when_the_setting_cannot_be_read(monkeypatch, tmp_path):
    monkeypatch.setattr(transport, "_EPHEMERAL_RANGE_FILE", str(tmp_path / "missing"))
    assert transport.ephemeral_port_range() == (32768, 60999)


def test_a_local_plan_has_four_distinct_ports():
    plan = transport.EndpointPlan.local()
    ports = {int(address.rsplit(":", 1)[1]) for address in (plan.rendezvous, plan.commands, plan.replies, plan.nodes)}
    assert len(ports) == 4
