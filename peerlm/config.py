"""Configuration: pydantic-settings models loaded from YAML, environment and CLI flags.

Precedence, highest first: CLI flags (passed as ``overrides``), environment variables
(``PEERLM_<COMPONENT>_...``, nested fields joined by ``__``), the YAML file, defaults.
Invalid configuration fails fast with :class:`ConfigError`, whose message names every bad
field in one readable list.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict

from peerlm.pki.identity import validate_name

__all__ = [
    "AgentOverlaySettings",
    "AgentSettings",
    "ConfigError",
    "CpmSettings",
    "GrpcLimits",
    "LogFormat",
    "OverlayProtocolSettings",
    "OverlaySettings",
    "ServiceSettings",
    "TlsSettings",
    "load_settings",
    "parse_host_port",
]

LogFormat = Literal["auto", "json", "console"]
MiB = 1024 * 1024


class ConfigError(ValueError):
    """The effective configuration is invalid; the message is meant for a person."""


def parse_host_port(value: str) -> tuple[str, int]:
    """Split ``host:port`` (``[v6]:port`` for IPv6) and validate the port."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    host = host.removeprefix("[").removesuffix("]")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"port in {value!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} in {value!r} is out of range 0..65535")
    return host, port


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TlsSettings(_Section):
    """Paths of the federation CA certificate and this process's certificate and key."""

    ca_cert: Path | None = None
    cert: Path | None = None
    key: Path | None = None


class GrpcLimits(_Section):
    """Every gRPC limit in one place. The reasons for each default live in peerlm.rpc."""

    max_message_bytes: int = Field(default=4 * MiB, ge=64 * 1024, le=64 * MiB)
    chunk_bytes: int = Field(default=1 * MiB, ge=16 * 1024, le=16 * MiB)
    max_concurrent_rpcs: int = Field(default=1024, ge=1)
    max_concurrent_streams: int = Field(default=256, ge=1)
    # Calls (unary or streaming) one identity may have in flight on a server: a member (or
    # an admin) cannot hold more than this of max_concurrent_rpcs, so one member's flood
    # leaves the others served. An agent needs 2 on the CPM (its feed and one call).
    max_calls_per_identity: int = Field(default=64, ge=1)
    keepalive_time_s: float = Field(default=30.0, gt=0)
    keepalive_timeout_s: float = Field(default=10.0, gt=0)
    min_ping_interval_s: float = Field(default=10.0, gt=0)
    rpc_timeout_s: float = Field(default=30.0, gt=0)
    shutdown_grace_s: float = Field(default=5.0, ge=0)


