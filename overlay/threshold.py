"""The round-level similarity threshold ``tau(t)`` of SemanticDFL Sec. 3.5.

Each querier keeps one :class:`ThresholdController`. ``tau(0)`` is the ``(1 - phi)``
quantile of recently observed similarities (a bounded window, :class:`RecentSimilarities`);
after every round the controller moves ``tau`` by the small-step rule

    tau(t+1) = clip_[-1,1]( tau(t) + eta_tau * (a_hat(t) - phi) - gamma * (1 - rho(t)) )

where ``a_hat`` is the fraction of scored edges (prototypes and leaf members) that met the
threshold and ``rho = cos(u(t), u(t-1))`` is the querier's own signature drift. Within a
round the root relaxes ``tau -= delta`` when fewer than K candidates pass
(:mod:`peerlm.overlay.search`); the controller continues from the relaxed value.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import numpy as np

__all__ = ["RecentSimilarities", "ThresholdController", "quantile_threshold"]


def quantile_threshold(similarities: Iterable[float], phi: float) -> float | None:
    """The ``(1 - phi)`` quantile of ``similarities``: about a ``phi`` share lies above it.

    ``None`` for no data. Uses numpy's default (linear) interpolation.
    """
    values = np.fromiter(similarities, dtype=np.float64)
    if values.size == 0:
        return None
    return float(np.clip(np.quantile(values, 1.0 - phi), -1.0, 1.0))


class RecentSimilarities:
    """A bounded window of the most recent similarities a node observed ("recent probes")."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._values: deque[float] = deque(maxlen=capacity)

    def extend(self, values: Iterable[float]) -> None:
        self._values.extend(float(v) for v in values)

    def __len__(self) -> int:
        return len(self._values)

    def quantile(self, phi: float) -> float | None:
        """The ``(1 - phi)`` quantile of the window (``None`` while empty)."""
        return quantile_threshold(self._values, phi)


class ThresholdController:
    """``tau(t)`` with the acceptance controller and drift slack (one per querier)."""

    def __init__(
        self, target_acceptance: float, step: float, drift_slack: float, window: int
    ) -> None:
        self.phi = target_acceptance
        self.eta = step
        self.gamma = drift_slack
        self.tau: float | None = None
        self.recent = RecentSimilarities(window)
        self.rounds = 0

    def current(self) -> float | None:
        """The threshold to send with the next query: the controller's value, else the
        streaming ``(1 - phi)`` quantile, else ``None`` (the root then uses the quantile of
        its own children's scores)."""
        if self.tau is not None:
            return self.tau
        return self.recent.quantile(self.phi)

    def update(
        self, tau_used: float, scored: int, accepted: int, drift: float, samples: Iterable[float]
    ) -> float:
        """Fold in one finished round; returns ``tau(t+1)``.

        ``tau_used`` is the (possibly relaxed) threshold the round ended with, ``drift`` is
        ``rho = cos(u(t), u(t-1))`` (1.0 when unknown).
        """
        self.recent.extend(samples)
        if self.tau is None and len(self.recent) > 0:
            # The first round probed with the root's estimate; tau(0) proper is the
            # (1 - phi) quantile of what that probe scored across all levels.
            first = self.recent.quantile(self.phi)
            assert first is not None
            self.tau = first
            self.rounds += 1
            return self.tau
        acceptance = accepted / scored if scored > 0 else self.phi
        rho = min(1.0, max(-1.0, drift))
        nxt = tau_used + self.eta * (acceptance - self.phi) - self.gamma * (1.0 - rho)
        self.tau = float(min(1.0, max(-1.0, nxt)))
        self.rounds += 1
        return self.tau
