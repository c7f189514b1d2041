"""Pull the adapters an overlay search returned and integrate them (SemanticDFL, pull step).

After a similarity search the agent holds up to K candidates ``(peer, address, similarity)``.
:func:`pull_and_aggregate` pulls each candidate's latest adapter over
``PeerExchange.PullAdapter`` (mTLS, chunked, SHA-256 verified by
:func:`~peerlm.agent.peer.client.pull_adapter_with_round`), decodes and checks it with the
adapter codec (:mod:`peerlm.agent.adapter_codec`, safetensors, never pickle), and then
applies the PDFL step of :func:`peerlm.overlay.aggregation.personalised_update`
(``w <- (1 - alpha) w + alpha sum_j W_ij w_j``) to the local adapter.

Each candidate is judged on its own. Every failure (unreachable, timed out, refused by the
peer, too large, corrupt stream, undecodable, another base model, tokenizer or LoRA
scaling, other tensor names or shapes, non-finite values, a norm far above ours) is logged
with the round and peer, counted in ``peerlm_agent_overlay_pull_failures_total{reason}``
and listed in the :class:`PullReport`; it never aborts the others. The local adapter changes
only when at least one neighbour was integrated (``peerlm_agent_overlay_pulled_adapters_total``);
with none the update is the identity and the host is not touched.

Choices made here:

* **Bounded fan-out and size.** At most ``max_peers`` candidates (highest similarity first;
  duplicates keep their best similarity, our own name is skipped), ``concurrency`` pulls at
  a time, each within ``timeout_s``. A compatible adapter has our tensor names and shapes,
  so it is at most the largest adapter our spec can produce (every tensor float32 plus the
  header bound, :meth:`~peerlm.agent.adapter_codec.AdapterSpec.max_encoded_bytes`); a
  payload announced above that, or above ``max_adapter_bytes`` when set, is refused at its
  first chunk.
* **One codec.** :func:`~peerlm.agent.adapter_codec.decode_adapter` checks the blob: the
  safetensors metadata must be peerlm's adapter format and name our model type, tokenizer
  and LoRA ``r``/``alpha`` (equal shapes with another scaling ``alpha / r`` or another base
  model would average numbers that mean different things), the tensor table our names,
  shapes and a float dtype, the values finite.
* **Norm bound relative to ours.** A neighbour whose overall Euclidean norm exceeds
  ``max_norm_ratio`` (default 10) times our own is refused (reason ``norm``): finite but
  huge values (1e30) pass every other check and would swamp the anchor. Honest peers start
  from the same LoRA initialisation distribution and drift by training, far less than 10x.
* **Update bound per module.** The factor bound alone can be split between ``A`` and ``B``
  so that the update ``(alpha / r) B A`` grows with its square (57x an honest teacher's,
  measured). Each module's update norm (from the factors, ``r x r`` Gram matrices) may be
  at most ``max_update_ratio`` (default 4) times ours there, or the root mean square of
  ours over modules, whichever is larger, and at least what our own ``A`` makes with a
  ``B`` as large as itself (:func:`~peerlm.agent.adapter_codec.update_bounds`); over it
  the neighbour is refused, reason ``update_norm``. CPM merge directives pull through this
  same step, so their senders are bounded the same way.
* **One model-thread call.** Reading the local adapter, aggregating and loading the result
  run as one call of ``run_model`` (the daemon passes its model-worker executor), so no
  training step can interleave between read and write.
* **Two aggregation methods** (``PullSettings.method``). ``pmix`` is the PDFL step above.
  ``svd_hka`` is OnePeFT on the peer (:func:`peerlm.agent.merging.onepeft.one_shot`): our adapter
  and the neighbours' are aggregated by SVD (Eq. 3) with weights ``W_ij`` (the same
  similarity softmax as PDFL, our own entry included: peers do not disclose their data
  size, the paper's default lambda) and refined by HKA (Eq. 4-6) on the agent's public
  pairs, ``hka_steps`` optimiser steps at ``hka_alpha``. The neighbours' adapters pass the
  same checks (same base, LoRA ``r``/``alpha``, shapes, finite, norm bound) first.
* **Advertised signature checked, weight capped.** An overlay search ranks and PDFL weighs
  a peer by the similarity of the signature it *published*; with the querier's signature
  (``query``) each pulled adapter's similarity is recomputed from the adapter, and a peer
  that advertised more than that plus ``signature_tolerance`` (0.2) is refused
  (``signature_mismatch``, :mod:`peerlm.agent.overlay_client.advertised_signature`). No neighbour
  weighs
  more than ``max_weight_share`` (2) equal shares of the row, the excess going to our own
  entry (``peerlm_agent_overlay_weights_capped_total``).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar

import torch
from peerlm.agent.acceptance import AcceptanceGate, Verdict
from peerlm.agent.adapter_codec import (
    ADAPTER_FORMAT,
    AdapterError,
    AdapterSpec,
    adapter_norm,
    decode_adapter,
    update_bounds,
)
from peerlm.agent.merging.fedsa import fedsa_update
from peerlm.agent.merging.lora_merge import ClientAdapter
from peerlm.agent.modelhost import ModelHost
from peerlm.agent.overlay_client.advertised_signature import SignatureMismatch, check_advertised
from peerlm.agent.peer.client import PeerExchangeError
from peerlm.agent.peer.transport import GrpcPeers, PeerTransport
from peerlm.agent.training import TrainSettings
from peerlm.overlay import (
    DEFAULT_ETA,
    DEFAULT_KAPPA,
    DEFAULT_PSI,
    AggregationError,
    AggregationReport,
    Refusal,
    Signature,
    neighbour_weights,
    personalised_update,
)
from pydantic import BaseModel, ConfigDict, Field

from peerlm.node import NodeContext
from peerlm.protocols import DEFAULT_OVERLAY_AGGREGATION, FEDSA, SVD_HKA, lookup

__all__ = [
    "ADAPTER_FORMAT",
    "Candidate",
    "ModelRunner",
    "PullReport",
    "PullSettings",
    "PulledAdapter",
    "integrate_adapters",
    "pull_and_aggregate",
]

T = TypeVar("T")


class Candidate(NamedTuple):
    """One result of an overlay search: a peer's name, its PeerExchange address, s_ij."""

    peer: str
    address: str
    similarity: float


