"""FedWave's DPO phase (Section 3.3): router-made preference pairs, then Eq. 10 on π_SFT.

**Pairs** (:func:`build_preference_pairs`). For each public prompt x (no reference answer),
π_SFT's router ranks the N experts (α, Eq. 7); the top-ranked expert ``c_w = argmax α``
generates y_w and a lower-ranked one c_l generates y_l, each greedily *alone* (its own
adapter and VCLayer). The paper says only "a lower-ranked expert"; here c_l is the
**lowest-ranked** one: the clearest contrast the router can name, and deterministic. A pair
whose two responses are identical carries no preference (Eq. 10's margin is then 0 for any
policy, its gradient zero) and is dropped; the number dropped is reported.

**Training** (:func:`run_dpo_phase`). π_θ starts as π_SFT (the :class:`AssembledModel`
given, trained in place) and π_ref is a frozen deep copy of it taken first; the reference
log-probabilities of every pair are computed once up front. DPO trains **the experts' LoRA
factors and VCLayers** (whatever requires grad in them); **the router stays fixed**: it
made the pairs, and letting it move would let the policy satisfy the preference by
re-routing (sending the prompt to c_w alone) instead of by changing what the experts
generate, and π_ref must route like π_θ for the ratio of Eq. 10 to compare the same mixture.
Both score (x, y) under the routing on x alone, as generation does. AdamW, β = 0.1.

Why not trl's ``DPOTrainer``: see :mod:`~peerlm.agent.fedwave.dpo` (``datasets`` cannot
build a dataset on this machine, and the trainer drives one HF model, not this composite).
The optimiser loop here is a plain torch loop over the existing Eq. 10 loss.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from peerlm.agent.fedwave.assembly import AssembledModel, prompt_ids
from peerlm.agent.fedwave.dpo import dpo_loss
from peerlm.agent.fedwave.generation import greedy_generate
from peerlm.agent.fedwave.params import (
    DEFAULT_BETA,
    DEFAULT_DPO_BATCH,
    DEFAULT_DPO_LR,
    DEFAULT_MAX_NEW_TOKENS,
)
from peerlm.agent.fedwave.sequence_losses import response_logprobs
from peerlm.agent.training import IGNORE_INDEX, collate, encode_example, eval_mode

__all__ = [
    "DPOOutcome",
    "DPOPhaseReport",
    "PairBatch",
    "PreferencePair",
    "build_preference_pairs",
    "chained_preference_pairs",
    "dpo_on_public_prompts",
    "encode_pairs",
    "pair_logprobs",
    "run_dpo_phase",
]


@dataclass(frozen=True)
class PreferencePair:
    """(x, y_w, y_l) with the experts that generated them and the router's α on x."""

    prompt: str
    chosen: str
    rejected: str
    chosen_expert: int
    rejected_expert: int
    alpha: tuple[float, ...]

    @property
    def informative(self) -> bool:
        """Whether y_w and y_l differ (an identical pair has no preference to learn)."""
        return self.chosen != self.rejected


