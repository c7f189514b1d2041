"""The agent daemon's FedProxy role, apart from the round logic: the owner's proxy made at
start (``fedproxy.compress_ratio``) and the cohort report in the agent's summary.

What each party measures is what it may see (docs/fedproxy.md, "peerlm up --fedproxy"):

* a **member** measures every proxy it pulls (before training it) on its own validation
  texts: ``heldout_before`` is the owner's first proxy, ``heldout_after`` the final merge it
  keeps; it sees no other member's data and no full model;
* the **owner** measures on its own validation texts (in ``peerlm up --fedproxy``: public
  held-out problems, nobody's private data): its full model ``M`` before the rounds and the
  fused ``M'`` after (``heldout_*``), and its proxy before and after (``proxy_*``); it sees
  the members' updates, never their data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CohortReport", "fedproxy_bytes", "make_owner_proxy"]


@dataclass
class CohortReport:
    """What one agent did in its FedProxy cohort (the summary's ``fedproxy``)."""

    role: str  # "owner" or "member"
    # Cohort rounds completed (owner: closed and published; member: trained and offered).
    rounds: int = 0
    # ProxyExchange bytes streamed to / pulled from the cohort (the agent's own counters
    # ``peerlm_agent_fedproxy_bytes_sent_total`` and ``..._received_total``).
    bytes_sent: int = 0
    bytes_received: int = 0
    # Validation texts the losses below are measured on (mean token cross-entropy, nats).
    heldout_texts: int = 0
    heldout_before: float | None = None
    heldout_after: float | None = None
    # Owner: its proxy's loss before round 1 and the final global proxy's.
    proxy_before: float | None = None
    proxy_after: float | None = None
    # SHA-256 of the proxy payload by round: published (owner) or pulled (member).
    proxy_sha256: dict[str, str] = field(default_factory=dict)
    # Member: the loss of each pulled proxy, by round.
    losses: dict[str, float] = field(default_factory=dict)
    # Owner: one record per round closed (outcome, merged, missing, refused, weights).
    merges: list[dict[str, Any]] = field(default_factory=list)
    # The proxy's blocks in the full model, and the full model's block count.
    kept_blocks: list[int] = field(default_factory=list)
    source_layers: int = 0


def fedproxy_bytes(registry: Any) -> tuple[int, int]:
    """(sent, received) ProxyExchange bytes in ``registry``, both RPCs together."""
    totals = []
    for name in (
        "peerlm_agent_fedproxy_bytes_sent_total",
        "peerlm_agent_fedproxy_bytes_received_total",
    ):
        totals.append(
            sum(
                int(registry.get_sample_value(name, {"rpc": rpc}) or 0)
                for rpc in ("PullProxy", "PullUpdate")
            )
        )
    return totals[0], totals[1]


def make_owner_proxy(
    model: str | Path, texts: list[str], out: Path, ratio: float, *, max_length: int
) -> tuple[list[int], list[float]]:
    """The owner's proxy of ``model`` at compression ratio ``ratio`` by Block Influence
    (FedProxy Eq. 4) over ``texts`` (public: the transfer set), each truncated to
    ``max_length`` tokens, written with the tokenizer to ``out`` (renamed into place);
    (kept blocks, influence per block). What ``peerlm models compress`` does, in process."""
    from peerlm.agent.fedproxy.compress import block_influence, blocks_to_keep, token_batches
    from peerlm.agent.fedproxy.member import save_model_atomic
    from peerlm.agent.fedproxy.proxy import ProxyError, build_proxy
    from transformers import AutoModelForCausalLM, AutoTokenizer

    full = AutoModelForCausalLM.from_pretrained(model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rows = [tokenizer(t, truncation=True, max_length=max_length)["input_ids"] for t in texts]
    batches = token_batches([r for r in rows if r], batch_size=8, pad_id=int(pad))
    if not batches:
        raise ProxyError("no public text to measure Block Influence on", reason="empty")
    influence = block_influence(full, batches)
    kept = blocks_to_keep(influence, ratio)
    proxy = build_proxy(full, kept, ratio=ratio, influence=influence)
    save_model_atomic(proxy, out)
    tokenizer.save_pretrained(out)
    return list(kept), list(influence)
