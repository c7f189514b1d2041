"""One local training step's loss for a FedWave expert agent (Eq. 2 or Eq. 8).

Agent i holds its stage's expert (:class:`~peerlm.agent.fedwave.vclayer.VCCausalLM`: the
base LM, its LoRA adapter, its VCLayer), the adjacent stages' VCLayers pulled this round,
and, unless the router is ablated, the shared router. :func:`expert_loss` gives

* with a router, Eq. 8: ``α_i L_SFT + γ L_VC + δ1 L_balance + δ2 L_entropy`` (plus the
  routing term of the default objective, see :mod:`~peerlm.agent.fedwave.router`);
* without, Eq. 2: ``L_SFT + γ L_VC``.

**The router's input** is the *base* LM's hidden states, computed with the LoRA adapter
disabled and without gradient (:func:`router_features`). The paper says "the base LLM's
hidden states"; it matters here because the router is averaged across agents (Eq. 9): with
each agent's own adapter in front, the same prompt would reach each agent's copy of the
router as different features, and their average would route none of them well. At
inference the assembled model routes on the same base features.

**Pooled over the prompt only.** Eq. 7's ``H̄`` is the mean over the *source* positions of
a training example (:attr:`ExpertBatch.prompt_mask`), not over source and target: at
inference the router sees only the prompt, and with causal attention the prompt
positions' hidden states do not depend on the target, so training and the assembled model
(:meth:`~peerlm.agent.fedwave.assembly.AssembledModel.route`, which calls the same
:func:`router_features`) see the same features for the same prompt. Pooling over the
whole example (as an earlier version did) trained the router on features it never meets at
inference.

Examples are encoded with the agent's own encoding (:func:`peerlm.agent.training.
encode_example`: prompt ids, then the target ids and EOS; only the target is scored).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from peerlm.agent.fedwave.code_chain import StageExample
from peerlm.agent.fedwave.collab_loss import CollabLossSettings, VCLossTerms, local_vc_loss
from peerlm.agent.fedwave.router import MoERouter, RouterLossTerms, RouterSettings, router_losses
from peerlm.agent.fedwave.sequence_losses import per_sample_sft_loss
from peerlm.agent.fedwave.vclayer import VCCausalLM, VCLayer, masked_mean
from peerlm.agent.training import IGNORE_INDEX, Encoded, collate, encode_example

__all__ = ["ExpertBatch", "ExpertLoss", "encode_stage_examples", "expert_loss", "router_features"]


@dataclass(frozen=True)
class ExpertBatch:
    """Right-padded ids, attention mask and target mask (1 on the scored target tokens)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    target_mask: torch.Tensor

    @property
    def prompt_mask(self) -> torch.Tensor:
        """1 on the prompt (source) tokens: real tokens that are not scored targets. The
        router pools over these, the tokens it sees at inference."""
        return self.attention_mask * (1 - self.target_mask)


@dataclass(frozen=True)
class ExpertLoss:
    """The step's total loss and its parts."""

    total: torch.Tensor
    sft: torch.Tensor  # plain mean of the per-sample SFT losses (for reporting)
    vc: VCLossTerms
    router: RouterLossTerms | None
    alpha: torch.Tensor | None  # (B, N) routing weights, when a router is used


def encode_stage_examples(
    tokenizer: Any, examples: Sequence[StageExample], max_length: int
) -> ExpertBatch:
    """Encode (source, target) examples into one batch; examples without a target token
    left after truncation are dropped (``ValueError`` if none is left)."""
    items: list[Encoded] = []
    for example in examples:
        encoded = encode_example(tokenizer, (example.source, example.target), max_length)
        if encoded is not None:
            items.append(encoded)
    if not items:
        raise ValueError("no example keeps a target token within max_length")
    ids, mask, labels = collate(items, int(tokenizer.pad_token_id), torch.device("cpu"))
    return ExpertBatch(ids, mask, (labels != IGNORE_INDEX).to(torch.long))


def router_features(
    model: VCCausalLM, input_ids: torch.Tensor, prompt_mask: torch.Tensor | None
) -> torch.Tensor:
    """Eq. 7's ``H̄``, ``(B, d)``: the base LM's final hidden states (adapter disabled, no
    gradient) mean-pooled over the tokens ``prompt_mask`` marks (all tokens if None).

    ``prompt_mask`` is also the attention mask of the forward pass: the prompt's positions
    then see exactly what they see at inference (under causal attention they never see
    the target anyway). Training (:func:`expert_loss`) and the assembled model both route
    on this function's output.
    """
    disable = getattr(model.lm, "disable_adapter", None)
    with torch.no_grad():
        if callable(disable):
            with disable():
                hidden = model.hidden_states(input_ids, prompt_mask)
        else:
            hidden = model.hidden_states(input_ids, prompt_mask)
        return masked_mean(hidden, prompt_mask)


def expert_loss(
    model: VCCausalLM,
    batch: ExpertBatch,
    *,
    stage_index: int,
    predecessor: VCLayer | None,
    successor: VCLayer | None,
    router: MoERouter | None,
    collab: CollabLossSettings | None = None,
    router_settings: RouterSettings | None = None,
) -> ExpertLoss:
    """Eq. 8 (with ``router``) or Eq. 2 (without) for agent ``stage_index``'s batch."""
    c = collab or CollabLossSettings()
    out = model(batch.input_ids, batch.attention_mask)
    sft = per_sample_sft_loss(out.logits, batch.input_ids, batch.target_mask)
    vc = local_vc_loss(
        model.vclayer,
        out.hidden,
        batch.attention_mask,
        predecessor=predecessor,
        successor=successor,
        settings=c,
    )
    if router is None:
        return ExpertLoss(sft.mean() + c.gamma * vc.total, sft.mean().detach(), vc, None, None)
    alpha = router.route_pooled(router_features(model, batch.input_ids, batch.prompt_mask))
    terms = router_losses(alpha, stage_index, sft, router_settings or router.settings)
    return ExpertLoss(terms.total + c.gamma * vc.total, sft.mean().detach(), vc, terms, alpha)
