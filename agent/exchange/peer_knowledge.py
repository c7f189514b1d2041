"""Knowledge from peers beside the participant's own: a second adapter and a router.

Integrating a peer's knowledge into the one adapter a participant trains on its own data
costs it what it knew: measured on world seeds 0 and 17, every collaborative strategy ended
9-10 Pass@1 points below training alone on the participant's own skills (docs/experiment.md,
"No regret"). So peerlm keeps the two apart, as a mixture of LoRAs does:

* the **own adapter** is trained on the participant's own data only, every round, with the
  same steps whatever the strategy; nothing a peer sends ever touches it;
* the **peer slot** (:class:`PeerSlot`) is a second adapter of the same shape that every
  integration writes to instead: AKD by text or logits, a merge directive's PDFL or SVD +
  HKA, the overlay's top-K pull. It starts as a copy of the own adapter at the first
  integration (so it knows the task's format and the public skills), and Eq. 2's own-data
  share keeps replaying own data while it learns the teacher's;
* an **input router** (:class:`InputRouter`) decides per input which adapter answers: the
  own adapter for inputs like the participant's own data, the peer slot for the others.

The router is a logistic regression on character n-gram TF-IDF of the prompt
(scikit-learn), fitted on the participant's own training prompts and the public transfer
set X_u's prompts, labelled by category where the categories are known (as they are for
competence and teaching), else "own" against "other", with balanced class weights; an
input's score is the probability of the categories the participant holds no data of. Its
threshold is calibrated on the participant's own **validation** prompts: an input goes to
the peer slot only if its score exceeds every own validation prompt's (and even odds), so
on what the participant can measure of its own skills the routed model *is* the own
adapter. That is the acceptance gate for routing: it never uses test data, and it holds
whatever a peer sent. A prompt-text router needs no forward pass and works across
architectures and tokenizers; routing on the base model's hidden states
(LoRARetriever-style) is the alternative we did not build.

None of this is in the papers: KNEXA-FL's Eq. 2 distils into the student's one adapter, and
OnePeFT / SemanticDFL merge into it. The separation, the router and its calibration are our
choices (docs/experiment.md).
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, TypeVar

import numpy as np
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression

if TYPE_CHECKING:
    import torch
    from peerlm.agent.exchange.package import KnowledgePackage
    from peerlm.agent.modelhost import ModelHost

__all__ = [
    "REHEARSAL_LESSONS",
    "REHEARSAL_PAIRS_PER_LESSON",
    "REHEARSAL_PAIR_CHARS",
    "SHARED_BANK",
    "InputRouter",
    "PeerSlot",
    "SlotSaved",
    "SlotWrite",
    "learnt_items",
    "rehearsable",
    "route_map",
    "routed_share",
]

_T = TypeVar("_T")
_R = TypeVar("_R")


@dataclass(frozen=True)
class InputRouter:
    """Which adapter answers an input: ``True`` for the peer slot, ``False`` for the own one.

    Build it with :meth:`fit`; :meth:`to_peer` routes prompts.
    """

    vectorizer: TfidfVectorizer
    classifier: LogisticRegression
    #: Per class of the classifier: whether the participant holds no data of it.
    unheld: np.ndarray
    #: An input goes to the peer slot when its "other" probability exceeds this: the
    #: largest any own validation prompt had, and at least 0.5.
    threshold: float

    @classmethod
    def fit(
        cls,
        own_prompts: Sequence[str],
        other_prompts: Sequence[str],
        validation_prompts: Sequence[str],
        *,
        own_categories: Sequence[str] | None = None,
        other_categories: Sequence[str] | None = None,
    ) -> InputRouter:
        """A router for a participant with ``own_prompts`` (its training data's prompts),
        against ``other_prompts`` (X_u's), calibrated on ``validation_prompts`` (its own
        held-out prompts). Raises :class:`ValueError` when a set is empty.

        With the categories of both (``own_categories``, ``other_categories``: the labels
        the agent already reads its competence by), the classifier learns the categories
        and an input's score is the probability of the categories the participant holds
        no data of: X_u prompts of a category it holds count as its own. Measured on world
        seed 0 with six clients, that sends 0-1.3 % of the public test problems to the peer
        slot, against up to 19 % for the own-against-X_u classifier used without labels.
        """
        if not own_prompts or not other_prompts or not validation_prompts:
            raise ValueError("a router needs own, other and validation prompts")
        texts = [*own_prompts, *other_prompts]
        if own_categories is None or other_categories is None:
            labels = ["own"] * len(own_prompts) + ["other"] * len(other_prompts)
            held = {"own"}
        else:
            if len(own_categories) != len(own_prompts) or len(other_categories) != len(
                other_prompts
            ):
                raise ValueError("one category per prompt")
            labels = [*own_categories, *other_categories]
            held = set(own_categories)
        if len(set(labels)) < 2 or set(labels) <= held:
            raise ValueError("a router needs prompts of a category the participant does not hold")
        vectorizer = TfidfVectorizer(analyzer="char_wb", ngram_range=(2, 4), sublinear_tf=True)
        features = vectorizer.fit_transform(texts)
        classifier = LogisticRegression(class_weight="balanced", max_iter=2_000)
        classifier.fit(features, labels)
        unheld = np.array([c not in held for c in classifier.classes_])
        router = cls(vectorizer, classifier, unheld, 0.5)
        scores = router.scores(validation_prompts)
        # Never below even odds: an input the classifier itself takes for the participant's
        # own stays with the own adapter, however uniform the validation prompts are.
        return cls(vectorizer, classifier, unheld, max(0.5, float(np.max(scores))))

    def scores(self, prompts: Sequence[str]) -> np.ndarray:
        """The probability that each prompt is unlike the participant's own data."""
        if not prompts:
            return np.zeros(0)
        proba = self.classifier.predict_proba(self.vectorizer.transform(list(prompts)))
        return np.asarray(proba[:, self.unheld].sum(axis=1))

    def to_peer(self, prompts: Sequence[str]) -> list[bool]:
        """Per prompt: whether the peer slot answers it."""
        return [bool(s > self.threshold) for s in self.scores(prompts)]

    def unheld_category(self, prompts: Sequence[str]) -> list[str]:
        """Per prompt, the most probable of the categories the participant holds no data
        of (the peer slot's bank for it: :attr:`PeerSlot.classify`)."""
        if not prompts:
            return []
        proba = self.classifier.predict_proba(self.vectorizer.transform(list(prompts)))
        classes = self.classifier.classes_[self.unheld]
        return [str(classes[k]) for k in np.argmax(proba[:, self.unheld], axis=1)]


@dataclass
class SlotWrite:
    """What one :meth:`PeerSlot.active` block did: ``kept`` False when it learnt nothing;
    ``rolled_back`` True when its gate undid what it learnt."""

    kept: bool = True
    rolled_back: bool = False


#: Lessons a peer slot remembers for its rehearsal (the newest), (prompt, completion)
#: pairs it keeps of one lesson (one large lesson cannot crowd out the others; a peer that
#: teaches every round still fills the memory with its lessons), and the characters of one
#: kept pair (a longer one is not kept: the memory goes into every checkpoint).
REHEARSAL_LESSONS: Final = 16
REHEARSAL_PAIRS_PER_LESSON: Final = 64
REHEARSAL_PAIR_CHARS: Final = 4096

Lesson = tuple[tuple[str, str], ...]


def rehearsable(pairs: Sequence[object]) -> Lesson:
    """What a slot keeps of a lesson: its first :data:`REHEARSAL_PAIRS_PER_LESSON`
    (prompt, completion) string pairs of at most :data:`REHEARSAL_PAIR_CHARS` characters;
    anything else (a longer pair, or what a damaged checkpoint holds that is not a pair of
    strings) is dropped."""
    kept: list[tuple[str, str]] = []
    for pair in pairs:
        if len(kept) == REHEARSAL_PAIRS_PER_LESSON:
            break
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            continue
        prompt, completion = pair
        if (
            isinstance(prompt, str)
            and isinstance(completion, str)
            and len(prompt) + len(completion) <= REHEARSAL_PAIR_CHARS
        ):
            kept.append((prompt, completion))
    return tuple(kept)


@dataclass(frozen=True)
class SlotSaved:
    """What a :class:`PeerSlot` holds at one moment (:meth:`PeerSlot.saved`)."""

    banks: tuple[tuple[str, dict[str, torch.Tensor], int], ...]
    integrations: int
    history: tuple[str, ...]
    lessons: tuple[Lesson, ...] = ()
    last: str = ""

    @property
    def state(self) -> dict[str, torch.Tensor] | None:
        """The bank written last (:attr:`PeerSlot.state`)."""
        return next((state for key, state, _ in self.banks if key == self.last), None)


#: The bank of integrations that teach no text (a merge, the overlay's pull) and of any
#: integration when the slot has one bank.
SHARED_BANK: Final = ""


@dataclass
class PeerSlot:
    """The adapter that holds what a participant learnt from peers (module docstring).

    ``state`` is None until the first integration; :meth:`active` puts it in the host for
    the length of a ``with`` block, and everything the block does to the host's adapter
    stays in the slot, while the own adapter is back in place afterwards.

    **Banks** (``classify`` set: the agent's ``slot_banks: category``, ours): the slot
    then holds one adapter per category the participant lacks, a mixture of LoRAs behind
    the router. A text lesson is written to the bank most of its learnt prompts vote for,
    each its most probable lacked category (``classify``: the router's
    :meth:`InputRouter.unheld_category`; every learnt prompt votes, also one the router
    keeps on the own adapter), and
    an input the router sends to the slot is answered by the bank of its own category
    (:meth:`bank_of`). Why: a student taught two skills by two teachers in alternating
    lessons of a few steps each writes both into one adapter, and each lesson overwrites
    part of the one before (docs/experiment.md, "A bank per lacked category"); a bank per
    category keeps them apart at no extra step. The banks are bounded by the router's
    categories, which come from the participant's own data and X_u, never from a peer.
    """

    #: Per bank (:data:`SHARED_BANK` with one bank), its adapter state.
    banks: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    #: Integrations written to the slot (accepted or rolled back by their own gate).
    integrations: int = 0
    history: list[str] = field(default_factory=list)
    #: Pairs of earlier lessons distilled beside each new text lesson (``slot_rehearsal``;
    #: 0: none, the papers' Eq. 2). The slot learns one peer's lesson after another in the
    #: same few steps, and a lesson overwrites what the one before taught; rehearsing
    #: earlier lessons (experience replay, ours) keeps them without extra steps.
    rehearsal: int = 0
    #: The draws' seed (with the integration count: the same draws on a replay).
    seed: int = 0
    #: The accepted text lessons' pairs, oldest first (:meth:`remember`).
    lessons: list[Lesson] = field(default_factory=list)
    #: Per prompt, the category whose bank learns or answers it; None: one bank.
    classify: Callable[[Sequence[str]], Sequence[str]] | None = None
    #: Integrations written to each bank (the fallback bank is the most written).
    writes: dict[str, int] = field(default_factory=dict)
    #: The bank written last: what :attr:`state` is.
    last: str = SHARED_BANK

    @property
    def state(self) -> dict[str, torch.Tensor] | None:
        """The adapter the slot's last integration wrote (its only one with one bank)."""
        return self.banks.get(self.last)

    @state.setter
    def state(self, value: dict[str, torch.Tensor] | None) -> None:
        """The slot as one bank holding ``value`` (or empty)."""
        self.banks = {} if value is None else {SHARED_BANK: value}
        self.writes = {} if value is None else {SHARED_BANK: self.integrations}
        self.last = SHARED_BANK

    def bank_for(self, prompts: Sequence[str]) -> str:
        """The bank a text lesson of ``prompts`` (what it learns) is written to: the
        category most of them fall in (ties to the first in sort order), or the shared one
        with one bank or no prompt."""
        if self.classify is None or not prompts:
            return SHARED_BANK
        counts = Counter(self.classify(prompts))
        return min(counts, key=lambda c: (-counts[c], c))

    def bank_of(self, prompts: Sequence[str]) -> list[str]:
        """Per prompt sent to the slot, the bank that answers it: its category's, else the
        shared bank, else the most written one (ties to the first in sort order)."""
        if not self.banks:
            raise ValueError("an empty peer slot answers nothing")
        fallback = self._fallback()
        if self.classify is None or len(self.banks) == 1:
            return [fallback] * len(prompts)
        return [c if c in self.banks else fallback for c in self.classify(prompts)]

    def _fallback(self) -> str:
        return (
            SHARED_BANK
            if SHARED_BANK in self.banks
            else min(self.banks, key=lambda b: (-self.writes.get(b, 0), b))
        )

    def as_one_bank(self) -> None:
        """Without ``classify`` (one bank), a slot that holds banks (restored from a
        checkpoint taken under ``slot_banks: category``) becomes the one bank that
        answered every input (:meth:`bank_of`'s fallback): the next lessons go on from
        what it learnt, not from the own adapter, and the other banks, which nothing would
        read again, are dropped; so also when the agent's router could not be fitted
        (no ``classify`` under ``category`` either). The daemon sets ``classify`` before
        it restores a checkpoint. Nothing changes with ``classify`` set or one bank."""
        if self.classify is not None or not self.banks or set(self.banks) == {SHARED_BANK}:
            return
        self.state = self.banks[self._fallback()]

    @contextmanager
    def active(
        self, host: ModelHost, what: str = "integration", bank: str = SHARED_BANK
    ) -> Iterator[SlotWrite]:
        """Bank ``bank`` of the slot in ``host`` inside the block; the own adapter restored
        after it, even when the block raises (the slot then keeps its state from before the
        block). A new bank starts as the shared bank where there is one (what the slot
        learnt before it had banks, or merges and pulls), else as the own adapter. The block
        may set the yielded :class:`SlotWrite`'s ``kept`` to False when it learnt nothing
        (an AKD package the slot learns none of): the slot then stays as it was, uncounted;
        and ``rolled_back`` when its gate undid it: counted, but a bank it would have
        created is not (it would hold only what it started as, and take its category's
        inputs from the bank that answered them)."""
        own = host.adapter_state()
        before = self.banks.get(bank)
        host.load_adapter_state(before if before is not None else self.banks.get(SHARED_BANK, own))
        write = SlotWrite()
        try:
            yield write
            if write.kept and write.rolled_back and before is None:
                self.integrations += 1
                self.history.append(what)
            elif write.kept:
                self.banks[bank] = host.adapter_state()
                self.writes[bank] = self.writes.get(bank, 0) + 1
                self.last = bank
                self.integrations += 1
                self.history.append(what)
        finally:
            host.load_adapter_state(own)

    def saved(self) -> SlotSaved:
        """The slot as it is now, for :meth:`restore`: a trial integration (the Oracle's,
        which tries every teacher and keeps the best) is undone by restoring what was saved
        before it, and kept by restoring what was saved after it. The tensors are shared,
        not copied: an integration replaces a bank's state, it never writes into it."""
        return SlotSaved(
            tuple((b, state, self.writes.get(b, 0)) for b, state in self.banks.items()),
            self.integrations,
            tuple(self.history),
            tuple(self.lessons),
            self.last,
        )

    def restore(self, saved: SlotSaved) -> None:
        """The slot back to ``saved`` (banks, integration count, history and lessons)."""
        self.banks = {b: state for b, state, _ in saved.banks}
        self.writes = {b: n for b, _, n in saved.banks}
        self.last = saved.last
        self.integrations = saved.integrations
        self.history = list(saved.history)
        self.lessons = list(saved.lessons)

    def rehearse(self) -> list[tuple[str, str]]:
        """Up to ``rehearsal`` pairs drawn without replacement from the remembered lessons,
        to distil beside the next lesson (empty with ``rehearsal`` 0 or nothing learnt)."""
        pool = [pair for lesson in self.lessons for pair in lesson]
        if not self.rehearsal or not pool:
            return []
        draw = random.Random(f"{self.seed}:{self.integrations}")
        return draw.sample(pool, min(self.rehearsal, len(pool)))

    def remember(self, pairs: Sequence[tuple[str, str]]) -> None:
        """Keep an accepted lesson's pairs for rehearsal (:func:`rehearsable`; the newest
        :data:`REHEARSAL_LESSONS` lessons). Nothing is kept while ``rehearsal`` is 0."""
        kept = rehearsable(pairs)
        if not self.rehearsal or not kept:
            return
        self.lessons.append(kept)
        del self.lessons[:-REHEARSAL_LESSONS]

    @property
    def ready(self) -> bool:
        """Whether the slot holds anything a router could send inputs to."""
        return bool(self.banks)


def route_map(
    host: ModelHost,
    slot: PeerSlot,
    router: InputRouter | None,
    items: Sequence[_T],
    prompt_of: Callable[[_T], str],
    run: Callable[[Sequence[_T]], Sequence[_R]],
    *,
    own_runs_all: bool = False,
    own_results: Sequence[_R] | None = None,
    choose: Callable[[Sequence[_T], Sequence[_R], Sequence[_R]], Sequence[_R]] | None = None,
) -> list[_R]:
    """``run`` over ``items`` with each item answered by the adapter the router picks for it
    (the own one when the slot is empty or there is no router; of the slot's banks, the
    one :meth:`PeerSlot.bank_of` picks, each bank one call); results in ``items``' order.

    ``run`` must return one result per item it is given, in order. With ``own_runs_all``
    the own adapter answers every item in one call (its answers to the items it keeps are
    then exactly those of the same call without a peer slot, sampled batches and random
    draws included: common random numbers for a comparison with training alone), and the
    peer slot answers its items on top. ``own_results`` (implies ``own_runs_all``) is that
    call's result, already known (the same own adapter answered the same items before):
    the own adapter runs nothing, and only the peer slot's items are computed.

    ``choose`` (implies ``own_runs_all``) gets the items the router sends to the slot, the
    own adapter's results for them and the slot's, and returns the results they keep
    (:mod:`.answer_check`: the own adapter's answer where the slot's is demonstrably worse).
    """
    if own_results is not None and len(own_results) != len(items):
        raise ValueError(f"own_results has {len(own_results)} results for {len(items)} items")
    peer = router.to_peer([prompt_of(x) for x in items]) if router and slot.ready else []
    if not any(peer):
        return list(run(items) if own_results is None else own_results)
    own_idx = [k for k, p in enumerate(peer) if not p]
    peer_idx = [k for k, p in enumerate(peer) if p]
    out: dict[int, _R] = {}
    own_all: Sequence[_R] | None = own_results
    if own_all is None and (own_runs_all or choose is not None):
        own_all = list(run(items))
    if own_all is not None:
        out.update((k, own_all[k]) for k in own_idx)
    elif own_idx:
        out.update(zip(own_idx, run([items[k] for k in own_idx]), strict=True))
    peer_items = [items[k] for k in peer_idx]
    banks = slot.bank_of([prompt_of(x) for x in peer_items])
    by_bank: dict[str, list[int]] = {}
    for j, bank in enumerate(banks):
        by_bank.setdefault(bank, []).append(j)
    answered: dict[int, _R] = {}
    own = host.adapter_state()
    try:
        for bank, idx in sorted(by_bank.items()):
            host.load_adapter_state(slot.banks[bank])
            answered.update(zip(idx, run([peer_items[j] for j in idx]), strict=True))
    finally:
        host.load_adapter_state(own)
    peer_results = [answered[j] for j in range(len(peer_items))]
    if choose is not None:
        assert own_all is not None
        own_of_peer = [own_all[k] for k in peer_idx]
        peer_results = list(choose(peer_items, own_of_peer, peer_results))
        if len(peer_results) != len(peer_idx):
            raise ValueError(f"choose gave {len(peer_results)} results for {len(peer_idx)}")
    out.update(zip(peer_idx, peer_results, strict=True))
    return [out[k] for k in range(len(items))]


def learnt_items(
    package: KnowledgePackage,
    transfer_prompts: Sequence[str],
    learns: Callable[[Sequence[str]], Sequence[bool]],
) -> KnowledgePackage:
    """``package`` with only the items whose prompt ``learns`` accepts (with
    ``slot_scope: routed``, the router's :meth:`InputRouter.to_peer`: the slot distils
    only what it will answer, not the categories the own adapter keeps).

    Why: a teacher answers every category it is competent in, public ones and the
    student's own included, and the router never sends those to the slot; distilling them
    spends the exchange's steps on text the slot is never asked for. An item that answers
    a prompt outside ``transfer_prompts`` is kept, so that the integration refuses the
    package for it exactly as without this filter.
    """
    from peerlm.agent.exchange.package import item_prompts

    prompts = item_prompts(package, transfer_prompts)
    known = [p for p in prompts if p is not None]
    verdicts = list(learns(known))
    if len(verdicts) != len(known):
        raise ValueError(f"learns gave {len(verdicts)} answers for {len(known)} prompts")
    accepted = iter(verdicts)
    kept = tuple(
        item
        for item, prompt in zip(package.items, prompts, strict=True)
        if prompt is None or next(accepted)
    )
    return dataclasses.replace(package, items=kept)  # type: ignore[arg-type]


def routed_share(router: InputRouter | None, prompts: Sequence[str]) -> float:
    """The share of ``prompts`` the router sends to the peer slot (0 without a router)."""
    if router is None or not prompts:
        return 0.0
    return float(np.mean(router.to_peer(prompts)))
