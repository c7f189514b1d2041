"""The plan of a ``peerlm run-experiment`` run (:class:`ExperimentPlan`, part of
``results.json``), its checks, and the ``--quick`` and ``--jobs`` defaults.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

from peerlm.app.experiment_strategies import (
    ARCHS,
    DEFAULT_STRATEGIES,
    FEDPROXY_STRATEGIES,
    KNOWN_STRATEGIES,
    PROXY_TUNED,
    STRATEGIES,
)
from peerlm.config import explicit_settings
from peerlm.protocols import DEFAULT_PROTOCOL

if TYPE_CHECKING:
    from peerlm.agent import TeachScope, WorldSpec

__all__ = [
    "DEFAULT_TEACHERS_PER_STUDENT",
    "WORKER_MEMORY_BYTES",
    "Event",
    "ExperimentPlan",
    "ProbeScope",
    "RewardMode",
    "default_jobs",
    "parse_strategies",
    "quick_plan",
]


Event = Callable[[str, Mapping[str, Any]], None]


RewardMode = Literal["val", "probe"]


ProbeScope = Literal["all", "lacked", "answered", "routed"]


#: Teachers a student learns from a round under ``pairing: per_student`` when the plan does
#: not say (docs/experiment.md, "Several teachers a student").
DEFAULT_TEACHERS_PER_STUDENT: Final[int] = 2


@dataclass(frozen=True)
class ExperimentPlan:
    """Everything that defines a run; part of ``results.json``."""

    agents: int = 6
    rounds: int = 20
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    # Five run seeds: three gave intervals that moved with the seed set (docs/experiment.md,
    # "Statistics"); `--seeds 0,1,2` is the 30-minute plan.
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
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
    # with locally tuned models; :mod:`peerlm.app.experiment_world`). 0: clients start from
    # the base model.
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
    # (what only a teacher can bring it; :mod:`peerlm.app.experiment`), or "answered",
    # those of the categories the AKD package answers (the agent's ``reward_scope``,
    # :mod:`peerlm.agent.exchange.reward_probe`; merges measure on the whole probe; the
    # default since 2026-12-07, docs/experiment.md "A student every round"). Under
    # ``reward="val"`` "answered" is moot (no probe): "lacked" and "routed" are refused there.
    # "routed" (ours): of "answered"'s, those the student's input router sends to its
    # peer slot (``integration="separate"`` only; AnsweredProbe.routed).
    probe_scope: ProbeScope = "answered"
    probe_per_category: int = 2
    reward_delta: float = 0.001
    # What a teacher answers (peerlm.agent.exchange.teaching): "competent", the prompts of
    # categories
    # whose validation pass@1 has a Wilson lower bound >= teach_min_pass (our choice beyond
    # the paper); "all", every prompt of X_u (the paper's Eq. 2).
    teach_scope: TeachScope = "competent"
    teach_min_pass: float = 0.2
    # A teacher runs each answer against its prompt's docstring example in the sandbox and
    # sends only those that pass (peerlm.agent.exchange.self_check; our choice beyond the
    # paper, whose Eq. 2 distils the predictions as they are).
    teach_self_check: bool = False
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
    # fedproxy_proxytuning's offset weight β: s_M + β (s_φT − s_φ0) (agent/fedproxy/tuning.py;
    # 1 is ProxyTuning's own sum, our knob beyond it).
    proxy_tuning_beta: float = 1.0
    # Where a client puts what peers send (peerlm.agent.exchange.peer_knowledge): "separate", a
    # peer slot beside its own adapter with a router calibrated on its own validation
    # prompts (our choice: the no-regret default); "shared", the papers' one adapter.
    integration: Literal["separate", "shared"] = "separate"
    # Eq. 2's teacher share alpha_KD when the knowledge goes to the peer slot (our choice):
    # the router sends the slot none of the client's own skills, so an own-data share keeps
    # nothing there; 1 (the default since 2026-12-07, docs/experiment.md "The teacher's
    # signal alone") halves an integration's work, and its 8 steps of 16 answers match
    # LocalOnly+'s 8 extra own-data steps of 16 examples; None: Table 6's 0.2 -> 0.5.
    peer_alpha: float | None = 1.0
    # With "separate": what the peer slot distils of a package, "all" its items or
    # "routed" only those its router sends to the slot (peerlm.agent.exchange.peer_knowledge
    # .learnt_items; ours).
    slot_scope: Literal["all", "routed"] = "all"
    # With "separate": which adapter's answer a routed test input keeps, judged by the
    # worked example its own prompt shows (peerlm.agent.exchange.answer_check; ours):
    # "own_first" the own adapter's unless it fails the example, "peer_first" the slot's
    # unless it fails and the own one passes, "off" the router alone. Every run records
    # each policy's pass@1 from the same answers (``answer_checks``), so one run is also
    # the ablation of the others.
    answer_check: Literal["off", "own_first", "peer_first"] = "own_first"
    # Pairs of the peer slot's earlier text lessons distilled beside each new one, in the
    # same steps (the agent's ``slot_rehearsal``; ours). 0: none.
    slot_rehearsal: int = 0
    # With "separate": "one" adapter in the peer slot, or "category": a bank a category the
    # client lacks, each text lesson written to its learnt prompts' category's bank and
    # each routed input answered by its category's (the agent's ``slot_banks``; ours;
    # docs/experiment.md "A bank per lacked category"). None: "category" under "separate"
    # (the default since 2026-12-08), "one" under "shared".
    slot_banks: Literal["one", "category"] | None = None
    # With "separate": the peer slot's learning rate, what every integration into it trains
    # at (ours; the agent's ``slot_learning_rate``). None: ``learning_rate``, the own
    # adapter's. The slot starts each lesson with a fresh optimiser and a linear decay over
    # its few steps (with peer_alpha 1 on the teacher's answers alone), so its rate is a
    # choice of its own.
    slot_learning_rate: float | None = None
    # Whether every client of a collaborative strategy also spends LocalOnly+'s extra
    # own-data steps every round (an agent keeps training on its own data whatever its
    # role); False: the earlier harness, where only students trained in the exchange phase.
    own_steps_every_round: bool = True
    # How a pairing strategy (Random-P2P, KNEXA-FL, the Oracle) pairs: "disjoint", at most
    # N/2 disjoint pairs a round (Algorithm 2); "per_student" (ours; the default since
    # 2026-12-07, docs/experiment.md "A student every round"), every client the student of
    # one teacher each round, a teacher serving up to teacher_capacity students (None: any
    # number) (``CpmSettings.pairing``; docs/matchmaker.md). Heuristic-P2P (Algorithm 4)
    # pairs disjointly whatever this says.
    pairing: Literal["disjoint", "per_student"] = "per_student"
    teacher_capacity: int | None = None
    # Under "per_student": the teachers a student learns from each round, distinct, its best
    # ones (KNEXA-FL: by UCB; the Oracle: by trial gain; Random-P2P: drawn) (ours;
    # docs/experiment.md "Several teachers a student"; ``CpmSettings.teachers_per_student``).
    # LocalOnly+, and every client's own track, then spends as many extra own-data steps as
    # a student spends on its lessons (:attr:`exchange_own_steps`). None: the pairing's
    # default, :data:`DEFAULT_TEACHERS_PER_STUDENT` under per_student, 1 under disjoint
    # (resolved at construction, so a stored plan names the number it ran).
    teachers_per_student: int | None = None

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
        slot_lr = self.slot_learning_rate
        if slot_lr is not None:
            if isinstance(slot_lr, bool) or not (math.isfinite(slot_lr) and 0 < slot_lr <= 1):
                raise ValueError("slot_learning_rate must be a number in (0, 1]")
            # 1 and 1.0 are one plan: the reuse key compares the plan's JSON.
            object.__setattr__(self, "slot_learning_rate", float(slot_lr))
        if self.peer_alpha is not None and not (
            math.isfinite(self.peer_alpha) and 0 < self.peer_alpha <= 1
        ):
            raise ValueError("peer_alpha must be in (0, 1]")
        if self.integration not in ("separate", "shared"):
            raise ValueError(
                f"integration must be 'separate' or 'shared', not {self.integration!r}"
            )
        if self.pairing not in ("disjoint", "per_student"):
            raise ValueError(f"pairing must be 'disjoint' or 'per_student', not {self.pairing!r}")
        if self.teacher_capacity is not None and self.teacher_capacity < 1:
            raise ValueError(f"teacher_capacity must be >= 1, not {self.teacher_capacity!r}")
        k = self.teachers_per_student
        if k is None:
            k = DEFAULT_TEACHERS_PER_STUDENT if self.pairing == "per_student" else 1
            object.__setattr__(self, "teachers_per_student", k)
        from peerlm.services.cpm import MAX_TEACHERS_PER_STUDENT as most

        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= most:
            raise ValueError(f"teachers_per_student must be an integer in [1, {most}], not {k!r}")
        if k > 1 and self.pairing != "per_student":
            raise ValueError("teachers_per_student > 1 needs pairing 'per_student'")
        if self.slot_scope not in ("all", "routed"):
            raise ValueError(f"slot_scope must be 'all' or 'routed', not {self.slot_scope!r}")
        if self.slot_banks is None:
            banks = "category" if self.integration == "separate" else "one"
            object.__setattr__(self, "slot_banks", banks)
        if self.slot_banks not in ("one", "category"):
            raise ValueError(f"slot_banks must be 'one' or 'category', not {self.slot_banks!r}")
        if not 0 <= self.slot_rehearsal <= 256:
            raise ValueError(f"slot_rehearsal must be in [0, 256], not {self.slot_rehearsal}")
        slot_only = [
            name
            for name, given in (
                ("slot_rehearsal", self.slot_rehearsal != 0),
                ("slot_banks", self.slot_banks != "one"),
                ("slot_learning_rate", self.slot_learning_rate is not None),
            )
            if given
        ]
        if slot_only and self.integration != "separate":
            raise ValueError(
                f"{' and '.join(slot_only)} {'needs' if len(slot_only) == 1 else 'need'} "
                "a peer slot: integration 'separate'"
            )
        if self.answer_check not in ("off", "own_first", "peer_first"):
            raise ValueError(
                f"answer_check must be off, own_first or peer_first, not {self.answer_check!r}"
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
        if self.probe_scope not in ("all", "lacked", "answered", "routed"):
            raise ValueError(
                "probe_scope must be 'all', 'lacked', 'answered' or 'routed', "
                f"not {self.probe_scope!r}"
            )
        if self.probe_scope == "routed" and self.integration != "separate":
            raise ValueError("probe_scope 'routed' needs a peer slot: integration 'separate'")
        if self.probe_scope in ("lacked", "routed") and self.reward != "probe":
            raise ValueError(f"probe_scope {self.probe_scope!r} needs reward 'probe'")
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
        if self.pairing != "disjoint":
            given["pairing"] = self.pairing
        if self.teacher_capacity is not None:
            given["teacher_capacity"] = self.teacher_capacity
        if self.teachers_per_student != 1:
            given["teachers_per_student"] = self.teachers_per_student
        given |= {
            "interaction_features": self.cpm_interaction_features,
            "context_columns": self.cpm_context_columns,
        }
        try:
            # The plan alone decides: no PEERLM_CPM_* variable of the shell reaches the runs.
            return explicit_settings(CpmSettings, given)
        except ValueError as exc:  # pydantic's ValidationError is one
            raise ValueError(f"CPM settings: {exc}") from None

    @property
    def integration_steps(self) -> int:
        """Optimiser steps of one AKD integration (``akd_steps`` or ``local_steps``)."""
        return self.local_steps if self.akd_steps is None else self.akd_steps

    @property
    def lessons_per_student(self) -> int:
        """Lessons one student takes a round under ``per_student``: ``teachers_per_student``,
        at most one from every other client."""
        k = self.teachers_per_student
        assert k is not None  # resolved at construction
        return max(1, min(k, self.agents - 1))

    @property
    def exchange_own_steps(self) -> int:
        """LocalOnly+'s extra own-data steps a round (and every collaborating client's own
        track's): what a student spends on its lessons, ``integration_steps`` each."""
        return self.integration_steps * self.lessons_per_student


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
