"""Vetting an incoming logits package through every token it teaches, not only its text.

A logits item holds, at each completion position, the teacher's top-k token ids and
log-probabilities; the student is distilled on the whole distribution, so every token
given real mass is something it learns to write. Vetting the text of column 0 alone (the
teacher's decoded completion) let a hostile teacher hide what it teaches one column to
the right: column 0 ``return a + b``, column 1 at probability 0.45 ``import socket``; or
put a harmless low-mass token in column 0 and its payload, most likely, in another.

:func:`mass_texts` lists the texts an item's rows spell for every rank that carries
mass: rows sorted by probability (the order a teacher sends is not trusted), rank ``r``'s
text takes the rank-``r`` token at each position where its probability is at least
``min_mass`` and the most likely token elsewhere, plus column 0's text (the tokens the
student is teacher-forced on). :func:`vet_logits_package` vets every such text with the
guardrail's incoming check and drops an item any of whose texts is refused; the student
then learns only from items all of whose taught tokens were vetted in context.

Choices made here:

* **Mass at the teacher's temperature**, ``exp(logprob)`` as sent: what the student's
  target distribution puts on the token before its own temperature.
* **``min_mass`` = 0.01** (:data:`DEFAULT_MIN_MASS`): a token below one percent is not
  something the student learns to write, and vetting texts stitched from many such tokens
  would refuse honest items for noise.
* **Ranks, not columns.** A payload spread over positions in other columns still lands in
  the rank-1 text when it is each position's runner-up, the most likely alternative path;
  a payload that needs a lower rank at some position is that much less likely to be
  written by the student.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt
from peerlm.agent.exchange.package import KnowledgePackage, LogitsItem, LogitsPackage

if TYPE_CHECKING:
    from peerlm.agent.vetting.guardrail import Guardrail

    from peerlm.node import NodeContext

__all__ = [
    "DEFAULT_MIN_MASS",
    "LogitsVetting",
    "mass_texts",
    "vet_logits_package",
    "vet_student_package",
]

#: Probability at or above which a top-k token is vetted as something the student learns.
DEFAULT_MIN_MASS: Final = 0.01

#: Decodes token ids to text (the student's tokenizer, which is the teacher's).
Decode = Callable[[list[int]], str]
#: Vets texts: per text ``None`` (learn from it) or the reason it is refused
#: (:meth:`~peerlm.agent.vetting.guardrail.Guardrail.vet_incoming`).
Vet = Callable[[Sequence[str]], Sequence[str | None]]


def mass_texts(
    token_ids: npt.NDArray[Any],
    logprobs: npt.NDArray[Any],
    decode: Decode,
    *,
    min_mass: float = DEFAULT_MIN_MASS,
) -> list[str]:
    """Every text an item's ``[L, k]`` rows teach (see the module docstring), deduplicated,
    column 0's first. An item without positions has no text."""
    ids = np.asarray(token_ids, dtype=np.int64)
    lps = np.asarray(logprobs, dtype=np.float64)
    if ids.ndim != 2 or ids.shape != lps.shape or ids.shape[0] == 0:
        return []
    # log(min_mass) compared with log-probabilities: no exp of large negative numbers.
    floor = math.log(min_mass) if min_mass > 0 else -math.inf
    order = np.argsort(-lps, axis=1, kind="stable")
    ranked_ids = np.take_along_axis(ids, order, axis=1)
    ranked_lps = np.take_along_axis(lps, order, axis=1)
    texts = [decode([int(i) for i in ids[:, 0]])]
    for rank in range(ids.shape[1]):
        carries = ranked_lps[:, rank] >= floor
        if rank > 0 and not bool(carries.any()):
            continue
        path = np.where(carries, ranked_ids[:, rank], ranked_ids[:, 0])
        text = decode([int(i) for i in path])
        if text not in texts:
            texts.append(text)
    return texts


@dataclass(frozen=True)
class LogitsVetting:
    """What :func:`vet_logits_package` did: the package of the items kept, and per refused
    item its prompt id and the first refusal reason; ``hidden`` counts the refused items
    whose column-0 text alone would have passed (what vetting column 0 missed)."""

    package: LogitsPackage
    refused: tuple[tuple[str, str], ...]
    hidden: int


def vet_logits_package(
    package: LogitsPackage,
    decode: Decode,
    vet: Vet,
    *,
    min_mass: float = DEFAULT_MIN_MASS,
) -> LogitsVetting:
    """Vet every text each item teaches (:func:`mass_texts`) in one call of ``vet`` and
    keep the items none of whose texts is refused. ``package`` is not changed."""
    per_item = [
        mass_texts(it.token_ids, it.logprobs, decode, min_mass=min_mass) for it in package.items
    ]
    flat = [text for texts in per_item for text in texts]
    verdicts = list(vet(flat)) if flat else []
    kept: list[LogitsItem] = []
    refused: list[tuple[str, str]] = []
    hidden = 0
    at = 0
    for item, texts in zip(package.items, per_item, strict=True):
        mine = verdicts[at : at + len(texts)]
        at += len(texts)
        reasons = [v for v in mine if v is not None]
        if reasons:
            refused.append((item.prompt_id, reasons[0]))
            hidden += int(mine[0] is None)
        else:
            kept.append(item)
    return LogitsVetting(replace(package, items=tuple(kept)), tuple(refused), hidden)


def vet_student_package(
    package: KnowledgePackage,
    tokenizer: Any,
    guardrail: Guardrail | None,
    ctx: NodeContext,
    *,
    min_mass: float = DEFAULT_MIN_MASS,
) -> KnowledgePackage:
    """The agent's student step before integration: a logits package with the items whose
    taught texts the guardrail refuses removed (a text package, or no guardrail: as is).

    Runs where the tokenizer may be used (the model thread). Refused items are counted in
    ``peerlm_agent_logits_items_refused_total{column}``: ``first`` when column 0's text
    was refused too, ``other`` when only a text with mass beyond it was (what vetting
    column 0 alone let through); each refused text is also counted by the guardrail.
    """
    if guardrail is None or not isinstance(package, LogitsPackage) or not package.items:
        return package

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=True))

    out = vet_logits_package(package, decode, guardrail.vet_incoming, min_mass=min_mass)
    if out.refused:
        counter = ctx.counter(
            "peerlm_agent_logits_items_refused_total",
            "Items of incoming logits packages not learnt from because a text they teach "
            "with mass was refused by the guardrail, by column (first: column 0's text too; "
            "other: only a text beyond column 0)",
            ("column",),
        )
        if out.hidden:
            counter.labels("other").inc(out.hidden)
        if len(out.refused) > out.hidden:
            counter.labels("first").inc(len(out.refused) - out.hidden)
        ctx.log.warning(
            "logits_items_refused",
            teacher=package.teacher,
            directive=package.directive_id,
            items=len(package.items),
            refused=len(out.refused),
            hidden=out.hidden,
        )
    return out.package
