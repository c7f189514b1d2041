"""One SemanticDFL round step of the agent: signature, search, pull, aggregate (Sec. 3.4).

After local training (and AKD integration, if the round had a directive) the agent:

1. flattens its adapter (:func:`~peerlm.overlay.signature.flatten_adapter`) and folds it into
   the importance EMA (:class:`~peerlm.overlay.signature.ImportanceTracker`, whose state
   the daemon saves in the round checkpoint, so a restart resumes it);
2. builds the raw masked signature ``mask(w, Top_P(s))`` and publishes it
   (``OverlayHost.set_signature``) together with its ``P_min`` (Alg. 1 for ``tau_min``);
3. asks the overlay for its ``k`` most similar peers (``OverlayHost.query``, bounded by
   ``overlay.query_timeout_s`` or else the round timeout);
4. pulls their adapters and applies the PDFL step
   (:func:`~peerlm.agent.merging.pull_aggregate.pull_and_aggregate`).

**P.** The paper fixes one network-wide ``P = min(Quantile_q({P_i^min}), P_max)``
agreed through the super-peers (App. B.1). The agent uses (:func:`choose_p`)
``overlay.signature_p`` when set, which every agent of the federation must share (a
network-wide P fixed by configuration); else the network-wide P the overlay announced with
its last epoch (``network_p`` of ``OverlayHost.describe``, from the members' reported
``P_min``); before the first announcement, its own ``P_min`` (the cosine is still defined
across different supports, only less comparable).

Nothing here ends a round: no overlay membership yet, a refused signature, a query that
times out or answers nothing, and every pull refusal are logged and counted
(``peerlm_agent_overlay_steps_total{outcome}``) and leave the adapter as it was.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from peerlm.agent.acceptance import AcceptanceGate
from peerlm.agent.merging.pull_aggregate import (
    Candidate,
    ModelRunner,
    PullReport,
    PullSettings,
    pull_and_aggregate,
)
from peerlm.agent.modelhost import ModelHost
from peerlm.agent.settings import AgentOverlaySettings
from peerlm.agent.training import TrainSettings
from peerlm.overlay import (
    ImportanceTracker,
    OverlayHost,
    SignatureError,
    flatten_adapter,
    make_signature,
    minimal_p,
)

from peerlm.node import NodeContext

__all__ = [
    "OverlayStepResult",
    "overlay_round_step",
    "publish_signature",
    "pull_settings",
    "signature_inputs",
]


@dataclass
class OverlayStepResult:
    """What one overlay step did. ``outcome``: ``aggregated`` (the adapter changed),
    ``identity`` (pulled nothing usable), ``no_candidates``, ``query_timeout``,
    ``query_refused`` (the core refused the search, e.g. not placed yet), ``signature_error``.
    """

    outcome: str
    p: int = 0
    p_min: int = 0
    neighbours: list[str] = field(default_factory=list)
    similarities: dict[str, float] = field(default_factory=dict)
    pulled: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    bytes_received: int = 0
    detail: str = ""


def pull_settings(overlay: AgentOverlaySettings, timeout_s: float) -> PullSettings:
    """The agent's overlay settings as :class:`PullSettings` (K = ``k``)."""
    # Unset PDFL parameters keep PullSettings' defaults, the overlay's DEFAULT_* (one place).
    step = {k: v for k in ("kappa", "eta", "psi") if (v := getattr(overlay, k)) is not None}
    return PullSettings(
        max_peers=overlay.k,
        timeout_s=timeout_s,
        max_adapter_bytes=overlay.max_adapter_bytes,
        max_norm_ratio=overlay.max_norm_ratio,
        max_update_ratio=overlay.max_update_ratio,
        signature_tolerance=overlay.signature_tolerance,
        max_weight_share=overlay.max_weight_share,
        method=overlay.aggregation,
        hka_alpha=overlay.hka_alpha,
        hka_steps=overlay.hka_steps,
        **step,
    )


def choose_p(p_min: int, network: int | None, configured: int | None, dim: int) -> int:
    """The signature cardinality: a configured ``signature_p`` (a deployment constant), else
    the network-wide P the overlay announced with the epoch (Sec. 3.2: the ``q``-quantile
    of the members' ``P_min``, so every signature has the same cardinality and similarities
    compare), else, before the first build, this agent's own ``P_min``."""
    return max(1, min(configured or network or p_min, dim))


def signature_inputs(
    host: ModelHost,
    tracker: ImportanceTracker,
    overlay: AgentOverlaySettings,
    network: int | None,
) -> tuple[Any, int, int]:
    """On the model thread: flatten, update the EMA, choose P; (signature, P, P_min).
    ``network`` is the network-wide P the overlay announced (None before its first build).
    The experiment's overlay view computes its signatures with this same step."""
    weights, space = flatten_adapter(host.adapter_state())
    scores = tracker.update(weights)
    p_min = minimal_p(weights, scores, overlay.tau_min)
    p = choose_p(p_min, network, overlay.signature_p, int(weights.shape[0]))
    return make_signature(weights, scores, p, space), p, p_min


