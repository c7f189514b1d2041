"""Forming clusters and their descriptors, level by level (SemanticDFL Sec. 3.3.2-3.3.3).

A zone initiator at level 1 clusters its members' signatures; at level ``l > 1`` it clusters
the prototypes of the level-``(l-1)`` clusters its zone's participants formed. Both run
:func:`~peerlm.overlay.clustering.affinity_clusters` on the cosine matrix; above level 1 the
fan-out cap ``F`` splits oversized clusters (:func:`~peerlm.overlay.clustering.cap_group_size`).

Choices made here (the paper leaves them open):

* **Prototype cardinality**: the median ``P`` of the inputs (all equal once the network-wide
  ``P`` is in force). Above level 1 the prototype is ``Top_P`` of the *unweighted* mean of
  the child prototypes.
* **Replica set** ``R_j`` at level 1: the ``r`` members closest (cosine) to the prototype;
  above level 1: the children's primaries in order of their prototypes' closeness, then
  their second replicas, and so on, until ``r`` distinct nodes. Either way the set is kept in
  succession order ``(VRF score, id)`` and the first is the primary. The root keeps
  ``root_replication`` replicas (default ``2r - 1``): every query enters there, and losing
  all of them at once would leave the tree headless until the next epoch.
* **Cluster ids** are ``"<zone_id>.<j>"`` with ``zone_id = "<epoch>.<level>.<initiator>"``:
  unique without coordination.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from peerlm.overlay.clustering import (
    Clustering,
    affinity_clusters,
    cap_group_size,
    choose_replicas,
    k_medoids,
)
from peerlm.overlay.messages import ClusterDescriptor, MemberEntry, NodeRef
from peerlm.overlay.params import OverlayParams
from peerlm.overlay.signature import Signature, cosine_matrix, cosine_to_many, prototype

__all__ = [
    "ClusterRole",
    "FormedCluster",
    "form_inner_clusters",
    "form_leaf_clusters",
    "form_root",
    "ordered_replicas",
    "zone_id_of",
]


def zone_id_of(epoch: int, level: int, initiator: str) -> str:
    return f"{epoch}.{level}.{initiator}"


def _common_p(signatures: Sequence[Signature]) -> int:
    return int(np.median([s.p for s in signatures]))


@dataclass(frozen=True, slots=True)
class FormedCluster:
    """A cluster a zone initiator just formed: its descriptor and its content."""

    descriptor: ClusterDescriptor
    members: tuple[MemberEntry, ...] = ()
    children: tuple[ClusterDescriptor, ...] = ()


def ordered_replicas(
    refs: Sequence[NodeRef], scores: Sequence[int]
) -> tuple[tuple[NodeRef, ...], tuple[int, ...]]:
    """Sort a replica set into succession order ``(VRF score, id)``."""
    pairs = sorted(zip(refs, scores, strict=True), key=lambda p: (p[1], p[0].node_id))
    return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)


def form_leaf_clusters(
    epoch: int,
    zone_id: str,
    members: Sequence[MemberEntry],
    params: OverlayParams,
) -> tuple[list[FormedCluster], Clustering]:
    """Level-1 clusters of a zone's members (each must carry a signature)."""
    sigs: list[Signature] = []
    for m in members:
        if m.signature is None:
            raise ValueError("every member to cluster needs a signature")
        sigs.append(m.signature)
    if not sigs:
        return [], Clustering((), (), "empty", True, 0)
    sim = cosine_matrix(sigs)
    clustering = affinity_clusters(sim, params)
    p = _common_p(sigs)
    formed = []
    for j, (group, exemplar) in enumerate(
        zip(clustering.groups, clustering.exemplars, strict=True)
    ):
        group_sigs = [sigs[i] for i in group]
        proto = prototype(group_sigs, p)
        closeness = cosine_to_many(proto, group_sigs)
        group_members = [members[i] for i in group]
        chosen = choose_replicas(
            [m.ref.node_id for m in group_members],
            closeness.tolist(),
            [m.score for m in group_members],
            params.replication,
        )
        descriptor = ClusterDescriptor(
            cluster_id=f"{zone_id}.{j}",
            level=1,
            exemplar=members[exemplar].ref.node_id,
            prototype=proto,
            replicas=tuple(group_members[i].ref for i in chosen),
            scores=tuple(group_members[i].score for i in chosen),
            size=len(group),
            zone_id=zone_id,
            epoch=epoch,
        )
        formed.append(FormedCluster(descriptor, members=tuple(group_members)))
    return formed, clustering


