"""``peerlm run-experiment``: the KNEXA-FL comparison (Table 4) with real tiny models.

Pairing strategies run the same rounds on the same world, models and seeds, in one process
over :class:`~peerlm.agent.modelhost.ModelHost` instances. Every model operation is the
agent daemon's own (:mod:`peerlm.agent.rounds`: local update, teacher predictions,
guardrailed packages encoded and decoded as on the wire, AKD per Eq. 2 with the Table 6
schedule, the reward); only the transport is missing. Strategies:

=============  ==========================================================================
local          LocalOnly: local training only, no exchange.
local_plus     LocalOnly+: local training, plus in the exchange phase as many optimiser
               steps on its own data as a student spends on AKD (compute-matched control).
random         Random-P2P: disjoint random pairs, random direction (``RandomMatchmaker``).
heuristic      Heuristic-P2P: Algorithm 4, greedy max JS divergence of the category
               histograms, the higher validation pass@1 teaches (``HeteroGreedyMatchmaker``).
central_kd     Central-KD: a server averages all clients' predictions into one ensemble
               teacher and every client distils from it (see below).
cpm            KNEXA-FL: the CPM's LinUCB ``Matchmaker`` (the service's defaults), fed the
               students' real rewards after each exchange.
oracle         Oracle pairing: every ordered pair is tried each round and the disjoint
               pairs with the largest true gain on the probe set are kept (the upper bound
               of matchmaking; its trials cost N(N-1) integrations a round).
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
                (:func:`peerlm.agent.onepeft.one_shot`, ``local_steps`` HKA steps).
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

FFA-LoRA's start. The warm-up above trains A, and each client's A differs, so ffa_lora
cannot start from it. Its clients run their own warm-up, once per world: the same steps,
data and batch seeds, with the family's shared A frozen (every client loads its adapter
from the one seed, the world seed); its round 0 and round-1 local phase are measured on
that start. Re-initialising A under the warmed-up B would throw the warm-up away (B_i was
trained against A_i); the frozen-A warm-up is what an organisation joining an FFA-LoRA
federation does locally. The cost is one more warm-up per world when ffa_lora runs
(``docs/experiment.md``).

D_pub of HKA is the transfer problems of the *public* categories with their references
(public in this world, like Alpaca for the paper); the private categories' references are
never used.

Round t (Algorithm 3): every client trains locally, measures validation loss and pass@1
and forms its profile p_i (as the daemon does); the strategy pairs clients; each student
integrates its teacher's package and its reward goes back to the strategy; then every
client's per-problem NLL of the test references is recorded per slice (the per-round
curves). After the last round each client draws ``samples`` completions per test problem
at ``sample_temperature``: unbiased pass@1 (Chen et al. 2021), structural match and NLL per
problem, reported on three slices per client (:mod:`peerlm.app.experiment_slices`) with
paired bootstrap intervals over seeds and problems (:mod:`peerlm.app.experiment_stats`).

The reward. ``reward="val"`` is Eq. 3 as the paper defines it: L_pre and L_post on the
student's own validation data. ``reward="probe"`` (our choice beyond the paper) measures
L_pre and L_post on a small labelled public *probe set* covering every category, so a
teacher's gain on skills the student lacks shows in the reward; the KB penalty is the same.

Central-KD with heterogeneous tokenizers. FedMD's server averages the clients' logits,
which is undefined across vocabularies. The probability of a *string* is not: here the
ensemble teacher is the mixture ``p_bar(y | x) = (1/N) sum_i p_i(y | x)`` of the clients'
sequence distributions, each client scoring a string under its own canonical tokenisation
(EOS included). Every client sends its guardrailed greedy completion of each transfer
prompt; every client scores every candidate (the scores are what is averaged, as FedMD
averages logits); the server broadcasts, per prompt, the candidate with the highest
ensemble log-likelihood per UTF-8 byte, ``log p_bar(y | x) / max(1, bytes(y))`` (per byte,
or the shortest candidate would always win). Each client then runs AKD on this one
consensus package, with the same alpha schedule as the P2P strategies.

Seeds. The *world seed* fixes the data (client split, transfer, test and probe sets), the
*model seed* the built models (0, as the shared model cache); each *run seed* fixes the
initial adapters (client i: ``seed + i``), the batches of round t, the random pairing and
the samples. Several run seeds reuse one world
and one set of models, so no model is rebuilt, and every strategy sees the same units
(client, test problem) under every seed: the bootstrap pairs over them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, Literal, ParamSpec, Protocol, TypeVar

import numpy as np

from peerlm.app.experiment_fedproxy import FEDPROXY_STRATEGIES, PROXY_TUNED, run_fedproxy
from peerlm.app.experiment_overlay import OverlayView
from peerlm.app.experiment_participant import participant_report, render_participant
from peerlm.app.experiment_slices import SLICES, ClientSlices, slices_of_world
from peerlm.app.experiment_stats import paired_bootstrap, paired_share
from peerlm.protocols import DEFAULT_PROTOCOL, lookup, names

if TYPE_CHECKING:
    from peerlm.agent import (
        Competence,
        Guardrail,
        InputRouter,
        Integration,
        ModelHost,
        PeerSlot,
        Problem,
        TeachScope,
        WorldSpec,
    )
    from peerlm.services.cpm import Pairing

_R = TypeVar("_R")


class _HasPrompt(Protocol):
    @property
    def prompt(self) -> str: ...


_P2 = TypeVar("_P2", bound=_HasPrompt)


def _new_slot() -> PeerSlot:
    from peerlm.agent import PeerSlot

    return PeerSlot()


__all__ = [
    "ARCHS",
    "COMPARISONS",
    "DEFAULT_STRATEGIES",
    "LABELS",
    "METRICS",
    "STRATEGIES",
    "ExperimentPlan",
    "consensus_texts",
    "default_jobs",
    "parse_strategies",
    "quick_plan",
    "render_table",
    "run_experiment",
    "summarise",
    "write_outputs",
]

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
_WITH_OVERLAY: frozenset[str] = frozenset({"overlay_topk", "cpm_menu_overlay"})
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

Event = Callable[[str, Mapping[str, Any]], None]
RewardMode = Literal["val", "probe"]
ProbeScope = Literal["all", "lacked"]


@dataclass(frozen=True)
class ExperimentPlan:
    """Everything that defines a run; part of ``results.json``."""

    agents: int = 6
    rounds: int = 20
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    seeds: tuple[int, ...] = (0, 1, 2)
    world_seed: int = 0  # data split, transfer/test/probe sets
    model_seed: int = 0  # the models' build (the shared model cache is built with 0)
    size: Literal["tiny", "micro"] = "tiny"
    alpha: float = 0.1  # Dirichlet concentration of the client split
    # The world's layout (agent.tasks.world.WorldSpec, "experts"): clients sharing each
    # private skill, and clients (the last ones) holding none.
    experts_per_skill: int = 1
    unskilled: int = 0
    local_steps: int = 2
    # Optimiser steps of one AKD integration (and LocalOnly+'s matching steps on its own
    # data); None: ``local_steps``.
    akd_steps: int | None = 8
    # Steps each client fine-tunes on its own data before round 1 (the organisations arrive
    # with locally tuned models; module docstring). 0: clients start from the base model.
    warmup_steps: int = 120
    grad_accumulation: int = 2
    learning_rate: float = 5e-3
    lora_rank: int = 8
    # Prompts of X_u used (a proportional prefix); None: all of it.
    transfer_limit: int | None = None
    # The world's sizes (agent.tasks.world.WorldSpec): problems per private category, and
    # transfer prompts per private category (docs/experiment.md, "The configurations").
    per_private_category: int = 300
    transfer_per_private: int = 96
    # Validation problems a client generates on each round (its profile's pass@1 and its
    # per-category competence, ``teach_scope``); None: all of them.
    val_limit: int | None = None
    # Generate the validation problems on round 1 and every ``val_every`` rounds after it;
    # between, the last measured pass@1 and competence stand (the validation loss is
    # measured every round).
    val_every: int = 5
    # Measure the test NLL curve after every ``curve_every``-th round (and the last); the
    # curve's rounds are in each run's ``curve_rounds``.
    curve_every: int = 5
    # Most X_u prompts a teacher answers in one round (a window moving over its teachable
    # prompts from round to round); None: all of them each round.
    teach_limit: int | None = 32
    test_limit: int = 120
    samples: int = 2
    sample_temperature: float = 0.8
    max_new_tokens: int = 64
    reward: RewardMode = "probe"
    # Which probe problems a student's reward is measured on (``reward="probe"``): "all",
    # or "lacked", those of the categories it holds no data of and that are not public
    # (what only a teacher can bring it; module docstring).
    probe_scope: ProbeScope = "all"
    probe_per_category: int = 2
    reward_delta: float = 0.001
    # What a teacher answers (peerlm.agent.teaching): "competent", the prompts of categories
    # whose validation pass@1 has a Wilson lower bound >= teach_min_pass (our choice beyond
    # the paper); "all", every prompt of X_u (the paper's Eq. 2).
    teach_scope: TeachScope = "competent"
    teach_min_pass: float = 0.2
    cpm_interaction_features: bool = True
    # The profile entries the CPM's context sees (``CpmSettings.context_columns``; None:
    # all 32) and its exploration weight (None: the service's default, 1.0).
    cpm_context_columns: tuple[int, ...] | None = None
    cpm_beta: float | None = None
    # Most senders of one merge directive (``CpmSettings.merge_senders``): the CPM's
    # merge pairings name up to this many senders whose adapters the student merges.
    cpm_merge_senders: int = 1
    # How the CPM scores a merge directive's co-senders (``CpmSettings.co_sender_scoring``):
    # "pair" (each by its own pair UCB) or "group" (the group as one arm).
    cpm_co_sender_scoring: Literal["pair", "group"] = "pair"
    # How the CPM normalises rewards (``CpmSettings.reward_normaliser``): "robust" (the
    # service's default), median/MAD over a window (docs/security.md), or "zscore", the
    # paper's running z-score.
    cpm_reward_normaliser: Literal["zscore", "robust"] = "robust"
    # One model family for every client (ARCHS' names); None: client i hosts ARCHS[i % 4].
    family: str | None = None
    # FedProxy (peerlm.app.experiment_fedproxy): the compression ratio κ (share of blocks
    # removed, Table 8's default), the members' full-parameter learning rate (the LoRA one
    # diverges on full weights; bench fedproxy's), PCR's λ_reg (Appendix B.1).
    proxy_ratio: float = 0.5
    proxy_learning_rate: float = 1e-3
    proxy_lambda_reg: float = 1e-5
    # fedproxy_proxytuning's offset weight β: s_M + β (s_φT − s_φ0) (agent/proxy_tuning.py;
    # 1 is ProxyTuning's own sum, our knob beyond it).
    proxy_tuning_beta: float = 1.0
    # Where a client puts what peers send (peerlm.agent.peer_knowledge): "separate", a
    # peer slot beside its own adapter with a router calibrated on its own validation
    # prompts (our choice: the no-regret default); "shared", the papers' one adapter.
    integration: Literal["separate", "shared"] = "separate"
    # Eq. 2's teacher share alpha_KD when the knowledge goes to the peer slot (our choice):
    # the own-data share there only keeps the slot's format, the own adapter keeps the
    # skills; None: Table 6's schedule, 0.2 -> 0.5.
    peer_alpha: float | None = 0.8
    # Whether every client of a collaborative strategy also spends LocalOnly+'s extra
    # own-data steps every round (an agent keeps training on its own data whatever its
    # role); False: the earlier harness, where only students trained in the exchange phase.
    own_steps_every_round: bool = True

    def arch(self, i: int) -> str:
        """The architecture client ``i`` hosts."""
        return self.family or ARCHS[i % len(ARCHS)]

    def __post_init__(self) -> None:
        unknown = [s for s in self.strategies if s not in KNOWN_STRATEGIES]
        if unknown:
            raise ValueError(
                f"unknown strategies {unknown}; choose from {', '.join(KNOWN_STRATEGIES)}"
            )
        if self.family is not None and self.family not in ARCHS:
            raise ValueError(f"unknown family {self.family!r}; one of {', '.join(ARCHS)}")
        proxied = [s for s in self.strategies if s in FEDPROXY_STRATEGIES]
        if proxied and self.family is None:
            raise ValueError(
                f"{', '.join(proxied)} need one model family for every client (--family): "
                "a FedProxy cohort trains one owner's proxy"
            )
        if not (0 <= self.proxy_ratio < 1):
            raise ValueError("proxy_ratio must be in [0, 1)")
        if not (math.isfinite(self.proxy_learning_rate) and 0 < self.proxy_learning_rate <= 1):
            raise ValueError("proxy_learning_rate must be in (0, 1]")
        if not (math.isfinite(self.proxy_lambda_reg) and self.proxy_lambda_reg >= 0):
            raise ValueError("proxy_lambda_reg must be >= 0")
        beta = self.proxy_tuning_beta
        if isinstance(beta, bool) or not (math.isfinite(beta) and beta >= 0):
            raise ValueError("proxy_tuning_beta must be a finite number >= 0")
        if beta != 1 and not any(s in PROXY_TUNED for s in self.strategies):
            raise ValueError(
                "proxy_tuning_beta is read by fedproxy_proxytuning only; add it to the strategies"
            )
        # 1 and 1.0 are one plan: the reuse key compares the plan's JSON.
        object.__setattr__(self, "proxy_tuning_beta", float(beta))
        if not (math.isfinite(self.learning_rate) and 0 < self.learning_rate <= 1):
            raise ValueError("learning_rate must be in (0, 1]")
        if self.peer_alpha is not None and not (
            math.isfinite(self.peer_alpha) and 0 < self.peer_alpha <= 1
        ):
            raise ValueError("peer_alpha must be in (0, 1]")
        if self.integration not in ("separate", "shared"):
            raise ValueError(
                f"integration must be 'separate' or 'shared', not {self.integration!r}"
            )
        if not self.strategies or len(set(self.strategies)) != len(self.strategies):
            raise ValueError("strategies must be a non-empty list without repeats")
        if self.warmup_steps < 0:
            raise ValueError("warmup_steps must be >= 0")
        if (
            self.val_every < 1
            or self.curve_every < 1
            or (self.teach_limit is not None and self.teach_limit < 1)
        ):
            raise ValueError("val_every, curve_every and teach_limit must be positive")
        if self.agents < 2 or self.rounds < 1:
            raise ValueError("need at least 2 agents and 1 round")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError("seeds must be a non-empty list without repeats")
        if self.akd_steps is not None and self.akd_steps < 1:
            raise ValueError("akd_steps must be positive")
        if (
            self.samples < 1
            or self.test_limit < 1
            or (self.transfer_limit is not None and self.transfer_limit < 1)
        ):
            raise ValueError("samples, test_limit and transfer_limit must be positive")
        if self.probe_per_category < 1:
            raise ValueError("probe_per_category must be positive")
        if self.reward not in ("val", "probe"):
            raise ValueError(f"reward must be 'val' or 'probe', not {self.reward!r}")
        if self.probe_scope not in ("all", "lacked"):
            raise ValueError(f"probe_scope must be 'all' or 'lacked', not {self.probe_scope!r}")
        if self.probe_scope == "lacked" and self.reward != "probe":
            raise ValueError("probe_scope 'lacked' needs reward 'probe'")
        if not self.sample_temperature > 0:
            raise ValueError("sample_temperature must be > 0")
        if self.teach_scope not in ("competent", "all"):
            raise ValueError(f"teach_scope must be 'competent' or 'all', not {self.teach_scope!r}")
        if not (math.isfinite(self.teach_min_pass) and 0 <= self.teach_min_pass <= 1):
            raise ValueError("teach_min_pass must be in [0, 1]")
        if self.cpm_beta is not None and not (math.isfinite(self.cpm_beta) and self.cpm_beta >= 0):
            raise ValueError("cpm_beta must be a finite number >= 0")
        self.cpm_settings()  # the CPM's own checks (context columns inside the profile)
        self.world_spec()  # the layout's own checks

    def world_spec(self) -> WorldSpec:
        """The world the plan's data are built with."""
        from peerlm.agent import WorldSpec

        if not 0 <= self.unskilled < self.agents:
            raise ValueError("unskilled must leave at least one skilled client")
        return WorldSpec(
            experts_per_skill=self.experts_per_skill,
            unskilled_clients=self.unskilled,
            per_private_category=self.per_private_category,
            transfer_per_private=self.transfer_per_private,
        )

    def cpm_settings(self, seed: int = 0, protocols: tuple[str, ...] = (DEFAULT_PROTOCOL,)) -> Any:
        """The CPM service's settings the plan's CPM strategies run with."""
        from peerlm.services.cpm import CpmSettings

        given: dict[str, Any] = {"seed": seed, "protocols": protocols}
        if self.cpm_beta is not None:
            given["beta"] = self.cpm_beta
        if self.cpm_merge_senders != 1:
            given["merge_senders"] = self.cpm_merge_senders
        if self.cpm_co_sender_scoring != "pair":
            given["co_sender_scoring"] = self.cpm_co_sender_scoring
        given["reward_normaliser"] = self.cpm_reward_normaliser
        try:
            return CpmSettings(
                **given,
                interaction_features=self.cpm_interaction_features,
                context_columns=self.cpm_context_columns,
            )
        except ValueError as exc:  # pydantic's ValidationError is one
            raise ValueError(f"CPM settings: {exc}") from None

    @property
    def integration_steps(self) -> int:
        """Optimiser steps of one AKD integration (``akd_steps`` or ``local_steps``)."""
        return self.local_steps if self.akd_steps is None else self.akd_steps


