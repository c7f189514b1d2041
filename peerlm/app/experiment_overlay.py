"""The SemanticDFL overlay in the experiment: ``overlay_topk`` and ``cpm_menu_overlay``.

In a deployment an agent with the overlay enabled joins it by publishing its adapter's
signature, and after each round's directive runs its overlay step
(:func:`~peerlm.agent.overlay_client.step.overlay_round_step`): it publishes the signature of its
adapter as it now is, searches the overlay for its ``k`` most similar peers, pulls their
adapters and aggregates them (the PDFL step, ``pmix``, by default). The neighbours it found
are the list it reports with its next profile (``SubmitProfileRequest.overlay_peers``), and
the CPM admits a merge protocol (``pmix``, ``svd_hka``) for ``sender -> student`` only if
the sender is on the student's list (docs/matchmaker.md, "Overlay narrowing"). Before its
first overlay step an agent reports no list, and nothing is narrowed.

:class:`OverlayView` is that state for the experiment's in-process clients, kept for one
(strategy, seed) run: each client's importance EMA
(:class:`~peerlm.overlay.signature.ImportanceTracker`), the network-wide P the overlay
announces from the members' reported P_min (as in the overlay, the P a round publishes at
is the one announced from the reports before it; a client's own P_min before the first
announcement), and the lists the clients report next. Signatures are computed by the
agent's own step (:func:`~peerlm.agent.overlay_client.step.signature_inputs`).

Choices made here: the neighbours are the **exact** ``k`` nearest of the same parameter
space by the signatures' cosine (ties: the lower name), where a deployment's beam search
returns an approximation of them (a cross-space cosine is 0 and a cross-space adapter is
never aggregated, so candidates of another space are left out); the search is exhaustive
because an experiment has a handful of clients; and a signature the agent's step refuses
ends the run with its error, where a daemon would count a ``signature_error`` step and go
on (the experiment's adapters are its own and finite, so it would be a bug, not an input).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["OverlayView", "nearest"]


class OverlayView:
    """Every client's overlay state across one run (module docstring).

    ``settings``: the agent's overlay settings (``k``, ``tau_min``, ``importance_beta``,
    ``signature_p``, and ``protocol``'s ``p_quantile`` and ``p_max``).
    """

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self.network_p: int | None = None
        #: What each client reports with its next profile (empty before its first step).
        self.listed: dict[str, tuple[str, ...]] = {}
        self._trackers: dict[str, Any] = {}

    @classmethod
    def defaults(cls) -> OverlayView:
        """The agent's overlay defaults (k = 2, tau_min 0.9, the protocol's q and P_max)."""
        from peerlm.agent import AgentOverlaySettings

        return cls(AgentOverlaySettings())

    def _publish(self, hosts: Mapping[str, Any]) -> tuple[list[str], list[Any]]:
        from peerlm.agent import signature_inputs
        from peerlm.overlay import ImportanceTracker, network_p

        names = sorted(hosts)
        signatures, p_mins = [], []
        for name in names:
            tracker = self._trackers.setdefault(
                name, ImportanceTracker(self.settings.importance_beta)
            )
            signature, _p, p_min = signature_inputs(
                hosts[name], tracker, self.settings, self.network_p
            )
            signatures.append(signature)
            p_mins.append(p_min)
        protocol = self.settings.protocol
        # The overlay's next announcement, from these reports.
        self.network_p = network_p(p_mins, protocol.p_quantile, protocol.p_max)
        return names, signatures

    def join(self, hosts: Mapping[str, Any]) -> None:
        """Every client joins: publishes its first signature (no search, no list)."""
        self._publish(hosts)

    def step(
        self, hosts: Mapping[str, Any]
    ) -> tuple[dict[str, tuple[str, ...]], dict[str, dict[str, float]]]:
        """Every client's overlay step on its current adapter (``hosts``: name →
        ``ModelHost``): publish, then its ``k`` nearest peers (best first) and their
        similarities; the lists become what the clients report next (:attr:`listed`)."""
        from peerlm.overlay import cosine_matrix

        names, signatures = self._publish(hosts)
        similarity = cosine_matrix(signatures)
        spaces = [s.space for s in signatures]
        neighbours = nearest(names, similarity, self.settings.k, spaces)
        # An agent whose step found nobody keeps reporting its last list (the daemon
        # replaces it only with a non-empty one).
        self.listed = {**self.listed, **{n: v for n, v in neighbours.items() if v}}
        index = {n: i for i, n in enumerate(names)}
        sims = {
            n: {m: float(similarity[index[n], index[m]]) for m in near}
            for n, near in neighbours.items()
        }
        return neighbours, sims


def nearest(
    names: Sequence[str],
    similarity: np.ndarray,
    k: int,
    spaces: Sequence[str] | None = None,
) -> dict[str, tuple[str, ...]]:
    """Each name's ``k`` most similar others by ``similarity`` (rows and columns in the
    order of ``names``), most similar first, ties broken by the lower name; with ``spaces``
    only others of the same parameter space are candidates."""
    out: dict[str, tuple[str, ...]] = {}
    for i, name in enumerate(names):
        others = sorted(
            (j for j in range(len(names)) if j != i and (spaces is None or spaces[j] == spaces[i])),
            key=lambda j: (-float(similarity[i, j]), names[j]),
        )
        out[name] = tuple(names[j] for j in others[:k])
    return out
