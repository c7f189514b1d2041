"""The acceptance gate: knowledge that makes the student worse is rolled back.

Whatever a student integrates (an AKD update from a teacher's package, a PDFL aggregate of
pulled adapters) comes from peers it cannot trust. Every format check can pass and the
result still wreck the model: finite but huge adapter values, or text crafted to teach
garbage. So the student measures its held-out (validation) loss before and after, and when
the update makes it worse by more than ``margin`` nats (mean token cross-entropy) it
restores the adapter it had before. The caller counts the rollback
(``peerlm_agent_integrations_rolled_back_total{kind}``) and, for AKD, reports the measured
loss change to the CPM as Eq. 3's reward, which is then negative: the bandit learns that
the pairing hurt.

Choices:

* **Margin 0.1 nats by default.** A fresh exchange may cost a little validation loss that
  later rounds recover (the paper's alpha_KD ramp expects that early on); 0.1 nats is about
  a 10% rise in perplexity, which we take as the most one honest exchange should cost (an
  assumption, not a measurement across models), and far below what poisoning does (the
  audit's adapter took generation to empty strings). ``None`` disables the gate.
* **A bounded penalty.** A loss that is not finite, or rose by more than
  :data:`LOSS_PENALTY_NATS`, is reported as that rise: the CPM refuses non-finite values and
  rewards beyond its magnitude limit, and a wrecked model is equally bad at any size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from peerlm.agent.modelhost import ModelHost
    from peerlm.agent.training import Example

__all__ = ["DEFAULT_MARGIN", "LOSS_PENALTY_NATS", "AcceptanceGate", "Verdict", "judge"]

#: Default allowed rise of the held-out loss, in nats (see the module docstring).
DEFAULT_MARGIN = 0.1
#: The largest loss rise reported (a non-finite loss counts as this).
LOSS_PENALTY_NATS = 10.0


@dataclass(frozen=True)
class Verdict:
    """Whether an update stands: ``rolled_back``, and the post-update loss to report
    (the measured one, bounded by :data:`LOSS_PENALTY_NATS` above ``pre``)."""

    rolled_back: bool
    loss_post: float


def judge(pre: float, post: float, margin: float | None) -> Verdict:
    """The verdict on an update that took the held-out loss from ``pre`` to ``post``."""
    reported = post
    if not math.isfinite(post) or post - pre > LOSS_PENALTY_NATS:
        reported = pre + LOSS_PENALTY_NATS
    worse = not math.isfinite(post) or (margin is not None and post - pre > margin)
    return Verdict(rolled_back=worse, loss_post=reported)


@dataclass(frozen=True)
class AcceptanceGate:
    """Held-out examples and the allowed loss rise; :meth:`guard` applies it to an update."""

    examples: Sequence[Example]
    #: None: measure only, never roll back (a CPM merge directive still reports the loss).
    margin: float | None = DEFAULT_MARGIN
    max_length: int = 256

    def loss(self, host: ModelHost) -> float:
        """The held-out loss of ``host`` now (runs on the model thread)."""
        return host.eval_loss(self.examples, max_length=self.max_length)[0]

    def settle(self, host: ModelHost, before: Mapping[str, torch.Tensor], pre: float) -> Verdict:
        """After an update: measure, and restore ``before`` (the adapter state taken before
        the update) if the update made the held-out loss worse by more than the margin."""
        verdict = judge(pre, self.loss(host), self.margin)
        if verdict.rolled_back:
            host.load_adapter_state(before)
        return verdict
