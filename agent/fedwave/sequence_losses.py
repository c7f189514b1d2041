"""Per-sequence quantities of a causal LM's logits: the SFT loss per sample, response log-probs.

Both read the standard shift: the logits at position ``t − 1`` predict the token at ``t``.
``target_mask`` (``(B, L)``, 1 on the tokens being scored: a stage's reference output, or a
DPO response) says which positions count; a position 0 is never scored (nothing predicts
it). Sans-IO tensor functions; no model is called here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["per_sample_sft_loss", "response_logprobs"]


def _token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    if logits.dim() != 3 or input_ids.shape != logits.shape[:2]:
        raise ValueError(
            f"logits (B, L, V) and ids (B, L), got {logits.shape} and {input_ids.shape}"
        )
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    return torch.gather(logp, -1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # (B, L-1)


def _mask(target_mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if target_mask.shape != like.shape:
        raise ValueError(f"target mask {target_mask.shape} does not match ids {like.shape}")
    return target_mask[:, 1:].to(torch.float32)


def response_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, target_mask: torch.Tensor
) -> torch.Tensor:
    """``log π(y | x)`` per sequence: the sum of the scored tokens' log-probabilities, ``(B,)``."""
    return (_token_logprobs(logits, input_ids) * _mask(target_mask, input_ids)).sum(dim=-1)


def per_sample_sft_loss(
    logits: torch.Tensor, input_ids: torch.Tensor, target_mask: torch.Tensor
) -> torch.Tensor:
    """Mean next-token cross-entropy over each sample's scored tokens, ``(B,)``.

    A sample with no scored token has loss 0 (it contributes nothing, rather than NaN).
    """
    mask = _mask(target_mask, input_ids)
    nll = -(_token_logprobs(logits, input_ids) * mask).sum(dim=-1)
    return nll / mask.sum(dim=-1).clamp_min(1.0)
