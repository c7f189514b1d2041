"""The model host: one causal LM with a LoRA adapter, and everything an agent does with it.

:meth:`ModelHost.load` takes a directory (or, where a hub is reachable, a model name) and
loads it with ``AutoTokenizer``/``AutoModelForCausalLM.from_pretrained``, the same path for
Qwen1.5-0.5B as for the project's locally built tiny models (DESIGN.md principle 8), then
wraps the frozen base W0 with a fresh, seeded LoRA adapter phi_i.

The host then offers the agent-side operations of KNEXA-FL:

- :meth:`~ModelHost.train_local`: causal-LM fine-tuning of phi_i on private data D_i;
- :meth:`~ModelHost.generate`: teacher predictions y_j(x) on the transfer set X_u (and
  completions for pass@k), batched, greedy or sampled, cut at stop sequences;
- :meth:`~ModelHost.train_akd`: Adaptive Knowledge Distillation, Eq. 2, with the teacher's
  text re-encoded by this host's tokenizer (any pair of architectures);
- :meth:`~ModelHost.topk_logits` / :meth:`~ModelHost.train_akd_logits`: the logit mode,
  defined only between hosts that share a tokenizer;
- :meth:`~ModelHost.eval_loss`: validation loss and perplexity (profile, Eq. 3's reward);
- adapter I/O as safetensors (checkpoints, adapter exchange); never pickle;
- :attr:`~ModelHost.frozen_lora_a`: train only LoRA B, A fixed (FFA-LoRA, Sun et al. 2024;
  off by default, the daemon trains both factors).

Thread-safety: a ModelHost is not thread-safe. Every method mutates or reads the model, the
tokenizer or torch's RNG; the agent daemon owns one worker thread that makes all calls, and
callers elsewhere must do the same (one thread at a time). All methods are synchronous. The
one exception is :attr:`ModelHost.interrupt`, a ``threading.Event`` any thread may set to
end training at the next optimiser step (graceful shutdown).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
import threading
from array import array
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
from peerlm.agent.adapter_codec import (
    AdapterError,
    AdapterSpec,
    EncodedAdapter,
    check_state,
    decode_adapter,
    encode_adapter,
)
from peerlm.agent.merging.lora_merge import ClientAdapter
from peerlm.agent.models.lora import LoraSettings, apply_lora, trainable_share
from peerlm.agent.training import (
    IGNORE_INDEX,
    Encoded,
    Example,
    LogitTarget,
    Source,
    TrainSettings,
    TrainStats,
    collate,
    encode_example,
    encode_pair,
    fit_lengths,
    kd_kl_sum,
    max_token_chars,
    run_training,
    split_prompt,
    text_budget,
    token_ids,
    token_loss_sum,
)
from peft import PeftModel, get_peft_model_state_dict, set_peft_model_state_dict
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TopPLogitsWarper,
)

from peerlm.atomic_file import write_atomic

__all__ = [
    "DEFAULT_STOPS",
    "AdapterMismatchError",
    "ModelHost",
    "TokenizerMismatchError",
    "family_of",
    "truncate_at_stops",
]

DEFAULT_STOPS: tuple[str, ...] = (
    "\ndef ",
    "\nclass ",
    "\nif __name__",
    "\nprint(",
    "\n#",
    "\n@",
    "\nassert ",
)
"""Top-level constructs that end a function body (HumanEval's stop set, plus decorators and
asserts): a completion of a ``def ...: \"\"\"docstring\"\"\"`` prompt stops at the body's end."""

# config.model_type -> the family one-hot of the profile (8 static features).
_FAMILIES: Mapping[str, str] = MappingProxyType(
    {
        "gpt2": "gpt2",
        "gpt_bigcode": "gpt2",
        "gpt_neox": "gpt_neox",
        "bloom": "bloom",
        "qwen2": "qwen2",
        "qwen3": "qwen2",
        "llama": "llama",
        "mistral": "llama",
    }
)


#: An adapter does not fit this host (other base model, other rank, other modules); the
#: codec's error, under the name this module has always raised.
AdapterMismatchError = AdapterError


class TokenizerMismatchError(ValueError):
    """Logit distillation between hosts whose tokenizers (token id spaces) differ."""


def family_of(model_type: str) -> str:
    """Family of a ``config.model_type``: gpt2, gpt_neox, bloom, qwen2, llama or other."""
    return _FAMILIES.get(model_type, "other")


#: Prompts whose cut (split_prompt) a host keeps: a world's own, public and probe prompts.
_SPLIT_CACHE = 4096
#: Encoded examples a host keeps (:meth:`ModelHost._compact_encoding`): ~2 KB each.
_ENCODE_CACHE = 8192
# A line that starts at column 0 after the body began: the function has ended.
_DEDENT = re.compile(r"\n(?=[^\s])")


