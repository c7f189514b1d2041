"""The agent's registry of exchange protocols: each protocol module's ``PROTOCOLS``.

A new protocol is one module (an :class:`~peerlm.agent.exchange.protocol.ExchangeProtocol`
per catalogue entry it implements) named in :data:`_MODULES`.
"""

from __future__ import annotations

from peerlm.agent.exchange import akd as exchange_akd
from peerlm.agent.exchange import merge as exchange_merge
from peerlm.agent.exchange.protocol import ProtocolRegistry

__all__ = ["agent_registry"]

_MODULES = (exchange_akd, exchange_merge)


def agent_registry() -> ProtocolRegistry:
    """Every exchange protocol this agent implements, by catalogue name."""
    return ProtocolRegistry(p for module in _MODULES for p in module.PROTOCOLS)
