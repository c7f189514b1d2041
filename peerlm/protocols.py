"""The catalogue of knowledge-exchange protocols: the CPM's menu K_rec, in one place.

Each protocol an agent may execute for a CPM directive is one frozen :class:`ProtocolEntry`
of :data:`CATALOGUE`: its name (the ``Directive.protocol`` string on the wire), its kind
(a *distillation* moves a package of teacher predictions, a *merge* moves the sender's
adapter), which pairs it is admissible between, what travels, and whether a directive of it
may name co-senders. Everything else reads these attributes instead of spelling names:
the CPM's menu and admissibility (:mod:`peerlm.services.cpm.menu`), the CPM's and the
agent's settings, ``peerlm up``'s flags, the agent's directive dispatch and the experiment.
Adding a protocol is one entry here, its implementation in the agent (a module registered by
this name), its tests and one row of docs/architecture.md's menu.

The catalogue is the kernel's: it names no subsystem, so the peer server, the CPM library
and the experiment all read it without importing each other.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Literal

__all__ = [
    "AKD",
    "AKD_LOGITS",
    "CATALOGUE",
    "DEFAULT_OVERLAY_AGGREGATION",
    "DEFAULT_PROTOCOL",
    "FEDSA",
    "PMIX",
    "SVD_HKA",
    "Admissibility",
    "Kind",
    "Payload",
    "ProtocolEntry",
    "UnknownProtocolError",
    "check_names",
    "lookup",
    "names",
]

#: A distillation integrates a package of the teacher's predictions on the public transfer
#: set; a merge pulls the sender's adapter and merges it into the student's.
Kind = Literal["distillation", "merge"]
#: ``any_pair``: any two agents that both execute it; ``same_space``: only agents that
#: declared one parameter-space fingerprint (one tokenizer, one base, one LoRA layout).
Admissibility = Literal["any_pair", "same_space"]
#: What travels from the sender to the student.
Payload = Literal["text_package", "logits_package", "adapter"]


class UnknownProtocolError(ValueError):
    """A protocol name the catalogue does not hold (a ``ValueError``: bad input)."""


@dataclass(frozen=True)
class ProtocolEntry:
    """One knowledge-exchange protocol of the menu.

    ``co_senders``: a directive of it may name further senders besides the teacher (the
    student merges them all in one exchange); ``needs_public_pairs``: the student aligns on
    public (prompt, completion) pairs, so an agent without them cannot execute it;
    ``overlay_aggregation``: it can also aggregate the adapters an agent pulls from its
    overlay top-K (``overlay.aggregation``). ``paper`` and ``summary`` are what a person
    reads (docs, ``--help``). ``on_by_default``: an agent executes it unless its settings
    name its protocols, and the experiment's full-menu strategies offer it; a baseline added
    for comparison is off by default, so that adding it changes no existing deployment or
    run (it is still on the menu: a CPM and agents that name it use it).
    """

    name: str
    kind: Kind
    admissibility: Admissibility
    payload: Payload
    co_senders: bool
    needs_public_pairs: bool
    overlay_aggregation: bool
    paper: str
    summary: str
    on_by_default: bool = True

    @property
    def is_merge(self) -> bool:
        """Whether the student pulls and merges the sender's adapter."""
        return self.kind == "merge"

    @property
    def same_space(self) -> bool:
        """Whether it is admissible only between agents of one parameter space."""
        return self.admissibility == "same_space"


#: Text AKD (KNEXA-FL Eq. 2), what every peerlm agent has always done.
AKD: Final = ProtocolEntry(
    name="akd",
    kind="distillation",
    admissibility="any_pair",
    payload="text_package",
    co_senders=False,
    needs_public_pairs=False,
    overlay_aggregation=False,
    paper="KNEXA-FL",
    summary="text AKD: the student distils the teacher's completions on X_u",
)
#: AKD on the teacher's top-k logits.
AKD_LOGITS: Final = ProtocolEntry(
    name="akd_logits",
    kind="distillation",
    # The student reads the teacher's top-k token ids: one tokenizer needed.
    admissibility="same_space",
    payload="logits_package",
    co_senders=False,
    needs_public_pairs=False,
    overlay_aggregation=False,
    paper="KNEXA-FL",
    summary="AKD on the teacher's top-k logits (same tokenizer needed)",
)
#: SemanticDFL's personalised mixing (the PDFL step) of the senders' adapters.
PMIX: Final = ProtocolEntry(
    name="pmix",
    kind="merge",
    admissibility="same_space",
    payload="adapter",
    co_senders=True,
    needs_public_pairs=False,
    overlay_aggregation=True,
    paper="SemanticDFL",
    summary="pulls the senders' adapters and mixes them with its own (PDFL step)",
)
#: OnePeFT's SVD aggregation refined by HKA on public pairs.
SVD_HKA: Final = ProtocolEntry(
    name="svd_hka",
    kind="merge",
    admissibility="same_space",
    payload="adapter",
    co_senders=True,
    needs_public_pairs=True,
    overlay_aggregation=True,
    paper="OnePeFT",
    summary="pulls the senders' adapters, SVD-aggregates them with its own and aligns "
    "by HKA on public pairs",
)
#: FedSA-LoRA's selective aggregation (Guo et al., ICLR 2025): share and average only the
#: LoRA A factors, keep B local. A baseline: off by default.
FEDSA: Final = ProtocolEntry(
    name="fedsa",
    kind="merge",
    admissibility="same_space",
    payload="adapter",
    co_senders=True,
    needs_public_pairs=False,
    overlay_aggregation=True,
    paper="FedSA-LoRA",
    summary="pulls the senders' adapters and averages only the LoRA A factors with its own, "
    "keeping its B",
    on_by_default=False,
)

#: Every protocol the CPM may recommend (K_rec), in menu order; a deployment configures a
#: subset (``CpmSettings.protocols``).
CATALOGUE: Final[tuple[ProtocolEntry, ...]] = (AKD, AKD_LOGITS, PMIX, SVD_HKA, FEDSA)

_BY_NAME: Final = MappingProxyType({entry.name: entry for entry in CATALOGUE})

#: What every peerlm agent has always done, and what an agent that advertises no protocol
#: is taken to support: text AKD.
DEFAULT_PROTOCOL: Final = AKD.name
#: What an agent's overlay pulls become unless configured otherwise (SemanticDFL's PDFL).
DEFAULT_OVERLAY_AGGREGATION: Final = PMIX.name


def lookup(name: str) -> ProtocolEntry:
    """The entry named ``name``; :class:`UnknownProtocolError` naming the catalogue if none."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise UnknownProtocolError(
            f"unknown protocol {str(name)[:40]!r}; the catalogue holds {', '.join(_BY_NAME)}"
        ) from None


def names(
    *,
    kind: Kind | None = None,
    admissibility: Admissibility | None = None,
    payload: Payload | None = None,
    co_senders: bool | None = None,
    needs_public_pairs: bool | None = None,
    overlay_aggregation: bool | None = None,
    on_by_default: bool | None = None,
) -> tuple[str, ...]:
    """The names of the entries whose attributes equal every given filter, in menu order
    (no filter: the whole menu)."""
    wanted = {
        "kind": kind,
        "admissibility": admissibility,
        "payload": payload,
        "co_senders": co_senders,
        "needs_public_pairs": needs_public_pairs,
        "overlay_aggregation": overlay_aggregation,
        "on_by_default": on_by_default,
    }
    return tuple(
        entry.name
        for entry in CATALOGUE
        if all(v is None or getattr(entry, k) == v for k, v in wanted.items())
    )


def check_names(values: Iterable[str], what: str = "protocols") -> tuple[str, ...]:
    """``values`` as a tuple if each is a catalogue name and none repeats; else ValueError
    (:class:`UnknownProtocolError` for an unknown name) saying which and what ``what`` may
    hold."""
    chosen = tuple(values)
    for name in chosen:
        lookup(name)
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"{what} must not repeat a name")
    return chosen