async def publish_signature(
    overlay_host: OverlayHost,
    model: ModelHost,
    tracker: ImportanceTracker,
    settings: AgentOverlaySettings,
    run_model: ModelRunner,
) -> tuple[int, int]:
    """Fold the current adapter into the importance EMA and publish its signature;
    ``(P, P_min)``. Raises ``ValueError`` (``SignatureError`` included) if refused.

    The agent also calls this once on joining, before its first round: a node without a
    signature when its zone is built is never placed in a leaf cluster (docs/overlay.md).
    """
    network = overlay_host.describe().get("network_p")
    signature, p, p_min = await run_model(
        signature_inputs, model, tracker, settings, network if isinstance(network, int) else None
    )
    overlay_host.set_signature(signature, p_min)
    return p, p_min


async def overlay_round_step(
    ctx: NodeContext,
    overlay_host: OverlayHost,
    model: ModelHost,
    tracker: ImportanceTracker,
    *,
    settings: AgentOverlaySettings,
    round_: int,
    round_timeout_s: float,
    run_model: ModelRunner,
    gate: AcceptanceGate | None = None,
    hka: tuple[Sequence[tuple[str, str]], TrainSettings] | None = None,
    pull: bool = True,
    integrate_model: ModelRunner | None = None,
) -> OverlayStepResult:
    """Publish this round's signature, search the ``k`` nearest peers, pull and aggregate.

    Never raises for an overlay or peer failure (see the module docstring); the result says
    what happened. ``ctx`` (the agent's node context) makes the pulls and counts the steps.
    ``hka`` (public pairs, training settings) is what ``aggregation = "svd_hka"`` distils on.
    ``pull`` False (an agent whose one-shot aggregation is done, ``aggregate_once``) only
    publishes the signature, so the others still find this agent's current adapter: outcome
    ``published``, nothing searched or pulled. ``integrate_model`` (default
    ``run_model``) runs the pull-and-aggregate's host calls: the daemon's peer-slot runner
    (:mod:`peerlm.agent.peer_integration`), while the signature stays the own adapter's.
    """
    log = ctx.log
    steps = ctx.counter(
        "peerlm_agent_overlay_steps_total",
        "Per-round overlay steps of the agent, by outcome",
        ("outcome",),
    )

    def done(result: OverlayStepResult) -> OverlayStepResult:
        steps.labels(result.outcome).inc()
        level = "info" if result.outcome in ("aggregated", "identity", "published") else "warning"
        getattr(log, level)(
            "overlay_step",
            round=round_,
            outcome=result.outcome,
            p=result.p,
            neighbours=result.neighbours,
            pulled=result.pulled,
            refused=result.refused,
            detail=result.detail or None,
        )
        return result

    try:
        p, p_min = await publish_signature(overlay_host, model, tracker, settings, run_model)
    except (SignatureError, ValueError) as err:
        return done(OverlayStepResult("signature_error", detail=str(err)))
    if not pull:
        return done(OverlayStepResult("published", p, p_min))
    timeout = min(settings.query_timeout_s or round_timeout_s, round_timeout_s)
    try:
        found = await overlay_host.query(settings.k + 1, timeout=timeout)
    except TimeoutError:
        return done(OverlayStepResult("query_timeout", p, p_min, detail=f"after {timeout:g} s"))
    except ValueError as err:
        return done(OverlayStepResult("query_refused", p, p_min, detail=str(err)))
    # k + 1: the search may count this node itself among the nearest.
    candidates = [
        Candidate(c.node_id, c.address, float(c.similarity))
        for c in found
        if c.node_id != overlay_host.node_id and math.isfinite(float(c.similarity))
    ][: settings.k]
    result = OverlayStepResult(
        "no_candidates",
        p,
        p_min,
        neighbours=[c.peer for c in candidates],
        similarities={c.peer: round(c.similarity, 6) for c in candidates},
    )
    if not candidates:
        return done(result)
    try:
        report: PullReport = await pull_and_aggregate(
            ctx,
            model,
            candidates,
            settings=pull_settings(settings, round_timeout_s),
            run_model=integrate_model or run_model,
            round_=round_,
            gate=gate,
            hka=hka,
            # The search ranked the candidates by this signature: each pulled adapter must
            # match the similarity its published signature claimed.
            query=overlay_host.signature,
        )
    except asyncio.CancelledError:
        raise
    except Exception as err:  # our own adapter invalid: reported, the round goes on
        result.outcome, result.detail = "aggregate_error", f"{type(err).__name__}: {err}"
        return done(result)
    result.pulled = [p_.peer for p_ in report.pulled]
    result.refused = {r.peer: r.reason for r in report.refused}
    result.bytes_received = report.bytes_received
    result.outcome = (
        "aggregated" if report.applied else "rolled_back" if report.rolled_back else "identity"
    )
    return done(result)
