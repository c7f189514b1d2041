"""The agent daemon's settings (``peerlm agent``), its overlay section included.

The overlay protocol section is the overlay's own parameter model
(:class:`peerlm.overlay.OverlayParams`), validated by it: one definition of every knob, its
default and its bounds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from peerlm.agent.fedwave.settings import FedWaveSettings
from peerlm.overlay import OverlayParams
from pydantic import ConfigDict, Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from peerlm.config import MiB, Section, ServiceSettings, parse_host_port
from peerlm.pki.identity import NAME_PATTERN as _AGENT_NAME
from peerlm.protocols import DEFAULT_OVERLAY_AGGREGATION, check_names, lookup, names

__all__ = ["AgentOverlaySettings", "AgentSettings", "FedProxySettings", "PeerSendSettings"]


class PeerSendSettings(Section):
    """Bounds on what the peer server holds for readers of adapters and packages.

    A chunk handed to gRPC stays in memory until its reader takes it, so the peer service
    reserves every chunk's bytes from one budget before writing it
    (:mod:`peerlm.agent.peer.send_budget`): at most ``budget_bytes`` are unwritten at once,
    all streams together, and at most ``identity_bytes`` of them for one member. See
    docs/security.md ("Slow readers").
    """

    # 64 chunks of the default 1 MiB: what one package at max_package_bytes needs, and a
    # bound of about twice this on the memory slow readers can hold (gRPC keeps the
    # serialised copy and its own).
    budget_bytes: int = Field(default=64 * MiB, ge=64 * 1024)
    # One member's streams may have 4 default chunks unwritten at once: a student pulls one
    # adapter or package from a teacher at a time, so an honest member never waits on it.
    identity_bytes: int = Field(default=4 * MiB, ge=16 * 1024)
    # A stream that gets no bytes within this long is refused (RESOURCE_EXHAUSTED); the
    # gRPC call deadline's default.
    wait_s: float = Field(default=30.0, gt=0)
    # A reader that takes none of a written chunk within this long is cut off: no more
    # chunks, and DEADLINE_EXCEEDED after what was queued. 1 MiB in 30 s is ~280 kbit/s.
    stall_s: float = Field(default=30.0, gt=0)

    @model_validator(mode="after")
    def _share_within_budget(self) -> PeerSendSettings:
        if self.identity_bytes > self.budget_bytes:
            raise ValueError(
                f"peer_send.identity_bytes ({self.identity_bytes}) must not exceed "
                f"peer_send.budget_bytes ({self.budget_bytes})"
            )
        return self


class AgentOverlaySettings(Section):
    """The agent as an overlay node: SemanticDFL pull and personalised aggregation.

    The overlay service shares the agent's peer-exchange server (one port, one certificate),
    so the address a search returns is the address the adapter is pulled from. See
    docs/overlay-aggregation.md ("Running it in the agent").
    """

    # ``protocol.genesis_seed`` is bytes: written and read as hex.
    model_config = ConfigDict(
        extra="forbid", frozen=True, ser_json_bytes="hex", val_json_bytes="hex"
    )

    enabled: bool = False
    bootstrap: tuple[str, ...] = ()
    protocol: OverlayParams = OverlayParams()
    k: int = Field(default=2, ge=1, le=1024)
    query_timeout_s: float | None = Field(default=None, gt=0)
    signature_p: int | None = Field(default=None, ge=1)
    tau_min: float = Field(default=0.9, gt=0, le=1)
    importance_beta: float = Field(default=0.5, ge=0, lt=1)
    # PDFL step; unset: the algorithm's defaults, defined (and argued for) once, in
    # peerlm.overlay.aggregation (psi 2, kappa 0.25, eta 1).
    psi: float | None = Field(default=None, ge=0)
    kappa: float | None = Field(default=None, gt=0)
    eta: float | None = Field(default=None, gt=0)
    # None: the largest adapter this agent's model and LoRA settings can produce (all tensors
    # float32 plus the 1 MiB header bound); a compatible neighbour's is never larger.
    max_adapter_bytes: int | None = Field(default=None, ge=1024)
    # A neighbour's adapter norm may be at most this times ours (None: no bound).
    max_norm_ratio: float | None = Field(default=10.0, gt=0)
    # Per LoRA module, a neighbour's (or a merge sender's) update (alpha/r) B A may be at most
    # this times ours (adapter_codec.update_bounds; None: no bound).
    max_update_ratio: float | None = Field(default=4.0, gt=0)
    # An overlay pull refuses a neighbour whose advertised similarity exceeds the one
    # recomputed from its pulled adapter by more than this (None: not checked).
    signature_tolerance: float | None = Field(default=0.2, ge=0)
    # No neighbour's PDFL weight above this many equal shares of the row (None: no cap).
    max_weight_share: float | None = Field(default=2.0, ge=1)
    bootstrap_retry_s: float = Field(default=1.0, gt=0)
    # Before its first round the agent waits up to this long for the overlay to place it
    # (root known, so searches can be answered); 0 starts at once and the rounds before the
    # first overlay build skip the pull (outcome ``query_refused``).
    placement_wait_s: float = Field(default=0.0, ge=0)
    leave_grace_s: float = Field(default=2.0, ge=0)
    # What the pulled adapters become: a merge protocol of the catalogue that aggregates
    # overlay pulls (peerlm.protocols, overlay_aggregation): pmix, SemanticDFL's
    # personalised mixing (the PDFL step), or svd_hka, OnePeFT's SVD aggregation refined by
    # HKA on the agent's public pairs (``public_file``), hka_steps optimiser steps at Eq. 6's
    # hka_alpha.
    aggregation: str = DEFAULT_OVERLAY_AGGREGATION
    # OnePeFT's one-shot mode: after joining, the agent pulls and aggregates until one step
    # has aggregated (outcome ``aggregated``), then only publishes its signature each round
    # (outcome ``published``). A restart is a re-join: it aggregates once again. False:
    # every round pulls and aggregates (SemanticDFL's schedule).
    aggregate_once: bool = False
    hka_alpha: float = Field(default=0.5, ge=0, le=1)
    hka_steps: int = Field(default=8, ge=1, le=10_000)

    @field_validator("aggregation")
    @classmethod
    def _aggregates_overlay_pulls(cls, v: str) -> str:
        if v not in names(overlay_aggregation=True):
            raise ValueError(
                f"unknown aggregation {v[:40]!r}; one of "
                f"{', '.join(names(overlay_aggregation=True))}"
            )
        return v


class FedProxySettings(Section):
    """FedProxy's cohort: the owner serves its proxy to the cohort over
    ``peerlm.v1.ProxyExchange``, collects the members' trained proxies each round, merges
    them with the analysis and H-TIES and publishes the next proxy with the conflict scores;
    members pull the proxy, train it with PCR and serve their update to the owner only.
    See docs/fedproxy.md ("The owner role over the network").
    """

    enabled: bool = False
    # This agent holds the full model (the agent's ``model``) and its proxy (``proxy_path``,
    # made by ``peerlm models compress``), and runs the rounds.
    owner: bool = False
    # Owner: the members admitted, agent name (their certificate's) -> host:port of their
    # peer server. Members: may be left empty (a member serves only the owner).
    cohort: dict[str, str] = Field(default_factory=dict)
    # Members: the owner's agent name (certificate) and address.
    owner_name: str | None = None
    owner_address: str | None = None
    # Owner: the proxy directory (from_pretrained). Members: where the pulled proxy is kept.
    proxy_path: Path = Path("state/proxy")
    # Owner: when set and ``proxy_path`` holds no model yet, the owner makes its proxy at
    # start: its ``model`` compressed by Block Influence on the public transfer set
    # (``transfer_file``, prompt + reference) at this ratio κ, the share of blocks removed
    # (what ``peerlm models compress --ratio`` does), written to ``proxy_path``. None: the
    # proxy must be there.
    compress_ratio: float | None = Field(default=None, ge=0, lt=1)
    # The agent plays only the cohort's rounds, none directed by the CPM (``rounds`` is not
    # played), as a FedWave expert plays only FedWave rounds; what ``peerlm up --fedproxy``
    # writes. False: the cohort's rounds run beside the agent's own.
    cohort_only: bool = False
    # Owner: where the final global proxy, fused into the full model (Section 4.3), is
    # written after the last round (a model folder); None: not written.
    fused_path: Path | None = None
    # Cohort rounds the owner runs (members follow): each collects until every member
    # delivered or the deadline passed.
    rounds: int = Field(default=3, ge=1, le=100_000)
    round_deadline_s: float = Field(default=300.0, gt=0)
    # How long to wait before asking an unreachable member or owner again.
    retry_s: float = Field(default=1.0, gt=0)
    # Largest proxy payload (weights + conflict scores) either side accepts or sends.
    max_proxy_bytes: int = Field(default=1024 * MiB, ge=1024)
    # H-TIES (Eq. 10-13) and PCR (Eq. 9), Appendix B.1's defaults.
    r0: float = Field(default=1.0, ge=0, le=1)
    delta: float = Field(default=0.2, ge=0)
    rho: float = Field(default=1.1, ge=1)
    lambda_reg: float = Field(default=1e-5, ge=0)
    # Members' local training of the proxy per round (full-parameter AdamW).
    local_steps: int = Field(default=8, ge=1, le=100_000)
    learning_rate: float = Field(default=1e-3, gt=0)
    # Owner: admission of members' updates (docs/fedproxy.md, "Hostile members"). A task
    # vector |phi_k - phi| over this times the owner's proxy norm |phi| is refused (None: no
    # bound); loose on purpose: an honest round's update is a few percent of |phi|.
    max_update_norm_ratio: float | None = Field(default=1.0, gt=0)
    # Owner: a merge that raises the proxy's held-out loss (on the first gate_examples texts
    # of the agent's val_file) by more than this many nats over the previous proxy is not
    # published; the previous proxy is republished (None: no gate).
    acceptance_margin: float | None = Field(default=0.1, ge=0)
    gate_examples: int = Field(default=32, ge=1, le=10_000)
    # Owner: every tensor, and every row of a matrix, of an update may move by at most this
    # times its own reference (docs/fedproxy.md, "Hostile members"); honest rounds measure
    # < 0.1. None: no per-group bound.
    max_group_norm_ratio: float | None = Field(default=0.5, gt=0)
    # Owner: merge with H-TIES after the per-coordinate support clip (no coordinate moves
    # further than a second member moved it); False: the paper's H-TIES as is.
    robust_merge: bool = True
    # Owner: a member reporting that the published proxy raised the loss on its own
    # validation by more than this (nats) over the previous one rolls the proxy back to
    # the previous version. None: reports are logged only.
    harm_margin: float | None = Field(default=0.5, ge=0)
    # Owner: how many times one member may pull one round's proxy (retries included).
    max_pulls_per_round: int = Field(default=4, ge=1, le=1000)

    @field_validator("cohort")
    @classmethod
    def _cohort_addresses(cls, v: dict[str, str]) -> dict[str, str]:
        for name, address in v.items():
            if not _AGENT_NAME.fullmatch(name):
                raise ValueError(f"fedproxy.cohort: {name!r} is not an agent name")
            try:
                parse_host_port(address)
            except ValueError as err:
                raise ValueError(f"fedproxy.cohort.{name}: {err}") from None
        return v

    @field_validator("owner_address")
    @classmethod
    def _owner_address(cls, v: str | None) -> str | None:
        if v is not None:
            parse_host_port(v)
        return v

    @model_validator(mode="after")
    def _roles(self) -> FedProxySettings:
        if not self.enabled:
            return self
        if self.owner:
            if not self.cohort:
                raise ValueError("fedproxy.owner needs fedproxy.cohort: name -> host:port")
            if self.owner_name is not None or self.owner_address is not None:
                raise ValueError(
                    "fedproxy.owner_name/owner_address are a member's settings; an owner has none"
                )
        elif self.fused_path is not None or self.compress_ratio is not None:
            raise ValueError(
                "fedproxy.fused_path and fedproxy.compress_ratio are an owner's settings "
                "(members hold no full model)"
            )
        elif self.owner_name is None or self.owner_address is None:
            raise ValueError(
                "a fedproxy member needs fedproxy.owner_name and fedproxy.owner_address "
                "(or set fedproxy.owner: true on the agent that holds the full model)"
            )
        elif not _AGENT_NAME.fullmatch(self.owner_name):
            raise ValueError(f"fedproxy.owner_name: {self.owner_name!r} is not an agent name")
        return self


class AgentSettings(ServiceSettings):
    """The agent daemon (``peerlm agent``). ``listen`` is its peer-exchange endpoint."""

    model_config = SettingsConfigDict(
        extra="forbid", env_prefix="PEERLM_AGENT_", env_nested_delimiter="__"
    )

    listen: str = "127.0.0.1:50061"
    advertise: str | None = None
    cpm: str = "127.0.0.1:50051"
    state_dir: Path = Path("state/agent")
    # Model (any causal LM loadable by from_pretrained from a path or hub name).
    model: str = "state/models/gpt2"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    lora_rank: int = Field(default=8, ge=1, le=1024)
    lora_alpha: float = Field(default=16.0, gt=0)
    lora_dropout: float = Field(default=0.05, ge=0, lt=1)
    lora_target_modules: tuple[str, ...] | None = None
    # Data: private train/validation JSONL and the public transfer set X_u, pinned by hash.
    train_file: Path = Path("data/train.jsonl")
    val_file: Path = Path("data/val.jsonl")
    transfer_file: Path = Path("data/transfer.jsonl")
    transfer_sha256: str = Field(default="", pattern=r"^([0-9a-f]{64})?$")
    # Public labelled pairs (JSONL problems: prompt + reference), D_pub of OnePeFT's HKA;
    # needed only by the protocols whose entry says needs_public_pairs (svd_hka). Never
    # private data.
    public_file: Path | None = None
    # Rounds (Algorithm 3) and local training (Table 6; tiny models need a larger lr).
    rounds: int = Field(default=20, ge=0)
    round_timeout_s: float = Field(default=60.0, gt=0)
    local_steps: int | None = Field(default=None, ge=1)
    learning_rate: float = Field(default=1e-3, gt=0)
    batch_size: int = Field(default=8, ge=1)
    grad_accumulation: int = Field(default=4, ge=1)
    max_length: int = Field(default=256, ge=16)
    seed: int = 0
    # AKD (Eq. 2); alpha_KD and the KD temperature linear over the rounds (Table 6).
    alpha_kd_start: float = Field(default=0.2, ge=0, le=1)
    alpha_kd_end: float = Field(default=0.5, ge=0, le=1)
    # With integration "separate": alpha_KD for the peer slot, every round (ours;
    # run-experiment's --peer-alpha). None (the default): the schedule above. The
    # experiment measures 1.0 without the acceptance gate; the agent's gate judges the
    # slot on its own validation set, whose loss a slot trained on no own data may raise
    # beyond the margin (docs/configuration.md).
    peer_alpha_kd: float | None = Field(default=None, gt=0, le=1)
    kd_temperature_start: float = Field(default=2.5, gt=0, le=100)
    kd_temperature_end: float = Field(default=1.5, gt=0, le=100)
    # What this agent sends as a teacher: "directive" follows the directive's protocol
    # (akd: text, akd_logits: logits), "text" always text, "logits" logits whenever the
    # student's tokenizer is ours; logits fall back to text for any other tokenizer.
    akd_mode: Literal["directive", "text", "logits"] = "directive"
    # The CPM directives' protocols this agent executes, advertised in its profile (the
    # CPM never recommends another): names of peerlm.protocols' catalogue. None: every one
    # it can (those that need public pairs only with public_file, which they align on).
    protocols: tuple[str, ...] | None = None
    logits_top_k: int = Field(default=16, ge=1, le=1024)
    # What this agent answers of X_u as a teacher (peerlm.agent.exchange.teaching): "all" (the
    # paper's Eq. 2), or "competent": the prompts of categories where the Wilson lower bound
    # of its last validation pass@1 is at least teach_min_pass (needs eval_every rounds'
    # pass@1; before the first measurement it answers all).
    teach_scope: Literal["all", "competent"] = "all"
    teach_min_pass: float = Field(default=0.2, ge=0, le=1)
    # As a teacher, run each answer against its prompt's docstring example in the sandbox
    # (its limits below) and send only those that pass (peerlm.agent.exchange.self_check;
    # our choice beyond the paper, whose Eq. 2 sends the predictions as they are).
    teach_self_check: bool = False
    transfer_limit: int | None = Field(default=None, ge=1)
    max_new_tokens: int = Field(default=96, ge=1, le=4096)
    # Reward (Eq. 3): gamma * (L_pre - L_post) - delta * KB, with L_pre and L_post measured
    # on reward_file when set: a labelled public probe (JSONL problems with prompt and
    # reference; our choice beyond the paper, docs/experiment.md "The reward"), so a
    # teacher's gain on a skill this agent lacks shows in the reward; None: on val_file
    # (the paper). The acceptance gate judges on val_file either way.
    reward_file: Path | None = None
    # Which of reward_file's problems an AKD package's reward is measured on: "all", or
    # "answered": those of the categories the package answers (peerlm.agent.exchange.
    # reward_probe; our choice beyond the paper); a package that answers none of them earns
    # Eq. 3's -delta * KB alone. "routed" (integration "separate"): of those, the ones the
    # input router sends to the peer slot, what a lesson into the slot is used for
    # (AnsweredProbe.routed; ours). Merges are measured on the whole file either way.
    reward_scope: Literal["all", "answered", "routed"] = "all"
    reward_gamma: float = Field(default=1.0, ge=0)
    reward_delta: float = Field(default=0.001, ge=0)
    # Evaluation (pass@k in the sandbox) and profile privacy.
    eval_every: int = Field(default=1, ge=1)
    eval_limit: int | None = Field(default=None, ge=1)
    # Held-out test problems per evaluation slice ("own", "lacked", "public": JSONL files),
    # measured before the first and after the last round for the run's report.
    eval_slice_files: dict[str, Path] = Field(default_factory=dict)
    sandbox_timeout_s: float = Field(default=5.0, gt=0)
    sandbox_memory_mb: int = Field(default=256, ge=32)
    # Operator opt-out: evaluate even where the kernel lacks Landlock or seccomp, i.e. run
    # model-generated code unconfined (logged as a warning and counted on every run).
    sandbox_allow_unconfined: bool = False
    profile_dp_epsilon: float | None = Field(default=None, gt=0)
    guardrail_ngram: int = Field(default=8, ge=3)
    max_package_bytes: int = Field(default=64 * MiB, ge=1024)
    # What the peer server may hold for slow readers of adapters and packages.
    peer_send: PeerSendSettings = PeerSendSettings()
    # One completion in a package a teacher sends us (UTF-8 bytes); with the transfer set's
    # size it bounds what a student parses and tokenises (agent.exchange.package.student_limits).
    package_max_item_bytes: int = Field(default=64 * 1024, ge=1024, le=64 * MiB)
    # Acceptance gate: an AKD update or overlay aggregate that raises the validation loss by
    # more than this many nats is rolled back (and, for AKD, reported as a negative reward).
    acceptance_margin: float | None = Field(default=0.1, ge=0)
    # Where peers' knowledge goes (AKD, merge directives, overlay pulls): "separate", a
    # peer slot beside the own adapter with an input router (peerlm.agent.peer_integration;
    # our choice beyond the papers), or "shared", the papers' one adapter.
    integration: Literal["separate", "shared"] = "separate"
    # With integration "separate": what the peer slot distils of a package. "all" its
    # every item; "routed" only the items whose prompt the router sends to the slot (the
    # categories this agent holds, public ones included, stay the own adapter's and are
    # not learnt; a package with nothing left teaches nothing and earns Eq. 3's KB
    # penalty alone). Ours (peerlm.agent.exchange.peer_knowledge.learnt_items).
    slot_scope: Literal["all", "routed"] = "all"
    # With integration "separate": which adapter's answer a routed input keeps, judged in
    # the sandbox (its limits below) by the worked example the input's own prompt shows:
    # "own_first" the own adapter's unless it fails it, "peer_first" the slot's unless it
    # fails and the own one passes, "off" the router alone (peerlm.agent.exchange
    # .answer_check; ours).
    answer_check: Literal["off", "own_first", "peer_first"] = "own_first"
    # With integration "separate": pairs of earlier text lessons (the newest 16 accepted,
    # 64 pairs of each) distilled beside each new one in the same steps, so that a lesson
    # does not overwrite the ones before (experience replay; ours). 0: none.
    slot_rehearsal: int = Field(default=0, ge=0, le=256)
    # With integration "separate": "one" adapter in the peer slot, or "category": one bank
    # (adapter) per category this agent holds no data of, each text lesson written to the
    # bank its learnt prompts vote for (each its most probable lacked category), each
    # routed input answered by its own category's bank (a mixture of LoRAs behind the
    # router; ours:
    # peerlm.agent.exchange.peer_knowledge.PeerSlot). Merges and pulls write a shared bank.
    # None (the default): "category" (measured: docs/experiment.md "A bank per lacked
    # category"); refused with "shared" only when given.
    slot_banks: Literal["one", "category"] | None = None
    # With integration "separate": the learning rate of every integration into the peer
    # slot that trains (AKD, OnePeFT's HKA in a merge or an overlay pull; ours,
    # run-experiment's --slot-lr). None: learning_rate. The slot starts each lesson with a
    # fresh optimiser, so its rate is a choice of its own (docs/configuration.md).
    slot_learning_rate: float | None = Field(default=None, gt=0, le=1)
    # SIGTERM: finish the current round within this grace, else stop training at the next
    # optimiser step, checkpoint and exit 0.
    stop_grace_s: float = Field(default=30.0, ge=0)
    # SemanticDFL: the agent as an overlay node pulling its K most similar peers' adapters.
    overlay: AgentOverlaySettings = AgentOverlaySettings()
    # FedProxy's owner/member role (docs/fedproxy.md).
    fedproxy: FedProxySettings = FedProxySettings()
    # FedWave: this agent as the expert of one stage of a value-chain workflow (serves its
    # router and VCLayer to the workflow's agents, pulls theirs). Off without a workflow.
    fedwave: FedWaveSettings = FedWaveSettings()

    @field_validator("protocols")
    @classmethod
    def _protocols_in_catalogue(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        return None if v is None else check_names(v)

    @field_validator("cpm", "advertise")
    @classmethod
    def _target_is_host_port(cls, v: str | None) -> str | None:
        if v is not None:
            parse_host_port(v)
        return v

    @model_validator(mode="after")
    def _slot_settings_have_a_slot(self) -> AgentSettings:
        # Refused, not ignored: a rehearsal asked for and never run would go unnoticed.
        if self.slot_rehearsal and self.integration != "separate":
            raise ValueError(
                "slot_rehearsal rehearses a peer slot's lessons: it needs integration 'separate'"
            )
        if self.slot_banks == "category" and self.integration != "separate":
            raise ValueError("slot_banks divides a peer slot: it needs integration 'separate'")
        if self.slot_learning_rate is not None and self.integration != "separate":
            raise ValueError("slot_learning_rate is a peer slot's: it needs integration 'separate'")
        return self

    @model_validator(mode="after")
    def _answered_scope_has_a_probe(self) -> AgentSettings:
        if self.reward_scope != "all" and self.reward_file is None:
            raise ValueError(
                f"reward_scope {self.reward_scope!r} measures on reward_file's problems: "
                "set reward_file"
            )
        if self.reward_scope == "routed" and self.integration != "separate":
            raise ValueError(
                "reward_scope 'routed' measures what the peer slot answers: it needs "
                "integration 'separate'"
            )
        return self

    @model_validator(mode="after")
    def _hka_has_public_pairs(self) -> AgentSettings:
        aggregation = self.overlay.aggregation
        if lookup(aggregation).needs_public_pairs and self.public_file is None:
            raise ValueError(
                f"overlay.aggregation {aggregation!r} distils on public pairs: set public_file "
                "(JSONL problems with prompt and reference)"
            )
        if self.protocols is not None and self.public_file is None:
            for name in self.protocols:
                if lookup(name).needs_public_pairs:
                    raise ValueError(
                        f"protocols names {name}, whose HKA distils on public pairs: set "
                        "public_file (JSONL problems with prompt and reference)"
                    )
        return self

    def executed_protocols(self) -> tuple[str, ...]:
        """The protocols this agent executes and advertises (``protocols`` resolved)."""
        if self.protocols is not None:
            return tuple(self.protocols)
        if self.public_file is not None:
            return names(on_by_default=True)
        return names(needs_public_pairs=False, on_by_default=True)
