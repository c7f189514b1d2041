"""A bound on the bytes a peer server has handed to gRPC and not yet written to its readers.

Why: a chunk written to a reader that does not consume stays in gRPC core's
stream buffer (and its serialised copy in Python) until the reader takes it or the
connection dies. grpc.aio has no per-stream or total bound on that memory (HTTP/2 flow
control only stops bytes from reaching the socket; ``grpc.max_concurrent_streams`` bounds
streams per connection, not connections; core's resource quota is not exposed to Python),
and a server handler cannot reset one stalled stream (``abort`` waits behind the queued
data). So 1,030 readers that took one chunk and stopped grew a teacher from 106 MB to
2.5 GB. The bound therefore sits in front of every write: a stream reserves the chunk's
bytes before it writes and gets them back when gRPC is done with the message, so the
memory held by unwritten chunks is at most ``total_bytes`` (plus one chunk that is larger than
what is free, sent alone) whatever the number of readers.

Fairness: one identity may hold at most ``identity_bytes`` of the total, and when bytes come
back they go to the waiting stream whose identity holds the least (ties: first come), so a
member whose streams stall holds its share and no more, and another member's pull is next
in line. A stream that waits longer than its caller allows is refused (the service answers
RESOURCE_EXHAUSTED): waiting costs no chunk memory, but it holds a call slot.

:class:`SendLedger` is the accounting with no I/O (every decision, tested directly);
:class:`SendBudget` is its asyncio face. Written by hand: asyncio's semaphores count units,
not bytes per owner, and no maintained library offers a weighted fair byte budget.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

__all__ = ["SendBudget", "SendLedger"]


@dataclass(order=True)
class _Waiter:
    seq: int
    identity: str = field(compare=False)
    cost: int = field(compare=False)


class SendLedger:
    """Bytes reserved per identity under a total and a per-identity bound (sans-IO).

    A request reserves exactly its bytes. One larger than the identity's share is granted
    when that identity holds nothing, one larger than the total when nothing is reserved, so
    a chunk is sent (alone) rather than never; the memory bound is then the total plus one
    chunk. :meth:`request` grants at once or queues; :meth:`release` and :meth:`withdraw`
    return the waiters granted as a consequence.
    """

    def __init__(self, total_bytes: int, identity_bytes: int) -> None:
        if total_bytes <= 0 or identity_bytes <= 0:
            raise ValueError("byte budgets must be positive")
        self.total_bytes = total_bytes
        self.identity_bytes = min(identity_bytes, total_bytes)
        self._held: dict[str, int] = {}
        self._in_flight = 0
        self._waiting: list[_Waiter] = []
        self._seq = itertools.count()

    @property
    def in_flight(self) -> int:
        """Bytes reserved now, all identities together."""
        return self._in_flight

    @property
    def waiting(self) -> int:
        """Requests queued for bytes."""
        return len(self._waiting)

    def held(self, identity: str) -> int:
        """Bytes ``identity`` has reserved now."""
        return self._held.get(identity, 0)

    def cost(self, nbytes: int) -> int:
        """What a request for ``nbytes`` reserves (an empty one still counts as a byte)."""
        return max(1, nbytes)

    def _fits(self, identity: str, cost: int) -> bool:
        held = self.held(identity)
        in_total = self._in_flight == 0 or self._in_flight + cost <= self.total_bytes
        in_share = held == 0 or held + cost <= self.identity_bytes
        return in_total and in_share

    def _take(self, identity: str, cost: int) -> None:
        self._held[identity] = self.held(identity) + cost
        self._in_flight += cost

    def request(self, identity: str, nbytes: int) -> int | None:
        """Reserve at once (None) or queue; a queued request's ticket is returned.

        With others queued, the request joins them and the usual order decides (identity
        holding least, then first come) among those that fit: a request that fits is not
        held back behind a larger one that does not (chunks are all ``chunk_bytes`` but a
        payload's last, so nobody starves that way)."""
        cost = self.cost(nbytes)
        if not self._waiting and self._fits(identity, cost):
            self._take(identity, cost)
            return None
        waiter = _Waiter(next(self._seq), identity, cost)
        self._waiting.append(waiter)
        granted = self._grant()
        return None if waiter.seq in granted else waiter.seq

    def release(self, identity: str, nbytes: int) -> list[int]:
        """Give back a reservation of ``nbytes``; the tickets granted in consequence."""
        cost = self.cost(nbytes)
        left = self.held(identity) - cost
        if left < 0:
            raise ValueError(f"{identity} releases {cost} bytes but holds {self.held(identity)}")
        if left:
            self._held[identity] = left
        else:
            del self._held[identity]
        self._in_flight -= cost
        return self._grant()

    def withdraw(self, ticket: int) -> list[int]:
        """Drop a queued request (its caller stopped waiting); the tickets granted in
        consequence (none as the ledger stands: whatever fits is granted when it fits)."""
        self._waiting = [w for w in self._waiting if w.seq != ticket]
        return self._grant()

    def _grant(self) -> list[int]:
        granted: list[int] = []
        while True:
            fitting = [w for w in self._waiting if self._fits(w.identity, w.cost)]
            if not fitting:
                return granted
            # The identity holding least goes first: a member whose streams stall cannot
            # keep the bytes that come back from another member's finished writes.
            best = min(fitting, key=lambda w: (self.held(w.identity), w.seq))
            self._waiting.remove(best)
            self._take(best.identity, best.cost)
            granted.append(best.seq)


class SendBudget:
    """The asyncio face of :class:`SendLedger`: wait for bytes, with a bound on the wait."""

    def __init__(self, total_bytes: int, identity_bytes: int) -> None:
        self.ledger = SendLedger(total_bytes, identity_bytes)
        self._futures: dict[int, asyncio.Future[None]] = {}

    async def reserve(self, identity: str, nbytes: int, timeout_s: float) -> bool:
        """Reserve ``nbytes`` for ``identity``, waiting at most ``timeout_s``; False if the
        wait ran out (nothing is then reserved). Cancelled while waiting: nothing reserved."""
        ticket = self.ledger.request(identity, nbytes)
        if ticket is None:
            return True
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._futures[ticket] = future
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout_s)
            return True
        except (TimeoutError, asyncio.CancelledError) as err:
            if future.done():
                # Granted just as the wait ended: give the bytes straight back.
                self.release(identity, nbytes)
            else:
                self._wake(self.ledger.withdraw(ticket))
            if isinstance(err, asyncio.CancelledError):
                raise
            return False
        finally:
            self._futures.pop(ticket, None)

    def release(self, identity: str, nbytes: int) -> None:
        """Give back what :meth:`reserve` reserved for the same ``identity`` and ``nbytes``."""
        self._wake(self.ledger.release(identity, nbytes))

    def _wake(self, tickets: list[int]) -> None:
        for ticket in tickets:
            future = self._futures.get(ticket)
            if future is not None and not future.done():
                future.set_result(None)
