"""The CPM's matchmaking library (pure, no I/O): LinUCB pairing of agents (KNEXA-FL).

``Matchmaker`` learns who should teach whom, with which protocol, from profiles and
receiver-reported rewards; the baselines share its ``select`` / ``observe`` interface.
See ``docs/matchmaker.md`` for the algorithm and every choice made beyond the paper.

The package exports what other packages may use: this library, and ``run_cpm`` (the
``peerlm cpm`` process, imported on first use so that the library stays free of gRPC).
"""

from typing import TYPE_CHECKING

from peerlm.exports import lazy_exports

from .allocator import retain_freed_memory
from .features import ContextFeatures, FeatureLayout
from .menu import (
    MAX_OVERLAY_PEERS,
    MENU,
    MERGE_PROTOCOLS,
    AdmissibilityMask,
    Capabilities,
)
from .normalise import EPS, RewardNormaliser
from .profile import (
    COLUMN_GROUPS,
    DISTRIBUTION_SLICE,
    DYNAMIC_SLICE,
    MAX_ABS_PROFILE_VALUE,
    PERFORMANCE_INDEX,
    PROFILE_DIM,
    PROFILE_LAYOUT,
    STATIC_SLICE,
    ProfileLayout,
    context_columns,
    validate_profile,
    validate_profiles,
)
from .robust_normalise import RobustRewardNormaliser
from .trust import TrustLedger

if TYPE_CHECKING:
    from .baselines import (
        HeteroGreedyMatchmaker,
        OracleMatchmaker,
        RandomMatchmaker,
        js_divergence,
        js_divergence_matrix,
    )
    from .core import open_database
    from .linucb import LinUCB
    from .matching import (
        greedy_disjoint,
        greedy_disjoint_sequential,
        greedy_students,
        max_weight_disjoint,
    )
    from .matchmaker import (
        MAX_MERGE_SENDERS,
        MAX_TEACHERS_PER_STUDENT,
        Matchmaker,
        MatchmakerState,
        Pairing,
        PairingPolicy,
    )
    from .prefilter import (
        CheapScore,
        cheap_pair_scores,
        exact_top_k,
        prefilter_pairs,
        top_k_partners,
    )
    from .server import cpm_command, run_cpm
    from .settings import CpmSettings

__all__ = [
    "COLUMN_GROUPS",
    "DISTRIBUTION_SLICE",
    "DYNAMIC_SLICE",
    "EPS",
    "MAX_ABS_PROFILE_VALUE",
    "MAX_MERGE_SENDERS",
    "MAX_OVERLAY_PEERS",
    "MAX_TEACHERS_PER_STUDENT",
    "MENU",
    "MERGE_PROTOCOLS",
    "PERFORMANCE_INDEX",
    "PROFILE_DIM",
    "PROFILE_LAYOUT",
    "STATIC_SLICE",
    "AdmissibilityMask",
    "Capabilities",
    "CheapScore",
    "ContextFeatures",
    "CpmSettings",
    "FeatureLayout",
    "HeteroGreedyMatchmaker",
    "LinUCB",
    "Matchmaker",
    "MatchmakerState",
    "OracleMatchmaker",
    "Pairing",
    "PairingPolicy",
    "ProfileLayout",
    "RandomMatchmaker",
    "RewardNormaliser",
    "RobustRewardNormaliser",
    "TrustLedger",
    "cheap_pair_scores",
    "context_columns",
    "cpm_command",
    "exact_top_k",
    "greedy_disjoint",
    "greedy_disjoint_sequential",
    "greedy_students",
    "js_divergence",
    "js_divergence_matrix",
    "max_weight_disjoint",
    "open_database",
    "prefilter_pairs",
    "retain_freed_memory",
    "run_cpm",
    "top_k_partners",
    "validate_profile",
    "validate_profiles",
]


#: Loaded on first use, by module: the process side (grpc, sqlite) stays out of ``import``
#: of the library, and so do the matchmaking modules (scipy, networkx, scikit-learn's
#: KMeans), which an agent, importing the package only for ``PROFILE_LAYOUT``, never runs.
_LAZY_MODULES: dict[str, tuple[str, ...]] = {
    "baselines": (
        "HeteroGreedyMatchmaker",
        "OracleMatchmaker",
        "RandomMatchmaker",
        "js_divergence",
        "js_divergence_matrix",
    ),
    "linucb": ("LinUCB",),
    "matching": (
        "greedy_disjoint",
        "greedy_disjoint_sequential",
        "greedy_students",
        "max_weight_disjoint",
    ),
    "matchmaker": (
        "MAX_MERGE_SENDERS",
        "MAX_TEACHERS_PER_STUDENT",
        "Matchmaker",
        "MatchmakerState",
        "Pairing",
        "PairingPolicy",
    ),
    "prefilter": (
        "CheapScore",
        "cheap_pair_scores",
        "exact_top_k",
        "prefilter_pairs",
        "top_k_partners",
    ),
    "settings": ("CpmSettings",),
    "server": ("cpm_command", "run_cpm"),
    "core": ("open_database",),
}
_LAZY: dict[str, tuple[str, str]] = {
    name: (f"{__name__}.{module}", name)
    for module, names in _LAZY_MODULES.items()
    for name in names
}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
