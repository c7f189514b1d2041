"""FedWave's exchange among a workflow's agents, without I/O: what is served, to whom,
what is pulled from whom, what is accepted, and the router aggregate (Eq. 9).

Importing it loads no torch (a server that only serves parts never needs it): the decoders
and the aggregate are imported by the functions that use them.

Each round an agent *publishes* its parts (:class:`PartStore`): its MoE router (with its
sample count ``n_i``) and its VCLayer (with its stage embedding). Every other agent of the
workflow pulls this agent's router; the agents of the adjacent stages pull its VCLayer
(Eq. 5-6 need only the neighbours' pieces). An agent that assembles π_SFT after its last
round (``fedwave.assembly``) also publishes its LoRA adapter, and every other agent pulls
its adapter and VCLayer once, after the last round (:func:`plan_expert_pulls`). No data
travels, ever.

* Serving: :func:`decide_pull` admits a caller only if its certificate name is an agent of
  the workflow, and answers the exact round asked for, or says why not (not published yet:
  retry; no longer kept; no such part). The gRPC transport
  (:mod:`~peerlm.agent.fedwave.exchange_service`) maps the decision to a status.
* Pulling: :func:`plan_pulls` lists what an agent needs for a round; :func:`accept_part`
  checks a received blob (from a workflow agent, its stage, its round, its shape, finite,
  within the size bound) with the existing decoders; the transport
  (:mod:`~peerlm.agent.fedwave.exchange_client`) runs the pulls under the round's deadline.
* Aggregating: :func:`aggregate_routers` over this agent's router and those that arrived:
  by default the coordinate-wise median (robust to a hostile minority, each member an equal
  share), or Eq. 9 (``fedavg_routers``, n_i-weighted); both depend on the set of routers
  only, so agents that aggregate the same set get the same bits.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from peerlm.agent.fedwave.errors import FedWaveError
from peerlm.agent.fedwave.params import VCLayerSettings
from peerlm.agent.fedwave.settings import DEFAULT_MAX_ROUTER_WEIGHT_RATIO, RouterRule
from peerlm.agent.fedwave.workflow import Workflow

from peerlm.chunks import HashedPayload

if TYPE_CHECKING:
    import torch
    from peerlm.agent.adapter_codec import AdapterSpec
    from peerlm.agent.fedwave.router_codec import DecodedRouter
    from peerlm.agent.fedwave.vclayer import VCLayer

__all__ = [
    "PART_CONTENT_TYPES",
    "AcceptedPart",
    "PartKind",
    "PartStore",
    "PullRefusal",
    "PullTarget",
    "RoundParts",
    "ShapeBounds",
    "accept_part",
    "aggregate_routers",
    "decide_pull",
    "parse_part_content_type",
    "part_content_type",
    "plan_expert_pulls",
    "plan_pulls",
    "router_weights",
]


class PartKind(enum.StrEnum):
    """What one pull fetches (the wire's ``PartKind``; also a metric label)."""

    ROUTER = "router"
    VCLAYER = "vclayer"
    ADAPTER = "adapter"


#: Media type of each part; the server appends ``; round=N``.
PART_CONTENT_TYPES: Final = {
    PartKind.ROUTER: "application/vnd.peerlm.fedwave-router+safetensors",
    PartKind.VCLAYER: "application/vnd.peerlm.fedwave-vclayer+safetensors",
    PartKind.ADAPTER: "application/vnd.peerlm.fedwave-adapter+safetensors",
}


def part_content_type(kind: PartKind, round_: int) -> str:
    """The content type naming ``kind`` and the round of a part's payload."""
    return f"{PART_CONTENT_TYPES[kind]}; round={round_}"


def parse_part_content_type(content_type: str) -> tuple[PartKind, int]:
    """(kind, round) of a part's content type; ``ValueError`` if it is not one."""
    base, _, params = content_type.partition(";")
    kinds = {v: k for k, v in PART_CONTENT_TYPES.items()}
    kind = kinds.get(base.strip())
    if kind is None:
        raise ValueError(f"content type {content_type!r} is not a FedWave part")
    for param in params.split(";"):
        key, _, value = param.strip().partition("=")
        if key == "round" and value.isdigit():
            return kind, int(value)
    raise ValueError(f"content type {content_type!r} names no round")


# --------------------------------------------------------------------------- serving


@dataclass(frozen=True)
class PullRefusal:
    """Why a pull is not served: ``status`` is a gRPC status name, ``reason`` a metric label."""

    status: str
    reason: str
    message: str


class PartStore:
    """The parts this agent has published, per round; the newest ``keep_rounds`` are kept.

    A round's parts are immutable once published: agents that pull them at different times
    must get the same bytes (or their aggregates would differ), so publishing a round again
    with other bytes is a ``ValueError``, and so is publishing a round older than the newest.
    """

    def __init__(self, keep_rounds: int = 2) -> None:
        if keep_rounds < 1:
            raise ValueError(f"keep_rounds must be at least 1, got {keep_rounds}")
        self._keep = keep_rounds
        self._rounds: dict[int, dict[PartKind, HashedPayload]] = {}

    @property
    def rounds(self) -> tuple[int, ...]:
        """The rounds held, ascending."""
        return tuple(sorted(self._rounds))

    def publish(self, round_: int, parts: Mapping[PartKind, bytes]) -> None:
        """Make ``parts`` (kind → blob) of ``round_`` available to the workflow's agents."""
        if round_ < 0:
            raise ValueError(f"round must be >= 0, got {round_}")
        if not parts:
            raise ValueError("nothing to publish")
        newest = max(self._rounds, default=-1)
        if round_ < newest:
            raise ValueError(f"round {round_} is older than the newest published ({newest})")
        hashed = {PartKind(k): HashedPayload.of(v) for k, v in parts.items()}
        held = self._rounds.get(round_)
        if held is not None:
            for kind, payload in hashed.items():
                if kind in held and held[kind].sha256 != payload.sha256:
                    raise ValueError(f"round {round_}'s {kind} is already published, differently")
            hashed = {**held, **hashed}
        self._rounds[round_] = hashed
        for old in sorted(self._rounds)[: -self._keep]:
            del self._rounds[old]

    def get(self, round_: int, kind: PartKind) -> HashedPayload | PullRefusal:
        """The payload of ``kind`` in ``round_``, or why there is none."""
        held = self._rounds.get(round_)
        if held is None:
            newest = max(self._rounds, default=None)
            if newest is None or round_ > newest:
                latest = "none yet" if newest is None else f"the newest is {newest}"
                return PullRefusal(
                    "UNAVAILABLE",
                    "not_yet",
                    f"round {round_} is not published yet ({latest}); retry within the "
                    "round's deadline",
                )
            return PullRefusal(
                "NOT_FOUND", "gone", f"round {round_} is no longer kept (held: {self.rounds})"
            )
        payload = held.get(kind)
        if payload is None:
            return PullRefusal("NOT_FOUND", "no_part", f"round {round_} has no {kind}")
        return payload


def decide_pull(
    workflow: Workflow,
    caller: str,
    store: PartStore,
    round_: int,
    kind: PartKind | None,
    *,
    me: str,
) -> HashedPayload | PullRefusal:
    """Admission and lookup of one pull: the payload to stream, or the refusal.

    ``caller`` is the certificate name of the caller (never a message field); ``me`` the
    serving agent; ``kind`` None is an unknown or unspecified wire value. An adapter is
    served only to the agents of the *other* stages (``same_stage``): they are the ones
    that assemble π_SFT with it (:func:`plan_expert_pulls`), and an agent of our own stage
    stands for that stage with its own expert, so it has no use for ours (a same-stage
    member is the likeliest competitor for the same data, and would otherwise get our
    adapter round by round).
    """
    if caller not in workflow.agents:
        return PullRefusal(
            "PERMISSION_DENIED",
            "not_in_workflow",
            f"{caller!r} is not an agent of this workflow; its parts are served only to "
            f"{', '.join(workflow.agents)}",
        )
    if kind is None:
        return PullRefusal(
            "INVALID_ARGUMENT", "bad_kind", "kind must be ROUTER, VCLAYER or ADAPTER"
        )
    if kind is PartKind.ADAPTER and caller != me:
        own = workflow.stage_of(me).name
        if workflow.stage_of(caller).name == own:
            return PullRefusal(
                "PERMISSION_DENIED",
                "same_stage",
                f"{caller!r} is of this agent's own stage ({own}); an expert's adapter is "
                "served only to the agents of the other stages, for their assembly of pi_SFT",
            )
    return store.get(round_, kind)


# --------------------------------------------------------------------------- pulling


@dataclass(frozen=True, order=True)
class PullTarget:
    """One part to pull: from ``agent``, of ``kind``."""

    agent: str
    kind: PartKind


def plan_pulls(workflow: Workflow, me: str) -> list[PullTarget]:
    """What agent ``me`` pulls each round: every other agent's router (Eq. 9) and the
    VCLayer of every agent of the adjacent stages (Eq. 5-6); sorted.

    ``KeyError`` if ``me`` is not in the workflow.
    """
    before, after = workflow.adjacent(me)
    targets = [PullTarget(a, PartKind.ROUTER) for a in workflow.agents if a != me]
    for stage in (before, after):
        if stage is not None:
            targets += [PullTarget(a, PartKind.VCLAYER) for a in stage.agents]
    return sorted(targets)


def plan_expert_pulls(workflow: Workflow, me: str) -> list[PullTarget]:
    """What agent ``me`` pulls after the last round to assemble π_SFT: the LoRA adapter and
    the VCLayer of every agent of the *other* stages (its own stage's expert is itself);
    sorted. ``KeyError`` if ``me`` is not in the workflow."""
    own = workflow.stage_of(me).name
    return sorted(
        PullTarget(agent, kind)
        for stage in workflow.stages
        if stage.name != own
        for agent in stage.agents
        for kind in (PartKind.ADAPTER, PartKind.VCLAYER)
    )


@dataclass(frozen=True)
class ShapeBounds:
    """What a received part must fit: this agent's router shapes, its width and VCLayer
    settings, its adapter's spec (None: adapters are not taken), and the size bounds
    (unset: the largest blob of these shapes)."""

    router_shapes: Mapping[str, tuple[int, ...]]
    hidden_size: int
    vclayer: VCLayerSettings
    max_router_bytes: int | None = None
    max_vclayer_bytes: int | None = None
    adapter: AdapterSpec | None = None

    def max_bytes(self, kind: PartKind) -> int:
        """The largest blob of ``kind`` accepted (announced size refused above it)."""
        from peerlm.agent.fedwave.router_codec import max_router_bytes
        from peerlm.agent.fedwave.vclayer import vclayer_max_bytes

        if kind is PartKind.ROUTER:
            own = max_router_bytes(dict(self.router_shapes))
            return own if self.max_router_bytes is None else min(own, self.max_router_bytes)
        if kind is PartKind.ADAPTER:
            # Every tensor in float32 plus the bounded header: the adapter codec's own rule.
            return 0 if self.adapter is None else self.adapter.max_encoded_bytes()
        own = vclayer_max_bytes(self.hidden_size, self.vclayer)
        return own if self.max_vclayer_bytes is None else min(own, self.max_vclayer_bytes)


@dataclass(frozen=True)
class AcceptedPart:
    """A checked part: a router (with ``n_i``), a VCLayer (with its stage) or a LoRA
    adapter's state."""

    agent: str
    kind: PartKind
    router: DecodedRouter | None = None
    vclayer: VCLayer | None = None
    adapter: dict[str, torch.Tensor] | None = None


def accept_part(
    workflow: Workflow,
    agent: str,
    kind: PartKind,
    round_: int,
    data: bytes,
    bounds: ShapeBounds,
) -> AcceptedPart:
    """Check and decode ``agent``'s ``kind`` blob for ``round_``; ``FedWaveError`` with a
    metric label on any misfit, before anything of it is used.

    Beyond the decoders' checks (size, format, names, dtypes, shapes, finite values): the
    sender is an agent of the workflow (``not_in_workflow``), a router is of the round
    asked for (``round``), a VCLayer names the sender's stage (``stage``). An adapter goes
    through the adapter codec (:func:`~peerlm.agent.adapter_codec.decode_adapter`: this
    agent's base model, tokenizer, LoRA settings, tensor names and shapes, finite values);
    its refusal keeps the codec's reason.
    """
    from peerlm.agent.adapter_codec import AdapterError, decode_adapter
    from peerlm.agent.fedwave.router_codec import decode_router
    from peerlm.agent.fedwave.vclayer import decode_vclayer

    if agent not in workflow.agents:
        raise FedWaveError(f"{agent!r} is not an agent of the workflow", reason="not_in_workflow")
    if kind is PartKind.ADAPTER:
        if bounds.adapter is None:
            raise FedWaveError("this agent takes no adapters", reason="bad_kind")
        try:
            state = decode_adapter(data, bounds.adapter, max_bytes=bounds.max_bytes(kind))
        except AdapterError as err:
            raise FedWaveError(
                f"adapter from {agent!r} refused: {err}", reason=err.reason
            ) from None
        return AcceptedPart(agent, kind, adapter=state)
    if kind is PartKind.ROUTER:
        if len(data) > bounds.max_bytes(kind):
            raise FedWaveError(
                f"router of {len(data)} bytes from {agent!r} exceeds {bounds.max_bytes(kind)}",
                reason="too_large",
            )
        router = decode_router(data, shapes=dict(bounds.router_shapes))
        if router.round != round_:
            raise FedWaveError(
                f"router from {agent!r} is of round {router.round}, asked for {round_}",
                reason="round",
            )
        return AcceptedPart(agent, kind, router=router)
    layer, stage = decode_vclayer(
        data,
        hidden_size=bounds.hidden_size,
        settings=bounds.vclayer,
        max_bytes=bounds.max_bytes(kind),
    )
    expected = workflow.stage_of(agent).name
    if stage != expected:
        raise FedWaveError(
            f"VCLayer from {agent!r} names stage {stage!r}; the workflow lists it in {expected!r}",
            reason="stage",
        )
    return AcceptedPart(agent, kind, vclayer=layer)


@dataclass
class RoundParts:
    """What one round's pulls brought: the accepted routers and VCLayers by agent, and the
    parts that did not arrive (``missing``: late, unreachable, refused by the peer) or were
    refused here (``rejected``), each with its reason."""

    round: int
    routers: dict[str, DecodedRouter] = field(default_factory=dict)
    vclayers: dict[str, VCLayer] = field(default_factory=dict)
    adapters: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    missing: dict[PullTarget, str] = field(default_factory=dict)
    rejected: dict[PullTarget, str] = field(default_factory=dict)

    def add(self, part: AcceptedPart) -> None:
        """File an accepted part."""
        if part.router is not None:
            self.routers[part.agent] = part.router
        if part.vclayer is not None:
            self.vclayers[part.agent] = part.vclayer
        if part.adapter is not None:
            self.adapters[part.agent] = part.adapter


def router_weights(claims: Mapping[str, int], max_ratio: float | None) -> dict[str, int]:
    """Each member's ``n_i`` in Eq. 9: its claimed sample count, capped at ``max_ratio``
    times the members' lower median claim (``fedwave.max_router_weight_ratio``; None: the
    claims as they are, the paper's weights).

    Why: ``n_i`` travels in the sender's own router (up to ``MAX_SAMPLES``) and nobody can
    check it, so one member claiming 1e9 samples would be all of the mean at every agent,
    whatever the norm bounds admit. The median of the claims is an honest member's while
    most members are honest, and the cap depends on the set of claims only, so every agent
    that averages the same routers computes the same weights (their aggregates stay equal).
    Honest members within ``max_ratio`` of the median keep the paper's weights."""
    if max_ratio is None or len(claims) < 2:
        return dict(claims)
    ordered = sorted(claims.values())
    cap = max(1, math.floor(max_ratio * ordered[(len(ordered) - 1) // 2]))
    return {name: min(n, cap) for name, n in claims.items()}


def aggregate_routers(
    me: str,
    own: Mapping[str, torch.Tensor],
    own_samples: int,
    pulled: Mapping[str, DecodedRouter],
    shapes: Mapping[str, tuple[int, ...]],
    *,
    max_weight_ratio: float | None = DEFAULT_MAX_ROUTER_WEIGHT_RATIO,
    rule: RouterRule = "median",
    stages: Mapping[str, str] | None = None,
) -> tuple[dict[str, torch.Tensor], tuple[str, ...]]:
    """This agent's router and the routers that arrived, aggregated: (the aggregate, the
    agents it takes, sorted). ``rule`` ``median`` (the default): the coordinate-wise median
    (:func:`~peerlm.agent.fedwave.router.median_routers`; with ``stages``, agent → stage,
    the median over the stages of each stage's median), every member an equal share
    whatever ``n_i`` it claims; ``fedavg``: Eq. 9, each ``n_i`` capped by
    :func:`router_weights`. ``FedWaveError`` if ``pulled`` holds this agent itself."""
    import torch
    from peerlm.agent.fedwave.router import fedavg_routers, median_routers

    if me in pulled:
        raise FedWaveError(f"a pulled router is attributed to this agent ({me!r})", reason="keys")
    if rule == "median":
        states: dict[str, Mapping[str, torch.Tensor]] = {
            name: router.state for name, router in pulled.items()
        }
        states[me] = {k: v.detach().to(device="cpu", dtype=torch.float32) for k, v in own.items()}
        return median_routers(states, shapes=shapes, stages=stages), tuple(sorted(states))
    if rule != "fedavg":
        raise FedWaveError(f"unknown router aggregation rule {rule!r}", reason="config")
    claims = {name: router.n_samples for name, router in pulled.items()}
    weights = router_weights({**claims, me: own_samples}, max_weight_ratio)
    members: dict[str, tuple[Mapping[str, torch.Tensor], int]] = {
        name: (router.state, weights[name]) for name, router in pulled.items()
    }
    # Our own router as the others see it (float32 on the CPU), so every agent sums the
    # same values.
    members[me] = (
        {k: v.detach().to(device="cpu", dtype=torch.float32) for k, v in own.items()},
        weights[me],
    )
    return fedavg_routers(members, shapes=shapes), tuple(sorted(members))
