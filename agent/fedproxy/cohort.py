"""One FedProxy cohort round's pieces, shared by ``peerlm bench fedproxy`` and the
experiment's FedProxy strategies (``peerlm run-experiment --strategies fedproxy_*``).

* :func:`compress_by_influence` — the owner's proxy of a full model: Block Influence
  (Eq. 4) over tokenised public texts, the blocks of highest influence kept at ratio ``κ``,
  the proxy built from them (Section 4.1).
* :func:`merge_proxies` — the owner's merge of a round by one of :data:`PROXY_MERGES`:
  plain FedAvg of proxies, TIES without the heterogeneity terms, or H-TIES (Eq. 5–7,
  10–14), with the conflict scores ``C_d`` the owner publishes when the method has them.
* :func:`uses_pcr` — whether the method's members train with PCR (Eq. 8–9).

Sans-IO: modules and state dicts in and out, nothing saved, no module-level state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
from peerlm.agent.fedproxy.compress import block_influence, blocks_to_keep, token_batches
from peerlm.agent.fedproxy.hties import fedavg_proxies, h_ties, ties_merge
from peerlm.agent.fedproxy.proxy import build_proxy
from transformers import PreTrainedModel

__all__ = [
    "PROXY_MERGES",
    "CompressedProxy",
    "ProxyMerge",
    "compress_by_influence",
    "merge_proxies",
    "uses_pcr",
]

#: The owner's merges: plain FedAvg of proxies, TIES (density 1, no h / w / ρ), H-TIES, and
#: H-TIES whose members train with PCR against the published scores (the paper's method).
PROXY_MERGES: Final = ("fedavg", "ties", "h_ties", "h_ties_pcr")

StateDict = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class CompressedProxy:
    """The proxy of a full model, with the measured influence and the kept blocks."""

    proxy: PreTrainedModel
    influence: list[float]
    kept: tuple[int, ...]


def compress_by_influence(
    model: PreTrainedModel,
    tokenizer: Any,
    texts: Sequence[str],
    ratio: float,
    *,
    batch_size: int = 8,
) -> CompressedProxy:
    """The proxy of ``model`` at compression ratio ``ratio`` (the share of blocks removed),
    by Block Influence over ``texts`` (public data; whole texts, right-padded)."""
    rows = [tokenizer(text)["input_ids"] for text in texts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    influence = block_influence(model, token_batches(rows, batch_size=batch_size, pad_id=pad))
    kept = tuple(blocks_to_keep(influence, ratio))
    proxy = build_proxy(model, kept, ratio=ratio, influence=influence)
    return CompressedProxy(proxy, list(influence), kept)


@dataclass(frozen=True)
class ProxyMerge:
    """A merged global proxy and the conflict scores published with it (None: the method
    has none, FedAvg and TIES)."""

    state: dict[str, torch.Tensor]
    conflict: dict[str, torch.Tensor] | None


def uses_pcr(method: str) -> bool:
    """Whether members of ``method``'s cohort add the PCR penalty (Eq. 9) to their loss."""
    return method == "h_ties_pcr"


def merge_proxies(method: str, base: StateDict, clients: Sequence[StateDict]) -> ProxyMerge:
    """The owner's merge of ``clients`` (trained from ``base``) by ``method``, one of
    :data:`PROXY_MERGES`, with the defaults of :mod:`peerlm.agent.fedproxy.hties` (``r0 = 1``,
    ``δ = 0.2``, ``ρ = 1.1``; TIES at density ``r0``). Refuses (``ProxyError``) what the
    merges refuse; an unknown method is ``ValueError``."""
    if method not in PROXY_MERGES:
        raise ValueError(f"unknown proxy merge {method!r}; one of {', '.join(PROXY_MERGES)}")
    if method == "fedavg":
        return ProxyMerge(fedavg_proxies(base, clients), None)
    if method == "ties":
        return ProxyMerge(ties_merge(base, clients), None)
    result = h_ties(base, clients)
    return ProxyMerge(result.state, dict(result.analysis.conflict))
