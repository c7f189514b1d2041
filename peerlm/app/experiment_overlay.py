"""The SemanticDFL overlay's top-K in the experiment: ``cpm_menu_overlay`` (issue 9 §3).

In a deployment an agent publishes its adapter's signature each round, searches the overlay
for its ``k`` most similar peers, and reports them with its profile
(``SubmitProfileRequest.overlay_peers``); the CPM then admits a merge protocol (``pmix``,
``svd_hka``) for ``sender -> student`` only if the sender is on the student's list
(docs/matchmaker.md, "Overlay narrowing"). The overlay narrows, the CPM chooses.

:class:`OverlayView` is that for the experiment's in-process clients. Each client keeps its
importance EMA (:class:`~peerlm.overlay.signature.ImportanceTracker`) across the rounds of a
run and computes its signature with the agent's own step
(:func:`~peerlm.agent.overlay_step.signature_inputs`: flatten, EMA, P_min by Alg. 1, the
network-wide P). As in the overlay, the network-wide P of round ``t`` is the ``q``-quantile
of the P_min reported in round ``t − 1`` (the epoch's announcement), each client's own P_min
in the first round. Choice made here: the neighbours are the **exact** ``k`` nearest by the
signatures' cosine (ties: the lower name), where a deployment's beam search returns an
approximation of them; with the handful of clients of an experiment nothing is gained by
building zones and clusters in process, and the exact list is what the search aims at.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["OverlayView"]


class OverlayView:
    """Every client's overlay signature state across one run, and its top-``k`` each round.

    ``settings``: the agent's overlay settings (``k``, ``tau_min``, ``importance_beta``,
    ``signature_p``); ``p_quantile`` and ``p_max``: the overlay protocol's (``OverlayParams``).
    """

    def __init__(self, settings: Any, *, p_quantile: float, p_max: int) -> None:
        self.settings = settings
        self.p_quantile = p_quantile
        self.p_max = p_max
        self.network_p: int | None = None
        self._trackers: dict[str, Any] = {}

    @classmethod
    def defaults(cls, k: int | None = None) -> OverlayView:
        """The agent's and the overlay's defaults (``k`` = 2 unless given)."""
        from peerlm.agent import AgentOverlaySettings
        from peerlm.overlay import OverlayParams

        settings = AgentOverlaySettings() if k is None else AgentOverlaySettings(k=k)
        params = OverlayParams()
        return cls(settings, p_quantile=params.p_quantile, p_max=params.p_max)

    def step(self, hosts: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
        """Publish every client's signature of its current adapter (``hosts``: name →
        ``ModelHost``) and return each one's ``k`` most similar peers, best first."""
        from peerlm.agent.overlay_step import signature_inputs
        from peerlm.overlay.signature import ImportanceTracker, cosine_matrix, network_p

        names = sorted(hosts)
        signatures = []
        p_mins = []
        for name in names:
            tracker = self._trackers.setdefault(
                name, ImportanceTracker(self.settings.importance_beta)
            )
            signature, _p, p_min = signature_inputs(
                hosts[name], tracker, self.settings, self.network_p
            )
            signatures.append(signature)
            p_mins.append(p_min)
        # The next round's announcement, from this round's reports.
        self.network_p = network_p(p_mins, self.p_quantile, self.p_max)
        return nearest(names, cosine_matrix(signatures), self.settings.k)


def nearest(names: Sequence[str], similarity: np.ndarray, k: int) -> dict[str, tuple[str, ...]]:
    """Each name's ``k`` most similar others by ``similarity`` (rows and columns in the
    order of ``names``), most similar first, ties broken by the lower name."""
    out: dict[str, tuple[str, ...]] = {}
    for i, name in enumerate(names):
        others = sorted(
            (j for j in range(len(names)) if j != i),
            key=lambda j: (-float(similarity[i, j]), names[j]),
        )
        out[name] = tuple(names[j] for j in others[:k])
    return out