@dataclass(frozen=True)
class PairBatch:
    """Encoded (prompt + response) rows: ids, attention mask, response mask, prompt mask."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    target_mask: torch.Tensor
    prompt_mask: torch.Tensor


@dataclass(frozen=True)
class DPOPhaseReport:
    """What the phase did: the pairs used, the losses per step, the final reward accuracy."""

    pairs: int
    losses: tuple[float, ...]
    reward_accuracy: float


def build_preference_pairs(
    model: AssembledModel,
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    max_new_tokens: int = 96,
    max_length: int = 256,
) -> list[PreferencePair]:
    """One pair per prompt (see the module docstring), informative or not."""
    pairs: list[PreferencePair] = []
    for prompt in prompts:
        ids, _ = prompt_ids(tokenizer, prompt, max_length)
        alpha = model.route(torch.tensor([ids])).alpha[0]
        order = torch.sort(alpha, descending=True, stable=True).indices
        # A missing expert (assembly.py) is never a candidate.
        ranked = [int(i) for i in order if int(i) in model.available]
        best, worst = ranked[0], ranked[-1]
        chosen = greedy_generate(
            model.expert(best), tokenizer, [prompt], max_new_tokens=max_new_tokens
        )
        rejected = greedy_generate(
            model.expert(worst), tokenizer, [prompt], max_new_tokens=max_new_tokens
        )
        pairs.append(
            PreferencePair(
                prompt, chosen[0], rejected[0], best, worst, tuple(float(a) for a in alpha)
            )
        )
    return pairs


def encode_pairs(
    tokenizer: Any,
    rows: Sequence[tuple[str, str]],
    *,
    max_length: int = 256,
) -> PairBatch:
    """Encode (prompt, response) rows as training does (only the response scored)."""
    items = []
    for prompt, response in rows:
        encoded = encode_example(tokenizer, (prompt, response), max_length)
        if encoded is None:
            raise ValueError(f"no response token left within {max_length} tokens")
        items.append(encoded)
    ids, mask, labels = collate(items, int(tokenizer.pad_token_id), torch.device("cpu"))
    target = (labels != IGNORE_INDEX).to(torch.long)
    return PairBatch(ids, mask, target, mask * (1 - target))


def pair_logprobs(model: AssembledModel, batch: PairBatch) -> torch.Tensor:
    """``log π(y | x)`` per row under the model, routed on the prompt tokens."""
    out = model(batch.input_ids, batch.attention_mask, route_mask=batch.prompt_mask)
    return response_logprobs(out.logits, batch.input_ids, batch.target_mask)


def run_dpo_phase(
    model: AssembledModel,
    tokenizer: Any,
    pairs: Sequence[PreferencePair],
    *,
    steps: int,
    batch_size: int = 4,
    lr: float = 1e-3,
    beta: float = DEFAULT_BETA,
    seed: int = 0,
    max_length: int = 256,
) -> DPOPhaseReport:
    """``steps`` AdamW steps of Eq. 10 on the informative ``pairs``, training ``model``
    (π_θ) in place."""
    pairs = [p for p in pairs if p.informative]
    if not pairs:
        raise ValueError("the DPO phase needs at least one informative preference pair")
    if steps < 0 or batch_size < 1:
        raise ValueError("steps must be >= 0 and batch_size >= 1")
    reference = copy.deepcopy(model).eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    chosen = encode_pairs(tokenizer, [(p.prompt, p.chosen) for p in pairs], max_length=max_length)
    rejected = encode_pairs(
        tokenizer, [(p.prompt, p.rejected) for p in pairs], max_length=max_length
    )
    with torch.no_grad():
        ref_c = pair_logprobs(reference, chosen)
        ref_r = pair_logprobs(reference, rejected)
    params = [p for e in model.experts for p in e.parameters() if p.requires_grad]
    optimiser = torch.optim.AdamW(params, lr=lr)
    rng = random.Random(seed)
    losses: list[float] = []
    model.train()
    for _ in range(steps):
        rows = rng.sample(range(len(pairs)), min(batch_size, len(pairs)))
        idx = torch.tensor(rows)
        terms = dpo_loss(
            pair_logprobs(model, _rows(chosen, idx)),
            pair_logprobs(model, _rows(rejected, idx)),
            ref_c[idx],
            ref_r[idx],
            beta=beta,
        )
        optimiser.zero_grad()
        terms.loss.backward()  # type: ignore[no-untyped-call]
        optimiser.step()
        losses.append(float(terms.loss.detach()))
    with eval_mode(model):
        final = dpo_loss(
            pair_logprobs(model, chosen), pair_logprobs(model, rejected), ref_c, ref_r, beta=beta
        )
    return DPOPhaseReport(len(pairs), tuple(losses), final.reward_accuracy)


def _rows(batch: PairBatch, idx: torch.Tensor) -> PairBatch:
    return PairBatch(
        batch.input_ids[idx],
        batch.attention_mask[idx],
        batch.target_mask[idx],
        batch.prompt_mask[idx],
    )


def chained_preference_pairs(
    model: AssembledModel,
    tokenizer: Any,
    requirements: Sequence[str],
    *,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
) -> list[PreferencePair]:
    """Preference pairs on the public requirements and on the chain they start, as the code
    chain's stages take their inputs (docs/fedwave.md, section 1): stage 1's prompt is the
    chosen answer (signature) to the requirement, stage 2's that signature followed by the
    chosen body. No reference answer is used anywhere. A model of fewer stages stops
    earlier; the code chain has three."""
    pairs = build_preference_pairs(model, tokenizer, requirements, max_new_tokens=max_new_tokens)
    out = list(pairs)
    if model.n_experts >= 2:
        signatures = [p.chosen + "\n" for p in pairs]
        stage1 = build_preference_pairs(model, tokenizer, signatures, max_new_tokens=max_new_tokens)
        out += stage1
        if model.n_experts >= 3:
            functions = [s + p.chosen + "\n" for s, p in zip(signatures, stage1, strict=True)]
            out += build_preference_pairs(
                model, tokenizer, functions, max_new_tokens=max_new_tokens
            )
    return out


@dataclass(frozen=True)
class DPOOutcome:
    """The pairs built (informative or not) and the phase's report (None: no informative
    pair, so no DPO step was taken and the model is unchanged)."""

    pairs: tuple[PreferencePair, ...]
    report: DPOPhaseReport | None

    @property
    def informative(self) -> int:
        """How many pairs carry a preference."""
        return sum(1 for p in self.pairs if p.informative)


def dpo_on_public_prompts(
    model: AssembledModel,
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    steps: int,
    batch_size: int = DEFAULT_DPO_BATCH,
    lr: float = DEFAULT_DPO_LR,
    beta: float = DEFAULT_BETA,
    seed: int = 0,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
) -> DPOOutcome:
    """FedWave's DPO phase on π_SFT (``model``, trained in place): router-made pairs on the
    public ``prompts`` and the chain they start (:func:`chained_preference_pairs`), then
    ``steps`` steps of Eq. 10 on the informative ones against a frozen reference. What both
    the workflow experiment and the agent daemon run."""
    pairs = chained_preference_pairs(model, tokenizer, prompts, max_new_tokens=max_new_tokens)
    informative = [p for p in pairs if p.informative]
    report = None
    if informative and steps > 0:
        report = run_dpo_phase(
            model,
            tokenizer,
            informative,
            steps=steps,
            batch_size=batch_size,
            lr=lr,
            beta=beta,
            seed=seed,
        )
    return DPOOutcome(tuple(pairs), report)