class ServiceSettings(BaseSettings):
    """Settings every gRPC process shares."""

    model_config = SettingsConfigDict(extra="forbid", env_nested_delimiter="__")

    federation: str = "peerlm"
    listen: str = "127.0.0.1:50051"
    insecure_dev: bool = False
    tls: TlsSettings = TlsSettings()
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    log_format: LogFormat = "auto"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    limits: GrpcLimits = GrpcLimits()

    @field_validator("listen")
    @classmethod
    def _listen_is_host_port(cls, v: str) -> str:
        parse_host_port(v)
        return v


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
    protocols: tuple[str, ...] = ("akd",)
    roles: tuple[str, ...] = ("one_way",)
    interaction_features: bool = True
    trust_features: bool = True
    matching: Literal["greedy", "blossom"] = "greedy"
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
    # Rewards between two bandit snapshots (the ledger holds every reward in between).
    snapshot_every: int = Field(default=256, ge=1)

    @field_validator("protocols", "roles")
    @classmethod
    def _non_empty_names(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v or any(not s or not s.replace("_", "").isalnum() for s in v):
            raise ValueError("must be a non-empty list of identifiers like 'akd'")
        if len(set(v)) != len(v):
            raise ValueError("must not repeat a name")
        return v


class OverlayProtocolSettings(_Section):
    """Overrides of the overlay protocol parameters (``peerlm.overlay.params.OverlayParams``).

    ``None`` keeps the parameter's default. They must agree across every node of an overlay
    (the epoch schedule and the limits are network-wide); see docs/overlay.md.
    """

    zone_cap: int | None = Field(default=None, ge=2)
    ttl_radius: int | None = Field(default=None, ge=1)
    hop_time: float | None = Field(default=None, gt=0)
    max_neighbours: int | None = Field(default=None, ge=1)
    peer_exchange_interval: float | None = Field(default=None, gt=0)
    replication: int | None = Field(default=None, ge=1)
    max_children: int | None = Field(default=None, ge=2)
    beam: int | None = Field(default=None, ge=1)
    heartbeat_interval: float | None = Field(default=None, gt=0)
    lease_duration: float | None = Field(default=None, gt=0)
    epoch_period: float | None = Field(default=None, gt=0)
    genesis_time: float | None = None
    root_replication: int | None = Field(default=None, ge=1)
    query_timeout: float | None = Field(default=None, gt=0)
    search_budget: float | None = Field(default=None, gt=0, le=1)
    member_timeout: float | None = Field(default=None, gt=0)
    orphan_after: float | None = Field(default=None, gt=0)
    join_retry: float | None = Field(default=None, gt=0)
    max_signature_p: int | None = Field(default=None, ge=1)
    max_items_per_message: int | None = Field(default=None, ge=1)
    max_k: int | None = Field(default=None, ge=1)
    # Local to each node (need not agree network-wide): the per-sender Deliver limit.
    deliver_rate: float | None = Field(default=None, gt=0)
    deliver_burst: float | None = Field(default=None, ge=1)

    def overrides(self) -> dict[str, Any]:
        """The fields that are set, as ``OverlayParams`` keyword arguments."""
        return {k: v for k, v in self.model_dump().items() if v is not None}


class AgentOverlaySettings(_Section):
    """The agent as an overlay node: SemanticDFL pull and personalised aggregation.

    The overlay service shares the agent's peer-exchange server (one port, one certificate),
    so the address a search returns is the address the adapter is pulled from. See
    docs/overlay-aggregation.md ("Running it in the agent").
    """

    enabled: bool = False
    bootstrap: tuple[str, ...] = ()
    protocol: OverlayProtocolSettings = OverlayProtocolSettings()
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
    bootstrap_retry_s: float = Field(default=1.0, gt=0)
    # Before its first round the agent waits up to this long for the overlay to place it
    # (root known, so searches can be answered); 0 starts at once and the rounds before the
    # first overlay build skip the pull (outcome ``query_refused``).
    placement_wait_s: float = Field(default=0.0, ge=0)
    leave_grace_s: float = Field(default=2.0, ge=0)


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
    kd_temperature_start: float = Field(default=2.5, gt=0, le=100)
    kd_temperature_end: float = Field(default=1.5, gt=0, le=100)
    # What this agent sends as a teacher: "directive" follows the directive's protocol
    # (akd: text, akd_logits: logits), "text" always text, "logits" logits whenever the
    # student's tokenizer is ours; logits fall back to text for any other tokenizer.
    akd_mode: Literal["directive", "text", "logits"] = "directive"
    logits_top_k: int = Field(default=16, ge=1, le=1024)
    transfer_limit: int | None = Field(default=None, ge=1)
    max_new_tokens: int = Field(default=96, ge=1, le=4096)
    # Reward (Eq. 3): gamma * (L_pre - L_post) - delta * KB.
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
    # One completion in a package a teacher sends us (UTF-8 bytes); with the transfer set's
    # size it bounds what a student parses and tokenises (agent.package.student_limits).
    package_max_item_bytes: int = Field(default=64 * 1024, ge=1024, le=64 * MiB)
    # Acceptance gate: an AKD update or overlay aggregate that raises the validation loss by
    # more than this many nats is rolled back (and, for AKD, reported as a negative reward).
    acceptance_margin: float | None = Field(default=0.1, ge=0)
    # SIGTERM: finish the current round within this grace, else stop training at the next
    # optimiser step, checkpoint and exit 0.
    stop_grace_s: float = Field(default=30.0, ge=0)
    # SemanticDFL: the agent as an overlay node pulling its K most similar peers' adapters.
    overlay: AgentOverlaySettings = AgentOverlaySettings()

    @field_validator("cpm", "advertise")
    @classmethod
    def _target_is_host_port(cls, v: str | None) -> str | None:
        if v is not None:
            parse_host_port(v)
        return v


class OverlaySettings(ServiceSettings):
    """A dedicated overlay node (``peerlm overlay-node``). ``listen`` serves the overlay."""

    model_config = SettingsConfigDict(
        extra="forbid", env_prefix="PEERLM_OVERLAY_", env_nested_delimiter="__"
    )

    listen: str = "127.0.0.1:50071"
    advertise: str | None = None
    name: str | None = None
    bootstrap: tuple[str, ...] = ()
    vrf_key: Path | None = None
    signature_file: Path | None = None
    seed: int | None = None
    protocol: OverlayProtocolSettings = OverlayProtocolSettings()
    # Delivery to other nodes (peerlm.overlay.transport.DeliveryPolicy).
    max_peers: int = Field(default=256, ge=1, le=65536)
    send_queue_depth: int = Field(default=1024, ge=1)
    max_batch: int = Field(default=64, ge=1, le=4096)
    deliver_timeout_s: float = Field(default=2.0, gt=0)
    deliver_retries: int = Field(default=3, ge=0, le=20)
    retry_backoff_s: float = Field(default=0.05, gt=0)
    send_max_age_s: float = Field(default=5.0, gt=0)
    # Incoming bounds and bookkeeping.
    max_receive_batch: int = Field(default=256, ge=1, le=65536)
    key_cache: int = Field(default=4096, ge=16)
    event_queue_depth: int = Field(default=1024, ge=1)
    metrics_interval_s: float = Field(default=1.0, gt=0)
    bootstrap_retry_s: float = Field(default=1.0, gt=0)
    leave_grace_s: float = Field(default=2.0, ge=0)

    @field_validator("advertise")
    @classmethod
    def _advertise_is_host_port(cls, v: str | None) -> str | None:
        if v is not None:
            parse_host_port(v)
        return v

    @field_validator("bootstrap")
    @classmethod
    def _bootstrap_entries(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for entry in v:
            name, _, target = entry.rpartition("@")
            if name:
                validate_name(name)
            parse_host_port(target)
        return v

    @field_validator("name")
    @classmethod
    def _name_is_certificate_name(cls, v: str | None) -> str | None:
        if v is not None:
            validate_name(v)
        return v


S = TypeVar("S", bound=BaseSettings)
SS = TypeVar("SS", bound="ServiceSettings")


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def _format_errors(exc: ValidationError, origin: str) -> str:
    lines = [f"invalid configuration ({origin}):"]
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(root)"
        lines.append(f"  - {where}: {err['msg']}")
    return "\n".join(lines)


def load_settings(
    cls: type[S],
    config_file: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> S:
    """Build ``cls`` from YAML < environment < ``overrides`` (``None`` values are ignored).

    ``overrides`` keys may be dotted (``"tls.cert"``) to reach nested sections.
    """
    layered: dict[str, Any] = _read_yaml(config_file) if config_file else {}
    try:
        env_values = EnvSettingsSource(cls)()
    except Exception as exc:  # pydantic-settings raises SettingsError on bad env JSON
        raise ConfigError(f"invalid environment variable: {exc}") from None
    layered = _deep_merge(layered, env_values)
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        node: dict[str, Any] = {}
        cursor = node
        parts = dotted.split(".")
        for part in parts[:-1]:
            cursor[part] = {}
            cursor = cursor[part]
        cursor[parts[-1]] = value
        layered = _deep_merge(layered, node)
    origin = str(config_file) if config_file else "defaults, environment and flags"
    try:
        # model_validate skips BaseSettings' own source loading: the layering above is the
        # single place precedence is decided.
        settings = cls.model_validate(layered)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, origin)) from None
    if isinstance(settings, ServiceSettings):
        settings = _federation_from_certificate(settings, origin)
    return settings


def _federation_from_certificate(settings: SS, origin: str) -> SS:
    """A process belongs to the federation its certificate names.

    Unset, ``federation`` is taken from the certificate (so ``peerlm cpm --cert ...`` works
    for a CA made with ``ca init --federation acme``); set and different, the process would
    refuse every peer of its own federation, so loading fails with both names instead. An
    unreadable certificate is left to the security check, which explains it.
    """
    cert = settings.tls.cert
    if cert is None or settings.insecure_dev:
        return settings
    from peerlm.pki.identity import identity_from_certificate_pem

    try:
        federation = identity_from_certificate_pem(cert.read_bytes()).federation
    except (OSError, ValueError):
        return settings
    if "federation" not in settings.model_fields_set:
        return settings.model_copy(update={"federation": federation})
    if settings.federation != federation:
        raise ConfigError(
            f"federation {settings.federation!r} (from {origin}) differs from the federation "
            f"{federation!r} of the certificate {cert}; drop the setting (the certificate "
            "decides) or use a certificate of that federation"
        )
    return settings
