"""Where a student measures an exchange's reward: the probe problems of what the package taught.

KNEXA-FL's Eq. 3 measures L_pre and L_post on the student's validation data; peerlm measures
them on a labelled public probe (``reward_file``, docs/experiment.md "The reward"), so that a
teacher's gain on a skill the student lacks can show. Measured on the whole probe (or on its
lacked categories), one lesson moves the loss of many categories it did not teach: on world 0
the 11 real lessons of two runs earned −0.023 on average (learning ``dict`` or ``boolean``
raised the slot's loss on the probe's other lacked categories) while a package with nothing
in it earned about 0, and LinUCB learnt to pick the empty ones (docs/experiment.md, "A slot
that distils only what it answers").

``answered`` scope (our choice beyond the paper): the reward of a package is measured on the
probe problems *of the categories the package answers*, so a lesson is judged on what it
taught. A package that answers no category of the probe is measured on nothing: its reward
is Eq. 3's −delta * KB alone (:func:`~peerlm.agent.exchange.rounds.integrate_package`).
Categories come from X_u's labels (every agent holds X_u with its categories) and the probe's
own; nothing about the package's text is read here.

``routed`` scope (ours, with a peer slot): of those, only the probe problems the student's
input router sends to the slot (:meth:`AnsweredProbe.routed`). A lesson into the slot only
matters for the inputs the slot will answer; measured on a public or own category's probe
(which the router keeps on the own adapter) a lesson the participant never uses earned a
reward, and the bandit chose such teachers for about a quarter of world 0's exchanges
(three eighths in one seed; docs/experiment.md, "A reward on what the slot answers").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

__all__ = ["AnsweredProbe"]


@dataclass(frozen=True)
class AnsweredProbe:
    """The probe problems of the categories a package answers.

    ``probe``: ``(prompt, reference, category)`` per probe problem; ``categories``: the
    category of each X_u prompt. Called with the prompts a package's items answer, it gives
    the ``(prompt, reference)`` pairs of the probe problems in their categories, in the
    probe's order; a prompt outside X_u adds no category.
    """

    probe: tuple[tuple[str, str, str], ...]
    categories: Mapping[str, str]

    @classmethod
    def of(
        cls, probe: Iterable[tuple[str, str, str]], prompts: Sequence[str], labels: Sequence[str]
    ) -> AnsweredProbe:
        """From the probe's problems and X_u's prompts with their category labels."""
        if len(prompts) != len(labels):
            raise ValueError(f"{len(prompts)} X_u prompts but {len(labels)} category labels")
        return cls(tuple(probe), dict(zip(prompts, labels, strict=True)))

    def __call__(self, answered: Sequence[str]) -> list[tuple[str, str]]:
        taught = {self.categories[p] for p in answered if p in self.categories}
        return [(prompt, ref) for prompt, ref, category in self.probe if category in taught]

    def routed(self, to_slot: Callable[[Sequence[str]], Sequence[bool]] | None) -> AnsweredProbe:
        """The same scope over the probe problems ``to_slot`` sends to the peer slot (an
        input router's :meth:`~peerlm.agent.exchange.peer_knowledge.InputRouter.to_peer`);
        None (no router: nothing reaches the slot) keeps none, so every package is then
        measured on nothing."""
        if to_slot is None or not self.probe:
            return replace(self, probe=())
        kept = to_slot([prompt for prompt, _, _ in self.probe])
        return replace(self, probe=tuple(p for p, k in zip(self.probe, kept, strict=True) if k))
