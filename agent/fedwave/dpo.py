"""FedWave's preference alignment loss: DPO (Eq. 10, Rafailov et al. 2023), β = 0.1.

    L_DPO = −log σ( β log π_θ(y_w|x)/π_θ(y_l|x) − β log π_ref(y_w|x)/π_ref(y_l|x) )

Inputs are sequence log-probabilities (:func:`~peerlm.agent.fedwave.sequence_losses.
response_logprobs`) of the chosen (y_w) and rejected (y_l) responses under the policy π_θ
(initialised from π_SFT) and the frozen reference π_ref (a copy of π_SFT). β = 0.1 is the
paper's value (Figure 3d).

**Written by hand, and why.** trl (1.16, the maintained DPO implementation) installs from
PyPI next to the CPU torch without pulling a CUDA package (it adds ``datasets``,
``pyarrow``, ``dill``, ``multiprocess``, ``xxhash``), but on this machine its trainer cannot
run: ``datasets`` 5.2 (the version the resolver picks) fails to build even a one-row
``Dataset.from_dict`` (``PicklingError: Can't pickle <class 'MonthDayNano'>`` in its
fingerprinting, also with pyarrow 25 and dill 0.3.8), and ``DPOTrainer`` drives one
HuggingFace model through ``transformers.Trainer``, whereas FedWave's π_SFT is a composite
(the router choosing among the experts' adapters and VCLayers). The loss itself is one line
of ``logsigmoid``, the same as trl's default ``loss_type="sigmoid"``
(``-F.logsigmoid(self.beta * delta_score)`` in ``trl/trainer/dpo_trainer.py``, with
``delta_score`` the policy-minus-reference log-ratio margin); the tests check it against a
hand computation and train a tiny model with it. docs/fedwave.md records the check.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from peerlm.agent.fedwave.params import DEFAULT_BETA, DPOSettings

__all__ = ["DEFAULT_BETA", "DPOSettings", "DPOTerms", "dpo_loss"]


@dataclass(frozen=True)
class DPOTerms:
    """Eq. 10 per pair and averaged, with the implicit rewards DPO reports."""

    losses: torch.Tensor  # (B,)
    loss: torch.Tensor  # mean over the pairs
    chosen_rewards: torch.Tensor  # β (log π_θ(y_w|x) − log π_ref(y_w|x)), (B,)
    rejected_rewards: torch.Tensor  # β (log π_θ(y_l|x) − log π_ref(y_l|x)), (B,)

    @property
    def reward_accuracy(self) -> float:
        """The share of pairs whose chosen reward exceeds the rejected one."""
        return float((self.chosen_rewards > self.rejected_rewards).float().mean())


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    beta: float = DEFAULT_BETA,
) -> DPOTerms:
    """Eq. 10 for a batch of pairs; the reference log-probs carry no gradient."""
    if beta <= 0:
        raise ValueError(f"beta must be positive, got {beta}")
    shapes = {
        t.shape for t in (policy_chosen, policy_rejected, reference_chosen, reference_rejected)
    }
    if len(shapes) != 1 or policy_chosen.dim() != 1:
        raise ValueError(
            f"four (B,) log-probability vectors of one length, got {sorted(map(tuple, shapes))}"
        )
    ref_c, ref_r = reference_chosen.detach(), reference_rejected.detach()
    margin = beta * ((policy_chosen - policy_rejected) - (ref_c - ref_r))
    losses = -F.logsigmoid(margin)
    return DPOTerms(
        losses=losses,
        loss=losses.mean(),
        chosen_rewards=beta * (policy_chosen - ref_c).detach(),
        rejected_rewards=beta * (policy_rejected - ref_r).detach(),
    )
