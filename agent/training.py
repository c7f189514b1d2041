"""Training mechanics of the model host: settings, example encoding, losses and the loop.

Used by :class:`peerlm.agent.modelhost.ModelHost`; kept apart so the pieces (loss masking,
learning-rate schedule, the weighted two-source objective of Eq. 2) are testable without a
host and readable in one place.

Examples
    An example is either a ``str`` (a whole text, e.g. prompt + reference solution; the loss
    covers every token) or a ``(prompt, completion)`` pair (the loss covers the completion
    only, conditioned on the prompt). Private training data are whole texts because the
    agent learns the prompt's style too (docstrings, signatures); teacher predictions on X_u
    are pairs because Eq. 2's CE(y~_j(x), p_i(. | x)) is a loss on the teacher's output
    given the prompt, not on the public prompt itself. The two parts are tokenised
    separately and concatenated, which is exactly what the model sees when it completes
    that prompt in :meth:`ModelHost.generate`. Every example ends with the EOS token so the
    model learns where a solution stops.

Steps
    A *step* is one optimiser update over ``batch_size x grad_accumulation`` examples (the
    paper's Table 6: 8 accumulated to 32). The loss of a step is the token-weighted mean
    over the whole accumulation window, not a mean of micro-batch means, so long and short
    examples weigh what their tokens weigh. The optimiser is created per call: the adapter
    is what persists between rounds, and integration strategies may replace it in between.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "IGNORE_INDEX",
    "Encoded",
    "Example",
    "LogitTarget",
    "Source",
    "TrainSettings",
    "TrainStats",
    "collate",
    "encode_example",
    "encode_pair",
    "eval_mode",
    "fit_lengths",
    "kd_kl_sum",
    "lr_factor",
    "max_token_chars",
    "run_training",
    "split_prompt",
    "text_budget",
    "token_ids",
    "token_loss_sum",
]

IGNORE_INDEX = -100
"""Label of positions without a loss (prompt tokens of a pair, padding)."""

Example = str | tuple[str, str]


class TrainSettings(BaseModel):
    """Optimiser and batching for local training and AKD (paper Table 6, with tiny-model lr).

    The paper trains ~0.5B-parameter backbones at lr 3e-5. LoRA on the project's 1-4 M
    parameter models needs a far larger step to move in a few dozen updates: 1e-3 is the
    default here (set 3e-5 for real backbones). Warm-up is linear over ``warmup_ratio`` of
    the steps, followed by linear decay to zero (``schedule="linear"``, the Hugging Face
    Trainer default) or a constant rate.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    learning_rate: float = Field(default=1e-3, gt=0)
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = Field(default=1e-6, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    warmup_ratio: float = Field(default=0.02, ge=0, lt=1)
    schedule: Literal["linear", "constant"] = "linear"
    batch_size: int = Field(default=8, ge=1)
    grad_accumulation: int = Field(default=4, ge=1)
    epochs: int = Field(default=1, ge=1)
    max_length: int = Field(default=256, ge=8)
    grad_clip: float | None = Field(default=1.0, gt=0)
    seed: int = 0

    @model_validator(mode="after")
    def _check_betas(self) -> TrainSettings:
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError("betas must lie in [0, 1)")
        return self

    @property
    def effective_batch_size(self) -> int:
        """Examples per optimiser step (batch size x gradient accumulation)."""
        return self.batch_size * self.grad_accumulation


@dataclass
class TrainStats:
    """What a training call did.

    ``mean_loss`` is the mean over steps of the optimised objective (for AKD the weighted
    sum of Eq. 2); ``local_loss`` and ``kd_loss`` are token-weighted means of the two
    components over the call (None where a component had weight zero and was skipped).
    ``interrupted``: training stopped early at a step boundary (``steps`` were done).
    """

    mean_loss: float
    steps: int
    micro_batches: int
    examples: int
    tokens: int
    seconds: float
    local_loss: float | None = None
    kd_loss: float | None = None
    alpha_kd: float | None = None
    step_losses: list[float] = field(default_factory=list)
    interrupted: bool = False

    @property
    def seconds_per_step(self) -> float:
        """Wall time per optimiser step."""
        return self.seconds / self.steps if self.steps else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dictionary."""
        return asdict(self)


# -------------------------------------------------------------------------------- encoding


@dataclass(frozen=True)
class Encoded:
    """Token ids of one example and its labels (``IGNORE_INDEX`` where there is no loss)."""

    input_ids: list[int]
    labels: list[int]

    @property
    def targets(self) -> int:
        """Positions that contribute to the loss (the first token is never predicted)."""
        return sum(1 for label in self.labels[1:] if label != IGNORE_INDEX)


@dataclass(frozen=True)
class LogitTarget:
    """A teacher's top-k distribution for each completion token of one transfer example.

    ``ids``/``logprobs`` have one row per completion token: row t is the teacher's top-k at
    the position that predicts ``input_ids[prompt_length + t]``, as log-probabilities at
    ``temperature``.
    """

    input_ids: list[int]
    prompt_length: int
    ids: np.ndarray
    logprobs: np.ndarray
    temperature: float

    @property
    def targets(self) -> int:
        """Completion positions (each contributes one KL term)."""
        return int(self.ids.shape[0])


def fit_lengths(prompt: list[int], completion: list[int], max_length: int) -> tuple[int, int]:
    """How many prompt tokens (kept from the end) and completion tokens (from the start) fit.

    The prompt keeps at most half the budget when both are long: the tokens right before the
    completion matter most for predicting it, and the completion is what is learned.
    """
    if len(prompt) + len(completion) <= max_length:
        return len(prompt), len(completion)
    keep_prompt = min(len(prompt), max(max_length - len(completion), max_length // 2))
    return keep_prompt, max_length - keep_prompt


def _eos_list(tokenizer: Any) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return [int(eos)] if eos is not None else []


def token_ids(tokenizer: Any, text: str, *, special: bool) -> list[int]:
    """Token ids of ``text`` (with the tokenizer's special prefix if ``special``)."""
    # verbose=False: the tokenizer warns about any text longer than the model's context,
    # but every caller cuts to its own budget right after encoding.
    return list(tokenizer(text, add_special_tokens=special, verbose=False)["input_ids"])


#: What a body usually starts with after the prompt's indent; :func:`split_prompt` checks
#: its cut against it.
_PROBE = "return"


def split_prompt(tokenizer: Any, prompt: str) -> tuple[str, str]:
    """``prompt`` cut into (head, whitespace tail) where ``tokenizer`` has a token boundary.

    A bank prompt ends with ``'\"\"\"\n    '``: the docstring's end, a newline and the
    four spaces that indent the body. Pre-tokenisers never put a token boundary at the end
    of such a prompt: GPT-2's attaches the last space to the next word (``'\n   '``,
    ``' return'``), Qwen2's the newline to the punctuation before it (``'\"\"\"\n'``).
    Tokenised on its own, the prompt ends in tokens (a lone ``'\n'`` or ``'    '``) that
    the model never saw before a body; after a lone ``'\n'`` it has only ever seen the
    end of a document. So generation and training tokenise only the head and let the
    completion start with the tail. The cut is the first position in the trailing
    whitespace at which the head's tokens followed by those of ``tail + "return"`` are
    the tokens of the whole text: a function of prompt and tokenizer alone, so training
    (:func:`encode_pair`) and :meth:`~peerlm.agent.modelhost.ModelHost.generate` always
    cut alike. A prompt without trailing whitespace, or without such a cut, is kept whole.
    """
    stripped = prompt.rstrip()
    if not stripped or stripped == prompt:
        return prompt, ""
    whole = token_ids(tokenizer, prompt + _PROBE, special=True)
    for cut in range(len(stripped), len(prompt)):
        head, tail = prompt[:cut], prompt[cut:]
        parts = token_ids(tokenizer, head, special=True)
        parts += token_ids(tokenizer, tail + _PROBE, special=False)
        if parts == whole:
            return head, tail
    return prompt, ""


def max_token_chars(tokenizer: Any) -> int:
    """The longest token of ``tokenizer``'s vocabulary, in characters of its vocabulary
    string (for byte-level BPE one character per byte): no token covers more text."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1


def text_budget(token_chars: int, max_length: int) -> int:
    """Characters of a text that certainly hold its first ``max_length`` tokens (each token
    covers at most ``token_chars``), with a margin for the word the cut splits."""
    return (max_length + 8) * token_chars


def encode_pair(
    tokenizer: Any,
    prompt: str,
    completion: str,
    *,
    max_chars: int | None = None,
    split: Callable[[str], tuple[str, str]] | None = None,
) -> tuple[list[int], list[int]]:
    """Prompt ids (with the tokenizer's special prefix, if any) and completion ids + EOS.

    The prompt's trailing indent moves to the completion (:func:`split_prompt`), exactly
    as :meth:`~peerlm.agent.modelhost.ModelHost.generate` tokenises it. With ``max_chars``
    the completion is cut to that many characters *before* it is tokenised: a teacher's
    text is untrusted, and tokenising a 16 MiB completion costs gigabytes to keep a few
    hundred tokens (:func:`text_budget` gives a cut that keeps every token used).
    ``split`` is :func:`split_prompt` for ``tokenizer`` (a caller's cached copy).
    """
    head, indent = split_prompt(tokenizer, prompt) if split is None else split(prompt)
    p = token_ids(tokenizer, head, special=True)
    if max_chars is not None:
        completion = completion[:max_chars]
    c = token_ids(tokenizer, indent + completion, special=False) + _eos_list(tokenizer)
    return p, c


def encode_example(
    tokenizer: Any,
    example: Example,
    max_length: int,
    *,
    max_chars: int | None = None,
    split: Callable[[str], tuple[str, str]] | None = None,
) -> Encoded | None:
    """Token ids and labels of one example (see the module docstring); None if no target.

    ``max_chars`` cuts a text (the completion of a pair) before tokenising, and ``split``
    cuts a pair's prompt (:func:`encode_pair`).
    """
    if isinstance(example, str):
        text = example if max_chars is None else example[:max_chars]
        ids = token_ids(tokenizer, text, special=True)
        ids = (ids + _eos_list(tokenizer))[:max_length]
        encoded = Encoded(ids, list(ids))
    else:
        prompt, completion = example
        p, c = encode_pair(tokenizer, prompt, completion, max_chars=max_chars, split=split)
        keep_p, keep_c = fit_lengths(p, c, max_length)
        p = p[len(p) - keep_p :]
        c = c[:keep_c]
        encoded = Encoded(p + c, [IGNORE_INDEX] * len(p) + c)
    return encoded if encoded.targets > 0 else None


def collate(
    items: Sequence[Encoded | LogitTarget], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (labels only for Encoded)."""
    width = max(len(x.input_ids) for x in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    labels = torch.full((len(items), width), IGNORE_INDEX, dtype=torch.long)
    for row, item in enumerate(items):
        n = len(item.input_ids)
        ids[row, :n] = torch.tensor(item.input_ids, dtype=torch.long)
        mask[row, :n] = 1
        if isinstance(item, Encoded):
            labels[row, :n] = torch.tensor(item.labels, dtype=torch.long)
    return ids.to(device), mask.to(device), labels.to(device)


# ---------------------------------------------------------------------------------- losses


@contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """``model`` in eval mode and without autograd for the ``with`` block; its train/eval
    mode as before afterwards, whatever happens (a forward pass that only reads the model)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def token_loss_sum(
    model: torch.nn.Module, items: Sequence[Encoded], pad_id: int
) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over the labelled positions, and their count."""
    ids, mask, labels = collate(items, pad_id, _device_of(model))
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    # float32 for the softmax: bf16 logits lose the small probabilities CE depends on.
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    loss = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return loss, int((shift_labels != IGNORE_INDEX).sum())


def kd_kl_sum(
    model: torch.nn.Module, items: Sequence[LogitTarget], pad_id: int, temperature: float
) -> tuple[torch.Tensor, int]:
    """Summed T^2 * KL(teacher || student) over completion positions, on the top-k support.

    Both distributions are renormalised over the teacher's k token ids at temperature
    ``temperature``. The teacher sent log-probabilities at its own temperature T_t, i.e.
    z/T_t up to a constant per position, so z/T = logprobs * T_t / T re-tempers them
    exactly. The T^2 factor keeps gradient magnitudes comparable across temperatures
    (Hinton et al. 2015).
    """
    device = _device_of(model)
    ids, mask, _ = collate(items, pad_id, device)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    total = torch.zeros((), device=device)
    count = 0
    for row, item in enumerate(items):
        n = item.targets
        start = item.prompt_length - 1
        student = logits[row, start : start + n].float()
        top_ids = torch.as_tensor(item.ids[:n], dtype=torch.long, device=device)
        student_log = F.log_softmax(student.gather(-1, top_ids) / temperature, dim=-1)
        teacher_scaled = torch.as_tensor(item.logprobs[:n], dtype=torch.float32, device=device)
        teacher_log = F.log_softmax(teacher_scaled * (item.temperature / temperature), dim=-1)
        kl = (teacher_log.exp() * (teacher_log - student_log)).sum()
        total = total + kl * temperature**2
        count += n
    return total, count


# -------------------------------------------------------------------------------- schedule


def lr_factor(
    step: int, total: int, warmup_ratio: float, schedule: Literal["linear", "constant"]
) -> float:
    """Learning-rate multiplier of 0-based optimiser step ``step`` out of ``total``.

    Warm-up is linear over ``round(warmup_ratio * total)`` steps and never yields zero (a
    step at lr 0 would be wasted in the short runs of a federated round).
    """
    warmup = round(warmup_ratio * total)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if schedule == "constant":
        return 1.0
    return max(0.0, (total - step) / max(1, total - warmup))


# ------------------------------------------------------------------------------------ loop


@dataclass
class Source:
    """One stream of training items with its weight in the objective (Eq. 2's terms)."""

    name: str
    weight: float
    items: Sequence[Any]
    loss: Callable[[Sequence[Any]], tuple[torch.Tensor, int]]
    loss_sum: float = 0.0
    token_count: int = 0

    def mean(self) -> float | None:
        """Token-weighted mean loss so far, or None if nothing was trained."""
        return self.loss_sum / self.token_count if self.token_count else None


class _Cycle:
    """Endless reshuffled passes over a list, seeded (deterministic order)."""

    def __init__(self, n: int, seed: int) -> None:
        self._n = n
        self._rng = random.Random(seed)
        self._order: list[int] = []

    def take(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            if not self._order:
                self._order = list(range(self._n))
                self._rng.shuffle(self._order)
            out.append(self._order.pop())
        return out


def run_training(
    model: torch.nn.Module,
    sources: Sequence[Source],
    settings: TrainSettings,
    steps: int | None = None,
    *,
    interrupt: threading.Event | None = None,
) -> TrainStats:
    """Minimise sum_s weight_s * L_s over the trainable parameters of ``model``.

    Each step draws one accumulation window (up to ``effective_batch_size`` items) from
    every source with a positive weight, back-propagates each source's token-mean loss
    scaled by its weight, clips and updates. Without ``steps``, ``epochs`` passes over the
    largest active source; smaller sources cycle. ``model`` is left in eval mode.

    ``interrupt`` (set from any thread) ends training at the next step boundary, after at
    least one step: the parameters are then those of a completed optimiser update, and
    ``TrainStats.interrupted`` says so.
    """
    active = [s for s in sources if s.weight > 0 and s.items]
    if not active:
        raise ValueError("nothing to train on: every source is empty or has weight 0")
    window = settings.effective_batch_size
    if steps is None:
        steps = settings.epochs * math.ceil(max(len(s.items) for s in active) / window)
    if steps < 1:
        raise ValueError("steps must be >= 1")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    optimizer = torch.optim.AdamW(
        params,
        lr=settings.learning_rate,
        betas=settings.betas,
        eps=settings.eps,
        weight_decay=settings.weight_decay,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, steps, settings.warmup_ratio, settings.schedule)
    )
    cycles = [_Cycle(len(s.items), settings.seed * 7919 + i) for i, s in enumerate(active)]
    started = time.perf_counter()
    step_losses: list[float] = []
    interrupted = False
    micro_batches = 0
    examples = 0
    device = _device_of(model)
    model.train()
    # Dropout (LoRA's and the base model's) draws from torch's global RNG: fork it so that a
    # seeded run is reproducible and the caller's RNG state is left untouched.
    fork_devices = [device.index or 0] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=fork_devices):
            torch.manual_seed(settings.seed)
            for step in range(steps):
                if step > 0 and interrupt is not None and interrupt.is_set():
                    interrupted = True
                    break
                optimizer.zero_grad(set_to_none=True)
                objective = 0.0
                for source, cycle in zip(active, cycles, strict=True):
                    batch = [source.items[i] for i in cycle.take(min(window, len(source.items)))]
                    n_tokens = sum(item.targets for item in batch)
                    if n_tokens == 0:
                        continue
                    window_sum = 0.0
                    for lo in range(0, len(batch), settings.batch_size):
                        micro = batch[lo : lo + settings.batch_size]
                        loss_sum, count = source.loss(micro)
                        (loss_sum * (source.weight / n_tokens)).backward()
                        window_sum += float(loss_sum.detach())
                        source.token_count += count
                        micro_batches += 1
                    source.loss_sum += window_sum
                    objective += source.weight * window_sum / n_tokens
                    examples += len(batch)
                if settings.grad_clip is not None:
                    torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
                optimizer.step()
                scheduler.step()
                step_losses.append(objective)
    finally:
        optimizer.zero_grad(set_to_none=True)
        model.eval()
    return TrainStats(
        mean_loss=sum(step_losses) / len(step_losses),
        steps=len(step_losses),
        micro_batches=micro_batches,
        examples=examples,
        tokens=sum(s.token_count for s in active),
        seconds=round(time.perf_counter() - started, 4),
        step_losses=[round(x, 6) for x in step_losses],
        interrupted=interrupted,
    )
