"""OnePeFT's Heterogeneous Knowledge Alignment (Eq. 4-6): distil K client adapters into one.

The student is the aggregated adapter (SVD, Eq. 3, :mod:`peerlm.agent.merging.lora_merge`) on the
shared base model. The teachers are the same base with client i's adapter, i = 1..K. On a
public dataset D_pub of (x, y) pairs the student minimises

    L_total = alpha * L_CE + (1 - alpha) * L_KL                                    (Eq. 6)
    L_CE    = - sum_t log q(y_t | x, y_<t)                                          (Eq. 4)
    L_KL    = sum_t KL( sum_i lambda_i p_i(. | x, y_<t)  ||  q(. | x, y_<t) )       (Eq. 5)

over the whole vocabulary (the teachers share the student's tokenizer: one backbone), with
alpha = 0.5 (Section 4.1). Eq. 5 as printed sums ``p log(p / q)``; that is KL(p || q) with the
teacher mixture first, implemented as written.

**Several adapters on one base, switched without reloading it.** Each teacher is registered
as a named peft adapter next to the student's ``default`` one (:func:`teacher_adapters`):
its own ``r`` and ``lora_alpha`` (the FlexLoRA setting: ranks may differ), frozen, removed
when the context ends. A teacher forward activates its adapter, under ``no_grad`` and in
eval mode (no dropout); the student's forward runs with ``default`` active. The teachers'
probabilities are recomputed per micro-batch rather than cached: K extra forwards per step
instead of ``|D_pub| x length x |V|`` floats held in memory.

Choices the paper leaves open (docs/onepeft.md): the mixture is of probabilities (not
logits), at temperature 1 (the paper names none); positions are those of y (the completion,
as in Eq. 4); the two terms are token means weighted by alpha (run_training's convention),
so alpha = 0.5 weighs a nat of CE like a nat of KL.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from peerlm.agent.adapter_codec import AdapterError
from peerlm.agent.merging.lora_merge import ClientAdapter, check_clients
from peerlm.agent.training import IGNORE_INDEX, Encoded, collate, eval_mode
from peft import LoraConfig, PeftModel, set_peft_model_state_dict

__all__ = ["TEACHER_PREFIX", "Teachers", "mixture_kl_sum", "teacher_adapters"]

#: Name prefix of the teachers' peft adapters (never the student's ``default``).
TEACHER_PREFIX = "hka_teacher_"


class Teachers:
    """Registered teacher adapters and their normalised weights lambda_i."""

    def __init__(self, model: PeftModel, names: Sequence[str], weights: Sequence[float]) -> None:
        self.model = model
        self.names = tuple(names)
        self.weights = tuple(weights)

    def mixture(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``sum_i lambda_i softmax(logits_i)`` at every position, float32 ``[B, L, V]``."""
        mix: torch.Tensor | None = None
        with eval_mode(self.model):
            try:
                for name, weight in zip(self.names, self.weights, strict=True):
                    self.model.set_adapter(name)
                    logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                    probs = F.softmax(logits.float(), dim=-1) * weight
                    mix = probs if mix is None else mix + probs
            finally:
                # set_adapter also sets requires_grad: "default" becomes trainable again.
                self.model.set_adapter("default")
        assert mix is not None
        return mix


def _teacher_config(base: Any, client: ClientAdapter) -> LoraConfig:
    """The student's LoRA configuration with the teacher's rank and alpha, no dropout."""
    return LoraConfig(
        task_type=base.task_type,
        r=client.r,
        lora_alpha=client.alpha,  # type: ignore[arg-type]  # peft computes alpha / r
        lora_dropout=0.0,
        target_modules=base.target_modules,
        fan_in_fan_out=base.fan_in_fan_out,
        bias=base.bias,
    )


@contextmanager
def teacher_adapters(
    model: PeftModel, clients: Sequence[ClientAdapter], weights: Sequence[float] | None = None
) -> Iterator[Teachers]:
    """Register ``clients`` as frozen teacher adapters of ``model`` for the ``with`` block.

    Weights default to the clients' data shares (:class:`ClientAdapter` ``examples``). Each
    client's module set must be the student's and its tensors finite and of its rank
    (:func:`~peerlm.agent.merging.lora_merge.check_clients`); an :class:`AdapterError` is raised
    before the model changes. On exit the teachers are deleted and ``default`` is active
    and trainable, as before.
    """
    lam = check_clients(clients, weights)
    base = model.peft_config["default"]
    student_modules = {
        k.rsplit(".lora_", 1)[0]
        for k, _ in model.named_parameters()
        if ".lora_A.default." in k or ".lora_B.default." in k
    }
    for i, client in enumerate(clients):
        modules = {k.rsplit(".lora_", 1)[0] for k in client.state}
        # peft names a module without the adapter segment: compare the module paths only.
        if modules != student_modules:
            raise AdapterError(
                f"client {i}: its adapted modules are not the student's "
                f"({len(modules)} vs {len(student_modules)})",
                reason="keys",
            )
    names: list[str] = []
    try:
        for i, client in enumerate(clients):
            name = f"{TEACHER_PREFIX}{i}"
            model.add_adapter(name, _teacher_config(base, client))
            names.append(name)
            device = next(model.parameters()).device
            state = {k: v.to(device=device, dtype=torch.float32) for k, v in client.state.items()}
            result = set_peft_model_state_dict(model, state, adapter_name=name)
            unused = list(getattr(result, "unexpected_keys", []) or [])
            if unused:
                raise AdapterError(f"client {i}: peft did not use {unused[:3]}", reason="keys")
        model.set_adapter("default")
        yield Teachers(model, names, lam)
    finally:
        model.set_adapter("default")
        for name in names:
            model.delete_adapter(name)


def mixture_kl_sum(
    model: torch.nn.Module, items: Sequence[Encoded], pad_id: int, teachers: Teachers
) -> tuple[torch.Tensor, int]:
    """Eq. 5 summed over the labelled positions of ``items``, and their count."""
    device = next(model.parameters()).device
    ids, mask, labels = collate(items, pad_id, device)
    target = teachers.mixture(ids, mask)[:, :-1]
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
    keep = labels[:, 1:] != IGNORE_INDEX
    log_q = F.log_softmax(logits.float(), dim=-1)[keep]
    p = target[keep]
    # p log p with 0 log 0 = 0 (xlogy), minus p log q.
    kl = (torch.special.xlogy(p, p) - p * log_q).sum()
    return kl, int(keep.sum())
