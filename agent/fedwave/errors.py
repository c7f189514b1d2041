"""The one error type of FedWave's library code."""

from __future__ import annotations

__all__ = ["FedWaveError"]


class FedWaveError(ValueError):
    """A FedWave input that does not fit; ``reason`` is a short label for a metric.

    Labels: ``decode``, ``format``, ``keys``, ``shape``, ``dtype``, ``non_finite``,
    ``too_large``, ``weights``, ``empty``, ``config``.
    """

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason
