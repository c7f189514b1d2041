"""Where the agent daemon's integrations write: the peer slot, the router, the checkpoint.

With ``integration: separate`` (the default) the daemon keeps peers' knowledge apart from
its own as the experiment does (:mod:`peerlm.agent.exchange.peer_knowledge`): the own adapter is
trained on the agent's own data only; AKD (text or logits), a merge directive (``pmix``,
``svd_hka``) and the overlay's pull write to a second adapter, the peer slot; an input
router, fitted once at start, sends an input to the slot only if it looks unlike the
agent's own data. ``integration: shared`` is the papers' single adapter.

The daemon runs model work on one worker thread, and an exchange is a sequence of calls to
it with network waits between them (pulls, fetches) during which the same thread builds
packages and encodes the adapter for other peers from the own adapter. So the slot is never
left in the host across calls: :func:`slot_runner` wraps each call so that the slot is put
in, the call runs, and the own adapter is back before the thread takes the next job.

* A call to an integration function (:data:`INTEGRATIONS`: AKD's
  :func:`~peerlm.agent.exchange.rounds.integrate_package`, the merge's and overlay's
  :func:`~peerlm.agent.merging.pull_aggregate.integrate_adapters`) runs inside
  :meth:`PeerSlot.active <peerlm.agent.exchange.peer_knowledge.PeerSlot.active>`: what it does to
  the adapter stays in the slot and counts as one integration. Its acceptance gate, which
  judges the adapter in the host against the agent's validation set, so protects the slot.
* Any other call (a merge's probe loss, the norm bound a pulled adapter is checked
  against) sees the slot (with banks, its shared bank, the one merges and pulls write) and
  leaves it as it was: whatever it might write is dropped, so nothing a peer sends can
  reach the own adapter even through a function not listed here.

What the agent teaches, its profile and the signature it publishes in the overlay (and the
adapter peers pull from it) are the own adapter's; only the report's evaluation per slice
is routed (:func:`~peerlm.agent.exchange.peer_knowledge.route_map`).

The slot is saved with every round's checkpoint as the extra tensor set ``peer_slot``
(:mod:`peerlm.agent.checkpoint`) and checked on restore as a peer's adapter is
(:func:`restore_slot`): a damaged or misfitting file is set aside and that bank (the slot,
with one bank) starts empty, counted in ``peerlm_agent_peer_slot_quarantined_total``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeVar

from peerlm.agent.exchange.peer_knowledge import (
    REHEARSAL_LESSONS,
    SHARED_BANK,
    InputRouter,
    PeerSlot,
    rehearsable,
)

if TYPE_CHECKING:
    import torch
    from peerlm.agent.checkpoint import Checkpoint, CheckpointStore
    from peerlm.agent.modelhost import ModelHost

__all__ = [
    "INTEGRATIONS",
    "SLOT_EXTRA",
    "fit_agent_router",
    "in_slot",
    "learnt_anything",
    "restore_slot",
    "slot_extra",
    "slot_learns",
    "slot_record",
    "slot_runner",
]

T = TypeVar("T")

#: The checkpoint's extra tensor set that holds the slot.
SLOT_EXTRA: Final = "peer_slot"
#: Integration names kept in the checkpoint's state (the newest ones).
_HISTORY_KEPT: Final = 64
#: Banks read back from a checkpoint's record at most.
_BANKS_READ: Final = 256


def _integrations() -> frozenset[Callable[..., Any]]:
    from peerlm.agent.exchange.rounds import integrate_package
    from peerlm.agent.merging.pull_aggregate import integrate_adapters

    return frozenset({integrate_package, integrate_adapters})


#: The functions whose call is an integration (the rest of an exchange only measures).
INTEGRATIONS: Final = _integrations()


def in_slot(
    slot: PeerSlot, host: ModelHost, what: str, fn: Callable[..., T], /, *args: Any, **kw: Any
) -> T:
    """On the model thread: ``fn(*args, **kw)`` with the slot in ``host``, the own adapter
    back afterwards. An integration (:data:`INTEGRATIONS`) keeps its effect in the slot and
    counts as ``what``; any other call sees the shared bank (the one slot with one bank; a
    merge's or pull's, which measure through here, with banks) and leaves the slot as it was
    (module docstring)."""
    if fn in INTEGRATIONS:
        from peerlm.agent.exchange.rounds import integrate_package

        rehearses = fn is integrate_package and slot.rehearsal > 0
        if rehearses:
            kw.setdefault("rehearsal", slot.rehearse())
        bank = _lesson_bank(slot, args, kw) if fn is integrate_package else SHARED_BANK
        with slot.active(host, what, bank) as write:
            out = fn(*args, **kw)
            write.kept = learnt_anything(out)
            write.rolled_back = bool(getattr(out, "rolled_back", False))
        if rehearses and write.kept and not getattr(out, "rolled_back", False):
            slot.remember(getattr(out, "learnt", ()))
        return out
    # What a measurement sees: the shared bank, which the only integrations that measure
    # through this runner (a merge's probe, a pull's norm bounds) write; the one slot with
    # one bank.
    shared = slot.banks.get(SHARED_BANK)
    own = host.adapter_state()
    if shared is not None:
        host.load_adapter_state(shared)
    try:
        return fn(*args, **kw)
    finally:
        host.load_adapter_state(own)


def _lesson_bank(slot: PeerSlot, args: tuple[Any, ...], kw: dict[str, Any]) -> str:
    """The bank an AKD integration ``integrate_package(host, package, ...)`` writes to:
    :meth:`PeerSlot.bank_for` the prompts of X_u its package answers that the slot learns
    (``learns``); the shared bank with one bank."""
    if slot.classify is None or len(args) < 2:
        return SHARED_BANK
    from peerlm.agent.exchange.package import item_prompts

    known = [p for p in item_prompts(args[1], kw.get("transfer_prompts", ())) if p is not None]
    learns = kw.get("learns")
    if learns is not None:
        known = [p for p, kept in zip(known, learns(known), strict=True) if kept]
    return slot.bank_for(known)


def slot_learns(
    router: InputRouter | None, slot_scope: str
) -> Callable[[Sequence[str]], Sequence[bool]] | None:
    """What a peer slot distils of a package (``slot_scope``): for ``"all"`` every item;
    for ``"routed"``, what ``router`` sends to the slot, and nothing at all without a
    router (then no input ever reaches the slot).

    Never None: a slot holds only what peers taught, so a package with nothing left to
    learn (empty, redacted, refused by the guardrail) takes no step in it under either
    scope, instead of the one adapter's fallback of an own-data step (Eq. 2 with
    nothing to distil), which would spend the exchange's compute moving the slot towards
    the own adapter's data, which the router never sends it."""
    if slot_scope != "routed":
        return lambda prompts: [True] * len(prompts)
    if router is None:
        return lambda prompts: [False] * len(prompts)
    return router.to_peer


def learnt_anything(integration: Any) -> bool:
    """Whether an integration call's result trained the adapter: False only for an AKD
    integration that took no optimiser step (a package the peer slot learns nothing of:
    :func:`slot_learns`); a merge's result carries no training statistics and counts as
    learnt."""
    stats = getattr(integration, "stats", None)
    return stats is None or int(stats.steps) > 0


def slot_runner(
    run_model: Callable[..., Awaitable[Any]], slot: PeerSlot, host: ModelHost, what: str
) -> Callable[..., Awaitable[Any]]:
    """A model runner (``run_model(fn, *args, **kw)``, as the daemon's ``_model``) whose
    every call runs by :func:`in_slot` on the model thread, the slot labelled ``what``."""

    async def run(fn: Callable[..., T], /, *args: Any, **kw: Any) -> T:
        result: T = await run_model(in_slot, slot, host, what, fn, *args, **kw)
        return result

    return run


def fit_agent_router(
    own_prompts: Sequence[str],
    own_categories: Sequence[str],
    transfer_prompts: Sequence[str],
    transfer_categories: Sequence[str],
    validation_prompts: Sequence[str],
) -> tuple[InputRouter | None, str]:
    """The agent's router: its training prompts against X_u's, calibrated on its
    validation prompts (its training prompts when it has none); ``(router, how)``.

    By category first (``how`` = ``categories``), as the experiment fits it; when X_u holds
    no category the agent lacks (or the categories do not line up), own against X_u
    (``own_vs_transfer``); when neither can be fitted, no router (``none: <why>``): every
    input is then answered by the own adapter, and the slot only keeps what peers sent.
    """
    validation = list(validation_prompts) or list(own_prompts)
    try:
        router = InputRouter.fit(
            own_prompts,
            transfer_prompts,
            validation,
            own_categories=own_categories,
            other_categories=transfer_categories,
        )
        return router, "categories"
    except ValueError:
        pass
    try:
        return InputRouter.fit(own_prompts, transfer_prompts, validation), "own_vs_transfer"
    except ValueError as err:
        return None, f"none: {err}"


def _bank_extra(index: int) -> str:
    """The checkpoint's extra set name of a slot's ``index``-th bank (the first keeps the
    one-bank name, so a one-bank checkpoint reads as before banks existed)."""
    return SLOT_EXTRA if index == 0 else f"{SLOT_EXTRA}_{index}"


def slot_extra(slot: PeerSlot | None) -> dict[str, Mapping[str, torch.Tensor]] | None:
    """The checkpoint's extra tensor sets for ``slot``, one a bank (None: nothing to save)."""
    if slot is None or not slot.banks:
        return None
    return {_bank_extra(k): state for k, state in enumerate(slot.banks.values())}


def slot_record(slot: PeerSlot) -> dict[str, Any]:
    """What the checkpoint's JSON state keeps of the slot beside its tensors: its count,
    history, the lessons it rehearses and its banks (key, writes), in their sets' order."""
    return {
        "integrations": slot.integrations,
        "history": slot.history[-_HISTORY_KEPT:],
        "lessons": [[list(pair) for pair in lesson] for lesson in slot.lessons],
        "banks": [[bank, slot.writes.get(bank, 0)] for bank in slot.banks],
        "last": slot.last,
    }


def _banks(record: Any) -> list[tuple[str, int]]:
    """The banks a checkpoint's slot record lists, in their sets' order; one shared bank
    for a record from before banks (or one that does not list them as written)."""
    listed = record.get("banks") if isinstance(record, dict) else None
    banks: dict[str, int] = {}
    if isinstance(listed, list):
        # A record lists no more banks than a router has categories; a longer list (a
        # damaged or hand-made state file) is read up to the bound, not all of it.
        for entry in listed[:_BANKS_READ]:
            if (
                isinstance(entry, list)
                and len(entry) == 2
                and isinstance(entry[0], str)
                and isinstance(entry[1], int)
                and entry[1] >= 0
                and entry[0] not in banks
            ):
                banks[entry[0]] = entry[1]
            else:
                return [(SHARED_BANK, 0)]
    return list(banks.items()) or [(SHARED_BANK, 0)]


def _lessons(record: Any) -> list[tuple[tuple[str, str], ...]]:
    """The lessons of a checkpoint's slot record, as :meth:`PeerSlot.remember` keeps them
    (:func:`~peerlm.agent.exchange.peer_knowledge.rehearsable`); what is not a list of
    lessons is dropped."""
    if not isinstance(record, list):
        return []
    lessons = [
        rehearsable(lesson) for lesson in record[-REHEARSAL_LESSONS:] if isinstance(lesson, list)
    ]
    return [lesson for lesson in lessons if lesson]


def restore_slot(
    slot: PeerSlot,
    host: ModelHost,
    checkpoint: Checkpoint,
    store: CheckpointStore,
    on_damaged: Callable[[str], None] | None = None,
) -> bool:
    """Put the slot saved with ``checkpoint`` back into ``slot``; True if it was.

    The tensors must fit ``host`` exactly as a peer's adapter must (names, shapes, floating
    point, finite: :func:`~peerlm.agent.adapter_codec.check_state`); a set that does not is
    set aside in the store, and a damaged file already was; then that bank (the slot, with
    one bank) starts empty and ``on_damaged(reason)`` is called. Never raises for what the
    file holds.
    """
    from peerlm.agent.adapter_codec import AdapterError, check_state

    record = checkpoint.state.get(SLOT_EXTRA)
    restored: dict[str, dict[str, torch.Tensor]] = {}
    writes: dict[str, int] = {}
    for index, (bank, written) in enumerate(_banks(record)):
        name = _bank_extra(index)
        tensors = checkpoint.extras.get(name)
        if name in checkpoint.damaged:
            if on_damaged is not None:
                on_damaged("damaged")
            continue
        if tensors is None:
            continue
        try:
            check_state(tensors, host.adapter_spec())
        except AdapterError as err:
            store.quarantine_extra(checkpoint, name, f"does not fit the model: {err}")
            if on_damaged is not None:
                on_damaged(err.reason)
            continue
        restored[bank], writes[bank] = dict(tensors), written
    if not restored:
        return False
    slot.banks, slot.writes = restored, writes
    last = record.get("last") if isinstance(record, dict) else None
    slot.last = last if isinstance(last, str) and last in restored else next(iter(restored))
    if isinstance(record, dict):
        count = record.get("integrations")
        history = record.get("history")
        slot.integrations = count if isinstance(count, int) and count >= 0 else 0
        slot.history = [str(h) for h in history] if isinstance(history, list) else []
        # Peers' text stays out of the slot (and its next checkpoints) without rehearsal.
        slot.lessons = _lessons(record.get("lessons")) if slot.rehearsal else []
    slot.as_one_bank()
    return True
