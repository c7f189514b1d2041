"""Logit-level ProxyTuning (Liu et al. 2024), FedProxy's Table 9 alternative to fusion.

FedProxy's owner plugs the cohort's trained proxy back into its full model by writing the
proxy's layers into ``M`` (Section 4.3, :func:`~peerlm.agent.fedproxy.proxy.fuse_into`). Table 9
compares that with ProxyTuning, which leaves every weight of ``M`` as it is and decodes
from the sum of logits

    s̃(x_t | x_<t) = s_M(x_t | x_<t) + s_φT(x_t | x_<t) − s_φ0(x_t | x_<t)

where ``φT`` is the trained proxy (the *expert*) and ``φ0`` the proxy before the cohort
trained it (the *anti-expert*: the compressed ``M``). The offset is what training changed in
the small model, applied to the large one's distribution; softmax of the sum is the
next-token distribution, for scoring and for sampling alike.

:class:`ProxyTunedHost` is a :class:`~peerlm.agent.modelhost.ModelHost` that scores
(:meth:`~ModelHost.sequence_logprobs`, hence the experiment's NLL) and generates
(:meth:`~ModelHost.generate`, hence pass@1) from those logits, so it is evaluated exactly like
any other model. It cannot be trained: it is a way of *decoding*, not a model with an
adapter of its own. The three models must share one vocabulary (a proxy is a sub-network
of ``M``: it always does); a mismatch is refused at construction.

Choices ProxyTuning's paper leaves to its user, written down: the offset is added to raw
logits before the temperature (the temperature divides the sum) and the nucleus (top-p) is
taken over the combined distribution; positions follow the attention mask during
left-padded generation, as ``generate`` computes them for ``M``.

``beta`` scales the offset, ``s_M + β (s_φT − s_φ0)`` (our addition; 1 is ProxyTuning's own
sum, 0 is ``M`` untouched). The offset is a difference of two small models' logits, of a
scale ``M``'s logits need not share; β < 1 trusts it less (docs/fedproxy.md, section 7).
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from peerlm.agent.modelhost import ModelHost
from peerlm.agent.training import TrainStats
from transformers import LogitsProcessor

__all__ = ["ProxyTunedHost"]


def _vocab(model: Any) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


class ProxyTunedHost(ModelHost):
    """``base``'s model decoded with the offset ``expert − anti_expert`` (see the module)."""

    def __init__(
        self, base: ModelHost, expert: Any, anti_expert: Any, *, beta: float = 1.0
    ) -> None:
        if isinstance(beta, bool) or not (math.isfinite(beta) and beta >= 0):
            raise ValueError(f"ProxyTuning's beta must be a finite number >= 0, not {beta!r}")
        sizes = {
            "M": _vocab(base.model),
            "expert": _vocab(expert),
            "anti-expert": _vocab(anti_expert),
        }
        if len(set(sizes.values())) != 1:
            raise ValueError(f"ProxyTuning needs one vocabulary; output sizes {sizes}")
        super().__init__(
            base.model,
            base.tokenizer,
            base.lora,
            source=f"{base.source} proxy-tuned",
            seed=base.seed,
        )
        self.beta = float(beta)
        self.expert = expert.eval()
        self.anti_expert = anti_expert.eval()
        accepts = inspect.signature(expert.forward).parameters
        self._positions = "position_ids" in accepts

    @torch.no_grad()
    def offset(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``β (s_φT − s_φ0)`` at every position of ``ids`` (float32)."""
        kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask, "use_cache": False}
        if self._positions:
            kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
        out: torch.Tensor = (
            self.expert(**kwargs).logits.float() - self.anti_expert(**kwargs).logits.float()
        )
        return out if self.beta == 1.0 else self.beta * out

    def _scoring_logits(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        logits = super()._scoring_logits(ids, mask).float()
        # β = 0 is M alone: the proxies' two forwards would only add zeros.
        return logits if self.beta == 0.0 else logits + self.offset(ids, mask)

    def _logit_offset(
        self, mask: torch.Tensor, copies: int, scale: float
    ) -> LogitsProcessor | None:
        if self.beta == 0.0:
            return None  # M's own decoding, generate()'s own top-p included
        return _Offset(self, mask.repeat_interleave(copies, 0) if copies > 1 else mask, scale)

    def _train(self, *_args: Any, **_kwargs: Any) -> TrainStats:
        raise TypeError("a proxy-tuned host decodes; train the proxy or the base model instead")

    def train_hka(self, *_args: Any, **_kwargs: Any) -> TrainStats:
        raise TypeError("a proxy-tuned host decodes; train the proxy or the base model instead")


class _Offset(LogitsProcessor):
    """Adds ``scale`` × the host's offset at the last position during ``generate``; the mask
    of the prompt batch grows by one attended column per generated token."""

    def __init__(self, host: ProxyTunedHost, mask: torch.Tensor, scale: float) -> None:
        self._host = host
        self._mask = mask
        self._scale = scale

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        grown = input_ids.shape[1] - self._mask.shape[1]
        ones = torch.ones(
            (self._mask.shape[0], grown), dtype=self._mask.dtype, device=self._mask.device
        )
        mask = torch.cat([self._mask, ones], dim=1)
        offset = self._host.offset(input_ids, mask)[:, -1]
        return scores + self._scale * offset.to(scores.dtype)  # type: ignore[return-value]
