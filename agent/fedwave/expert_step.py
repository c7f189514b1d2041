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
from peerlm.agent.fedwave.vclayer import VCCausalLM, VCLayer
from peerlm.agent.training import IGNORE_INDEX, Encoded, collate, encode_example

__all__ = ["ExpertBatch", "ExpertLoss", "encode_stage_examples", "expert_loss", "router_features"]


@dataclass(frozen=True)
class ExpertBatch:
    """Right-padded ids, attention mask and target mask (1 on the scored target tokens)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    target_mask: torch.Tensor


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


def router_features(model: VCCausalLM, batch: ExpertBatch) -> torch.Tensor:
    """The base LM's final hidden states for the batch (adapter disabled, no gradient)."""
    disable = getattr(model.lm, "disable_adapter", None)
    with torch.no_grad():
        if callable(disable):
            with disable():
                return model.hidden_states(batch.input_ids, batch.attention_mask)
        return model.hidden_states(batch.input_ids, batch.attention_mask)


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
    alpha = router.route(router_features(model, batch), batch.attention_mask)
    terms = router_losses(alpha, stage_index, sft, router_settings or router.settings)
    return ExpertLoss(terms.total + c.gamma * vc.total, sft.mean().detach(), vc, terms, alpha)
