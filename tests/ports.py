"""Ports for the processes a test starts before it can ask them which port they bound.

A port found with ``bind(0)`` comes from the kernel's ephemeral range, from which every
outgoing connection takes its port too: between the test picking it and the node binding it,
another node's connection could take it (an overlay node of the process test failed to serve
its metrics so). :func:`peerlm.app.devfed.free_ports` draws outside that range; this wrapper
also never hands the same port out twice in one test process.
"""

from __future__ import annotations

from peerlm.app.devfed import free_ports

# Ports handed out by this test process, which may not be bound yet.
_HANDED: set[int] = set()


def free_port() -> int:
    """A port on 127.0.0.1 that is free now, outside the ephemeral range, and new to this
    test process."""
    while True:
        port = free_ports(1)[0]
        if port not in _HANDED:
            _HANDED.add(port)
            return port
