"""CPM-maintained exchange history and trust (the paper's "historical/trust features").

For each agent the CPM counts ``(exchanges, successes)`` and scores it by the
Beta(1, 1)-smoothed success rate ``(successes + 1) / (exchanges + 2)``: 0.5 for an agent
never seen, moving towards its empirical rate as evidence accumulates.

Choices the paper leaves open:

* **An exchange is a success when its raw reward is > 0**, i.e. the receiver's loss went
  down by more than the communication penalty of Eq. 3. The *raw* reward is used, not the
  z-scored one, because "above the running average" is not "useful".
* **Only the sender (teacher) is credited.** The reward measures what the sender's
  knowledge did for the receiver, so it is evidence about the sender. Crediting the
  receiver too would (a) mix in how well it absorbs, which its dynamic features already
  describe, and (b) let a receiver raise its own trust by reporting inflated rewards —
  the receiver is the party that reports. So trust(a) is "how often a's teaching helped".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import chain

import numpy as np
from numpy.typing import NDArray

__all__ = ["TrustLedger"]


class TrustLedger:
    """Per-agent ``(exchanges, successes)`` counts and their smoothed success rate."""

    __slots__ = ("_counts",)

    def __init__(self, counts: Mapping[str, tuple[int, int]] | None = None) -> None:
        self._counts: dict[str, list[int]] = {}
        for agent, (exchanges, successes) in (counts or {}).items():
            if not isinstance(agent, str):
                raise ValueError(f"agent ids must be strings, got {agent!r}")
            if not 0 <= int(successes) <= int(exchanges):
                raise ValueError(
                    f"trust of {agent!r} needs 0 <= successes <= exchanges, "
                    f"got ({exchanges}, {successes})"
                )
            self._counts[agent] = [int(exchanges), int(successes)]

    def record(self, agent: str, success: bool) -> None:
        """Count one exchange of ``agent`` (as teacher), successful or not."""
        entry = self._counts.get(agent)
        if entry is None:
            entry = self._counts[agent] = [0, 0]
        entry[0] += 1
        entry[1] += int(success)

    def counts(self, agent: str) -> tuple[int, int]:
        """``(exchanges, successes)`` of ``agent``; ``(0, 0)`` if never seen."""
        entry = self._counts.get(agent)
        return (entry[0], entry[1]) if entry is not None else (0, 0)

    def score(self, agent: str) -> float:
        """Smoothed success rate ``(successes + 1) / (exchanges + 2)``."""
        exchanges, successes = self.counts(agent)
        return (successes + 1.0) / (exchanges + 2.0)

    def scores(self, agents: Sequence[str]) -> NDArray[np.float64]:
        """:meth:`score` for many agents at once, as an array."""
        if not agents:
            return np.empty(0, dtype=np.float64)
        # One dict lookup per agent and array arithmetic (a per-agent score() call cost
        # ~5 ms at N = 10^4); (s + 1) / (e + 2) in float64, exactly as score().
        get, unseen = self._counts.get, (0, 0)
        # fromiter over the flattened pairs: np.array of a list of tuples was ~3x slower.
        flat = chain.from_iterable(get(a, unseen) for a in agents)
        counts = np.fromiter(flat, dtype=np.float64, count=2 * len(agents)).reshape(-1, 2)
        return (counts[:, 1] + 1.0) / (counts[:, 0] + 2.0)

    def state(self) -> dict[str, tuple[int, int]]:
        """A copy of every agent's counts."""
        return {agent: (e[0], e[1]) for agent, e in self._counts.items()}

    def __len__(self) -> int:
        return len(self._counts)
