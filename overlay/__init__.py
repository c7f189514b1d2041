"""The semantic overlay (SemanticDFL): a sans-IO protocol core, its gRPC transport, the host
builder, the simulator and the personalised aggregation step.

What other packages may use is exported here; the modules behind it are the overlay's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from peerlm.exports import lazy_exports

if TYPE_CHECKING:
    from peerlm.overlay.aggregation import (
        DEFAULT_ETA,
        DEFAULT_KAPPA,
        DEFAULT_PSI,
        AggregationError,
        AggregationReport,
        Refusal,
        check_neighbour,
        neighbour_weights,
        personalised_update,
    )
    from peerlm.overlay.events import BuildFinished, QueryCompleted, Send
    from peerlm.overlay.host import (
        OverlayHostConfig,
        OverlayStack,
        build_overlay_host,
        certified_vrf_secret,
        describe_bootstrap,
        name_seed,
        parse_bootstrap,
    )
    from peerlm.overlay.main import run_overlay
    from peerlm.overlay.messages import NodeRef
    from peerlm.overlay.node import OverlayNode
    from peerlm.overlay.params import OverlayParams, paper_k, round_half_up
    from peerlm.overlay.population import ClusteredPopulation, Member, PopulationSpec
    from peerlm.overlay.service import OVERLAY_POLICY
    from peerlm.overlay.service import SERVICE_NAME as OVERLAY_SERVICE_NAME
    from peerlm.overlay.settings import OverlaySettings
    from peerlm.overlay.signature import (
        ImportanceTracker,
        Signature,
        SignatureError,
        cosine_matrix,
        cosine_rows,
        cosine_to_many,
        flatten_adapter,
        make_signature,
        minimal_p,
        network_p,
        prototype,
        sparse_cosine,
    )
    from peerlm.overlay.sim import LinkModel, Simulator
    from peerlm.overlay.transport import DeliveryPolicy, OverlayHost

#: Public name -> (module, attribute): imported on first use, so that importing the
#: package stays cheap (no torch, numpy or grpc until a name needs them).
_EXPORTS: dict[str, tuple[str, str]] = {
    "OverlaySettings": ("peerlm.overlay.settings", "OverlaySettings"),
    "AggregationError": ("peerlm.overlay.aggregation", "AggregationError"),
    "AggregationReport": ("peerlm.overlay.aggregation", "AggregationReport"),
    "BuildFinished": ("peerlm.overlay.events", "BuildFinished"),
    "ClusteredPopulation": ("peerlm.overlay.population", "ClusteredPopulation"),
    "DEFAULT_ETA": ("peerlm.overlay.aggregation", "DEFAULT_ETA"),
    "DEFAULT_KAPPA": ("peerlm.overlay.aggregation", "DEFAULT_KAPPA"),
    "DEFAULT_PSI": ("peerlm.overlay.aggregation", "DEFAULT_PSI"),
    "DeliveryPolicy": ("peerlm.overlay.transport", "DeliveryPolicy"),
    "ImportanceTracker": ("peerlm.overlay.signature", "ImportanceTracker"),
    "LinkModel": ("peerlm.overlay.sim", "LinkModel"),
    "Member": ("peerlm.overlay.population", "Member"),
    "NodeRef": ("peerlm.overlay.messages", "NodeRef"),
    "OVERLAY_POLICY": ("peerlm.overlay.service", "OVERLAY_POLICY"),
    "OVERLAY_SERVICE_NAME": ("peerlm.overlay.service", "SERVICE_NAME"),
    "OverlayHost": ("peerlm.overlay.transport", "OverlayHost"),
    "OverlayHostConfig": ("peerlm.overlay.host", "OverlayHostConfig"),
    "OverlayNode": ("peerlm.overlay.node", "OverlayNode"),
    "OverlayParams": ("peerlm.overlay.params", "OverlayParams"),
    "OverlayStack": ("peerlm.overlay.host", "OverlayStack"),
    "PopulationSpec": ("peerlm.overlay.population", "PopulationSpec"),
    "QueryCompleted": ("peerlm.overlay.events", "QueryCompleted"),
    "Refusal": ("peerlm.overlay.aggregation", "Refusal"),
    "Send": ("peerlm.overlay.events", "Send"),
    "Signature": ("peerlm.overlay.signature", "Signature"),
    "SignatureError": ("peerlm.overlay.signature", "SignatureError"),
    "Simulator": ("peerlm.overlay.sim", "Simulator"),
    "build_overlay_host": ("peerlm.overlay.host", "build_overlay_host"),
    "certified_vrf_secret": ("peerlm.overlay.host", "certified_vrf_secret"),
    "check_neighbour": ("peerlm.overlay.aggregation", "check_neighbour"),
    "cosine_matrix": ("peerlm.overlay.signature", "cosine_matrix"),
    "cosine_rows": ("peerlm.overlay.signature", "cosine_rows"),
    "cosine_to_many": ("peerlm.overlay.signature", "cosine_to_many"),
    "describe_bootstrap": ("peerlm.overlay.host", "describe_bootstrap"),
    "flatten_adapter": ("peerlm.overlay.signature", "flatten_adapter"),
    "make_signature": ("peerlm.overlay.signature", "make_signature"),
    "minimal_p": ("peerlm.overlay.signature", "minimal_p"),
    "network_p": ("peerlm.overlay.signature", "network_p"),
    "name_seed": ("peerlm.overlay.host", "name_seed"),
    "paper_k": ("peerlm.overlay.params", "paper_k"),
    "parse_bootstrap": ("peerlm.overlay.host", "parse_bootstrap"),
    "neighbour_weights": ("peerlm.overlay.aggregation", "neighbour_weights"),
    "personalised_update": ("peerlm.overlay.aggregation", "personalised_update"),
    "prototype": ("peerlm.overlay.signature", "prototype"),
    "round_half_up": ("peerlm.overlay.params", "round_half_up"),
    "run_overlay": ("peerlm.overlay.main", "run_overlay"),
    "sparse_cosine": ("peerlm.overlay.signature", "sparse_cosine"),
}

__all__ = [
    "DEFAULT_ETA",
    "DEFAULT_KAPPA",
    "DEFAULT_PSI",
    "OVERLAY_POLICY",
    "OVERLAY_SERVICE_NAME",
    "AggregationError",
    "AggregationReport",
    "BuildFinished",
    "ClusteredPopulation",
    "DeliveryPolicy",
    "ImportanceTracker",
    "LinkModel",
    "Member",
    "NodeRef",
    "OverlayHost",
    "OverlayHostConfig",
    "OverlayNode",
    "OverlayParams",
    "OverlaySettings",
    "OverlayStack",
    "PopulationSpec",
    "QueryCompleted",
    "Refusal",
    "Send",
    "Signature",
    "SignatureError",
    "Simulator",
    "build_overlay_host",
    "certified_vrf_secret",
    "check_neighbour",
    "cosine_matrix",
    "cosine_rows",
    "cosine_to_many",
    "describe_bootstrap",
    "flatten_adapter",
    "make_signature",
    "minimal_p",
    "name_seed",
    "neighbour_weights",
    "network_p",
    "paper_k",
    "parse_bootstrap",
    "personalised_update",
    "prototype",
    "round_half_up",
    "run_overlay",
    "sparse_cosine",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
