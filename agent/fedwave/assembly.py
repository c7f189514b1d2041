"""FedWave's assembled model π_SFT: the stage experts behind the aggregated router.

After the federated SFT phase each stage has an expert (a LoRA adapter on the shared base
model plus its VCLayer, :class:`~peerlm.agent.fedwave.vclayer.VCCausalLM`) and the workflow
has one aggregated router (Eq. 9). :class:`AssembledModel` puts them together as the paper's
"aggregated model" (Section 3.2-3.3, Figure 3c):

1. the router reads the *base* model's mean-pooled hidden states of the prompt (adapter
   disabled, as in training: :func:`~peerlm.agent.fedwave.expert_step.router_features`) and
   gives α over the N experts (Eq. 7);
2. the ``top_k`` = 2 experts with the largest α are kept and their weights renormalised to
   sum to 1 (:func:`~peerlm.agent.fedwave.router.top_k_routing`; ties go to the lower index);
3. the next-token distribution is the mixture of the kept experts' distributions,
   ``p(y_t | y_<t, x) = Σ_k w_k p_k(y_t | y_<t, x)``.

Choices the paper leaves open (docs/fedwave.md, section 3):

* **What is mixed.** The paper says the router "dynamically determines each expert's
  contribution" and uses top_k = 2, but not at which level the outputs combine. Here the
  experts' *probability distributions* are mixed (a mixture of experts in the classical
  sense): the result is again a distribution, so greedy decoding and DPO's sequence
  log-probabilities read it directly, and with one expert at weight 1 it is that expert
  exactly. ``logits`` returned are the mixture's log-probabilities (log-softmax is the
  identity on them).
* **Routing once per prompt.** α is computed on the prompt only and held fixed while the
  response is generated or scored: the routing decision is about the task (the prompt), and
  re-routing on the model's own partial output would let the response steer its own
  expert. DPO scores a (prompt, response) pair under the same routing generation used.
* **The base features** come from expert 0's LM with its adapter disabled: all experts are
  one base model family with frozen base weights (checked: equal widths), so any expert's
  base gives the same features.

* **A missing expert** (``None`` in its stage's place: an agent daemon whose pull of that
  stage's expert did not arrive by the deadline, docs/fedwave.md section 5) gets α = 0:
  α is renormalised over the experts present and top-k keeps at most as many as there
  are. With every expert present this is exactly the paper's routing.

Bad input is refused with :class:`~peerlm.agent.fedwave.errors.FedWaveError`: a router for
another number of experts (``reason="shape"``), experts of different widths, a ``top_k``
outside 1..N (``"config"``), no expert at all (``"config"``), a NaN or infinite weight in an
expert or the router (``"non_finite"``, naming it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from peerlm.agent.fedwave.errors import FedWaveError
from peerlm.agent.fedwave.expert_step import router_features
from peerlm.agent.fedwave.router import MoERouter, top_k_routing
from peerlm.agent.fedwave.vclayer import VCCausalLM
from peerlm.agent.training import eval_mode, split_prompt, token_ids
from torch import nn

__all__ = ["AssembledModel", "AssembledOutput", "Routing", "assembled_generate", "prompt_ids"]


@dataclass(frozen=True)
class Routing:
    """The routing of a batch: α ``(B, N)``, the kept experts ``(B, k)`` and their weights."""

    alpha: torch.Tensor
    experts: torch.Tensor  # (B, k) expert indices, best first
    weights: torch.Tensor  # (B, k) renormalised α of those experts


@dataclass(frozen=True)
class AssembledOutput:
    """One forward pass: the mixture's log-probabilities ``(B, L, V)`` and the routing."""

    logits: torch.Tensor
    routing: Routing


def _check_finite(module: nn.Module, what: str) -> None:
    for name, tensor in module.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise FedWaveError(f"{what}: {name} holds NaN or infinite values", reason="non_finite")