def _inner_descriptor(
    epoch: int,
    level: int,
    cluster_id: str,
    zone_id: str,
    children: Sequence[ClusterDescriptor],
    exemplar: ClusterDescriptor,
    params: OverlayParams,
    replication: int | None = None,
) -> ClusterDescriptor:
    want = params.replication if replication is None else replication
    protos = [c.prototype for c in children]
    proto = prototype(protos, _common_p(protos))
    closeness = cosine_to_many(proto, protos)
    order = sorted(range(len(children)), key=lambda i: (-closeness[i], children[i].cluster_id))
    refs: list[NodeRef] = []
    scores: list[int] = []
    seen: set[str] = set()
    depth = max(len(c.replicas) for c in children)
    for rank in range(depth):
        for i in order:
            child = children[i]
            if rank < len(child.replicas) and child.replicas[rank].node_id not in seen:
                seen.add(child.replicas[rank].node_id)
                refs.append(child.replicas[rank])
                scores.append(child.scores[rank])
            if len(refs) == want:
                break
        if len(refs) == want:
            break
    replicas, ordered_scores = ordered_replicas(refs, scores)
    return ClusterDescriptor(
        cluster_id=cluster_id,
        level=level,
        exemplar=exemplar.cluster_id,
        prototype=proto,
        replicas=replicas,
        scores=ordered_scores,
        size=sum(c.size for c in children),
        zone_id=zone_id,
        epoch=epoch,
    )


def form_inner_clusters(
    epoch: int,
    level: int,
    zone_id: str,
    items: Sequence[ClusterDescriptor],
    params: OverlayParams,
    *,
    force_reduction: bool = False,
) -> tuple[list[FormedCluster], Clustering]:
    """Level-``level`` clusters over the prototypes of level-``(level-1)`` clusters.

    With ``force_reduction`` (a lone zone that still has too many items) a clustering that
    leaves every item alone is replaced by k-medoids with ``ceil(n / F)`` groups, so the
    recursion always shrinks.
    """
    if not items:
        return [], Clustering((), (), "empty", True, 0)
    sim = cosine_matrix([c.prototype for c in items])
    clustering = affinity_clusters(sim, params)
    n = len(items)
    if force_reduction and len(clustering.groups) >= n and n > 1:
        clustering = k_medoids(sim, -(-n // params.max_children))
    groups, exemplars = cap_group_size(sim, clustering, params.max_children)
    formed = []
    for j, (group, exemplar) in enumerate(zip(groups, exemplars, strict=True)):
        children = tuple(items[i] for i in group)
        descriptor = _inner_descriptor(
            epoch, level, f"{zone_id}.{j}", zone_id, children, items[exemplar], params
        )
        formed.append(FormedCluster(descriptor, children=children))
    return formed, clustering


def form_root(
    epoch: int,
    level: int,
    zone_id: str,
    children: Sequence[ClusterDescriptor],
    params: OverlayParams,
) -> FormedCluster:
    """The single top-level cluster over ``children`` (at most ``S_Z`` of them)."""
    protos = [c.prototype for c in children]
    proto = prototype(protos, _common_p(protos))
    central = int(np.argmax(cosine_to_many(proto, protos)))
    descriptor = _inner_descriptor(
        epoch,
        level,
        f"{zone_id}.root",
        zone_id,
        children,
        children[central],
        params,
        params.root_replication,
    )
    return FormedCluster(descriptor, children=tuple(children))


@dataclass(slots=True)
class ClusterRole:
    """What one replica of a cluster holds (descriptor, content, pointers, lease state).

    Level-1 clusters hold ``members`` (with their latest signatures); higher clusters hold
    ``children`` descriptors. ``parent`` is the parent cluster's descriptor (``None`` at the
    root or until the next level formed).
    """

    descriptor: ClusterDescriptor
    term: int
    members: dict[str, MemberEntry] = field(default_factory=dict)
    children: dict[str, ClusterDescriptor] = field(default_factory=dict)
    parent: ClusterDescriptor | None = None
    is_root: bool = False
    # Primary-side liveness bookkeeping (clock values of the last sign of life).
    last_seen: dict[str, float] = field(default_factory=dict)
    # Replica-side: when the primary last renewed the lease.
    lease_renewed: float = 0.0
    p_mins: tuple[int, ...] = ()
    dirty: bool = False
    # Primary-side memo: the prototype inputs and descriptor prototype of the last refresh
    # that changed nothing (:class:`~peerlm.overlay.cluster_upkeep.PrimaryUpkeep`).
    prototype_checked: tuple[tuple[Signature, ...], Signature] | None = field(
        default=None, repr=False, compare=False
    )

    @property
    def cluster_id(self) -> str:
        return self.descriptor.cluster_id

    @property
    def level(self) -> int:
        return self.descriptor.level

    def primary_id(self) -> str:
        return self.descriptor.replicas[0].node_id

    def replica_ids(self) -> list[str]:
        return [r.node_id for r in self.descriptor.replicas]

    def bump(self, **changes: object) -> ClusterDescriptor:
        """Replace descriptor fields and increase its version."""
        self.descriptor = replace(
            self.descriptor,
            version=self.descriptor.version + 1,
            **changes,  # type: ignore[arg-type]
        )
        return self.descriptor

    def refresh_size(self) -> None:
        size = (
            len(self.members)
            if self.descriptor.level == 1
            else sum(c.size for c in self.children.values())
        )
        if size != self.descriptor.size:
            self.bump(size=size)
