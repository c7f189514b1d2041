"""`peerlm up`'s ports: free, distinct, and outside the kernel's ephemeral range."""

from __future__ import annotations

import socket
from pathlib import Path

from peerlm.app.devfed import free_ports


def test_ports_are_free_distinct_and_not_ones_the_kernel_hands_out() -> None:
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = free_ports(12)
    assert len(set(ports)) == 12
    # bind(0) and outgoing connections take their ports from [low, high]: a port from
    # there could be gone before the agent binds it.
    assert all(not low <= p <= high and p >= 10_000 for p in ports), ports
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_chosen() -> None:
    held = []
    try:
        for port in free_ports(40):
            sock = socket.socket()
            sock.bind(("127.0.0.1", port))
            sock.listen()
            held.append(sock)
        taken = {s.getsockname()[1] for s in held}
        assert not taken & set(free_ports(40))
    finally:
        for sock in held:
            sock.close()