def truncate_at_stops(text: str, stops: Sequence[str], *, dedent: bool = False) -> str:
    """``text`` up to (excluding) the earliest occurrence of any stop sequence.

    With ``dedent``, a newline followed by a non-blank character at column 0 is a stop
    too: the completion of a function prompt ends where the function does, whatever
    top-level statement follows (HumanEval's evaluation cuts the same way).
    """
    cut = len(text)
    for stop in stops:
        if stop:
            at = text.find(stop)
            if 0 <= at < cut:
                cut = at
    if dedent:
        match = _DEDENT.search(text, 0, cut)
        if match is not None:
            cut = match.start()
    return text[:cut]


class _StopOnStrings(StoppingCriteria):
    """Marks a sequence finished once its generated text contains a stop (see
    :func:`truncate_at_stops`)."""

    def __init__(
        self, tokenizer: Any, prompt_width: int, stops: Sequence[str], *, dedent: bool
    ) -> None:
        self._tokenizer = tokenizer
        self._width = prompt_width
        self._stops = [s for s in stops if s]
        self._dedent = dedent

    def __call__(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any
    ) -> torch.BoolTensor:
        done = [
            any(s in text for s in self._stops)
            or (self._dedent and _DEDENT.search(text) is not None)
            for text in self._tokenizer.batch_decode(
                input_ids[:, self._width :], skip_special_tokens=True
            )
        ]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)  # type: ignore[return-value]


def _vocab_hash(tokenizer: Any) -> str:
    # The id -> token mapping is what logit distillation needs to agree on.
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()


