"""The strategies of ``peerlm run-experiment`` by name, and the tables that sort them.

Every name ``--strategies`` accepts is in one of the tables below; what a strategy does in a
round is :func:`peerlm.app.experiment_exchange.exchange`'s dispatch on these tables.

Pairing strategies:

=============  ==========================================================================
local          LocalOnly: local training only, no exchange.
local_plus     LocalOnly+: local training, plus in the exchange phase as many optimiser
               steps on its own data as a student spends on AKD (compute-matched control).
random         Random-P2P: disjoint random pairs, random direction (``RandomMatchmaker``);
               with the plan's ``pairing: per_student``, a random teacher for every client.
heuristic      Heuristic-P2P: Algorithm 4, greedy max JS divergence of the category
               histograms, the higher validation pass@1 teaches (``HeteroGreedyMatchmaker``);
               disjoint pairs whatever the plan's ``pairing`` (half the lessons of a
               per-student strategy: not compute-matched to them).
central_kd     Central-KD: a server averages all clients' predictions into one ensemble
               teacher and every client distils from it (:mod:`~peerlm.app.experiment_distill`).
cpm            KNEXA-FL: the CPM's LinUCB ``Matchmaker`` (the service's defaults), fed the
               students' real rewards after each exchange.
oracle         Oracle pairing: every ordered pair is tried each round and the disjoint
               pairs with the largest true gain on the probe set are kept (the upper bound
               of matchmaking; its trials cost N(N-1) integrations a round); with
               ``pairing: per_student``, each student's largest-gain teacher.
semantic_dfl   SemanticDFL pull-and-aggregate: after its local phase each client averages
               its LoRA adapter with those of the clients of its own model family (the
               PDFL step of :func:`peerlm.overlay.aggregation.personalised_update`, equal
               similarities). Adapters only average within one family; a client alone in
               its family trains locally (LocalOnly).
=============  ==========================================================================

Adapter-merge strategies (not in the default list, name them with
``--strategies``; adapters merge only within one model family, so run them with
``--family``, every client on one backbone, as in the papers):

==============  =========================================================================
fedavg_lora     FedAvg-LoRA (FedIT): every round each client pulls its family's adapters
                and loads the data-weighted average of the A and B factors.
onepeft         OnePeFT one-shot: local rounds only, then in the last round each client
                pulls its family's adapters once, aggregates them by SVD (Eq. 3) to its
                rank and refines by HKA (Eq. 4-6) on the public pairs
                (:func:`peerlm.agent.merging.onepeft.one_shot`, ``local_steps`` HKA steps).
onepeft_svd     the same, SVD without HKA (Table 5).
onepeft_hka     the same, HKA from the FedAvg of factors (Table 5).
onepeft_fedavg  the same, FedAvg of factors once, no HKA (Table 5's "neither").
onepeft_multi   OnePeFT multi-round: every round each client pulls its family's adapters,
                aggregates them by SVD and refines by HKA (``local_steps`` HKA steps a
                round), as ``onepeft`` does once; the multi-round row of Table 4.
onepeft_multi_ce  the same with HKA at alpha = 1: CE on the public pairs only, no KL to
                the teachers' mixture (separates what the public references teach from
                what the teachers do).
fedavg_lora_plus  FedAvg-LoRA, then ``local_steps`` more steps on the client's own data
                each round: the compute-matched baseline of ``onepeft_multi`` (the steps
                OnePeFT spends on HKA, spent as LocalOnly+ spends them).
ffa_lora        FFA-LoRA (Sun et al. 2024): every client of a family initialises LoRA A
                from one shared seed and never trains it (warm-up, local steps); every
                round each client pulls its family's adapters and loads the data-weighted
                average of the B factors with the shared A (:func:`aggregate_ffa`).
cpm_menu        the CPM over the whole menu (docs/matchmaker.md): each round LinUCB picks
                pairs *and* a protocol per pair among akd, akd_logits, pmix and svd_hka,
                admissible ones only (every client declares its parameter-space
                fingerprint and every protocol); the student executes it as the daemon
                does and the Eq. 3 reward trains the bandit. Each round's record and
                event name how many directives chose each protocol (``protocols``).
cpm_akd_logits  the same CPM with one protocol forced for everyone (the comparison the
cpm_pmix        issue asks for; ``cpm`` is akd forced). Across families no protocol but
cpm_svd_hka     akd is admissible, so these pair only within a family.
==============  =========================================================================

The overlay (not in the default list, with ``--family``;
:mod:`peerlm.app.experiment_overlay`):

================  =======================================================================
overlay_topk      the SemanticDFL overlay as an agent with it enabled runs it: after its
                  local phase each client publishes its adapter's signature, finds its
                  k = 2 nearest peers, pulls their adapters and aggregates them (the PDFL
                  step weighted by similarity, behind the acceptance gate).
cpm_menu_overlay  ``cpm_menu`` and the overlay together, as a deployment runs them: the
                  CPM's directive first, then the overlay step; a merge protocol is
                  admissible only from a sender on the student's list of its last
                  overlay step (the overlay narrows, the CPM chooses).
================  =======================================================================

FedProxy strategies (not in the default list, with ``--family``): every client
is a member of one owner's cohort; the owner compresses the family's model to a proxy, the
members train the proxy, the owner merges and fuses it back (:mod:`peerlm.app.experiment_fedproxy`,
where the evaluation and compute matching are written down):

=====================  ==================================================================
fedproxy_hties         H-TIES + PCR (the paper's method, Algorithm 1).
fedproxy_hties_nopcr   H-TIES, members without PCR.
fedproxy_fedavg        plain FedAvg of the proxies.
fedproxy_ties          TIES without the heterogeneity terms (density 1).
fedproxy_proxytuning   the H-TIES + PCR cohort, M decoded by ProxyTuning (Table 9) instead
                       of fused.
fedproxy_centsft       CentSFT: the full model fine-tuned on the members' data pooled, the
                       cohort's optimiser steps (the paper's upper bound; a reference).
=====================  ==================================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from peerlm.protocols import DEFAULT_PROTOCOL, names

__all__ = [
    "ARCHS",
    "CENTSFT",
    "COLLABORATIVE",
    "COMPARISONS",
    "CPM_PROTOCOLS",
    "DEFAULT_STRATEGIES",
    "FEDPROXY_MERGE",
    "FEDPROXY_STRATEGIES",
    "KNOWN_STRATEGIES",
    "LABELS",
    "MENU_STRATEGIES",
    "MERGE_STRATEGIES",
    "METRICS",
    "OVERLAY_STRATEGIES",
    "PROXY_TUNED",
    "STRATEGIES",
    "WITH_OVERLAY",
]


#: The FedProxy strategies and the owner's merge each runs (:data:`peerlm.agent.PROXY_MERGES`;
#: :mod:`peerlm.app.experiment_fedproxy`).
FEDPROXY_MERGE: Final[Mapping[str, str]] = {
    "fedproxy_hties": "h_ties_pcr",
    "fedproxy_hties_nopcr": "h_ties",
    "fedproxy_fedavg": "fedavg",
    "fedproxy_ties": "ties",
    "fedproxy_proxytuning": "h_ties_pcr",
}
#: Strategies whose owner decodes with ProxyTuning (M + φ_T − φ_0 logits) instead of fusing.
PROXY_TUNED: Final[frozenset[str]] = frozenset({"fedproxy_proxytuning"})
#: The CentSFT reference: the full model fine-tuned on the pooled data (no proxy, no merge).
CENTSFT: Final = "fedproxy_centsft"
FEDPROXY_STRATEGIES: Final[tuple[str, ...]] = (*FEDPROXY_MERGE, CENTSFT)

#: The paper's table (KNEXA-FL's Table 1): ``--strategies table`` and ``--quick``.
STRATEGIES: tuple[str, ...] = (
    "local",
    "local_plus",
    "random",
    "heuristic",
    "central_kd",
    "cpm",
    "oracle",
    "semantic_dfl",
)


#: What a plan runs when none is named: the key comparisons (KNEXA-FL − Random-P2P,
#: KNEXA-FL − LocalOnly+, best − LocalOnly+), the cheapest run that holds them all: 35 min
#: on two idle cores here (docs/experiment.md), where the whole table takes over an hour
#: (the Oracle alone about 35 minutes of a core a seed).
DEFAULT_STRATEGIES: tuple[str, ...] = ("local_plus", "random", "cpm")


#: The CPM with one protocol of the catalogue forced for everyone, by strategy name
#: (``cpm_<protocol>``; ``cpm`` itself is the default protocol forced).
_FORCED: Mapping[str, str] = MappingProxyType(
    {f"cpm_{name}": name for name in names() if name != DEFAULT_PROTOCOL}
)


LABELS: Mapping[str, str] = {
    "local": "LocalOnly",
    "local_plus": "LocalOnly+",
    "random": "Random-P2P",
    "heuristic": "Heuristic-P2P",
    "central_kd": "Central-KD",
    "cpm": "KNEXA-FL (CPM)",
    "oracle": "Oracle pairing",
    "semantic_dfl": "SemanticDFL",
    "fedavg_lora": "FedAvg-LoRA",
    "onepeft": "OnePeFT (SVD+HKA)",
    "onepeft_svd": "OnePeFT SVD only",
    "onepeft_hka": "OnePeFT HKA only",
    "onepeft_fedavg": "One-shot FedAvg of factors",
    "onepeft_multi": "OnePeFT multi-round (SVD+HKA)",
    "onepeft_multi_ce": "OnePeFT multi-round, CE only (HKA alpha 1)",
    "fedavg_lora_plus": "FedAvg-LoRA+ (compute-matched)",
    "ffa_lora": "FFA-LoRA",
    "cpm_menu": "KNEXA-FL (CPM, full menu)",
    "cpm_menu_overlay": "KNEXA-FL (CPM, full menu) + overlay",
    "overlay_topk": "SemanticDFL overlay (top-K, PDFL)",
    **{strategy: f"CPM, {name} forced" for strategy, name in _FORCED.items()},
    "fedproxy_hties": "FedProxy (H-TIES+PCR)",
    "fedproxy_hties_nopcr": "FedProxy H-TIES, no PCR",
    "fedproxy_fedavg": "FedAvg of proxies",
    "fedproxy_ties": "TIES of proxies",
    "fedproxy_centsft": "CentSFT (pooled data, full model)",
    "fedproxy_proxytuning": "FedProxy, ProxyTuning plug-in",
}


#: Adapter-merge strategies (OnePeFT, FedAvg-LoRA, FFA-LoRA): known, not run
#: by default.
MERGE_STRATEGIES: tuple[str, ...] = (
    "fedavg_lora",
    "ffa_lora",
    "onepeft",
    "onepeft_svd",
    "onepeft_hka",
    "onepeft_fedavg",
    "onepeft_multi",
    "onepeft_multi_ce",
    "fedavg_lora_plus",
)


#: The CPM recommending among the whole menu (the catalogue, :mod:`peerlm.protocols`), or
#: one of its protocols forced: known, not run by default; meant for clients of one family
#: (``--family``), since every protocol but akd needs a shared parameter space.
MENU_STRATEGIES: tuple[str, ...] = ("cpm_menu", "cpm_menu_overlay", *_FORCED)


#: The SemanticDFL overlay as an agent runs it
#: (:mod:`peerlm.app.experiment_overlay`): alone, known, not run by default.
OVERLAY_STRATEGIES: tuple[str, ...] = ("overlay_topk",)


#: Strategies whose clients run the overlay step every round.
WITH_OVERLAY: frozenset[str] = frozenset({"overlay_topk", "cpm_menu_overlay"})


#: The protocols each CPM strategy may recommend: the menu, or one forced for everyone
#: (``cpm`` itself is akd forced).
CPM_PROTOCOLS: Mapping[str, tuple[str, ...]] = {
    "cpm": (DEFAULT_PROTOCOL,),
    "cpm_menu": names(on_by_default=True),
    "cpm_menu_overlay": names(on_by_default=True),
    **{strategy: (name,) for strategy, name in _FORCED.items()},
}


#: Every strategy ``--strategies`` accepts.
KNOWN_STRATEGIES: tuple[str, ...] = (
    STRATEGIES + MERGE_STRATEGIES + MENU_STRATEGIES + OVERLAY_STRATEGIES + FEDPROXY_STRATEGIES
)


#: Strategies that exchange knowledge (candidates for "best collaborative").
COLLABORATIVE: tuple[str, ...] = (
    "random",
    "heuristic",
    "central_kd",
    "cpm",
    "oracle",
    *MENU_STRATEGIES,
    *OVERLAY_STRATEGIES,
)


#: Per-problem metrics: unbiased pass@1, structural match rate, NLL (nats/byte; lower wins).
METRICS: tuple[str, ...] = ("pass@1", "struct", "nll")


#: Key differences of the table: (a, b) for a - b; "best" is the best collaborative
#: strategy on the lacked slice's pass@1.
COMPARISONS: tuple[tuple[str, str], ...] = (
    ("cpm_menu_overlay", "cpm_menu"),
    ("cpm_menu_overlay", "overlay_topk"),
    ("cpm_menu", "cpm"),
    *(("cpm_menu", strategy) for strategy in _FORCED),
    ("cpm_menu", "local_plus"),
    ("cpm", "random"),
    ("cpm", "local_plus"),
    ("best", "local_plus"),
    ("oracle", "local_plus"),
    ("onepeft", "fedavg_lora"),
    ("onepeft", "ffa_lora"),
    ("onepeft", "local_plus"),
    ("onepeft", "onepeft_svd"),
    ("onepeft", "onepeft_fedavg"),
    ("onepeft_svd", "onepeft_fedavg"),
    ("onepeft_hka", "onepeft_fedavg"),
    ("onepeft_multi", "fedavg_lora_plus"),
    ("onepeft_multi", "fedavg_lora"),
    ("onepeft_multi", "onepeft"),
    ("onepeft_multi", "onepeft_multi_ce"),
    ("fedavg_lora_plus", "fedavg_lora"),
    ("fedproxy_hties", "fedproxy_fedavg"),
    ("fedproxy_hties_nopcr", "fedproxy_fedavg"),
    ("fedproxy_hties", "fedproxy_hties_nopcr"),
    ("fedproxy_ties", "fedproxy_fedavg"),
    ("fedproxy_hties", "local_plus"),
    ("fedproxy_fedavg", "fedavg_lora"),
    ("fedproxy_centsft", "fedproxy_hties"),
    ("fedproxy_proxytuning", "fedproxy_hties"),
    ("fedproxy_centsft", "local_plus"),
)


#: Client i hosts ARCHS[i % 4] (as ``peerlm up``).
ARCHS: tuple[str, ...] = ("gpt2", "gpt_neox", "bloom", "qwen2")