class AssembledModel(nn.Module):
    """π_SFT: the stage experts mixed by the aggregated router's top-k routing.

    ``experts`` holds one expert per stage in stage order; ``None`` marks a stage whose
    expert is missing (module docstring): it is never routed to.
    """

    def __init__(
        self, experts: Sequence[VCCausalLM | None], router: MoERouter, *, top_k: int = 2
    ) -> None:
        super().__init__()
        if len(experts) != router.n_experts:
            raise FedWaveError(
                f"the router routes over {router.n_experts} experts but {len(experts)} were "
                "given (one expert per stage)",
                reason="shape",
            )
        if not 1 <= top_k <= len(experts):
            raise FedWaveError(f"top_k must be in 1..{len(experts)}, got {top_k}", reason="config")
        present = [(i, e) for i, e in enumerate(experts) if e is not None]
        if not present:
            raise FedWaveError("no expert to assemble", reason="config")
        widths = {e.vclayer.hidden_size for _, e in present}
        if len(widths) != 1 or router.fc1.in_features not in widths:
            raise FedWaveError(
                f"experts and router must share one width, got experts {sorted(widths)} and "
                f"router {router.fc1.in_features}",
                reason="shape",
            )
        for index, expert in present:
            _check_finite(expert, f"expert {index}")
        _check_finite(router, "router")
        # Only the experts present are modules (their parameters are what DPO trains).
        self.experts = nn.ModuleList([e for _, e in present])
        self._slot = {index: slot for slot, (index, _) in enumerate(present)}
        self._n = len(experts)
        self.router = router
        self.top_k = top_k

    @property
    def n_experts(self) -> int:
        """N, the number of experts (stages), the missing ones included."""
        return self._n

    @property
    def available(self) -> tuple[int, ...]:
        """The stages whose expert is present, ascending."""
        return tuple(sorted(self._slot))

    def expert(self, index: int) -> VCCausalLM:
        """Expert ``index`` (its LM, adapter and VCLayer); ``KeyError`` if it is missing."""
        module = self.experts[self._slot[index]]
        assert isinstance(module, VCCausalLM)
        return module

    def route(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Routing:
        """Eq. 7 and top-k on the base model's hidden states of ``input_ids`` (the prompt:
        ``attention_mask`` marks the tokens to pool). No gradient reaches the router here."""
        with torch.no_grad():
            alpha = self.router.route_pooled(
                router_features(self.expert(self.available[0]), input_ids, attention_mask)
            )
            if len(self._slot) < self._n:
                mask = torch.zeros(self._n, dtype=alpha.dtype)
                mask[list(self.available)] = 1.0
                kept = alpha * mask
                total = kept.sum(dim=-1, keepdim=True)
                # A router sure of a missing expert can leave the others at an exact 0:
                # then the experts present share the weight evenly.
                alpha = torch.where(total > 0, kept / total.clamp_min(1e-38), mask / mask.sum())
        experts, weights = top_k_routing(alpha, min(self.top_k, len(self._slot)))
        return Routing(alpha=alpha, experts=experts, weights=weights)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        route_mask: torch.Tensor | None = None,
        routing: Routing | None = None,
    ) -> AssembledOutput:
        """The mixture's log-probabilities for ``input_ids`` ``(B, L)``.

        The routing is ``routing`` if given, else computed on the tokens ``route_mask``
        marks (the prompt; default ``attention_mask``). Only the experts some row keeps
        are run; the gradient reaches those experts' trainable parameters.
        """
        if routing is None:
            mask = route_mask if route_mask is not None else attention_mask
            routing = self.route(input_ids, mask)
        if routing.experts.shape[0] != input_ids.shape[0]:
            raise ValueError("routing and input_ids must have one batch size")
        logp: dict[int, torch.Tensor] = {}
        for index in sorted({int(e) for e in routing.experts.flatten()}):
            out = self.expert(index)(input_ids, attention_mask)
            logp[index] = torch.log_softmax(out.logits.float(), dim=-1)
        rows = torch.arange(input_ids.shape[0])
        parts = []
        for k in range(routing.experts.shape[1]):
            chosen = routing.experts[:, k]
            stacked = torch.stack([logp[int(e)][int(b)] for b, e in zip(rows, chosen, strict=True)])
            parts.append(stacked + torch.log(routing.weights[:, k]).view(-1, 1, 1))
        mixture = torch.logsumexp(torch.stack(parts), dim=0)
        return AssembledOutput(logits=mixture, routing=routing)


def prompt_ids(tokenizer: Any, source: str, max_prompt: int) -> tuple[list[int], str]:
    """The prompt's token ids as training and generation encode them, and its whitespace
    tail (which the model generates and the caller strips from the completion)."""
    head, tail = split_prompt(tokenizer, source)
    return token_ids(tokenizer, head, special=True)[-max_prompt:], tail


def assembled_generate(
    model: AssembledModel,
    tokenizer: Any,
    sources: Sequence[str],
    *,
    max_new_tokens: int = 96,
    max_length: int = 256,
) -> tuple[list[str], list[Routing]]:
    """Greedy completions through π_SFT, routed once per source on its prompt.

    Encodes and strips as :func:`~peerlm.agent.fedwave.generation.greedy_generate` does
    (whose output it equals when one expert has all the weight).
    """
    if max_new_tokens < 1 or max_length <= max_new_tokens:
        raise ValueError("need max_new_tokens >= 1 and max_length > max_new_tokens")
    eos = getattr(tokenizer, "eos_token_id", None)
    outputs: list[str] = []
    routings: list[Routing] = []
    with eval_mode(model):
        for source in sources:
            ids, tail = prompt_ids(tokenizer, source, max_length - max_new_tokens)
            routing = model.route(torch.tensor([ids]))
            new: list[int] = []
            for _ in range(max_new_tokens):
                logits = model(torch.tensor([ids + new]), routing=routing).logits
                token = int(logits[0, -1].argmax())
                if eos is not None and token == int(eos):
                    break
                new.append(token)
            outputs.append(tokenizer.decode(new, skip_special_tokens=True).removeprefix(tail))
            routings.append(routing)
    return outputs, routings
