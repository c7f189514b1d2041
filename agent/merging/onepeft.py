"""OnePeFT on a peer: build one adapter from K pulled adapters in one communication round.

Algorithm 1 of the paper, with the peer in the server's place: the K client adapters (the
overlay's top-K, or the senders a directive names) are aggregated by SVD (Eq. 3,
:func:`~peerlm.agent.merging.lora_merge.aggregate_svd`) to this host's rank and alpha, loaded as the
host's adapter, and refined by Heterogeneous Knowledge Alignment on public data (Eq. 4-6,
:meth:`~peerlm.agent.modelhost.ModelHost.train_hka`). Nothing is sent back: one round.

The variants of Table 5's ablation run through the same function:

| ``svd`` | ``hka`` | initialisation | refinement |
|---|---|---|---|
| True | True | SVD aggregate (OnePeFT) | HKA |
| True | False | SVD aggregate | none |
| False | True | FedAvg of A and B (FedIT) | HKA |
| False | False | FedAvg of A and B | none (the paper's "neither") |

Without SVD the factors are averaged, which needs every client at the host's rank and alpha
(an :class:`~peerlm.agent.adapter_codec.AdapterError` otherwise).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from peerlm.agent.adapter_codec import AdapterError
from peerlm.agent.merging.lora_merge import (
    ClientAdapter,
    MergedAdapter,
    aggregate_fedavg_factors,
    aggregate_svd,
)
from peerlm.agent.modelhost import ModelHost
from peerlm.agent.training import TrainSettings, TrainStats

__all__ = ["OneShotResult", "one_shot"]


@dataclass(frozen=True)
class OneShotResult:
    """What :func:`one_shot` did: the aggregate it started from and the HKA run (if any)."""

    merged: MergedAdapter
    hka: TrainStats | None
    svd: bool

    @property
    def variant(self) -> str:
        """Table 5's row: ``svd+hka``, ``svd``, ``hka`` or ``fedavg``."""
        if self.svd:
            return "svd+hka" if self.hka is not None else "svd"
        return "hka" if self.hka is not None else "fedavg"


def one_shot(
    host: ModelHost,
    clients: Sequence[ClientAdapter],
    public_examples: Sequence[tuple[str, str]],
    settings: TrainSettings,
    *,
    svd: bool = True,
    hka: bool = True,
    alpha: float = 0.5,
    weights: Sequence[float] | None = None,
    steps: int | None = None,
) -> OneShotResult:
    """Replace ``host``'s adapter by the one-shot aggregate of ``clients`` (see the module).

    Every client is checked before the host changes; a refused one raises
    :class:`AdapterError` and leaves the host's adapter as it was. HKA failing after the
    aggregate was loaded (a setting it refuses, an error mid-training) restores the adapter
    the host had before re-raising, so a failed step never leaves a half-made adapter.
    """
    if svd:
        merged = aggregate_svd(clients, r=host.lora.r, alpha=host.lora.alpha, weights=weights)
    else:
        merged = aggregate_fedavg_factors(clients, weights=weights)
        if merged.r != host.lora.r or merged.alpha != host.lora.alpha:
            raise AdapterError(
                f"FedAvg of factors gives r={merged.r}, alpha={merged.alpha}; this host has "
                f"r={host.lora.r}, alpha={host.lora.alpha} (use the SVD aggregation)",
                reason="lora_config",
            )
    before = host.adapter_state() if hka else None
    host.load_adapter_state(merged.state)
    stats = None
    if before is not None:
        try:
            stats = host.train_hka(
                public_examples, clients, settings, alpha=alpha, weights=merged.weights, steps=steps
            )
        except BaseException:
            host.load_adapter_state(before)
            raise
    return OneShotResult(merged, stats, svd)
