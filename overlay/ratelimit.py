"""Per-sender token buckets: how many overlay messages each member may deliver.

Written by hand (about 30 lines) rather than taken from a library: the maintained ones
(``aiolimiter``, ``limits``) either wait for capacity, which would let a flood hold server
tasks, or keep state in a storage backend; here a refusal must be immediate, the clock
injectable for tests, and the number of senders tracked bounded.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["SenderBuckets"]


@dataclass(slots=True)
class _Bucket:
    tokens: float
    stamp: float


class SenderBuckets:
    """A token bucket per sender: ``rate`` tokens per second, at most ``burst`` saved.

    At most ``max_senders`` buckets are kept; the least recently used is forgotten first (a
    forgotten sender starts again with a full bucket, which only certified members can
    reach, so cycling identities costs a certificate each).
    """

    def __init__(
        self,
        rate: float,
        burst: float,
        max_senders: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rate <= 0 or burst < 1 or max_senders < 1:
            raise ValueError("need rate > 0, burst >= 1 and max_senders >= 1")
        self._rate = rate
        self._burst = burst
        self._max = max_senders
        self._clock = clock
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    @property
    def rate(self) -> float:
        """Tokens added per second."""
        return self._rate

    @property
    def burst(self) -> float:
        """Most tokens a bucket holds."""
        return self._burst

    def take(self, sender: str, cost: float) -> bool:
        """Spend ``cost`` tokens of ``sender``'s bucket; False (nothing spent) if too few."""
        now = self._clock()
        bucket = self._buckets.get(sender)
        if bucket is None:
            bucket = _Bucket(self._burst, now)
            self._buckets[sender] = bucket
            if len(self._buckets) > self._max:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(sender)
            bucket.tokens = min(self._burst, bucket.tokens + (now - bucket.stamp) * self._rate)
            bucket.stamp = now
        if bucket.tokens < cost:
            return False
        bucket.tokens -= cost
        return True