class ModelHost:
    """A causal LM with a LoRA adapter (see the module docstring). Build with :meth:`load`."""

    def __init__(
        self,
        model: PeftModel,
        tokenizer: Any,
        lora: LoraSettings,
        *,
        source: str,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.lora = lora
        self.source = source
        self.seed = seed
        self.tokenizer_hash = _vocab_hash(tokenizer)
        self._pad_id = int(tokenizer.pad_token_id)
        # Texts are cut to what max_length tokens can cover before they are tokenised.
        self._token_chars = max_token_chars(tokenizer)
        # A prompt's cut costs several tokenizer calls and depends on the prompt and this
        # tokenizer alone; the same prompts recur every round (own data, X_u, the probe):
        # 13 of a micro experiment's 94 CPU s before. Bounded: teachers' prompts vary.
        self._split = functools.lru_cache(maxsize=_SPLIT_CACHE)(
            functools.partial(split_prompt, tokenizer)
        )
        # Training encodes every example of a source to draw a few batches from them, and
        # the own data are the same every round: 10 of a micro experiment's 94 CPU s went
        # to encoding them again. Teachers' texts vary, hence the bound.
        self._encoding = functools.lru_cache(maxsize=_ENCODE_CACHE)(self._compact_encoding)
        #: Set from any thread to end the running (and any later) training call at its next
        #: optimiser step boundary; the one cross-thread signal a host accepts.
        self.interrupt = threading.Event()
        self._adapter_version = 0
        self._encoded: tuple[int, EncodedAdapter] | None = None
        self._frozen_lora_a = False
        self.model.eval()

    # ------------------------------------------------------------------------ construction

    @classmethod
    def load(
        cls,
        path_or_name: str | Path,
        lora: LoraSettings | None = None,
        *,
        device: str = "auto",
        seed: int = 0,
    ) -> ModelHost:
        """Load tokenizer and model with ``from_pretrained`` and attach a seeded LoRA adapter.

        ``device="auto"`` picks CUDA in bfloat16 where available, otherwise CPU in float32;
        "cpu" and "cuda" force the device (CUDA still uses bfloat16 when supported). A
        tokenizer without a pad token pads with EOS (padding is always masked).
        """
        if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda, not {device!r}")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but torch.cuda.is_available() is False")
        dtype = torch.float32
        if device.startswith("cuda") and torch.cuda.is_bf16_supported():
            dtype = torch.bfloat16
        source = str(path_or_name)
        tokenizer = AutoTokenizer.from_pretrained(source)
        if tokenizer.pad_token is None:
            if tokenizer.eos_token is None:
                raise ValueError(f"tokenizer of {source} has neither a pad nor an EOS token")
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
        model.to(device)  # type: ignore[arg-type]
        settings = lora or LoraSettings()
        # Seeded adapter initialisation (LoRA A is random, B zero) without touching the
        # caller's RNG: agents with the same seed start from the same phi_i.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            peft_model = apply_lora(model, settings)
        return cls(peft_model, tokenizer, settings, source=source, seed=seed)

    # -------------------------------------------------------------------------- properties

    @property
    def model_type(self) -> str:
        """``config.model_type`` of the base model (e.g. "gpt2", "qwen2")."""
        return str(self.model.config.model_type)

    @property
    def family(self) -> str:
        """gpt2, gpt_neox, bloom, qwen2, llama or other (see :func:`family_of`)."""
        return family_of(self.model_type)

    @property
    def vocab_size(self) -> int:
        """Size of the tokenizer's vocabulary (the token id space of this host)."""
        return len(self.tokenizer)

    @property
    def trainable_parameters(self) -> int:
        """Parameters that LoRA trains."""
        return trainable_share(self.model)[0]

    @property
    def total_parameters(self) -> int:
        """All parameters, base and adapter."""
        return trainable_share(self.model)[1]

    @property
    def trainable_share(self) -> float:
        """trainable / total (Table 3's *Trainable %* as a fraction)."""
        return trainable_share(self.model)[2]

    @property
    def device(self) -> str:
        """Device of the model's parameters, e.g. "cpu" or "cuda:0"."""
        return str(next(self.model.parameters()).device)

    @property
    def context_length(self) -> int:
        """Longest sequence the model accepts (position table size; 2048 for ALiBi models)."""
        config = self.model.config
        for name in ("max_position_embeddings", "n_positions", "seq_length"):
            value = getattr(config, name, None)
            if isinstance(value, int) and value > 0:
                return value
        limit = getattr(self.tokenizer, "model_max_length", 0)
        return int(limit) if isinstance(limit, int) and 0 < limit < 1_000_000 else 2048

    @property
    def frozen_lora_a(self) -> bool:
        """Whether training leaves this host's LoRA A factors unchanged (FFA-LoRA).

        When True, every training call (local, AKD, HKA, ...) updates only the B factors of
        the host's own adapter; A stays bit-identical (it is not even given to the
        optimiser, so weight decay cannot move it). Loading an adapter still replaces A:
        the caller decides which A the host holds. False by default.
        """
        return self._frozen_lora_a

    @frozen_lora_a.setter
    def frozen_lora_a(self, frozen: bool) -> None:
        self._frozen_lora_a = bool(frozen)
        self._set_lora_a_trainable(not self._frozen_lora_a)

    def _enforce_freeze(self) -> None:
        # peft's set_adapter marks the active adapter's factors trainable again; every path
        # that switches adapters calls this afterwards.
        if self._frozen_lora_a:
            self._set_lora_a_trainable(False)

    def _set_lora_a_trainable(self, trainable: bool) -> None:
        # Only the host's own adapter ("default"); HKA's teacher adapters stay as they are.
        for name, p in self.model.named_parameters():
            if ".lora_A.default." in name:
                p.requires_grad_(trainable)

    # ------------------------------------------------------------------------------ helpers

    @contextmanager
    def _seeded(self, seed: int) -> Iterator[None]:
        dev = next(self.model.parameters()).device
        with torch.random.fork_rng(devices=[dev.index or 0] if dev.type == "cuda" else []):
            torch.manual_seed(seed)
            yield

    def _encode_all(self, examples: Sequence[Example], max_length: int) -> list[Encoded]:
        limit = min(max_length, self.context_length)
        budget = text_budget(self._token_chars, limit)
        out: list[Encoded] = []
        for example in examples:
            compact = self._encoding(example, limit, budget)
            if compact is not None:
                ids, masked = compact
                out.append(Encoded(list(ids), [IGNORE_INDEX] * masked + list(ids[masked:])))
        return out

    def _compact_encoding(
        self, example: Example, limit: int, budget: int
    ) -> tuple[array[int], int] | None:
        """:func:`encode_example` as the ids and the count of leading unlabelled positions
        (its labels are ``IGNORE_INDEX`` there and the ids after): a tenth of the lists'
        memory in :attr:`_encoding`'s cache."""
        encoded = encode_example(
            self.tokenizer, example, limit, max_chars=budget, split=self._split
        )
        if encoded is None:
            return None
        masked = 0
        while masked < len(encoded.labels) and encoded.labels[masked] == IGNORE_INDEX:
            masked += 1
        return array("q", encoded.input_ids), masked

    def _text_source(self, name: str, weight: float, items: list[Encoded]) -> Source:
        return Source(
            name, weight, items, lambda batch: token_loss_sum(self.model, batch, self._pad_id)
        )

    def _train(
        self, sources: list[Source], settings: TrainSettings, steps: int | None
    ) -> TrainStats:
        # Training changes the adapter: the cached encoding (if any) is of an older version.
        self._adapter_version += 1
        # The optimiser takes its parameters once, at the start: a frozen A stays out of it
        # even if peft marks it trainable mid-call (HKA switches adapters inside each step).
        self._enforce_freeze()
        return run_training(self.model, sources, settings, steps, interrupt=self.interrupt)

    # ----------------------------------------------------------------------------- training

    def train_local(
        self, examples: Sequence[Example], settings: TrainSettings, *, steps: int | None = None
    ) -> TrainStats:
        """Fine-tune the adapter on private examples by causal-LM loss (``L_i(D_i)``).

        A ``str`` example is trained on all its tokens, a (prompt, completion) pair on the
        completion only (see :mod:`peerlm.agent.training`). ``steps`` optimiser steps, or
        ``settings.epochs`` passes over the data.
        """
        items = self._encode_all(examples, settings.max_length)
        if not items:
            raise ValueError("train_local: no example has a token to train on")
        stats = self._train([self._text_source("local", 1.0, items)], settings, steps)
        stats.local_loss = stats.mean_loss
        return stats

    def _check_alpha(self, alpha_kd: float) -> float:
        alpha = float(alpha_kd)
        if not 0.0 <= alpha <= 1.0 or math.isnan(alpha):
            raise ValueError(f"alpha_kd must lie in [0, 1], got {alpha_kd}")
        return alpha

    def train_akd(
        self,
        local_examples: Sequence[Example],
        teacher_texts: Sequence[tuple[str, str]],
        alpha_kd: float,
        settings: TrainSettings,
        *,
        steps: int | None = None,
    ) -> TrainStats:
        """Adaptive Knowledge Distillation, Eq. 2, text mode.

        Minimises ``(1 - alpha_kd) * L_local + alpha_kd * CE(y~_j(x), p_i(. | x))`` where
        ``teacher_texts`` are (prompt x, teacher completion y_j(x)) pairs on X_u. The
        teacher's *text* is re-encoded with this host's tokenizer, so any teacher
        architecture and tokenizer works; the CE covers the completion tokens given the
        prompt. Each step takes one accumulation window from each source (the sources
        interleave; the smaller cycles); a source of weight 0 is skipped entirely. Without
        ``steps``: ``settings.epochs`` passes over the larger source.
        """
        alpha = self._check_alpha(alpha_kd)
        local = self._encode_all(local_examples, settings.max_length) if alpha < 1 else []
        teacher = self._encode_all(list(teacher_texts), settings.max_length) if alpha > 0 else []
        if alpha < 1 and not local:
            raise ValueError("train_akd: alpha_kd < 1 needs local examples with tokens")
        if alpha > 0 and not teacher:
            raise ValueError("train_akd: alpha_kd > 0 needs teacher completions with tokens")
        local_src = self._text_source("local", 1.0 - alpha, local)
        kd_src = self._text_source("kd", alpha, teacher)
        stats = self._train([local_src, kd_src], settings, steps)
        stats.local_loss, stats.kd_loss, stats.alpha_kd = local_src.mean(), kd_src.mean(), alpha
        return stats

    def train_akd_logits(
        self,
        local_examples: Sequence[Example],
        teacher_logits: Sequence[Mapping[str, Any]],
        alpha_kd: float,
        settings: TrainSettings,
        *,
        temperature: float = 1.0,
        steps: int | None = None,
    ) -> TrainStats:
        """Eq. 2 with the logit mode's KD term: T^2 * KL(teacher || student) on top-k.

        ``teacher_logits`` are the dictionaries of a teacher's :meth:`topk_logits`. Token
        distributions only compare within one id space, so this mode requires the teacher's
        tokenizer to be this host's (same vocabulary hash) and raises
        :class:`TokenizerMismatchError` otherwise; across tokenizers use :meth:`train_akd`.
        ``temperature`` is the student-side T (Table 6 anneals 2.5 -> 1.5).
        """
        alpha = self._check_alpha(alpha_kd)
        if temperature <= 0:
            raise ValueError("temperature must be > 0")
        targets: list[LogitTarget] = []
        if alpha > 0:
            limit = min(settings.max_length, self.context_length)
            targets = [self._logit_target(entry, limit) for entry in teacher_logits]
            targets = [t for t in targets if t.targets > 0]
            if not targets:
                raise ValueError("train_akd_logits: alpha_kd > 0 needs teacher logits")
        local = self._encode_all(local_examples, settings.max_length) if alpha < 1 else []
        if alpha < 1 and not local:
            raise ValueError("train_akd_logits: alpha_kd < 1 needs local examples with tokens")
        local_src = self._text_source("local", 1.0 - alpha, local)
        kd_src = Source(
            "kd",
            alpha,
            targets,
            lambda batch: kd_kl_sum(self.model, batch, self._pad_id, temperature),
        )
        stats = self._train([local_src, kd_src], settings, steps)
        stats.local_loss, stats.kd_loss, stats.alpha_kd = local_src.mean(), kd_src.mean(), alpha
        return stats

    def train_hka(
        self,
        public_examples: Sequence[tuple[str, str]],
        clients: Sequence[ClientAdapter],
        settings: TrainSettings,
        *,
        alpha: float = 0.5,
        weights: Sequence[float] | None = None,
        steps: int | None = None,
    ) -> TrainStats:
        """OnePeFT's Heterogeneous Knowledge Alignment (Eq. 4-6) of this host's adapter.

        Minimises ``alpha * CE + (1 - alpha) * KL(sum_i lambda_i p_i || q)`` on the
        completions of ``public_examples`` (D_pub), the teachers ``p_i`` being this base
        model with client i's adapter (:mod:`peerlm.agent.merging.hka`: one base, the adapters
        switched per forward; ranks may differ from this host's). ``weights`` are the
        lambda_i, by default the clients' data shares. ``stats.local_loss`` is the CE mean
        and ``stats.kd_loss`` the KL mean; ``stats.alpha_kd`` is ``1 - alpha`` (the KD
        share). A client that does not fit raises :class:`AdapterError` before anything
        changes.
        """
        from peerlm.agent.merging.hka import mixture_kl_sum, teacher_adapters

        a = self._check_alpha(alpha)
        items = self._encode_all(list(public_examples), settings.max_length)
        if not items:
            raise ValueError("train_hka: no public example has a token to train on")
        try:
            with teacher_adapters(self.model, clients, weights) as teachers:
                ce_src = self._text_source("ce", a, items)
                kl_src = Source(
                    "kl",
                    1.0 - a,
                    items,
                    lambda batch: mixture_kl_sum(self.model, batch, self._pad_id, teachers),
                )
                stats = self._train([ce_src, kl_src], settings, steps)
        finally:
            self._enforce_freeze()  # teacher_adapters leaves by set_adapter("default")
        stats.local_loss, stats.kd_loss, stats.alpha_kd = ce_src.mean(), kl_src.mean(), 1.0 - a
        return stats

    def check_logit_tokenizer(self, teacher_hash: str) -> None:
        """Raise :class:`TokenizerMismatchError` unless logits of a teacher whose tokenizer
        hashes to ``teacher_hash`` index this model's vocabulary (the same tokenizer)."""
        if teacher_hash != self.tokenizer_hash:
            raise TokenizerMismatchError(
                "logit distillation needs the teacher's tokenizer to be the student's "
                f"(teacher vocabulary {teacher_hash[:12] or 'unknown'}, student "
                f"{self.tokenizer_hash[:12]}); use text distillation (train_akd) across "
                "tokenizers"
            )

    def _logit_target(self, entry: Mapping[str, Any], limit: int) -> LogitTarget:
        self.check_logit_tokenizer(str(entry.get("tokenizer_hash", "")))
        ids = [int(i) for i in np.asarray(entry["input_ids"]).tolist()]
        prompt_length = int(entry["prompt_length"])
        top_ids = np.asarray(entry["ids"], dtype=np.int64)
        logprobs = np.asarray(entry["logprobs"], dtype=np.float32)
        n_completion = len(ids) - prompt_length
        if (
            not 0 < prompt_length <= len(ids)
            or top_ids.ndim != 2
            or top_ids.shape != logprobs.shape
            or top_ids.shape[0] != n_completion
        ):
            raise ValueError("malformed teacher logits entry (shapes do not match the ids)")
        if (ids and (min(ids) < 0 or max(ids) >= self.vocab_size)) or (
            top_ids.size and (top_ids.min() < 0 or top_ids.max() >= self.vocab_size)
        ):
            raise ValueError("teacher logits entry has token ids outside the vocabulary")
        if not np.isfinite(logprobs).all():
            raise ValueError("teacher logits entry has non-finite log-probabilities")
        keep_p, keep_c = fit_lengths(ids[:prompt_length], ids[prompt_length:], limit)
        prompt = ids[prompt_length - keep_p : prompt_length]
        completion = ids[prompt_length : prompt_length + keep_c]
        return LogitTarget(
            input_ids=prompt + completion,
            prompt_length=len(prompt),
            ids=top_ids[:keep_c],
            logprobs=logprobs[:keep_c],
            temperature=float(entry.get("temperature", 1.0)),
        )

    # --------------------------------------------------------------------- teacher outputs

    @torch.inference_mode()
    def topk_logits(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        k: int = 16,
        temperature: float = 1.0,
        *,
        max_length: int = 256,
        batch_size: int = 8,
    ) -> list[dict[str, Any]]:
        """Teacher side of the logit mode: top-k log-probabilities per completion token.

        One dictionary per (prompt, completion): ``input_ids`` (int32, prompt + completion +
        EOS as this tokenizer encodes them, the prompt's trailing indent moved to the
        completion as in training), ``prompt_length``, ``ids`` (int32, [L, k]) and
        ``logprobs`` (float32, [L, k], log-softmax of logits / ``temperature``),
        ``temperature`` and ``tokenizer_hash`` (the student checks it).

        Row t describes the position that predicts ``input_ids[prompt_length + t]``.
        Column 0 is that token itself (the completion's own token, whatever its rank),
        columns 1..k-1 the k-1 most probable other tokens, best first. So the completion
        can be rebuilt from column 0 (a package need not carry it twice), and the KD
        support always contains the token the teacher's text has.
        """
        if len(prompts) != len(completions):
            raise ValueError("prompts and completions differ in length")
        if k < 1 or temperature <= 0:
            raise ValueError("k must be >= 1 and temperature > 0")
        k = min(k, self.vocab_size)
        limit = min(max_length, self.context_length)
        encoded: list[tuple[list[int], int]] = []
        for prompt, completion in zip(prompts, completions, strict=True):
            p, c = encode_pair(
                self.tokenizer,
                prompt,
                completion,
                max_chars=text_budget(self._token_chars, limit),
                split=self._split,
            )
            keep_p, keep_c = fit_lengths(p, c, limit)
            encoded.append((p[len(p) - keep_p :] + c[:keep_c], keep_p))
        out: list[dict[str, Any]] = []
        self.model.eval()
        for lo in range(0, len(encoded), batch_size):
            chunk = encoded[lo : lo + batch_size]
            items = [Encoded(ids, ids) for ids, _ in chunk]
            ids_t, mask, _ = collate(items, self._pad_id, next(self.model.parameters()).device)
            logits = self.model(input_ids=ids_t, attention_mask=mask, use_cache=False).logits
            for row, (ids, plen) in enumerate(chunk):
                n = len(ids) - plen
                scores = torch.log_softmax(
                    logits[row, plen - 1 : plen - 1 + n].float() / temperature, -1
                )
                # Column 0: the token the text has there; then the k-1 likeliest others.
                actual = torch.as_tensor(ids[plen:], dtype=torch.long, device=scores.device)
                own = scores.gather(-1, actual[:, None])
                others = scores.scatter(-1, actual[:, None], float("-inf"))
                top = others.topk(k - 1, dim=-1) if k > 1 else None
                top_ids = (
                    actual[:, None]
                    if top is None
                    else torch.cat([actual[:, None], top.indices], -1)
                )
                top_lp = own if top is None else torch.cat([own, top.values], -1)
                out.append(
                    {
                        "input_ids": np.asarray(ids, dtype=np.int32),
                        "prompt_length": plen,
                        "ids": top_ids.cpu().numpy().astype(np.int32),
                        "logprobs": top_lp.cpu().numpy().astype(np.float32),
                        "temperature": float(temperature),
                        "tokenizer_hash": self.tokenizer_hash,
                    }
                )
        return out

    # --------------------------------------------------------------------------- evaluation

    @torch.inference_mode()
    def eval_loss(
        self, examples: Sequence[Example], *, batch_size: int = 8, max_length: int = 256
    ) -> tuple[float, float]:
        """(mean token loss, perplexity) over ``examples``, token-weighted, without gradients.

        Examples are encoded as for training (whole text, or completion given prompt).
        """
        items = self._encode_all(examples, max_length)
        if not items:
            raise ValueError("eval_loss: no example has a token to score")
        self.model.eval()
        total = 0.0
        count = 0
        for lo in range(0, len(items), batch_size):
            loss_sum, n = token_loss_sum(self.model, items[lo : lo + batch_size], self._pad_id)
            total += float(loss_sum)
            count += n
        loss = total / count
        return loss, (math.exp(loss) if loss < 700 else math.inf)

    @torch.inference_mode()
    def sequence_logprobs(
        self, pairs: Sequence[tuple[str, str]], *, batch_size: int = 8, max_length: int = 256
    ) -> list[float]:
        """log p(completion + EOS | prompt) of each (prompt, completion) pair, in nats.

        The probability of a *string* under this model (its canonical tokenisation, as in
        training), so values of hosts with different tokenizers compare. Pairs too long
        for ``max_length`` are scored on what :func:`fit_lengths` keeps.
        """
        limit = min(max_length, self.context_length)
        budget = text_budget(self._token_chars, limit)
        encoded = [
            encode_example(self.tokenizer, pair, limit, max_chars=budget, split=self._split)
            for pair in pairs
        ]
        # A pair with nothing to score (no room left for its completion) gets -inf.
        empty = Encoded([self._pad_id], [IGNORE_INDEX])
        items = [e if e is not None else empty for e in encoded]
        device = next(self.model.parameters()).device
        out: list[float] = []
        self.model.eval()
        for lo in range(0, len(items), batch_size):
            chunk = items[lo : lo + batch_size]
            ids, mask, labels = collate(chunk, self._pad_id, device)
            logits = self._scoring_logits(ids, mask)
            logp = torch.log_softmax(logits[:, :-1].float(), -1)
            target = labels[:, 1:]
            picked = logp.gather(-1, target.clamp(min=0)[..., None])[..., 0]
            picked = picked.masked_fill(target < 0, 0.0)
            out.extend(float(v) for v in picked.sum(-1).cpu())
        return [v if e is not None else float("-inf") for v, e in zip(out, encoded, strict=True)]

    def _scoring_logits(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The next-token logits :meth:`sequence_logprobs` scores with; a host that decodes
        from combined logits (:class:`~peerlm.agent.fedproxy.tuning.ProxyTunedHost`) overrides
        this and :meth:`_logit_offset` together."""
        logits: torch.Tensor = self.model(
            input_ids=ids, attention_mask=mask, use_cache=False
        ).logits
        return logits

    def _logit_offset(
        self, mask: torch.Tensor, copies: int, scale: float
    ) -> LogitsProcessor | None:
        """A processor adding ``scale`` × an offset to the next-token logits during
        :meth:`generate` (rows: ``copies`` per prompt of ``mask``'s batch); None here."""
        return None

    # --------------------------------------------------------------------------- generation

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[str],
        *,
        max_new_tokens: int = 96,
        temperature: float = 0.0,
        top_p: float = 0.95,
        n: int = 1,
        seed: int = 0,
        stop: Sequence[str] = DEFAULT_STOPS,
        dedent: bool = True,
        batch_size: int = 8,
    ) -> list[list[str]]:
        """``n`` completions per prompt: the text after the prompt, cut at ``stop``.

        ``temperature=0`` is greedy (deterministic; n copies of the same completion);
        otherwise nucleus sampling with ``top_p``, seeded by ``seed`` (reproducible, and
        the caller's RNG is untouched). Prompts are batched with left padding; a prompt
        longer than the context minus ``max_new_tokens`` keeps its end.

        A prompt's trailing indent is not tokenised with it: the model generates it as the
        start of the body (:func:`~peerlm.agent.training.split_prompt`, the same split as
        training), and the completion returned is the text after the *whole* prompt (the
        indent removed again when the model produced it). With ``dedent`` (the default),
        generation also stops at the first line that starts at column 0
        (:func:`truncate_at_stops`), so a completion is one function body.
        """
        if n < 1 or max_new_tokens < 1 or temperature < 0:
            raise ValueError("need n >= 1, max_new_tokens >= 1, temperature >= 0")
        sample = temperature > 0
        budget = max(1, self.context_length - max_new_tokens)
        device = next(self.model.parameters()).device
        eos = self.tokenizer.eos_token_id
        start = int(eos) if eos is not None else self._pad_id
        results: list[list[str]] = []
        self.model.eval()
        with self._seeded(seed):
            for lo in range(0, len(prompts), batch_size):
                chunk = prompts[lo : lo + batch_size]
                # An empty prompt starts from EOS (a document boundary): a row with no
                # attended position at all has no defined attention.
                heads = [self._split(p) for p in chunk]
                encoded = [
                    token_ids(self.tokenizer, head, special=True)[-budget:] or [start]
                    for head, _ in heads
                ]
                width = max(len(e) for e in encoded)
                ids = torch.full((len(chunk), width), self._pad_id, dtype=torch.long)
                mask = torch.zeros((len(chunk), width), dtype=torch.long)
                for row, e in enumerate(encoded):
                    ids[row, width - len(e) :] = torch.tensor(e, dtype=torch.long)
                    mask[row, width - len(e) :] = 1
                kwargs: dict[str, Any] = {
                    "max_new_tokens": max_new_tokens,
                    "do_sample": sample,
                    "num_return_sequences": n if sample else 1,
                    "pad_token_id": self._pad_id,
                    "eos_token_id": eos,
                    "stopping_criteria": StoppingCriteriaList(
                        [_StopOnStrings(self.tokenizer, width, stop, dedent=dedent)]
                    ),
                }
                if sample:
                    kwargs.update(temperature=temperature, top_p=top_p, top_k=0)
                else:
                    # Explicit neutral values: a checkpoint's generation_config may carry
                    # sampling defaults that would otherwise trigger warnings.
                    kwargs.update(temperature=None, top_p=None, top_k=None)
                offset = self._logit_offset(
                    mask.to(device), n if sample else 1, 1.0 / temperature if sample else 1.0
                )
                if offset is not None:
                    # generate() runs a caller's processors after its own warpers: the offset
                    # comes after the temperature (hence its scale), and the nucleus must be
                    # taken after the offset, so ours replaces generate()'s top-p.
                    custom: list[LogitsProcessor] = [offset]
                    if sample:
                        kwargs["top_p"] = 1.0
                        custom.append(TopPLogitsWarper(top_p))
                    kwargs["logits_processor"] = LogitsProcessorList(custom)
                out = self.model.generate(  # type: ignore[no-untyped-call]
                    input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs
                )
                texts = self.tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
                texts = [truncate_at_stops(t, stop, dedent=dedent) for t in texts]
                per = n if sample else 1
                for i in range(len(chunk)):
                    indent = heads[i][1]
                    group = [
                        t[len(indent) :] if t.startswith(indent) else t
                        for t in texts[i * per : (i + 1) * per]
                    ]
                    results.append(group if sample else group * n)
        return results

    # ---------------------------------------------------------------------------- adapters

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The LoRA weights only (``peft.get_peft_model_state_dict``), detached CPU copies."""
        state = get_peft_model_state_dict(self.model, save_embedding_layers=False)
        return {k: v.detach().to("cpu").clone().contiguous() for k, v in state.items()}

    def adapter_spec(self) -> AdapterSpec:
        """What an adapter must be to fit this host (:mod:`peerlm.agent.adapter_codec`)."""
        shapes = {
            k: tuple(v.shape)
            for k, v in get_peft_model_state_dict(self.model, save_embedding_layers=False).items()
        }
        return AdapterSpec(
            shapes=shapes,
            model_type=self.model_type,
            tokenizer_hash=self.tokenizer_hash,
            lora_r=self.lora.r,
            lora_alpha=self.lora.alpha,
            lora_json=self.lora.model_dump_json(),
        )

    def _metadata(self) -> dict[str, str]:
        return self.adapter_spec().metadata()

    def load_adapter_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replace the adapter's weights; :class:`AdapterMismatchError` if they do not fit.

        Every expected tensor must be present with the expected shape, no other tensor may
        be, and all values must be finite (a peer's adapter is untrusted input); checked by
        :func:`~peerlm.agent.adapter_codec.check_state` before anything changes.
        """
        check_state(state, self.adapter_spec())
        self._load_checked(state)

    def _load_checked(self, state: Mapping[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        device = next(self.model.parameters()).device
        converted: dict[str, torch.Tensor] = {}
        for k, v in state.items():
            # peft names tensors without the adapter name; find the live one for its dtype.
            live = params.get(k.replace(".weight", ".default.weight"))
            dtype = live.dtype if live is not None else v.dtype
            converted[k] = v.to(device=device, dtype=dtype)
        self._adapter_version += 1
        result = set_peft_model_state_dict(self.model, converted)
        unexpected_after = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected_after:
            raise AdapterMismatchError(f"peft did not use tensors: {unexpected_after[:3]}")

    def encoded_adapter(self) -> EncodedAdapter:
        """The adapter encoded (safetensors with metadata) and hashed, once per version.

        Every training call and every load makes a new version; until then all pulls share
        one encoding and one SHA-256 pass (the peer server streams it as is).
        """
        cached = self._encoded
        if cached is not None and cached[0] == self._adapter_version:
            return cached[1]
        version = self._adapter_version
        encoded = EncodedAdapter.of(encode_adapter(self.adapter_state(), self.adapter_spec()))
        self._encoded = (version, encoded)
        return encoded

    def adapter_bytes(self) -> bytes:
        """The adapter as safetensors bytes (with base and LoRA metadata), for peers."""
        return self.encoded_adapter().data

    def load_adapter_bytes(self, data: bytes, *, strict: bool = True) -> None:
        """Load safetensors bytes from :meth:`adapter_bytes` (never pickle).

        With ``strict`` a blob carrying peerlm metadata must name this host's model type,
        tokenizer and LoRA settings, so an adapter of another base model is refused even
        where shapes happen to agree; a plain safetensors adapter loads by shape.
        """
        tensors = decode_adapter(
            data, self.adapter_spec(), identity="if_present" if strict else "ignored"
        )
        self._load_checked(tensors)

    def save_adapter(self, path: str | Path) -> Path:
        """Write the adapter to ``path`` as safetensors, atomically (temp file + rename)."""
        return write_atomic(Path(path), self.adapter_bytes())

    def load_adapter(self, path: str | Path, *, strict: bool = True) -> None:
        """Load an adapter written by :meth:`save_adapter`."""
        self.load_adapter_bytes(Path(path).read_bytes(), strict=strict)

    def describe(self) -> dict[str, Any]:
        """A JSON-ready summary (logs, status endpoints)."""
        trainable, total, share = trainable_share(self.model)
        return {
            "source": self.source,
            "model_type": self.model_type,
            "family": self.family,
            "vocab_size": self.vocab_size,
            "trainable_parameters": trainable,
            "total_parameters": total,
            "trainable_share": share,
            "device": self.device,
            "lora": self.lora.model_dump(),
            "tokenizer_hash": self.tokenizer_hash,
        }