class PullSettings(BaseModel):
    """Limits and PDFL coefficients of one pull-and-aggregate step."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_peers: int = Field(default=16, ge=1, le=1024, description="Most candidates pulled (K).")
    concurrency: int = Field(default=4, ge=1, le=64, description="Pulls in flight at once.")
    timeout_s: float = Field(default=60.0, gt=0, description="Deadline of one whole pull.")
    max_adapter_bytes: int | None = Field(
        default=None,
        ge=1024,
        description="Largest adapter accepted from a peer; None: the largest our model and "
        "LoRA settings can produce (AdapterSpec.max_encoded_bytes).",
    )
    max_norm_ratio: float | None = Field(
        default=10.0,
        gt=0,
        description="A neighbour's adapter norm may be at most this times ours; None: no bound.",
    )
    max_update_ratio: float | None = Field(
        default=4.0,
        gt=0,
        description="Per LoRA module, a neighbour's update (alpha/r) B A may be at most this "
        "times ours (adapter_codec.update_bounds); None: no bound.",
    )
    kappa: float = Field(default=DEFAULT_KAPPA, gt=0, description="Softmax temperature.")
    eta: float = Field(default=DEFAULT_ETA, gt=0, description="Proximal step size.")
    psi: float = Field(default=DEFAULT_PSI, ge=0, description="Personalisation weight.")
    method: str = Field(
        default=DEFAULT_OVERLAY_AGGREGATION,
        description="A merge protocol of the catalogue (peerlm.protocols): pmix, the PDFL "
        "step; svd_hka: OnePeFT's SVD aggregation and HKA.",
    )
    hka_alpha: float = Field(default=0.5, ge=0, le=1, description="OnePeFT Eq. 6's alpha.")
    hka_steps: int = Field(default=8, ge=1, le=10_000, description="HKA optimiser steps.")
    signature_tolerance: float | None = Field(
        default=0.2,
        ge=0,
        description="With the querier's signature (an overlay pull), a neighbour whose "
        "advertised similarity exceeds the one recomputed from its adapter by more than "
        "this is refused (signature_mismatch); None: not checked.",
    )
    max_weight_share: float | None = Field(
        default=2.0,
        ge=1,
        description="No neighbour's W_ij above this many equal shares of the row; the excess "
        "goes to our own entry (overlay.aggregation.neighbour_weights); None: no cap.",
    )


@dataclass(frozen=True)
class PulledAdapter:
    """A neighbour integrated into the local adapter."""

    peer: str
    address: str
    round: int
    bytes: int
    similarity: float


@dataclass(frozen=True)
class PullReport:
    """Outcome of :func:`pull_and_aggregate`.

    ``pulled``: neighbours in the anchor; ``refused``: every candidate left out, with the
    reason; ``weights``: ``W_ij`` by peer (our own name included; ``{self: 1.0}`` when
    nothing was integrated); ``alpha``: the mixing weight; ``bytes_received``: payload bytes
    of all completed pulls (integrated or not); ``applied``: whether the local adapter was
    replaced; ``delta_norm``: Euclidean norm of the change.
    """

    pulled: tuple[PulledAdapter, ...]
    refused: tuple[Refusal, ...]
    weights: dict[str, float]
    alpha: float
    bytes_received: int
    applied: bool
    delta_norm: float
    rolled_back: bool = False
    #: Held-out loss right before and after the aggregate, when a gate measured them
    #: (``loss_post`` bounded as :func:`~peerlm.agent.acceptance.judge` reports it); NaN
    #: otherwise. A CPM merge directive reports Eq. 3's reward from these.
    loss_pre: float = math.nan
    loss_post: float = math.nan


class ModelRunner(Protocol):
    """Runs a model-host call where the host may be used (the daemon's model thread)."""

    def __call__(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Awaitable[T]: ...


async def _inline(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    return fn(*args, **kwargs)


class _Metrics:
    def __init__(self, ctx: NodeContext) -> None:
        self._failures = ctx.counter(
            "peerlm_agent_overlay_pull_failures_total",
            "Overlay neighbours not integrated, by reason",
            ("reason",),
        )
        self._pulled = ctx.counter(
            "peerlm_agent_overlay_pulled_adapters_total",
            "Neighbour adapters integrated by personalised aggregation",
        )
        self._rolled_back = ctx.counter(
            "peerlm_agent_integrations_rolled_back_total",
            "Integrations undone by the acceptance gate (held-out loss worse by more than "
            "the margin), by kind (akd, overlay).",
            ("kind",),
        )
        self._steps = ctx.counter(
            "peerlm_agent_overlay_aggregations_total",
            "Pull-and-aggregate steps, by outcome (applied, identity, failed, rolled_back)",
            ("outcome",),
        )

    def failure(self, reason: str) -> None:
        self._failures.labels(reason).inc()

    def pulled(self, n: int) -> None:
        if n:
            self._pulled.inc(n)

    def rolled_back(self, kind: str) -> None:
        self._rolled_back.labels(kind).inc()

    def step(self, outcome: str) -> None:
        self._steps.labels(outcome).inc()


class _Refused(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class _Local:
    """What a neighbour is checked against: our adapter's spec and a norm bound from it."""

    spec: AdapterSpec
    max_norm: float | None
    max_update_norms: dict[str, float] | None = None


def _local_view(
    host: ModelHost, max_norm_ratio: float | None, max_update_ratio: float | None = None
) -> _Local:
    own = host.adapter_state()
    norm = adapter_norm(own)
    # A fresh adapter still has its random LoRA A, so its norm is not 0; the floor only
    # keeps the bound meaningful for a degenerate local adapter.
    bound = None if max_norm_ratio is None else max_norm_ratio * max(norm, 1e-3)
    spec = host.adapter_spec()
    # The factor bound alone lets a sender split it between A and B so that their product,
    # the update it applies, grows with its square: each module's B A is bounded too.
    updates = (
        None
        if max_update_ratio is None
        else update_bounds(own, spec.lora_alpha / spec.lora_r, max_update_ratio)
    )
    return _Local(spec=spec, max_norm=bound, max_update_norms=updates)


def _decode(payload: bytes, local: _Local, max_bytes: int) -> dict[str, torch.Tensor]:
    """Decode and check one pulled adapter (the codec); raises :class:`_Refused`."""
    try:
        return decode_adapter(
            payload,
            local.spec,
            identity="required",
            max_bytes=max_bytes,
            max_norm=local.max_norm,
            max_update_norms=local.max_update_norms,
        )
    except AdapterError as err:
        raise _Refused(err.reason, str(err)) from None


def _select(
    candidates: Sequence[Candidate | tuple[str, str, float]],
    self_name: str,
    max_peers: int,
) -> tuple[list[Candidate], list[Refusal]]:
    """Deduplicate (best similarity wins), drop ourselves and bad entries, keep the top K."""
    refused: list[Refusal] = []
    best: dict[str, Candidate] = {}
    for raw in candidates:
        cand = Candidate(*raw)
        try:
            similarity = float(cand.similarity)
        except (TypeError, ValueError):
            similarity = math.nan
        if cand.peer == self_name:
            refused.append(Refusal(cand.peer, "self", "the search returned this agent itself"))
            continue
        if not math.isfinite(similarity):
            refused.append(Refusal(cand.peer, "bad_similarity", f"similarity {cand.similarity!r}"))
            continue
        cand = Candidate(cand.peer, cand.address, similarity)
        kept = best.get(cand.peer)
        if kept is not None:
            loser = kept if similarity > kept.similarity else cand
            refused.append(Refusal(loser.peer, "duplicate", f"listed again at {loser.address}"))
            if loser is cand:
                continue
        best[cand.peer] = cand
    ranked = sorted(best.values(), key=lambda c: (-c.similarity, c.peer))
    for extra in ranked[max_peers:]:
        refused.append(
            Refusal(extra.peer, "over_limit", f"beyond the {max_peers} most similar candidates")
        )
    return ranked[:max_peers], refused


def _one_shot(
    host: ModelHost,
    own: dict[str, torch.Tensor],
    neighbours: Mapping[str, Mapping[str, torch.Tensor]],
    similarities: Mapping[str, float],
    settings: PullSettings,
    self_name: str,
    hka: tuple[Sequence[tuple[str, str]], TrainSettings],
) -> AggregationReport:
    """OnePeFT's SVD + HKA of our adapter and the neighbours' (see the module docstring)."""
    from peerlm.agent.merging.onepeft import one_shot

    weights = neighbour_weights(
        similarities,
        self_id=self_name,
        kappa=settings.kappa,
        max_share=settings.max_weight_share,
    )
    names = [self_name, *neighbours]
    states = {self_name: own, **neighbours}
    clients = [
        ClientAdapter(states[n], r=host.lora.r, alpha=host.lora.alpha, name=n) for n in names
    ]
    public, train = hka
    one_shot(
        host,
        clients,
        public,
        train,
        alpha=settings.hka_alpha,
        weights=[weights[n] for n in names],
        steps=settings.hka_steps,
    )
    new = host.adapter_state()
    delta = math.sqrt(sum(float(torch.sum((new[k] - own[k]) ** 2)) for k in own))
    return AggregationReport(weights, 1.0, tuple(neighbours), (), delta)


def integrate_adapters(
    host: ModelHost,
    neighbours: Mapping[str, Mapping[str, torch.Tensor]],
    similarities: Mapping[str, float],
    settings: PullSettings,
    self_name: str,
    gate: AcceptanceGate | None = None,
    hka: tuple[Sequence[tuple[str, str]], TrainSettings] | None = None,
) -> tuple[AggregationReport, Verdict | None, float]:
    """Read, aggregate, load and judge in one model-thread call; the host changes only if
    useful, and with a ``gate`` stays changed only if the held-out loss allows. Returns
    the report, the gate's verdict and the held-out loss before (NaN without a gate).
    ``neighbours`` must already have passed the codec's checks (:func:`pull_and_aggregate`
    does that, over the network or the experiment's in-process transport)."""
    own = host.adapter_state()
    if settings.method == SVD_HKA.name:
        if hka is None:
            raise ValueError(f"{SVD_HKA.name} needs public pairs and training settings")
        pre = gate.loss(host) if gate is not None else math.nan
        report = _one_shot(host, own, neighbours, similarities, settings, self_name, hka)
        return report, (gate.settle(host, own, pre) if gate is not None else None), pre
    if settings.method == FEDSA.name:
        updated, report = fedsa_update(own, neighbours, self_name)
    else:
        updated, report = personalised_update(
            own,
            neighbours,
            similarities,
            kappa=settings.kappa,
            eta=settings.eta,
            psi=settings.psi,
            self_id=self_name,
            max_share=settings.max_weight_share,
        )
    if not report.accepted:
        return report, None, math.nan
    pre = gate.loss(host) if gate is not None else math.nan
    host.load_adapter_state(updated)
    return report, (gate.settle(host, own, pre) if gate is not None else None), pre


async def pull_and_aggregate(
    ctx: NodeContext,
    host: ModelHost,
    candidates: Sequence[Candidate | tuple[str, str, float]],
    *,
    settings: PullSettings | None = None,
    run_model: ModelRunner | None = None,
    round_: int = 0,
    gate: AcceptanceGate | None = None,
    hka: tuple[Sequence[tuple[str, str]], TrainSettings] | None = None,
    kind: str = "overlay",
    query: Signature | None = None,
    peers: PeerTransport | None = None,
) -> PullReport:
    """Pull the candidates' latest adapters and apply the PDFL step to ``host``'s adapter.

    ``ctx`` is the agent's node context: its channels, metrics, logger and its name (the
    client's own id in the weights); over the default transport every adapter must carry
    the sender proof of the peer the search named. ``run_model`` runs host calls on the
    model thread (default: inline, for callers that own the host on the event loop's
    thread). ``round_`` only labels log
    lines. Failures of single peers are reported, never raised; an invalid local adapter
    (non-finite) raises :class:`~peerlm.overlay.aggregation.AggregationError`. With a
    ``gate`` (:mod:`peerlm.agent.acceptance`) an aggregate that makes the held-out loss worse
    by more than its margin is rolled back: ``applied`` is False, ``rolled_back`` True, the
    neighbours are listed as refused with reason ``rolled_back``. ``method="svd_hka"`` needs
    ``hka``: the public (prompt, completion) pairs of D_pub and the training settings of the
    HKA steps (a ``ValueError`` before anything is pulled otherwise). ``kind`` labels a
    rollback in ``peerlm_agent_integrations_rolled_back_total`` (``overlay``, or
    ``merge`` for a CPM merge directive). ``query``: the signature the search was made
    with; each pulled adapter must then match the similarity its candidate advertised
    (:mod:`peerlm.agent.overlay_client.advertised_signature`, ``settings.signature_tolerance``),
    else it
    is refused ``signature_mismatch``.
    """
    cfg = settings or PullSettings()
    if lookup(cfg.method).needs_public_pairs and (hka is None or not hka[0]):
        raise ValueError(
            f"aggregation {cfg.method} needs public (prompt, completion) pairs for HKA"
        )
    run: ModelRunner = run_model or _inline
    logger: Any = ctx.log
    self_name = ctx.name
    metrics = _Metrics(ctx)
    chosen, refused = _select(candidates, self_name, cfg.max_peers)
    local = await run(_local_view, host, cfg.max_norm_ratio, cfg.max_update_ratio)
    max_bytes = local.spec.max_encoded_bytes()
    if cfg.max_adapter_bytes is not None:
        max_bytes = min(max_bytes, cfg.max_adapter_bytes)
    slots = asyncio.Semaphore(cfg.concurrency)
    transport: PeerTransport = peers if peers is not None else GrpcPeers(ctx)

    async def pull_one(cand: Candidate) -> tuple[Candidate, int, bytes]:
        async with slots:
            sent_round, payload = await transport.pull_adapter(
                cand.address,
                # The search named this peer; the adapter must come from it (signed).
                expect=cand.peer,
                max_bytes=max_bytes,
                timeout_s=cfg.timeout_s,
            )
        return cand, sent_round, payload

    outcomes = await asyncio.gather(*(pull_one(c) for c in chosen), return_exceptions=True)
    neighbours: dict[str, dict[str, torch.Tensor]] = {}
    received: dict[str, PulledAdapter] = {}
    bytes_received = 0
    for cand, outcome in zip(chosen, outcomes, strict=True):
        if isinstance(outcome, BaseException):
            if isinstance(outcome, asyncio.CancelledError):
                raise outcome
            if isinstance(outcome, PeerExchangeError):
                refused.append(Refusal(cand.peer, outcome.reason, str(outcome)))
            else:  # e.g. a malformed address rejected by the channel factory
                refused.append(Refusal(cand.peer, "error", f"{type(outcome).__name__}: {outcome}"))
            continue
        _, sent_round, payload = outcome
        bytes_received += len(payload)
        try:
            state = _decode(payload, local, max_bytes)
            if query is not None and cfg.signature_tolerance is not None:
                check_advertised(query, state, cand.similarity, cfg.signature_tolerance)
        except _Refused as err:
            refused.append(Refusal(cand.peer, err.reason, err.detail))
            continue
        except SignatureMismatch as err:
            refused.append(Refusal(cand.peer, err.reason, str(err)))
            continue
        neighbours[cand.peer] = state
        received[cand.peer] = PulledAdapter(
            cand.peer, cand.address, sent_round, len(payload), cand.similarity
        )

    report: AggregationReport | None = None
    applied = load_failed = rolled_back = False
    loss_pre = loss_post = math.nan
    if neighbours:
        similarities = {peer: received[peer].similarity for peer in neighbours}
        try:
            aggregated, verdict, loss_pre = await run(
                integrate_adapters, host, neighbours, similarities, cfg, self_name, gate, hka
            )
            report = aggregated
            if verdict is not None:
                loss_post = verdict.loss_post
            applied = bool(aggregated.accepted)
            rolled_back = verdict is not None and verdict.rolled_back
        except AggregationError:
            raise  # our own adapter is invalid: not a neighbour's fault
        except Exception as err:  # loading into the host failed; the host validated first
            for peer in neighbours:
                refused.append(Refusal(peer, "load", f"loading the aggregate failed: {err}"))
            logger.error("overlay_aggregate_load_failed", round=round_, error=repr(err))
            report, load_failed = None, True
    pulled: tuple[PulledAdapter, ...]
    if report is not None and rolled_back:
        refused.extend(report.refused)
        for peer in report.accepted:
            refused.append(
                Refusal(peer, "rolled_back", "the aggregate made our held-out loss worse")
            )
        metrics.rolled_back(kind)
        pulled, weights, alpha, delta = (), {self_name: 1.0}, report.alpha, 0.0
        applied = False
    elif report is not None:
        refused.extend(report.refused)
        pulled = tuple(received[p] for p in report.accepted)
        weights, alpha, delta = report.weights, report.alpha, report.delta_norm
    else:
        pulled, weights = (), {self_name: 1.0}
        alpha = cfg.eta * cfg.psi / (1.0 + cfg.eta * cfg.psi)
        delta = 0.0

    for item in refused:
        metrics.failure(item.reason)
        logger.warning(
            "overlay_pull_refused",
            round=round_,
            peer=item.peer,
            reason=item.reason,
            detail=item.detail,
        )
    metrics.pulled(len(pulled))
    if report is not None and report.capped and not rolled_back:
        ctx.counter(
            "peerlm_agent_overlay_weights_capped_total",
            "Neighbours whose PDFL weight the per-neighbour cap (max_weight_share) lowered",
        ).inc(len(report.capped))
    outcome_label = (
        "applied"
        if applied
        else "failed"
        if load_failed
        else "rolled_back"
        if rolled_back
        else "identity"
    )
    metrics.step(outcome_label)
    logger.info(
        "overlay_aggregated",
        round=round_,
        outcome=outcome_label,
        pulled=[p.peer for p in pulled],
        refused=len(refused),
        weights={k: round(v, 4) for k, v in weights.items()},
        alpha=round(alpha, 4),
        delta_norm=delta,
        bytes=bytes_received,
    )
    return PullReport(
        pulled=pulled,
        refused=tuple(refused),
        weights=weights,
        alpha=alpha,
        bytes_received=bytes_received,
        applied=applied,
        delta_norm=delta,
        rolled_back=rolled_back,
        loss_pre=loss_pre,
        loss_post=loss_post,
    )
