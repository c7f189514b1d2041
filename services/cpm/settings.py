"""The CPM service's settings (``peerlm cpm``): bandit, matching trigger, bounds."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from peerlm.services.cpm.matchmaker import MAX_MERGE_SENDERS, MAX_TEACHERS_PER_STUDENT, Matchmaker
from peerlm.services.cpm.menu import MENU
from peerlm.services.cpm.normalise import DEFAULT_REWARD_CLIP_SIGMAS
from peerlm.services.cpm.profile import check_context_columns
from peerlm.services.cpm.robust_normalise import (
    DEFAULT_REWARD_WINDOW,
    MAX_REWARD_WINDOW,
    MIN_REWARD_WINDOW,
)
from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from peerlm.config import ServiceSettings
from peerlm.protocols import DEFAULT_PROTOCOL

__all__ = ["CpmSettings"]


class CpmSettings(ServiceSettings):
    """The CPM service (``peerlm cpm``)."""

    model_config = SettingsConfigDict(
        extra="forbid", env_prefix="PEERLM_CPM_", env_nested_delimiter="__"
    )

    db: Path = Path("state/cpm.db")
    # Create a new federation database when ``db`` holds none (missing or empty file).
    # Without it such a start is refused: a lost database must not become a new federation.
    init: bool = False
    # Bandit (Algorithm 2) and context map.
    profile_dim: int = Field(default=32, ge=1, le=4096)
    beta: float = Field(default=1.0, ge=0)
    ridge: float = Field(default=1.0, gt=0)
    pair_budget: int | None = Field(default=None, ge=1)
    # K_rec: the protocols the CPM may recommend, a subset of the menu (peerlm.protocols'
    # catalogue; docs/matchmaker.md). The default changes nothing for a deployment.
    protocols: tuple[str, ...] = (DEFAULT_PROTOCOL,)
    roles: tuple[str, ...] = ("one_way",)
    interaction_features: bool = True
    trust_features: bool = True
    # The profile entries the context sees (indices; None: all). Fewer columns, a smaller
    # context: what a federation with few rewards per round can learn (docs/matchmaker.md,
    # "Context columns"). Part of the database's fingerprint when set.
    context_columns: tuple[int, ...] | None = None
    matching: Literal["greedy", "blossom"] = "greedy"
    # "disjoint" (Algorithm 2): at most N/2 pairs a round, no agent in two. "per_student"
    # (ours; docs/matchmaker.md, "A student every round"): every agent may be the student
    # of one directive a round, a teacher serving up to teacher_capacity students (null:
    # any number); an agent may teach and learn in one round. Greedy matching only.
    pairing: Literal["disjoint", "per_student"] = "disjoint"
    teacher_capacity: int | None = Field(default=None, ge=1)
    # Under "per_student": directives one agent may receive as a student a round, from
    # distinct teachers, its best ones by UCB (ours; docs/matchmaker.md, "Several teachers
    # a student"). 1: one, as before.
    teachers_per_student: int = Field(default=1, ge=1, le=MAX_TEACHERS_PER_STUDENT)
    # Most senders one merge directive (pmix, svd_hka) names: the pairing's teacher and up
    # to merge_senders - 1 co-senders ranked by UCB (docs/matchmaker.md, "Several senders
    # per merge directive"). 1: one sender, as before. Part of the database's fingerprint
    # when not 1: a K-sender merge reward is a group reward, another quantity for the arms.
    merge_senders: int = Field(default=1, ge=1, le=MAX_MERGE_SENDERS)
    # Rewards winsorised to this many running standard deviations before the z-score (a
    # hostile student's extreme report must not flatten every later reward; null: the
    # paper's plain running z-score; services/cpm/normalise.py). Part of the database's
    # fingerprint when not the default.
    reward_clip_sigmas: float | None = Field(default=DEFAULT_REWARD_CLIP_SIGMAS, gt=0, le=1e6)
    # How rewards are normalised before the bandit learns them: "robust" (the default, our
    # choice beyond the paper), median and 1.4826 * MAD over the last reward_window
    # rewards, which a member filing fewer than half of them cannot flatten
    # (services/cpm/robust_normalise.py; docs/security.md), each z-score bounded by
    # reward_clip_sigmas; "zscore", the paper's running z-score (winsorised as above).
    # Chosen by measurement (docs/matchmaker.md, "Reward normalisation"): on the learning
    # ground the two are indistinguishable in what the CPM learns. Part of the database's
    # fingerprint (with reward_window) when "robust": a database made under "zscore" (every
    # one made before this default) is refused until reward_normaliser: zscore is set.
    reward_normaliser: Literal["zscore", "robust"] = "robust"
    reward_window: int = Field(
        default=DEFAULT_REWARD_WINDOW, ge=MIN_REWARD_WINDOW, le=MAX_REWARD_WINDOW
    )
    # How a merge directive's co-senders are chosen and what its reward teaches the bandit
    # (docs/matchmaker.md, "Group scoring"): "pair", each co-sender ranked by its own pair
    # UCB and the reward learnt on the teacher's context; "group", the group built greedily
    # by the UCB of its mean-profile context, which the reward then updates. Only matters
    # with merge_senders > 1. Part of the database's fingerprint when "group".
    co_sender_scoring: Literal["pair", "group"] = "pair"
    # Distinct students whose pulled adapter must disprove a member's declared parameter-
    # space fingerprint before the member is matched as undeclared for every pair (one
    # disproof already excludes the disproving student's own pairs with it;
    # docs/matchmaker.md, "The fingerprint"). A policy over the stored disproofs, not
    # part of the database's fingerprint: changing it re-reads the same records.
    space_disproof_quorum: int = Field(default=2, ge=1)
    prefilter_k: int = Field(default=8, ge=1)
    prefilter_min_agents: int = Field(default=64, ge=2)
    seed: int = 0
    # Matchmaking trigger (Algorithm 3, phase 2): on quorum or timer.
    quorum_fraction: float = Field(default=1.0, gt=0, le=1.0)
    min_quorum: int = Field(default=2, ge=2)
    round_interval_s: float = Field(default=30.0, gt=0)
    directive_ttl_s: float = Field(default=600.0, gt=0)
    # Bounds on what clients can make the CPM hold.
    max_agents: int = Field(default=10_000, ge=2)
    stream_queue_depth: int = Field(default=64, ge=1)
    max_reward_magnitude: float = Field(default=1e6, gt=0)
    # What the bandit learns from a refused exchange (services/cpm/refusals.py): Eq. 3's
    # value for an exchange that changed nothing and moved nothing. At most
    # max_reward_magnitude in absolute value.
    refusal_reward: float = 0.0
    # Rewards one ReportRewards stream may have read but not yet answered; with
    # limits.max_calls_per_identity streams per agent this bounds what one agent queues.
    reward_stream_window: int = Field(default=64, ge=1, le=4096)
    # Rewards between two bandit snapshots (the ledger holds every reward in between).
    snapshot_every: int = Field(default=256, ge=1)
    # BLAS threads for the bandit's linear algebra. Its matrices are d x d with d ~ 132:
    # too small for threads to pay, and OpenBLAS's spinning workers take the cores that the
    # gRPC and TLS work needs (docs/bench-cpm.md, "Durable reward acknowledgement").
    blas_threads: int = Field(default=1, ge=1, le=256)

    def new_matchmaker(self) -> Matchmaker:
        """A fresh LinUCB :class:`~peerlm.services.cpm.matchmaker.Matchmaker` with these
        settings (the CPM service's, and the experiment harness's CPM strategies')."""
        return Matchmaker(
            profile_dim=self.profile_dim,
            beta=self.beta,
            pair_budget=self.pair_budget,
            protocols=self.protocols,
            seed=self.seed,
            roles=self.roles,
            interaction_features=self.interaction_features,
            trust_features=self.trust_features,
            matching=self.matching,
            prefilter_k=self.prefilter_k,
            prefilter_min_agents=self.prefilter_min_agents,
            ridge=self.ridge,
            context_columns=self.context_columns,
            merge_senders=self.merge_senders,
            reward_clip_sigmas=self.reward_clip_sigmas,
            co_sender_scoring=self.co_sender_scoring,
            reward_normaliser=self.reward_normaliser,
            reward_window=self.reward_window,
            pairing=self.pairing,
            teacher_capacity=self.teacher_capacity,
            teachers_per_student=self.teachers_per_student,
        )

    @model_validator(mode="after")
    def _per_student_is_greedy(self) -> CpmSettings:
        if self.pairing == "per_student" and self.matching != "greedy":
            raise ValueError("pairing 'per_student' is walked greedily: matching must be 'greedy'")
        if self.teachers_per_student > 1 and self.pairing != "per_student":
            raise ValueError("teachers_per_student > 1 needs pairing 'per_student'")
        return self

    @model_validator(mode="after")
    def _refusal_reward_bounded(self) -> CpmSettings:
        if not abs(self.refusal_reward) <= self.max_reward_magnitude:
            raise ValueError(
                f"refusal_reward {self.refusal_reward} exceeds max_reward_magnitude "
                f"{self.max_reward_magnitude:g} (or is not finite)"
            )
        return self

    @model_validator(mode="after")
    def _columns_in_profile(self) -> CpmSettings:
        check_context_columns(self.context_columns, self.profile_dim)
        return self

    @field_validator("protocols", "roles")
    @classmethod
    def _non_empty_names(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v or any(not s or not s.replace("_", "").isalnum() for s in v):
            raise ValueError(f"must be a non-empty list of identifiers like {DEFAULT_PROTOCOL!r}")
        if len(set(v)) != len(v):
            raise ValueError("must not repeat a name")
        return v

    @field_validator("protocols")
    @classmethod
    def _on_the_menu(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [p for p in v if p not in MENU]
        if unknown:
            raise ValueError(
                f"{', '.join(unknown)} not on the menu; choose from {', '.join(MENU)} "
                "(h_ties is FedProxy's owner-run cohort merge, configured per owner)"
            )
        return v
