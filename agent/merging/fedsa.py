"""FedSA-LoRA's selective aggregation as a merge protocol (``fedsa``; :mod:`peerlm.protocols`).

FedSA-LoRA (Guo et al., "Selective Aggregation for Low-Rank Adaptation in Federated
Learning", ICLR 2025, arXiv:2410.01463) observes that in LoRA the A matrices learn what is
general across clients and the B matrices what is client-specific, and so shares and
averages **only the A matrices**; each client keeps its own B. Without a server, the
student is the aggregator: its new A of every LoRA module is the plain mean of its own A
and each usable sender's A; its B, and every tensor that is not a LoRA A, stay its own.

Choices made here:

* **Equal weights.** The paper's server weights clients by their data size, which a peer
  does not know (the CPM never sees it either); every participant counts once, the
  student included, as FedAvg with equal shards.
* **The usual checks.** A sender's tensors must have the student's names, shapes and
  dtypes and be finite (:func:`peerlm.overlay.check_neighbour`); one that fails is refused
  with that reason and the others are merged. With none usable the adapter is unchanged
  (``identity``), as for the PDFL step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Final

import torch
from peerlm.overlay import AggregationError, AggregationReport, Refusal, check_neighbour

__all__ = ["fedsa_update"]

#: The suffix of a LoRA A factor in an adapter's state (``<module>.lora_A.weight``).
_A: Final = ".lora_A.weight"


def fedsa_update(
    own: Mapping[str, torch.Tensor],
    neighbours: Mapping[str, Mapping[str, torch.Tensor]],
    self_id: str = "self",
) -> tuple[dict[str, torch.Tensor], AggregationReport]:
    """Average the LoRA A factors of ``own`` and the usable ``neighbours``; keep the rest.

    Returns new tensors (``own`` is never modified) and the report: ``weights`` the equal
    shares of the participants, ``alpha`` 1.0 (the A factors are replaced by the mean),
    ``accepted``/``refused`` the senders, ``delta_norm`` the norm of the change.
    ``AggregationError`` when ``own`` holds no LoRA A factor."""
    names = [name for name in own if name.endswith(_A)]
    if not names:
        raise AggregationError("the adapter holds no LoRA A factor", reason="keys")
    accepted: list[str] = []
    refused: list[Refusal] = []
    for peer in sorted(neighbours):
        try:
            if peer == self_id:
                raise AggregationError(f"{peer}: the client itself", reason="self")
            check_neighbour(own, neighbours[peer], peer)
        except AggregationError as err:
            refused.append(Refusal(peer, err.reason, str(err)))
            continue
        accepted.append(peer)
    updated = {name: t.detach().clone() for name, t in own.items()}
    share = 1.0 / (len(accepted) + 1)
    report_weights = {self_id: share, **dict.fromkeys(accepted, share)}
    if not accepted:
        report = AggregationReport(
            weights={self_id: 1.0}, alpha=1.0, accepted=(), refused=tuple(refused), identity=True
        )
        return updated, report
    delta_sq = 0.0
    for name in names:
        stack = torch.stack([own[name].double(), *(neighbours[p][name].double() for p in accepted)])
        mean = stack.mean(dim=0)
        delta_sq += float(((mean - own[name].double()) ** 2).sum())
        updated[name] = mean.to(own[name].dtype)
    report = AggregationReport(
        weights=report_weights,
        alpha=1.0,
        accepted=tuple(accepted),
        refused=tuple(refused),
        delta_norm=math.sqrt(delta_sq),
    )
    return updated, report