#: Memory one worker process of ``--jobs`` may take: four tiny models, their adapters and
#: the run's evaluation (peak RSS of a default run's process: 1.0 GB), with headroom.
WORKER_MEMORY_BYTES: Final[int] = 3 * 2**29  # 1.5 GiB


def default_jobs(runs: int, cores: int, available: int | None, threads: int = 1) -> int:
    """``--jobs`` when none is given: one worker per ``threads`` usable cores, at most one
    per run, and no more than ``available`` bytes of memory hold beside the main process
    (:data:`WORKER_MEMORY_BYTES` each, the main process as one more; None: unknown, not
    limited); at least 1."""
    jobs = min(cores // max(1, threads), runs)
    if available is not None:
        jobs = min(jobs, available // WORKER_MEMORY_BYTES - 1)
    return max(1, jobs)


def parse_strategies(text: str) -> tuple[str, ...]:
    """``--strategies``' value: a comma list of names, or ``table`` for :data:`STRATEGIES`
    (names are checked by :class:`ExperimentPlan`)."""
    named = tuple(s.strip() for s in text.split(",") if s.strip())
    if "table" in named and len(named) > 1:
        raise ValueError("'table' (the paper's eight strategies) stands alone in --strategies")
    return STRATEGIES if named == ("table",) else named


def quick_plan(**overrides: Any) -> ExperimentPlan:
    """``--quick``: a smoke-test configuration (2 seeds, 2 rounds, few problems) of the
    whole table (:data:`STRATEGIES`)."""
    base: dict[str, Any] = {
        "strategies": STRATEGIES,
        "agents": 4,
        "rounds": 2,
        "val_every": 1,
        "curve_every": 1,
        "seeds": (0, 1),
        "local_steps": 2,
        "grad_accumulation": 1,
        "transfer_limit": 6,
        "akd_steps": None,
        "warmup_steps": 2,
        "val_limit": 4,
        "test_limit": 24,
        "samples": 2,
        "max_new_tokens": 32,
        "probe_per_category": 1,
    }
    base.update(overrides)
    return ExperimentPlan(**base)


@dataclass
class _Client:
    name: str
    arch: str
    host: ModelHost
    train: list[Problem]
    val: list[Problem]
    guardrail: Guardrail
    history: list[dict[str, float]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    exchanges: int = 0
    # Greedy validation pass counts per category of the last local phase (what the client
    # may teach: :mod:`peerlm.agent.teaching`); None before the first.
    competence: Competence | None = None
    # What peers sent, beside the own adapter, and which inputs it answers
    # (``plan.integration == "separate"``; :mod:`peerlm.agent.peer_knowledge`).
    slot: PeerSlot = field(default_factory=_new_slot)
    router: InputRouter | None = None
    # Optimiser steps spent on own data and on distillation or merging (per client, the
    # compute each strategy spends; part of the run's record).
    own_steps: int = 0
    peer_steps: int = 0

    def integrating(self, plan: ExperimentPlan, what: str = "integration") -> Any:
        """Where an integration writes: the peer slot (``separate``) or the one adapter."""
        if plan.integration == "separate":
            return self.slot.active(self.host, what)
        return contextlib.nullcontext()

    def routed(
        self, problems: Sequence[_P2], run: Callable[[Sequence[_P2]], Sequence[_R]]
    ) -> list[_R]:
        """``run`` over ``problems``, each answered by the adapter the router picks."""
        from peerlm.agent import route_map

        # The own adapter answers every problem as LocalOnly+'s does (same batches, same
        # draws), so a problem it keeps is compared with common random numbers.
        return route_map(
            self.host,
            self.slot,
            self.router,
            problems,
            lambda p: p.prompt,
            run,
            own_runs_all=True,
        )

    @property
    def train_examples(self) -> list[tuple[str, str]]:
        return [(p.prompt, p.reference) for p in self.train]

    @property
    def val_examples(self) -> list[tuple[str, str]]:
        return [(p.prompt, p.reference) for p in self.val]


@dataclass
class _World:
    plan: ExperimentPlan
    models: Path
    clients_data: list[tuple[list[Problem], list[Problem]]]
    transfer: list[str]
    transfer_sha256: str
    test: list[Problem]
    probe: list[Problem]
    slices: list[ClientSlices]
    public: tuple[str, ...]
    # D_pub of OnePeFT's HKA: the public categories' transfer problems with references.
    public_pairs: list[tuple[str, str]] = field(default_factory=list)
    # Each client's adapter after the warm-up (by client name); empty without one.
    warm: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The same after ffa_lora's warm-up (shared A, frozen); empty unless ffa_lora runs.
    ffa_warm: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The category of each prompt of ``transfer`` (what a competent teacher selects by).
    transfer_categories: list[str] = field(default_factory=list)

    def teachable(self, client: _Client, t: int = 1) -> list[int]:
        """Indices of the X_u prompts ``client`` answers as a teacher in round ``t``
        (``teach_scope``; at most ``teach_limit`` of them, a window that moves on each
        round so that the rounds cover them all)."""
        from peerlm.agent import teachable_indices

        chosen = teachable_indices(
            self.transfer_categories,
            client.competence,
            scope=self.plan.teach_scope,
            min_pass=self.plan.teach_min_pass,
        )
        limit = self.plan.teach_limit
        if limit is None or len(chosen) <= limit:
            return chosen
        start = ((t - 1) * limit) % len(chosen)
        return sorted((chosen + chosen)[start : start + limit])

    @property
    def probe_examples(self) -> list[tuple[str, str]]:
        return [(p.prompt, p.reference) for p in self.probe]

    def units(self, slice_name: str) -> list[tuple[int, int]]:
        """(client index, test problem index) of ``slice_name``, in a fixed order."""
        return [
            (i, j)
            for i, sl in enumerate(self.slices)
            for j, p in enumerate(self.test)
            if sl.of(p.category) == slice_name
        ]


# ------------------------------------------------------------------------ the ensemble


def consensus_texts(
    hosts: Sequence[ModelHost], prompts: Sequence[str], candidates: Sequence[Sequence[str]]
) -> list[str]:
    """Central-KD's ensemble teacher (module docstring): per prompt, the candidate with the
    highest mixture log-likelihood per UTF-8 byte under all ``hosts``.

    ``candidates[i]`` are client i's completions of ``prompts``; empty ones are not
    candidates (a prompt nobody answered gets ``""``).
    """
    out: list[str] = []
    for j, prompt in enumerate(prompts):
        options = list(dict.fromkeys(c[j] for c in candidates if c[j].strip()))
        if not options:
            out.append("")
            continue
        pairs = [(prompt, option) for option in options]
        scores = np.array([h.sequence_logprobs(pairs) for h in hosts])  # [clients, options]
        mixture = np.logaddexp.reduce(scores, axis=0) - math.log(len(hosts))
        per_byte = mixture / np.array([max(1, len(o.encode())) for o in options])
        out.append(options[int(np.argmax(per_byte))])
    return out


# ------------------------------------------------------------------------- set-up


def _prepare(plan: ExperimentPlan, models: Path, data: Path, event: Event) -> _World:
    from peerlm.agent import (
        CATEGORIES,
        build_federation_data,
        build_models,
        probe_problems,
        read_jsonl,
        read_manifest,
        transfer_set_sha256,
    )

    archs = tuple(dict.fromkeys(plan.arch(i) for i in range(plan.agents)))

    def on_build(e: Any) -> None:
        if e.phase == "pretrain" or e.finished:
            event(
                "build",
                {"arch": e.arch, "phase": e.phase, "step": e.step, "total": e.total,
                 "finished": e.finished},
            )  # fmt: skip

    build_models(models, archs, size=plan.size, seed=plan.model_seed, progress=on_build)
    build_federation_data(
        data,
        plan.agents,
        alpha=plan.alpha,
        seed=plan.world_seed,
        world=plan.world_spec(),
        overwrite=True,
    )
    clients = [
        (
            read_jsonl(data / "clients" / str(i) / "train.jsonl"),
            read_jsonl(data / "clients" / str(i) / "val.jsonl"),
        )
        for i in range(plan.agents)
    ]
    transfer_problems = read_jsonl(data / "transfer.jsonl")
    transfer = [p.prompt for p in transfer_problems][: plan.transfer_limit]
    all_test = read_jsonl(data / "test.jsonl")
    test = all_test[: plan.test_limit]
    categories = list(dict.fromkeys([*CATEGORIES, *(p.category for p in all_test)]))
    world = read_manifest(data).world
    public = world.public_categories
    slices = [slices_of_world(world, i) for i in range(plan.agents)]
    taken = [*all_test, *transfer_problems, *(p for tr, va in clients for p in (*tr, *va))]
    probe = probe_problems(plan.probe_per_category, plan.world_seed, taken, categories)
    return _World(
        plan,
        models,
        clients,
        transfer,
        transfer_set_sha256(transfer),
        test,
        probe,
        slices,
        public,
        [(p.prompt, p.reference) for p in transfer_problems if p.category in public],
        transfer_categories=[p.category for p in transfer_problems][: plan.transfer_limit],
    )


def _clients(
    world: _World,
    seed: int,
    *,
    ffa: bool = False,
    only: int | None = None,
    routers: bool = True,
) -> list[_Client]:
    """The clients of run seed ``seed`` on their warm start. With ``ffa`` (FFA-LoRA) every
    client's adapter is initialised from ``seed`` itself, so a family shares one A, its A is
    frozen, and the warm start is ffa_lora's own (module docstring). ``only``: client
    ``only`` alone; ``routers`` False: no input routers (nothing will be routed)."""
    from peerlm.agent import Guardrail, LoraSettings, ModelHost

    plan = world.plan
    warm = world.ffa_warm if ffa else world.warm
    out = []
    for i, (train, val) in enumerate(world.clients_data):
        if only is not None and i != only:
            continue
        arch = plan.arch(i)
        host = ModelHost.load(
            world.models / arch,
            LoraSettings(r=plan.lora_rank),
            device="cpu",
            seed=seed if ffa else seed + i,
        )
        host.frozen_lora_a = ffa
        guard = Guardrail([p.prompt + p.reference for p in train], public_texts=world.transfer)
        name = f"agent-{i}"
        if name in warm:
            host.load_adapter_state(warm[name])
        client = _Client(name, arch, host, train, val, guard)
        if plan.integration == "separate" and routers:
            client.router = _router(world, train, val)
        out.append(client)
    return out


def _router(world: _World, train: Sequence[Problem], val: Sequence[Problem]) -> InputRouter:
    """A client's input router (:class:`~peerlm.agent.peer_knowledge.InputRouter`): its own
    training prompts and X_u's by category, calibrated on its own validation prompts."""
    from peerlm.agent import InputRouter

    return InputRouter.fit(
        [p.prompt for p in train],
        world.transfer,
        [p.prompt for p in val] or [p.prompt for p in train],
        own_categories=[p.category for p in train],
        other_categories=world.transfer_categories,
    )


def _warm_up(
    world: _World, event: Event, *, ffa: bool = False, jobs: int = 1
) -> dict[str, dict[str, Any]]:
    """Every client's adapter after ``warmup_steps`` on its own data, once per world.

    Seeded by the world seed, not the run seed: the warmed-up models are part of the world
    the federation starts from (as the built models are), so every run seed and strategy
    starts from the same experts and the seeds vary only what the federation does. With
    ``ffa``, ffa_lora's warm-up: the same steps and batches with the family's shared A
    frozen (module docstring).
    """
    plan = world.plan
    if plan.warmup_steps == 0:
        return {}
    out: dict[str, dict[str, Any]] = {}
    clients = range(plan.agents)
    if jobs > 1:
        # The clients warm up apart: one process each, the cores busy from the start.
        import multiprocessing
        import os
        from concurrent.futures import ProcessPoolExecutor

        import torch

        from peerlm.process import exit_with_parent

        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(
            min(jobs, plan.agents),
            mp_context=ctx,
            initializer=exit_with_parent,
            initargs=(os.getpid(),),
        ) as pool:
            futures = [
                pool.submit(_warm_one, world, i, ffa, torch.get_num_threads()) for i in clients
            ]
            done = [f.result() for f in futures]
    else:
        done = [_warm_one(world, i, ffa) for i in clients]
    for name, state, loss in done:
        out[name] = state
        event("warmup", {"client": name, "steps": plan.warmup_steps, "loss": loss, "ffa": ffa})
    return out


def _warm_one(
    world: _World, i: int, ffa: bool, threads: int | None = None
) -> tuple[str, dict[str, Any], float]:
    """Client ``i``'s warm-up (:func:`_warm_up`): its name, adapter and mean loss."""
    from peerlm.agent import TrainSettings

    if threads is not None:  # in a worker process
        import torch

        torch.set_num_threads(threads)
    plan = world.plan
    [c] = _clients(world, plan.world_seed, ffa=ffa, only=i, routers=False)
    settings = TrainSettings(
        learning_rate=plan.learning_rate,
        grad_accumulation=plan.grad_accumulation,
        seed=plan.world_seed * 1_009 + i,
    )
    stats = c.host.train_local(c.train_examples, settings, steps=plan.warmup_steps)
    return c.name, c.host.adapter_state(), stats.mean_loss


def _round_config(plan: ExperimentPlan, seed: int, i: int, *, integration: bool = False) -> Any:
    """Client ``i``'s round configuration; with ``integration`` its ``local_steps`` are the
    AKD integration's steps (``plan.integration_steps``)."""
    from peerlm.agent import RoundConfig, TrainSettings

    config = RoundConfig(
        total_rounds=plan.rounds,
        train=TrainSettings(
            learning_rate=plan.learning_rate,
            grad_accumulation=plan.grad_accumulation,
            seed=seed + i,
        ),
        local_steps=plan.integration_steps if integration else plan.local_steps,
        reward_delta=plan.reward_delta,
        max_new_tokens=plan.max_new_tokens,
    )
    if plan.integration == "separate" and plan.peer_alpha is not None:
        config = dataclasses.replace(
            config, alpha_kd_start=plan.peer_alpha, alpha_kd_end=plan.peer_alpha
        )
    return config


def _pairing_policy(strategy: str, plan: ExperimentPlan, seed: int) -> Any:
    from peerlm.services.cpm import (
        CpmSettings,
        HeteroGreedyMatchmaker,
        Matchmaker,
        RandomMatchmaker,
    )

    if strategy == "random":
        return RandomMatchmaker(seed=seed)
    if strategy == "heuristic":
        return HeteroGreedyMatchmaker()
    if strategy in CPM_PROTOCOLS:
        s: CpmSettings = plan.cpm_settings(seed, CPM_PROTOCOLS[strategy])
        return Matchmaker(
            profile_dim=s.profile_dim,
            beta=s.beta,
            pair_budget=s.pair_budget,
            protocols=s.protocols,
            seed=s.seed,
            roles=s.roles,
            interaction_features=s.interaction_features,
            trust_features=s.trust_features,
            matching=s.matching,
            ridge=s.ridge,
            context_columns=s.context_columns,
            merge_senders=s.merge_senders,
            co_sender_scoring=s.co_sender_scoring,
            reward_clip_sigmas=s.reward_clip_sigmas,
            reward_normaliser=s.reward_normaliser,
            reward_window=s.reward_window,
        )
    return None


# ------------------------------------------------------------------------ evaluation


def _test_nll(world: _World, client: _Client) -> list[float]:
    from peerlm.agent import reference_nll

    return client.routed(world.test, lambda ps: reference_nll(client.host, ps))


def _slice_means(world: _World, per_client: Mapping[int, Sequence[float]]) -> dict[str, float]:
    """Mean of a per-(client, problem) value over each non-empty slice's units."""
    out: dict[str, float] = {}
    for name in SLICES:
        units = world.units(name)
        if units:
            out[name] = float(np.mean([per_client[i][j] for i, j in units]))
    return out


def _final_eval(world: _World, client: _Client, seed: int) -> dict[str, Any]:
    from peerlm.agent import (
        reference_nll,
        sample_completions,
        score_completions,
        structural_match_rate,
    )

    plan = world.plan

    def sample(problems: Sequence[Problem]) -> list[list[str]]:
        got = sample_completions(
            client.host,
            problems,
            max_new_tokens=plan.max_new_tokens,
            n=plan.samples,
            temperature=plan.sample_temperature,
            seed=seed,
        )
        return [got[p.task_id] for p in problems]

    answers = client.routed(world.test, sample)
    completions = {p.task_id: a for p, a in zip(world.test, answers, strict=True)}
    report = score_completions(world.test, completions, ks=(1,))
    # Which adapter answered each test problem (1: the peer slot); the router never sees
    # the test set's categories.
    peer = _peer_routes(client, world.test)
    return {
        "arch": client.arch,
        "pass@1": [r.pass_at[1] for r in report.problems],
        "struct": [structural_match_rate(p, completions[p.task_id]) for p in world.test],
        "nll": _test_nll(world, client),
        # The probe set's NLL (not test data): what "best" is chosen by.
        "probe_nll": client.routed(world.probe, lambda ps: reference_nll(client.host, ps)),
        "status_counts": dict(report.status_counts),
        "peer_routed": peer,
        "own_steps": client.own_steps,
        "peer_steps": client.peer_steps,
        "peer_integrations": client.slot.integrations,
    }


def _peer_routes(client: _Client, problems: Sequence[Problem]) -> list[int]:
    """Per problem, 1 if the peer slot answers it, else 0."""
    if client.router is None or not client.slot.ready:
        return [0] * len(problems)
    return [int(x) for x in client.router.to_peer([p.prompt for p in problems])]


# ------------------------------------------------------------------------ one round


def _reward_examples(world: _World, student: _Client, i: int) -> list[tuple[str, str]]:
    """Where student ``i`` measures L_pre and L_post: its validation data (Eq. 3 as in the
    paper), the public probe set, or the probe problems of its lacked categories
    (``probe_scope``; our choices, module docstring)."""
    if world.plan.reward != "probe":
        return student.val_examples
    if world.plan.probe_scope == "all":
        return world.probe_examples
    lacked = world.slices[i].lacked
    # A client that lacks nothing (every private skill its own) has no such probe: the
    # whole probe then, so that it still measures what an exchange did.
    return [(p.prompt, p.reference) for p in world.probe if p.category in lacked] or (
        world.probe_examples
    )


def _integrate(
    world: _World,
    student: _Client,
    package: Any,
    kilobytes: float,
    seed: int,
    i: int,
    t: int,
) -> Integration:
    from peerlm.agent import integrate_package

    with student.integrating(world.plan, f"akd-{package.__class__.__name__}"):
        result = integrate_package(
            student.host,
            package,
            kilobytes=kilobytes,
            local_examples=student.train_examples,
            val_examples=_reward_examples(world, student, i),
            transfer_prompts=world.transfer,
            config=_round_config(world.plan, seed, i, integration=True),
            t=t,
        )
    student.peer_steps += world.plan.integration_steps
    return result


def _predictions(world: _World, teacher: _Client, t: int) -> tuple[list[int], list[str]]:
    """What ``teacher`` answers of X_u (:meth:`_World.teachable`) and its greedy answers."""
    from peerlm.agent import teacher_completions

    chosen = world.teachable(teacher, t)
    prompts = [world.transfer[k] for k in chosen]
    return chosen, teacher_completions(teacher.host, prompts, world.plan.max_new_tokens)


def _package(
    world: _World,
    teacher: _Client,
    predictions: tuple[list[int], list[str]],
    directive: str,
    mode: Literal["text", "logits"] = "text",
) -> tuple[Any, float]:
    """The teacher's package of ``predictions`` (:func:`_predictions`): text, or top-k
    logits for a student of the teacher's tokenizer; encoded and decoded as on the wire;
    (package, KB)."""
    from peerlm.agent import build_package, decode_package

    chosen, completions = predictions
    data = build_package(
        teacher.host,
        mode=mode,
        prompts=[world.transfer[k] for k in chosen],
        prompt_ids=[str(k) for k in chosen],
        completions=completions,
        teacher=teacher.name,
        directive_id=directive,
        transfer_sha256=world.transfer_sha256,
        guardrail=teacher.guardrail,
    )
    package = decode_package(
        data,
        expect_transfer_sha256=world.transfer_sha256,
        expect_directive_id=directive,
        expect_teacher=teacher.name,
    )
    return package, len(data) / 1024


def _central_kd(world: _World, clients: list[_Client], seed: int, t: int) -> list[dict[str, Any]]:
    from peerlm.agent import Guardrail, build_text_package, decode_package

    completions = []
    for c in clients:
        # What a client does not answer (``teach_scope``) is no candidate: "".
        chosen, texts = _predictions(world, c, t)
        vetted = c.guardrail.filter_many(texts, [world.transfer[k] for k in chosen])
        answers = [""] * len(world.transfer)
        for k, r in zip(chosen, vetted, strict=True):
            answers[k] = r.text
        completions.append(answers)
    consensus = consensus_texts([c.host for c in clients], world.transfer, completions)
    data = build_text_package(
        prompts=world.transfer,
        completions=consensus,
        teacher="central",
        directive_id=f"central-{t}",
        transfer_sha256=world.transfer_sha256,
        family="other",
        guardrail=Guardrail([]),  # the clients vetted their texts before sending
    )
    package = decode_package(data, expect_transfer_sha256=world.transfer_sha256)
    records = []
    for i, student in enumerate(clients):
        result = _integrate(world, student, package, len(data) / 1024, seed, i, t)
        student.rewards.append(result.reward)
        student.exchanges += 1
        records.append(_record("central", student.name, result, None))
    return records


def _oracle(
    world: _World, clients: list[_Client], seed: int, t: int
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Try every ordered pair, keep the disjoint pairs of largest true probe gain.

    The gain of (teacher, student) is the student's probe-loss drop from integrating the
    teacher's package (whatever ``reward`` the plan uses). Pairs are chosen greedily by
    gain, ⌊N/2⌋ of them as the matchmakers do; the chosen students keep their trial
    adapter, the others are restored. Returns the records and every pair's gain
    (``"teacher>student"``), for the CPM's figures.
    """
    predictions = {c.name: _predictions(world, c, t) for c in clients}
    probe = world.probe_examples
    trials: dict[tuple[int, int], tuple[float, Any, Integration, float]] = {}
    separate = world.plan.integration == "separate"
    for si, student in enumerate(clients):
        # The trials start from what integrations write to (the peer slot, or the adapter),
        # and the gain is measured on the model that answers (routed, or the adapter).
        before_slot = student.slot.state
        before = {k: v.clone() for k, v in student.host.adapter_state().items()}
        pre = _probe_loss(student, probe)
        for ti, teacher in enumerate(clients):
            if ti == si:
                continue
            directive = f"oracle-{t}-{teacher.name}-{student.name}"
            package, kb = _package(world, teacher, predictions[teacher.name], directive)
            result = _integrate(world, student, package, kb, seed, si, t)
            post = _probe_loss(student, probe)
            if separate:
                assert student.slot.state is not None
                after = student.slot.state
                student.slot.state = before_slot
                student.slot.integrations -= 1
            else:
                after = {k: v.clone() for k, v in student.host.adapter_state().items()}
                student.host.load_adapter_state(before)
            trials[(ti, si)] = (pre - post, after, result, kb)
    used: set[int] = set()
    records: list[dict[str, Any]] = []
    for (ti, si), (gain, after, result, _kb) in sorted(
        trials.items(), key=lambda kv: (-kv[1][0], kv[0])
    ):
        if len(records) >= len(clients) // 2:
            break
        if ti in used or si in used:
            continue
        used |= {ti, si}
        student = clients[si]
        if separate:
            student.slot.state = after
            student.slot.integrations += 1
        else:
            student.host.load_adapter_state(after)
        student.rewards.append(result.reward)
        student.exchanges += 1
        records.append(
            {**_record(clients[ti].name, student.name, result, None), "probe_gain": round(gain, 6)}
        )
    gains = {
        f"{clients[ti].name}>{clients[si].name}": round(g[0], 6) for (ti, si), g in trials.items()
    }
    return records, gains


def _probe_loss(client: _Client, examples: Sequence[tuple[str, str]]) -> float:
    """Mean loss of ``examples`` on the model that answers them (each routed)."""
    losses = client.routed(
        [_Prompted(p, r) for p, r in examples],
        lambda xs: [client.host.eval_loss([(x.prompt, x.reference)])[0] for x in xs],
    )
    return float(np.mean(losses)) if losses else 0.0


@dataclass(frozen=True)
class _Prompted:
    prompt: str
    reference: str


def _semantic_dfl(world: _World, clients: list[_Client]) -> list[dict[str, Any]]:
    """Within each model family, every client takes the PDFL step towards the others'
    adapters (equal similarities); the adapters travel whole, as an overlay pull does."""
    from peerlm.overlay import personalised_update

    states = {c.name: {k: v.clone() for k, v in c.host.adapter_state().items()} for c in clients}
    records: list[dict[str, Any]] = []
    for c in clients:
        peers = {o.name: states[o.name] for o in clients if o is not c and o.arch == c.arch}
        if not peers:
            continue
        with c.integrating(world.plan, "semantic_dfl"):
            base = c.host.adapter_state() if world.plan.integration == "separate" else None
            new, _report = personalised_update(
                base or states[c.name], peers, dict.fromkeys(peers, 1.0), self_id=c.name
            )
            c.host.load_adapter_state(new)
        c.exchanges += 1
        kb = (
            sum(sum(t.numel() * t.element_size() for t in s.values()) for s in peers.values())
            / 1024
        )
        records.append({"teacher": ",".join(sorted(peers)), "student": c.name, "kilobytes": kb})
    return records


#: Merge strategies that aggregate every round (the others, OnePeFT's, once at the end).
_EVERY_ROUND: tuple[str, ...] = (
    "fedavg_lora",
    "ffa_lora",
    "onepeft_multi",
    "onepeft_multi_ce",
    "fedavg_lora_plus",
)
#: The OnePeFT variants and the parts of Eq. 3-6 each runs (Table 5's rows).
_SVD: tuple[str, ...] = ("onepeft", "onepeft_svd", "onepeft_multi", "onepeft_multi_ce")
_HKA: tuple[str, ...] = ("onepeft", "onepeft_hka", "onepeft_multi", "onepeft_multi_ce")
#: HKA's Eq. 6 alpha (the CE share): the paper's 0.5, or CE only for the control.
_HKA_ALPHA: Mapping[str, float] = {"onepeft_multi_ce": 1.0}


def _families(clients: list[_Client]) -> list[list[_Client]]:
    groups: dict[str, list[_Client]] = {}
    for c in clients:
        groups.setdefault(c.arch, []).append(c)
    return [g for g in groups.values() if len(g) > 1]


def _merge_exchange(
    world: _World, strategy: str, clients: list[_Client], seed: int, t: int
) -> list[dict[str, Any]]:
    """FedAvg-LoRA (with or without own steps after it), FFA-LoRA or multi-round OnePeFT
    every round, or a OnePeFT variant once in the last round, within each model family (a
    client alone in its family trains locally). Each client pulls the other members'
    adapters (counted in KB) and builds the aggregate itself, as a peer would."""
    from peerlm.agent import ClientAdapter

    plan = world.plan
    if strategy not in _EVERY_ROUND and t != plan.rounds:
        return []
    records: list[dict[str, Any]] = []
    for group in _families(clients):
        adapters = [
            ClientAdapter(
                c.host.adapter_state(),
                r=c.host.lora.r,
                alpha=c.host.lora.alpha,
                examples=len(c.train),
                name=c.name,
            )
            for c in group
        ]
        sizes = [sum(x.numel() * x.element_size() for x in a.state.values()) for a in adapters]
        for k, c in enumerate(group):
            # The family-merge baselines (FedAvg-LoRA, FFA-LoRA, OnePeFT) keep the papers'
            # one adapter: their point is the shared model (docs/experiment.md).
            _merge_one(world, strategy, c, adapters, seed, clients.index(c), t)
            c.exchanges += 1
            records.append(
                {
                    "teacher": ",".join(o.name for o in group if o is not c),
                    "student": c.name,
                    "kilobytes": round((sum(sizes) - sizes[k]) / 1024, 2),
                }
            )
    return records


def _merge_one(
    world: _World, strategy: str, c: _Client, adapters: Sequence[Any], seed: int, i: int, t: int
) -> None:
    """Client ``c``'s aggregate of its family's ``adapters`` under a merge strategy."""
    from peerlm.agent import aggregate_fedavg_factors, aggregate_ffa, one_shot

    plan = world.plan
    settings = _round_config(plan, seed, i).train_settings(t)
    if strategy in ("fedavg_lora", "fedavg_lora_plus"):
        c.host.load_adapter_state(aggregate_fedavg_factors(adapters).state)
        if strategy == "fedavg_lora_plus":
            c.host.train_local(c.train_examples, settings, steps=plan.local_steps)
    elif strategy == "ffa_lora":
        # Refuses (AdapterError "frozen_a") if a client's A had moved.
        c.host.load_adapter_state(aggregate_ffa(adapters).state)
    else:
        one_shot(
            c.host,
            adapters,
            world.public_pairs,
            settings,
            svd=strategy in _SVD,
            hka=strategy in _HKA,
            alpha=_HKA_ALPHA.get(strategy, 0.5),
            steps=plan.local_steps,
        )
        c.peer_steps += plan.local_steps


def _own_steps(world: _World, clients: Sequence[_Client], seed: int, t: int) -> None:
    """LocalOnly+'s extra own-data steps of round ``t``, on every client's own adapter."""
    plan = world.plan
    for i, c in enumerate(clients):
        config = _round_config(plan, seed, i)
        c.host.train_local(c.train_examples, config.train_settings(t), steps=plan.integration_steps)
        c.own_steps += plan.integration_steps


def _exchange(
    world: _World,
    strategy: str,
    policy: Any,
    clients: list[_Client],
    profiles: Mapping[str, np.ndarray],
    seed: int,
    t: int,
    *,
    overlay: OverlayView | None = None,
) -> tuple[list[dict[str, Any]], dict[str, float] | None]:
    by_name = {c.name: c for c in clients}
    if strategy == "local":
        return [], None
    if strategy == "local_plus":  # its own-data steps are the round loop's
        return [], None
    if strategy == "central_kd":
        return _central_kd(world, clients, seed, t), None
    if strategy == "oracle":
        return _oracle(world, clients, seed, t)
    if strategy == "semantic_dfl":
        return _semantic_dfl(world, clients), None
    if strategy in MERGE_STRATEGIES:
        return _merge_exchange(world, strategy, clients, seed, t), None
    if strategy in MENU_STRATEGIES:
        directed = _menu_exchange(world, policy, clients, profiles, seed, t, overlay)
        if overlay is not None:
            directed += _overlay_exchange(world, clients, overlay, seed, t)
        return directed, None
    if strategy in OVERLAY_STRATEGIES:
        assert overlay is not None
        return _overlay_exchange(world, clients, overlay, seed, t), None
    records: list[dict[str, Any]] = []
    pairings: list[Pairing] = policy.select(profiles)
    for pairing in pairings:
        teacher, student = by_name[pairing.sender], by_name[pairing.receiver]
        directive = f"{strategy}-{t}-{teacher.name}-{student.name}"
        package, kb = _package(world, teacher, _predictions(world, teacher, t), directive)
        result = _integrate(world, student, package, kb, seed, clients.index(student), t)
        normalised = policy.observe(pairing, result.reward)
        student.rewards.append(result.reward)
        student.exchanges += 1
        records.append(_record(teacher.name, student.name, result, float(normalised)))
    return records, None


def _menu_exchange(
    world: _World,
    policy: Any,
    clients: list[_Client],
    profiles: Mapping[str, np.ndarray],
    seed: int,
    t: int,
    overlay: OverlayView | None = None,
) -> list[dict[str, Any]]:
    """``cpm_menu``: the CPM chooses a protocol of the whole menu per pair (the
    ``cpm_<protocol>`` strategies: of one protocol, forced for everyone), among those
    admissible for it (each client declares its parameter-space fingerprint and every
    protocol, as an agent does), and the student executes it as the daemon would: AKD by
    text or top-k logits, or the teacher's adapter merged by PDFL (``pmix``) or OnePeFT's
    SVD + HKA (``svd_hka``) through the agent's own aggregation code. Each reward is Eq. 3
    measured where the plan measures it (``_reward_examples``). With ``overlay``
    (``cpm_menu_overlay``) every client reports the list of its last overlay step, and a
    merge protocol is admissible only from a sender on the student's list
    (:mod:`~peerlm.app.experiment_overlay`; no list before the first step)."""
    from peerlm.agent import (
        AcceptanceGate,
        PullSettings,
        host_parameter_space,
        integrate_adapters,
        reward_eq3,
    )
    from peerlm.services.cpm import MENU, Capabilities

    plan = world.plan
    by_name = {c.name: c for c in clients}
    listed = overlay.listed if overlay is not None else {}
    capabilities = {
        c.name: Capabilities(
            host_parameter_space(c.host),
            MENU,
            frozenset(listed[c.name]) if listed.get(c.name) else None,
        )
        for c in clients
    }
    records: list[dict[str, Any]] = []
    pairings: list[Pairing] = policy.select(profiles, capabilities)
    for pairing in pairings:
        teacher, student = by_name[pairing.sender], by_name[pairing.receiver]
        i = clients.index(student)
        config = _round_config(plan, seed, i, integration=True)
        record: dict[str, Any]
        entry = lookup(pairing.protocol)
        if entry.kind == "distillation":
            directive = f"cpm-{pairing.protocol}-{t}-{teacher.name}-{student.name}"
            mode: Literal["text", "logits"] = (
                "logits" if entry.payload == "logits_package" else "text"
            )
            predictions = _predictions(world, teacher, t)
            package, kb = _package(world, teacher, predictions, directive, mode)
            result = _integrate(world, student, package, kb, seed, i, t)
            reward = result.reward
            record = _record(teacher.name, student.name, result, None)
        else:
            # The teacher and the pairing's co-senders (merge_senders > 1): every adapter
            # the directive names, each counted like one neighbour of similarity 1, as the
            # agent does (agent/merge_directive.py).
            senders = [teacher, *(by_name[c] for c in pairing.co_senders)]
            states = {
                c.name: {k: v.clone() for k, v in c.host.adapter_state().items()} for c in senders
            }
            kb = (
                sum(
                    v.numel() * v.element_size()
                    for state in states.values()
                    for v in state.values()
                )
                / 1024
            )
            settings = PullSettings.model_validate(
                {"method": pairing.protocol, "hka_steps": plan.integration_steps}
            )
            gate = AcceptanceGate(_reward_examples(world, student, i), None)
            with student.integrating(plan, pairing.protocol):
                _report, verdict, pre = integrate_adapters(
                    student.host,
                    states,
                    dict.fromkeys(states, 1.0),
                    settings,
                    student.name,
                    gate,
                    (world.public_pairs, config.train_settings(t)),
                )
            if entry.needs_public_pairs:  # HKA's optimiser steps on the public pairs
                student.peer_steps += plan.integration_steps
            if verdict is None:  # the aggregation refused the teacher: no reward, as an agent
                continue
            reward = reward_eq3(
                pre, verdict.loss_post, kb, config.reward_gamma, config.reward_delta
            )
            record = {
                "teacher": teacher.name,
                "co_senders": list(pairing.co_senders),
                "student": student.name,
                "mode": pairing.protocol,
                "loss_pre": round(pre, 5),
                "loss_post": round(verdict.loss_post, 5),
                "kilobytes": round(kb, 2),
                "reward": round(reward, 6),
            }
        normalised = policy.observe(pairing, reward)
        student.rewards.append(reward)
        student.exchanges += 1
        if overlay is not None:
            record["overlay_listed"] = list(listed.get(student.name, ()))
        records.append(
            {**record, "protocol": pairing.protocol, "normalised_reward": round(normalised, 5)}
        )
    return records


def _overlay_exchange(
    world: _World, clients: list[_Client], overlay: OverlayView, seed: int, t: int
) -> list[dict[str, Any]]:
    """Every client's overlay step, as the agent runs it after its directive
    (:func:`peerlm.agent.overlay_step.overlay_round_step`, in process): publish its
    signature, find its ``k`` nearest peers, pull their adapters and aggregate them with
    the agent's own code and settings (the PDFL step weighted by the similarities, the
    acceptance gate on its validation set at the agent's default margin). The agents step
    at once, so each pulls what its neighbours hold before their own steps. One record per
    client: its neighbours (what it reports next), what it pulled and the outcome."""
    from peerlm.agent import AcceptanceGate, AgentSettings, integrate_adapters, pull_settings

    plan = world.plan
    neighbours, similarities = overlay.step({c.name: c.host for c in clients})
    held = {c.name: {k: v.clone() for k, v in c.host.adapter_state().items()} for c in clients}
    defaults = AgentSettings.model_fields
    settings = pull_settings(overlay.settings, defaults["round_timeout_s"].default)
    margin = defaults["acceptance_margin"].default
    records: list[dict[str, Any]] = []
    for i, c in enumerate(clients):
        near = neighbours[c.name]
        record: dict[str, Any] = {
            "teacher": ",".join(near),
            "student": c.name,
            "mode": f"overlay_{settings.method}",
            "protocol": "overlay",
            "neighbours": list(near),
            "similarities": {n: round(v, 6) for n, v in similarities[c.name].items()},
            "kilobytes": 0.0,
        }
        if not near:
            records.append({**record, "outcome": "no_candidates"})
            continue
        pulled = {n: held[n] for n in near}
        kb = sum(v.numel() * v.element_size() for st in pulled.values() for v in st.values())
        gate = AcceptanceGate(c.val_examples, margin) if margin is not None else None
        config = _round_config(plan, seed, i, integration=True)
        with c.integrating(plan, "overlay"):
            report, verdict, _pre = integrate_adapters(
                c.host,
                pulled,
                similarities[c.name],
                settings,
                c.name,
                gate,
                (world.public_pairs, config.train_settings(t)),
            )
        rolled_back = verdict is not None and verdict.rolled_back
        outcome = "rolled_back" if rolled_back else "aggregated" if report.accepted else "identity"
        records.append({**record, "kilobytes": round(kb / 1024, 2), "outcome": outcome})
    return records


def _record(
    teacher: str, student: str, result: Integration, normalised: float | None
) -> dict[str, Any]:
    return {
        "teacher": teacher,
        "student": student,
        "mode": result.mode,
        "alpha_kd": round(result.alpha_kd, 4),
        "loss_pre": round(result.loss_pre, 5),
        "loss_post": round(result.loss_post, 5),
        "kilobytes": round(result.kilobytes, 2),
        "reward": round(result.reward, 6),
        "normalised_reward": None if normalised is None else round(normalised, 5),
    }


@dataclass(frozen=True)
class _LocalPhase:
    """One client's local phase of a round: adapter after it, and what it measured."""

    adapter: dict[str, Any]
    train_loss: float
    val_loss: float
    val_pass1: float
    competence: Competence


@dataclass(frozen=True)
class _OwnRound:
    """One client's own track in one round: its local phase, and its own adapter after the
    round's own-data steps. Under ``integration="separate"`` with ``own_steps_every_round``
    nothing a peer sends touches the own adapter, so it is the same in every strategy of a
    seed (LocalOnly+'s): computed once, by LocalOnly+'s run, and replayed by the others."""

    phase: _LocalPhase
    trained: dict[str, Any]


#: Per round (index t - 1), every client's :class:`_OwnRound`.
_Track = list[dict[str, _OwnRound]]


def _shares_track(plan: ExperimentPlan, strategy: str) -> bool:
    """Whether ``strategy`` replays LocalOnly+'s own track (:class:`_OwnRound`) instead of
    training its clients' own adapters again."""
    return (
        plan.integration == "separate"
        and plan.own_steps_every_round
        and "local_plus" in plan.strategies
        and strategy not in ("local", "local_plus", *MERGE_STRATEGIES, *FEDPROXY_STRATEGIES)
    )


def _local_phase(world: _World, c: _Client, seed: int, i: int, t: int) -> _LocalPhase:
    from peerlm.agent import local_update

    plan = world.plan
    stats = local_update(c.host, c.train_examples, _round_config(plan, seed, i), t)
    loss, _ = c.host.eval_loss(c.val_examples)
    if (t - 1) % plan.val_every and c.competence is not None:
        # Not a validation round: the competence stands, and the profile carries the last
        # measured pass@1 forward (round_profile's rule for a round without one).
        return _LocalPhase(c.host.adapter_state(), stats.mean_loss, loss, math.nan, c.competence)
    pass1, competence = _validate(world, c)
    return _LocalPhase(c.host.adapter_state(), stats.mean_loss, loss, pass1, competence)


def _validate(world: _World, c: _Client) -> tuple[float, Competence]:
    """Greedy pass@1 of ``c``'s own adapter on its validation problems, and per category
    (what it may teach)."""
    from peerlm.agent import competence_of, sample_completions, score_completions

    plan = world.plan
    val = c.val[: plan.val_limit] if plan.val_limit else c.val
    completions = sample_completions(c.host, val, max_new_tokens=plan.max_new_tokens)
    report = score_completions(val, completions)
    competence = competence_of((r.category, r.c, r.n) for r in report.problems)
    return report.mean.get(1, 0.0), competence


def _first_local_phase(world: _World, seed: int, *, ffa: bool = False) -> dict[str, _LocalPhase]:
    """Round 1's local phase, the same for every strategy of a seed (same adapters, data and
    batches): computed once and handed to each strategy (ffa_lora's, ``ffa``, on its own
    start)."""
    clients = _clients(world, seed, ffa=ffa)
    return {c.name: _local_phase(world, c, seed, i, 1) for i, c in enumerate(clients)}


@dataclass(frozen=True)
class _Start:
    """What the strategies of one start share: round 0's test NLL per client and round 1's
    local phase per run seed. ffa_lora has its own (module docstring)."""

    initial: Mapping[str, Sequence[float]]
    firsts: Mapping[int, Mapping[str, _LocalPhase]]


def _start(world: _World, *, ffa: bool = False, firsts: bool = True) -> _Start:
    """Round 0's NLL, and (``firsts``) round 1's local phase per seed; without ``firsts``
    each run computes its own round 1 (LocalOnly+'s track then carries it to the others)."""
    plan = world.plan
    initial = {c.name: _test_nll(world, c) for c in _clients(world, plan.seeds[0], ffa=ffa)}
    phases = (
        {seed: _first_local_phase(world, seed, ffa=ffa) for seed in plan.seeds}
        if firsts
        else {seed: {} for seed in plan.seeds}
    )
    return _Start(initial, phases)


_P = ParamSpec("_P")


def _cpu_seconds() -> float:
    """This process's CPU time (all threads) and its waited-for children's."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def _with_cpu_seconds(
    run: Callable[_P, dict[str, Any]],
) -> Callable[_P, dict[str, Any]]:
    """A run's result with the CPU seconds its process and its finished child processes
    (the sandbox runs of the tests) spent on it, every thread: on a loaded machine the wall
    time says little about the budget on idle cores, the CPU time does."""

    @functools.wraps(run)
    def timed(*args: _P.args, **kwargs: _P.kwargs) -> dict[str, Any]:
        cpu = _cpu_seconds()
        out = run(*args, **kwargs)
        out["cpu_seconds"] = round(_cpu_seconds() - cpu, 1)
        return out

    return timed


@_with_cpu_seconds
def _run_strategy(
    world: _World,
    strategy: str,
    seed: int,
    initial: Mapping[str, Sequence[float]],
    first: Mapping[str, _LocalPhase],
    event: Event,
    track: _Track | None = None,
    record: _Track | None = None,
) -> dict[str, Any]:
    """One (strategy, seed) run. With ``track`` (LocalOnly+'s own track of this seed) the
    clients' own adapters replay it instead of training; with ``record`` the run appends
    its own track to it, round by round."""
    from peerlm.agent import ProfileInputs, category_counts, round_profile

    if strategy in FEDPROXY_STRATEGIES:
        return run_fedproxy(world, strategy, seed, event)
    plan = world.plan
    clients = _clients(world, seed, ffa=strategy == "ffa_lora")
    policy = _pairing_policy(strategy, plan, seed)
    overlay = OverlayView.defaults() if strategy in _WITH_OVERLAY else None
    if overlay is not None:
        # An agent publishes its first signature when it joins, before its first round.
        overlay.join({c.name: c.host for c in clients})
    rounds: list[dict[str, Any]] = []
    start = _slice_means(world, {i: initial[c.name] for i, c in enumerate(clients)})
    curve = {name: [value] for name, value in start.items()}
    curve_rounds = [0]
    started = time.perf_counter()
    for t in range(1, plan.rounds + 1):
        profiles: dict[str, np.ndarray] = {}
        trained: dict[str, float] = {}
        phases: dict[str, _LocalPhase] = {}
        for i, c in enumerate(clients):
            if track is not None:
                phase = track[t - 1][c.name].phase
                c.host.load_adapter_state(phase.adapter)
            elif t == 1 and c.name in first:
                phase = first[c.name]
                c.host.load_adapter_state(phase.adapter)
            else:
                phase = _local_phase(world, c, seed, i, t)
            phases[c.name] = phase
            trained[c.name] = phase.train_loss
            c.own_steps += plan.local_steps
            c.competence = phase.competence
            profile, pass1 = round_profile(
                c.host,
                ProfileInputs(
                    t=t,
                    total_rounds=plan.rounds,
                    val_loss=phase.val_loss,
                    pass_at_1=phase.val_pass1,
                    last_reward=c.rewards[-1] if c.rewards else 0.0,
                    exchanges=c.exchanges,
                ),
                c.history,
                category_counts(c.train),
                seed=seed + i,
            )
            c.history.append({"round": t, "loss": phase.val_loss, "pass1": pass1})
            profiles[c.name] = profile
        if strategy == "local_plus" or (plan.own_steps_every_round and strategy != "local"):
            # LocalOnly+: the compute a student spends on AKD, spent on the client's own
            # data instead. Every collaborating client spends the same steps on its own data
            # too (an agent keeps training whatever its role), before it teaches or learns.
            if track is not None:
                for c in clients:
                    c.host.load_adapter_state(track[t - 1][c.name].trained)
                    c.own_steps += plan.integration_steps
            else:
                _own_steps(world, clients, seed, t)
            if record is not None:
                record.append(
                    {c.name: _OwnRound(phases[c.name], c.host.adapter_state()) for c in clients}
                )
        exchanges, gains = _exchange(
            world, strategy, policy, clients, profiles, seed, t, overlay=overlay
        )
        nll: dict[str, float] | None = None
        if t % plan.curve_every == 0 or t == plan.rounds:
            nll = _slice_means(world, {i: _test_nll(world, c) for i, c in enumerate(clients)})
            curve_rounds.append(t)
            for name in curve:
                curve[name].append(nll[name])
        rounds.append(
            {
                "round": t,
                "train_loss": {k: round(v, 5) for k, v in trained.items()},
                "val_loss": {c.name: round(c.history[-1]["loss"], 5) for c in clients},
                "val_pass@1": {c.name: c.history[-1]["pass1"] for c in clients},
                # What a matchmaker saw (for analyses of what the CPM could learn).
                "profiles": {k: [round(float(x), 6) for x in v] for k, v in profiles.items()},
                "test_nll": nll,
                "exchanges": exchanges,
                **({"oracle_gains": gains} if gains is not None else {}),
                **(
                    {"protocols": _protocol_counts(exchanges)}
                    if strategy in MENU_STRATEGIES
                    else {}
                ),
            }
        )
        event(
            "round",
            {
                "strategy": strategy,
                "seed": seed,
                "round": t,
                "nll": nll,
                **(
                    {"protocols": _protocol_counts(exchanges)}
                    if strategy in MENU_STRATEGIES
                    else {}
                ),
            },
        )
    return _finish_run(
        world, clients, strategy, seed, rounds, curve, started, event, curve_rounds=curve_rounds
    )


def _finish_run(
    world: _World,
    clients: Sequence[_Client],
    strategy: str,
    seed: int,
    rounds: list[dict[str, Any]],
    curve: Mapping[str, list[float]],
    started: float,
    event: Event,
    **extra: Any,
) -> dict[str, Any]:
    """The final evaluation of every client and the run's record (every strategy's)."""
    final = {c.name: _final_eval(world, c, seed * 1_000 + i) for i, c in enumerate(clients)}
    event("final", {"strategy": strategy, "seed": seed})
    rewards = [x["reward"] for r in rounds for x in r["exchanges"] if "reward" in x]
    return {
        "strategy": strategy,
        "seed": seed,
        "clients": final,
        "curve_nll": curve,
        "exchanges": sum(len(r["exchanges"]) for r in rounds),
        "mean_reward": sum(rewards) / len(rewards) if rewards else None,
        "kilobytes": round(sum(x["kilobytes"] for r in rounds for x in r["exchanges"]), 2),
        "rounds": rounds,
        **extra,
        "seconds": round(time.perf_counter() - started, 1),
    }


def _protocol_counts(exchanges: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """How many of a round's directives named each protocol (the CPM menu strategies)."""
    counts: dict[str, int] = {}
    for x in exchanges:
        counts[x["protocol"]] = counts.get(x["protocol"], 0) + 1
    return counts


def _strategy_job(
    world: _World,
    strategy: str,
    seed: int,
    initial: Mapping[str, Sequence[float]],
    first: Mapping[str, _LocalPhase],
    events: Any,
    threads: int,
    track: _Track | None = None,
) -> tuple[dict[str, Any], _Track | None]:
    """One (strategy, seed) in a worker process; events go back through a queue. Returns the
    run and, for LocalOnly+ when others replay it, its own track."""
    import torch

    from peerlm.logs import configure_logging

    # Warnings only, to stderr: stdout is the command's (--json), and per-exchange info
    # lines (the guardrail's counts) would be thousands.
    configure_logging("experiment", "worker", level="warning")
    torch.set_num_threads(threads)
    record: _Track | None = [] if _records_track(world.plan, strategy) else None
    run = _run_strategy(
        world,
        strategy,
        seed,
        initial,
        first,
        lambda k, d: events.put((k, dict(d))),
        track=track,
        record=record,
    )
    return run, record


def _records_track(plan: ExperimentPlan, strategy: str) -> bool:
    """Whether ``strategy``'s run records the own track others replay (LocalOnly+'s)."""
    return strategy == "local_plus" and any(_shares_track(plan, s) for s in plan.strategies)


def _schedule(
    plan: ExperimentPlan, todo: Sequence[tuple[str, int]]
) -> tuple[list[tuple[str, int]], dict[tuple[str, int], tuple[str, int]]]:
    """The runs that can start at once (LocalOnly+'s first), and for each run that replays
    a track, the run it waits for."""
    producers = {seed for s, seed in todo if _records_track(plan, s)}
    waits = {
        (s, seed): ("local_plus", seed)
        for s, seed in todo
        if seed in producers and _shares_track(plan, s)
    }
    ready = [k for k in todo if k not in waits]
    ready.sort(key=lambda k: k[0] != "local_plus")
    return ready, waits


def _run_parallel(
    world: _World,
    starts: Mapping[str, _Start],
    todo: Sequence[tuple[str, int]],
    jobs: int,
    emit: Event,
    finished: Callable[[tuple[str, int], dict[str, Any]], None],
) -> None:
    """(strategy, seed) runs in ``jobs`` worker processes (spawned: no forked torch state);
    ``finished`` gets each run as it completes, in this process."""
    import multiprocessing
    import os
    import queue
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing.managers import SyncManager

    import torch

    from peerlm.process import exit_with_parent

    ctx = multiprocessing.get_context("spawn")
    manager = SyncManager(ctx=ctx)  # the events' queue server: also a process to end
    manager.start(exit_with_parent, (os.getpid(),))
    with (
        manager,
        ProcessPoolExecutor(
            jobs, mp_context=ctx, initializer=exit_with_parent, initargs=(os.getpid(),)
        ) as pool,
    ):
        events = manager.Queue()
        ready, waits = _schedule(world.plan, todo)

        def submit(name: str, seed: int, track: _Track | None = None) -> Any:
            return pool.submit(
                _strategy_job,
                world,
                name,
                seed,
                starts[name].initial,
                starts[name].firsts[seed],
                events,
                torch.get_num_threads(),
                track,
            )

        pending = {key: submit(*key) for key in ready}

        def drain(block: bool) -> None:
            while True:
                try:
                    kind, data = events.get(timeout=0.5) if block else events.get_nowait()
                except queue.Empty:
                    return
                emit(kind, data)
                block = False

        while pending:
            drain(block=True)
            for key, future in list(pending.items()):
                if future.done():
                    del pending[key]
                    drain(block=False)  # its last events before its result
                    run, track = future.result()
                    finished(key, run)
                    for waiting, on in list(waits.items()):
                        if on == key:
                            del waits[waiting]
                            pending[waiting] = submit(*waiting, track)
        drain(block=False)


#: Plan fields that only CPM strategies read: a run of another strategy is reusable
#: whatever they say.
_CPM_ONLY_FIELDS: tuple[str, ...] = (
    "cpm_interaction_features",
    "cpm_context_columns",
    "cpm_beta",
    # Where rewards are measured steers only a bandit: a stored run of another strategy
    # keeps the rewards it measured under its own scope (reported, never acted on).
    "probe_scope",
    "cpm_merge_senders",
    "cpm_co_sender_scoring",
    "cpm_reward_normaliser",
)


#: Plan fields that only a collaborating run reads: where peers' knowledge goes, how it is
#: distilled, how much is taught and whether non-students train on own data. A client that
#: trains alone (LocalOnly, LocalOnly+) runs the same steps whatever they say, so an
#: ablation of one of them reuses the stored LocalOnly+ runs.
_COLLABORATION_ONLY_FIELDS: tuple[str, ...] = (
    "integration",
    "peer_alpha",
    "own_steps_every_round",
    "teach_limit",
)

#: The strategies whose clients train alone (:data:`_COLLABORATION_ONLY_FIELDS`).
_ALONE: frozenset[str] = frozenset({"local", "local_plus"})


#: Plan fields that only ProxyTuning's decoding reads (:data:`PROXY_TUNED`).
_PROXY_TUNING_ONLY_FIELDS: tuple[str, ...] = ("proxy_tuning_beta",)


#: What a plan that predates a field was run with, where that differs from today's default:
#: every results.json written before ``cpm_reward_normaliser`` existed ran the z-score.
_PREDATED: Mapping[str, Any] = MappingProxyType(
    {
        "cpm_reward_normaliser": "zscore",
        # The harness before the peer slot: one adapter, own-data steps for LocalOnly+
        # only, validation, teaching and the curve every round.
        "integration": "shared",
        "peer_alpha": None,
        "own_steps_every_round": False,
        "val_every": 1,
        "curve_every": 1,
        "teach_limit": None,
    }
)


def _reuse_key(plan: Mapping[str, Any], strategy: str) -> str:
    """What must match for a stored (strategy, seed) run to stand in for a new one: the
    whole plan but the strategy and seed lists (and the CPM's settings, for a strategy
    that has no CPM; the collaboration's settings, for one that trains alone). Fields an
    older plan lacks take what it ran with: today's defaults, or :data:`_PREDATED`'s value
    where the default changed since."""
    full = {**asdict(ExperimentPlan()), **_PREDATED, **plan}
    drop = {"strategies", "seeds"} | (set() if strategy in CPM_PROTOCOLS else set(_CPM_ONLY_FIELDS))
    if strategy not in PROXY_TUNED:
        drop |= set(_PROXY_TUNING_ONLY_FIELDS)
    if strategy in _ALONE:
        drop |= set(_COLLABORATION_ONLY_FIELDS)
    return json.dumps(
        {k: v for k, v in full.items() if k not in drop}, sort_keys=True, default=list
    )


#: The runs a command has finished so far, in its work directory (``--reuse`` takes it).
PROGRESS_FILE: Final[str] = "runs-so-far.json"


def _save_progress(
    work: Path,
    plan: ExperimentPlan,
    initial_nll: Mapping[str, float],
    runs: Mapping[tuple[str, int], dict[str, Any]],
) -> None:
    """Every (strategy, seed) run finished so far (reused ones included), as a file
    ``--reuse`` accepts: a command stopped after hours keeps what it had finished."""
    from peerlm.atomic_file import write_atomic

    by_strategy: dict[str, dict[str, Any]] = {}
    for (strategy, seed), run in sorted(runs.items()):
        by_strategy.setdefault(strategy, {})[str(seed)] = run
    partial = {
        "plan": {**asdict(plan), "strategies": list(plan.strategies), "seeds": list(plan.seeds)},
        "initial_nll": dict(initial_nll),
        "runs": by_strategy,
        "partial": True,
    }
    write_atomic(work / PROGRESS_FILE, json.dumps(partial).encode(), mode=0o644)


def reusable_runs(
    plan: ExperimentPlan,
    earlier: Sequence[Mapping[str, Any]],
    initial_nll: Mapping[str, float],
) -> dict[tuple[str, int], dict[str, Any]]:
    """The (strategy, seed) runs of ``plan`` that earlier results (``results.json``) hold,
    run under the same plan on the same world and models.

    The same world and models are checked by the round-0 test NLL per slice, which every
    run measures on them (equal to the last bit, or the earlier result is not used); the
    same plan by :func:`_reuse_key`. Raises ``ValueError`` for an earlier result that
    does not match at all (another world, models or plan), so a wrong file is not
    silently ignored.
    """
    mine = asdict(plan)
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for k, old in enumerate(earlier):
        try:
            old_plan, old_runs, old_nll = old["plan"], old["runs"], old["initial_nll"]
        except (KeyError, TypeError):
            raise ValueError(f"reused result {k} is not a run-experiment results.json") from None
        if old_nll != dict(initial_nll):
            raise ValueError(
                f"reused result {k} was measured on another world or other models "
                f"(round-0 NLL {old_nll} against {dict(initial_nll)})"
            )
        matched = False
        for strategy in plan.strategies:
            if strategy not in old_runs:
                continue
            if _reuse_key(old_plan, strategy) != _reuse_key(mine, strategy):
                continue
            for seed in plan.seeds:
                run = old_runs[strategy].get(str(seed))
                if run is not None and (strategy, seed) not in out:
                    out[(strategy, seed)] = run
                    matched = True
        if not matched:
            raise ValueError(
                f"reused result {k} holds no run of this plan's strategies and seeds under "
                "the same settings"
            )
    return out


def run_experiment(
    plan: ExperimentPlan,
    *,
    models: Path,
    work: Path,
    event: Event | None = None,
    jobs: int = 1,
    reuse: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """Run every strategy of ``plan`` under every run seed; results as a JSON-ready dict
    with the bootstrap summary (:func:`summarise`) under ``"summary"``.

    ``jobs > 1`` runs (strategy, seed) pairs in that many worker processes; results are the
    same (every run is seeded on its own), only the wall time changes. ``reuse``: earlier
    results (``results.json``) whose runs of the same plan, world and models stand in for
    running them again (:func:`reusable_runs`); the result lists them under ``"reused"``.

    ``work`` is held for the whole run (:func:`~peerlm.app.work_lock.work_dir_lock`): a
    second run in the same directory raises ``WorkDirBusy`` at once rather than rebuild the
    first one's world under it.
    """
    from peerlm.app.work_lock import work_dir_lock

    with work_dir_lock(work):
        return _run_experiment(plan, models, work, event, jobs, reuse)


def _run_experiment(
    plan: ExperimentPlan,
    models: Path,
    work: Path,
    event: Event | None,
    jobs: int,
    reuse: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    emit = event or (lambda _kind, _data: None)
    started, cpu_started = time.perf_counter(), _cpu_seconds()
    world = _prepare(plan, models, work / "data", emit)
    # Round 0: the pre-trained models with fresh adapters (LoRA B = 0), or the warmed-up
    # ones: the same for every strategy and seed; measured once. Round 1's local phase once
    # per seed. ffa_lora starts from its own warm-up (frozen shared A). The FedProxy
    # strategies start from the owner's proxy (experiment_fedproxy) and need neither.
    adapters = [s for s in plan.strategies if s not in FEDPROXY_STRATEGIES]
    none = _Start({}, {seed: {} for seed in plan.seeds})
    starts = dict.fromkeys(plan.strategies, none)
    common = none
    initial_nll: dict[str, float] = {}
    if adapters:
        world.warm = _warm_up(world, emit, jobs=jobs)
        # With LocalOnly+'s track replayed, every run computes its own round 1 (in the
        # workers, not here in the main process alone).
        common = _start(world, firsts=not any(_shares_track(plan, s) for s in plan.strategies))
        initial_nll = _slice_means(world, dict(enumerate(common.initial.values())))
        emit("initial", initial_nll)
        starts.update(dict.fromkeys(adapters, common))
    ffa: _Start | None = None
    if "ffa_lora" in plan.strategies:
        world.ffa_warm = _warm_up(world, emit, ffa=True, jobs=jobs)
        ffa = starts["ffa_lora"] = _start(world, ffa=True)
    runs = reusable_runs(plan, reuse, initial_nll)
    for strategy, seed in runs:
        emit("reused", {"strategy": strategy, "seed": seed})
    todo = [(s, seed) for seed in plan.seeds for s in plan.strategies if (s, seed) not in runs]

    def finished(key: tuple[str, int], run: dict[str, Any]) -> None:
        runs[key] = run
        _save_progress(work, plan, initial_nll, runs)

    if jobs > 1 and len(todo) > 1:
        _run_parallel(world, starts, todo, jobs, emit, finished)
    else:
        ready, waits = _schedule(plan, todo)
        tracks: dict[tuple[str, int], _Track] = {}
        for s, seed in [*ready, *waits]:
            record: _Track | None = [] if _records_track(plan, s) else None
            run = _run_strategy(
                world,
                s,
                seed,
                starts[s].initial,
                starts[s].firsts[seed],
                emit,
                track=tracks.get(waits[(s, seed)]) if (s, seed) in waits else None,
                record=record,
            )
            if record is not None:
                tracks[(s, seed)] = record
            finished((s, seed), run)
    result: dict[str, Any] = {
        "plan": {**asdict(plan), "strategies": list(plan.strategies), "seeds": list(plan.seeds)},
        "models": str(models),
        "clients": [
            {
                "name": f"agent-{i}",
                "arch": plan.arch(i),
                "train": len(train),
                "val": len(val),
                "slices": world.slices[i].to_dict(),
            }
            for i, (train, val) in enumerate(world.clients_data)
        ],
        "public_categories": list(world.public),
        "transfer_prompts": len(world.transfer),
        "probe_problems": len(world.probe),
        "probe_categories": [p.category for p in world.probe],
        "test_problems": len(world.test),
        "units": {name: [list(u) for u in world.units(name)] for name in SLICES},
        "initial_nll": initial_nll,
        **(
            {"initial_nll_ffa_lora": _slice_means(world, dict(enumerate(ffa.initial.values())))}
            if ffa is not None
            else {}
        ),
        "runs": {s: {str(seed): runs[(s, seed)] for seed in plan.seeds} for s in plan.strategies},
        "reused": sorted(f"{s}:{seed}" for s, seed in runs if (s, seed) not in todo),
        "seconds": round(time.perf_counter() - started, 1),
        # What this command computed (reused runs not included; the worker processes are
        # joined by now, so their time is among this process's children's): the budget on
        # idle cores is about cpu_seconds / cores when the runs keep every core busy.
        "cpu_seconds": round(_cpu_seconds() - cpu_started, 1),
    }
    result["summary"] = summarise(result)
    return result


# ------------------------------------------------------------------------ statistics


def _matrix(result: Mapping[str, Any], strategy: str, metric: str, slice_name: str) -> Any:
    """[seeds, units] of one metric of one strategy on one slice."""
    names = [c["name"] for c in result["clients"]]
    rows = []
    for seed in result["plan"]["seeds"]:
        clients = result["runs"][strategy][str(seed)]["clients"]
        rows.append([clients[names[i]][metric][j] for i, j in result["units"][slice_name]])
    return np.asarray(rows, dtype=np.float64)


def _cpm_learning(result: Mapping[str, Any]) -> dict[str, Any] | None:
    """What the CPM learnt, against the oracle's true probe gains of the same round/seed.

    Per round: the gain (under the oracle run's trial matrix of that round and seed) of the
    CPM's chosen pairs, of the oracle's pairs, and of the mean pair (what random pairing
    gets in expectation). The oracle's matrix is measured on the oracle run's adapters, not
    the CPM's, so this is an approximation: both runs share round 1's local phase and
    differ afterwards only by what their exchanges taught.
    """
    runs = result["runs"]
    if "cpm" not in runs or "oracle" not in runs:
        return None
    per_round: list[dict[str, Any]] = []
    for seed in result["plan"]["seeds"]:
        cpm_rounds = runs["cpm"][str(seed)]["rounds"]
        oracle_rounds = runs["oracle"][str(seed)]["rounds"]
        for cr, orr in zip(cpm_rounds, oracle_rounds, strict=True):
            gains: Mapping[str, float] = orr["oracle_gains"]
            chosen = [f"{x['teacher']}>{x['student']}" for x in cr["exchanges"]]
            best = [f"{x['teacher']}>{x['student']}" for x in orr["exchanges"]]
            per_round.append(
                {
                    "seed": seed,
                    "round": cr["round"],
                    "cpm_pairs": chosen,
                    "oracle_pairs": best,
                    "cpm_gain": float(sum(gains.get(p, 0.0) for p in chosen)),
                    "oracle_gain": float(sum(gains[p] for p in best)),
                    "random_gain": float(np.mean(list(gains.values())) * len(best))
                    if gains
                    else 0.0,
                    "agreement": len(set(chosen) & set(best)) / max(1, len(best)),
                }
            )
    by_round: dict[int, list[dict[str, Any]]] = {}
    for r in per_round:
        by_round.setdefault(r["round"], []).append(r)
    return {
        "per_round": per_round,
        "mean_by_round": {
            str(t): {
                key: float(np.mean([r[key] for r in rows]))
                for key in ("cpm_gain", "oracle_gain", "random_gain", "agreement")
            }
            for t, rows in sorted(by_round.items())
        },
    }


def summarise(result: Mapping[str, Any]) -> dict[str, Any]:
    """Means per strategy, metric and slice with 95% intervals (paired bootstrap over seeds
    and units, :func:`~peerlm.app.experiment_stats.paired_bootstrap`), the key differences
    as ``comparisons["<a>_vs_<b>"]`` and the CPM's learning figures."""
    strategies = list(result["plan"]["strategies"])
    slices = [s for s in SLICES if result["units"][s]]
    per: dict[str, dict[str, dict[str, Any]]] = {s: {} for s in strategies}
    estimates: dict[tuple[str, str], Any] = {}
    for slice_name in slices:
        for metric in METRICS:
            values = {s: _matrix(result, s, metric, slice_name) for s in strategies}
            pairs = [(a, b) for a in strategies for b in strategies if a != b]
            means, diffs = paired_bootstrap(values, pairs)
            for s in strategies:
                per[s].setdefault(slice_name, {})[metric] = means[s].to_dict()
            for (a, b), est in diffs.items():
                estimates[(f"{slice_name}:{metric}", f"{a}_vs_{b}")] = est
    # "best": the collaborative strategy with the lowest NLL on the probe problems of the
    # clients' lacked categories (data other than the test set); runs without probe
    # figures (stored before they were recorded): the highest lacked-slice test pass@1.
    target = "lacked" if "lacked" in slices else (slices[0] if slices else None)
    collaborative = [s for s in strategies if s in COLLABORATIVE]
    best = None
    if target is not None and collaborative:
        probe = {s: _probe_lacked_nll(result, s) for s in collaborative}
        if all(v is not None for v in probe.values()):
            best = min(collaborative, key=lambda s: (probe[s], s))
        else:
            best = max(
                collaborative,
                key=lambda s: (per[s][target]["pass@1"]["mean"], -per[s][target]["nll"]["mean"]),
            )
    comparisons: dict[str, Any] = {}
    if target is not None:
        for a, b in COMPARISONS:
            name = best if a == "best" else a
            if name is None or name not in strategies or b not in strategies or name == b:
                continue
            entry: dict[str, Any] = {"a": name, "b": b, "slice": target}
            for metric in METRICS:
                est = estimates[(f"{target}:{metric}", f"{name}_vs_{b}")]
                entry[metric] = {"delta": est.mean, "ci95": [est.low, est.high]}
            entry["delta"] = entry["pass@1"]["delta"]
            entry["ci95"] = entry["pass@1"]["ci95"]
            comparisons[f"{a}_vs_{b}"] = entry
    oracle_share = None
    shares: dict[str, Any] = {}
    if {"oracle", "cpm", "local_plus"} <= set(strategies) and target is not None:
        # The share of Oracle pairing's gain over LocalOnly+ that KNEXA-FL reaches, per
        # metric where the oracle is the better one (NLL: lower), with its interval.
        for metric in METRICS:
            # Only a resolved gain has a share: the oracle's interval against LocalOnly+
            # must lie on the better side of zero (NLL: below).
            sign = -1.0 if metric == "nll" else 1.0
            gain = estimates[(f"{target}:{metric}", "oracle_vs_local_plus")]
            if not min(sign * gain.low, sign * gain.high) > 0:
                continue
            values = {
                s: _matrix(result, s, metric, target) for s in ("cpm", "local_plus", "oracle")
            }
            share = paired_share(values, "cpm", "local_plus", "oracle")
            if share is not None:
                shares[metric] = share.to_dict()
        if "pass@1" in shares:
            oracle_share = shares["pass@1"]["mean"]
    runs = result["runs"]
    seeds = [str(s) for s in result["plan"]["seeds"]]
    return {
        "slices": slices,
        "strategies": {
            s: {
                "label": LABELS[s],
                "metrics": per[s],
                "exchanges": float(np.mean([runs[s][k]["exchanges"] for k in seeds])),
                "kilobytes": float(np.mean([runs[s][k]["kilobytes"] for k in seeds])),
                "mean_reward": _mean_or_none([runs[s][k]["mean_reward"] for k in seeds]),
            }
            for s in strategies
        },
        "best_collaborative": best,
        "comparisons": comparisons,
        "cpm_share_of_oracle_gain": oracle_share,
        "cpm_share_of_oracle_gain_ci": shares,
        "cpm_learning": _cpm_learning(result),
        "participant": participant_report(result),
        "steps_per_client": _steps_per_client(result),
        "bootstrap": "paired two-level percentile bootstrap (numpy), 2000 replicates",
    }


def _steps_per_client(result: Mapping[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """Per strategy and client, the mean own-data and distillation (or merge) optimiser
    steps a run spent, and the share of its test problems the peer slot answered."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    seeds = [str(s) for s in result["plan"]["seeds"]]
    for s in result["plan"]["strategies"]:
        for name in (c["name"] for c in result["clients"]):
            runs = [result["runs"][s][k]["clients"][name] for k in seeds]
            if not all("own_steps" in r for r in runs):
                continue
            out.setdefault(s, {})[name] = {
                "own_steps": float(np.mean([r["own_steps"] for r in runs])),
                "peer_steps": float(np.mean([r["peer_steps"] for r in runs])),
                "peer_routed_share": float(np.mean([np.mean(r["peer_routed"]) for r in runs])),
            }
    return out


def _probe_lacked_nll(result: Mapping[str, Any], strategy: str) -> float | None:
    """Mean probe-set NLL of ``strategy`` over seeds, clients and the probe problems of each
    client's lacked categories; None when a run has no probe figures."""
    probe_categories = result.get("probe_categories")
    if not probe_categories:
        return None
    values: list[float] = []
    for seed in result["plan"]["seeds"]:
        clients = result["runs"][strategy][str(seed)]["clients"]
        for c in result["clients"]:
            got = clients[c["name"]].get("probe_nll")
            if got is None:
                return None
            lacked = set(c["slices"]["lacked"])
            values += [v for v, cat in zip(got, probe_categories, strict=True) if cat in lacked]
    return float(np.mean(values)) if values else None


def _mean_or_none(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return float(np.mean(present)) if present else None


# ------------------------------------------------------------------------ reporting


def _fmt(est: Mapping[str, Any], scale: float, digits: int) -> str:
    low, high = est["ci95"]
    center = est.get("mean", est.get("delta"))
    return f"{scale * center:.{digits}f} [{scale * low:.{digits}f}, {scale * high:.{digits}f}]"


def render_table(result: Mapping[str, Any]) -> str:
    """The table as Markdown: per strategy and slice, Pass@1 (%), structural match (%) and
    NLL (nats/byte) with 95% intervals; then the key differences."""
    summary = result["summary"]
    lines: list[str] = []
    for slice_name in summary["slices"]:
        lines += [
            f"**{slice_name}** slice ({len(result['units'][slice_name])} client-problem units "
            f"x {len(result['plan']['seeds'])} seeds)",
            "",
            "| Method | Pass@1 (%) | Struct match (%) | NLL (nats/byte) | exchanges | KB | "
            "mean reward |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in summary["strategies"].values():
            m = r["metrics"][slice_name]
            reward = "-" if r["mean_reward"] is None else f"{r['mean_reward']:.4f}"
            lines.append(
                f"| {r['label']} | {_fmt(m['pass@1'], 100, 2)} | {_fmt(m['struct'], 100, 2)} | "
                f"{_fmt(m['nll'], 1, 4)} | {r['exchanges']:.0f} | {r['kilobytes']:.0f} | "
                f"{reward} |"
            )
        lines.append("")
    if summary["comparisons"]:
        lines += [
            "Key differences (a - b, paired bootstrap 95% interval; NLL: lower is better):",
            "",
            "| Comparison | slice | ΔPass@1 (pts) | ΔStruct (pts) | ΔNLL |",
            "|---|---|---|---|---|",
        ]
        shown: set[tuple[str, str]] = set()
        for c in summary["comparisons"].values():
            # "best" may be a strategy that has its own row (the same difference twice).
            if (c["a"], c["b"]) in shown:
                continue
            shown.add((c["a"], c["b"]))
            lines.append(
                f"| {LABELS[c['a']]} - {LABELS[c['b']]} | {c['slice']} | "
                f"{_fmt(c['pass@1'], 100, 2)} | {_fmt(c['struct'], 100, 2)} | "
                f"{_fmt(c['nll'], 1, 4)} |"
            )
        lines.append("")
    shares = summary.get("cpm_share_of_oracle_gain_ci") or {}
    for metric, est in shares.items():
        low, high = est["ci95"]
        lines.append(
            f"KNEXA-FL reaches {100 * est['mean']:.0f}% [{100 * low:.0f}, {100 * high:.0f}] of "
            f"Oracle pairing's {metric} gain over LocalOnly+ on the lacked slice."
        )
    if shares:
        lines.append("")
    learning = summary["cpm_learning"]
    if learning:
        lines += [
            "CPM vs oracle pairing, per round (true probe gain of the chosen pairs):",
            "",
            "| round | CPM | oracle | random (mean pair) | agreement |",
            "|---|---|---|---|---|",
        ]
        for t, v in learning["mean_by_round"].items():
            lines.append(
                f"| {t} | {v['cpm_gain']:.4f} | {v['oracle_gain']:.4f} | "
                f"{v['random_gain']:.4f} | {100 * v['agreement']:.0f}% |"
            )
        lines.append("")
    participant = summary.get("participant")
    if participant:
        lines.append(render_participant(participant, LABELS))
    return "\n".join(lines)


def write_outputs(result: Mapping[str, Any], out: Path) -> list[Path]:
    """``results.json``, ``table.md`` and (with matplotlib) the per-round plot under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json", out / "table.md"]
    written[0].write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    written[1].write_text(render_table(result))
    try:
        import matplotlib
    except ImportError:  # the plots need the bench extra; the numbers do not
        return written
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slices = result["summary"]["slices"]
    fig, axes = plt.subplots(1, len(slices), figsize=(5 * len(slices), 4.2), squeeze=False)
    seeds = [str(s) for s in result["plan"]["seeds"]]
    for ax, slice_name in zip(axes[0], slices, strict=True):
        for name in result["plan"]["strategies"]:
            curves = np.asarray(
                [result["runs"][name][s]["curve_nll"][slice_name] for s in seeds], dtype=float
            )
            first = result["runs"][name][seeds[0]]
            x = np.asarray(first.get("curve_rounds", range(curves.shape[1])))
            mean = curves.mean(axis=0)
            ax.plot(x, mean, marker="o", label=LABELS[name])
            # Band: the range over run seeds (3 seeds make a standard error meaningless).
            ax.fill_between(x, curves.min(axis=0), curves.max(axis=0), alpha=0.15)
        ax.set_xlabel("round")
        ax.set_ylabel("NLL of the test references (nats/byte)")
        ax.set_title(f"{slice_name} skills")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path = out / "nll_by_round.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


# ------------------------------------------------------------------------ round cost


def round_costs(
    plan: ExperimentPlan, models: Path, data: Path, event: Event, rounds: int = 2
) -> dict[str, Any]:
    """What one client-round of ``plan`` costs, phase by phase (``peerlm bench
    experiment-round``): ``rounds`` rounds of every client, each phase timed on its own, in
    this process on one thread. Every client teaches its successor and learns from its
    predecessor each round, so the AKD and teaching phases count as a student's and a
    teacher's (a pairing strategy has half the clients in each role); the final
    evaluation is timed once per client. Returns seconds per phase, per client-round
    (``per_client_round``: the mean over clients of the phases a client-round of a pairing
    strategy spends) and per client (``final``)."""
    from peerlm.agent import local_update

    world = _prepare(plan, models, data, event)
    if plan.warmup_steps:
        world.warm = _warm_up(world, event)
    clients = _clients(world, plan.seeds[0])
    phases: dict[str, list[float]] = {}

    def timed(name: str, run: Callable[..., _R], *args: Any) -> _R:
        began = time.perf_counter()
        out = run(*args)
        phases.setdefault(name, []).append(time.perf_counter() - began)
        return out

    seed = plan.seeds[0]
    for t in range(1, rounds + 1):
        for i, c in enumerate(clients):
            timed(
                "local steps",
                local_update,
                c.host,
                c.train_examples,
                _round_config(plan, seed, i),
                t,
            )
            timed("validation loss", c.host.eval_loss, c.val_examples)
            _pass1, c.competence = timed("validation generation", _validate, world, c)
        timed("own-data steps", _own_steps, world, clients, seed, t)
        for i, student in enumerate(clients):
            teacher = clients[i - 1]
            predictions = timed("teacher answers X_u", _predictions, world, teacher, t)
            package, kb = _package(world, teacher, predictions, f"cost-{t}-{i}")
            timed("AKD integration", _integrate, world, student, package, kb, seed, i, t)
        for c in clients:
            timed("test NLL curve", _test_nll, world, c)
    for c in clients:
        timed("final evaluation", _final_eval, world, c, seed)
    n = len(clients) * rounds
    per = {k: sum(v) / n for k, v in phases.items() if k != "final evaluation"}
    # Averaged over the plan's strategies: in a pairing strategy half the clients teach and
    # half learn in a round, LocalOnly+ does neither; the own-data steps are every
    # strategy's, or LocalOnly+'s alone in the earlier harness; the curve is measured every
    # curve_every rounds.
    strategies = plan.strategies
    collaborative = sum(st in COLLABORATIVE for st in strategies) / len(strategies)
    per["teacher answers X_u"] *= collaborative / 2
    per["AKD integration"] *= collaborative / 2
    if not plan.own_steps_every_round:
        per["own-data steps"] *= strategies.count("local_plus") / len(strategies)
    # Runs that replay LocalOnly+'s own track train and validate nothing themselves.
    own = sum(not _shares_track(plan, st) for st in strategies) / len(strategies)
    for phase in ("local steps", "validation loss", "validation generation", "own-data steps"):
        per[phase] *= own
    per["test NLL curve"] /= plan.curve_every
    per["validation generation"] /= plan.val_every
    total = sum(per.values())
    final = sum(phases["final evaluation"]) / len(clients)
    runs = len(plan.strategies) * len(plan.seeds)
    cpu = runs * plan.agents * (plan.rounds * total + final)
    return {
        "plan": {k: v for k, v in asdict(plan).items() if k not in ("strategies",)},
        "per_client_round": per,
        "seconds_per_client_round": total,
        "final_seconds_per_client": final,
        "projected_cpu_seconds": cpu,
        "client_rounds": runs * plan.agents * plan.rounds,
    }
