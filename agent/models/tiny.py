"""Tiny causal LMs of four real architectures, built locally with their own tokenizers.

No model hub is reachable where peerlm is developed and tested, yet the agent must load its
model exactly as it would load Qwen1.5-0.5B or pythia-410m (DESIGN.md principle 8). This
module builds stand-ins of the same families (GPT-2, GPT-NeoX, BLOOM, Qwen2) from scratch:

1. a **corpus** every machine has: the Python standard library's top-level ``*.py`` files
   (sorted paths, the first ``corpus_bytes`` of them; no test suites, no site-packages),
   plus a **public, bank-style corpus**: complete functions (prompt + reference) of the
   public problems :func:`~peerlm.agent.tasks.bank.public_problems`, drawn with a seed of
   their own; federation data never contain one of those functions, so no private,
   validation, transfer or test problem was seen in pre-training;
2. a **byte-level BPE tokenizer per architecture** trained with ``tokenizers`` on that
   corpus, each with a *different* vocabulary size, so tokenizer heterogeneity in the
   federation is real: the same text becomes different token sequences for different agents.
   ``<|endoftext|>`` (id 0) is the only special token and serves as bos, eos, pad and unk,
   as in GPT-2;
3. a **small config of the family** (``tiny``: 1-2 M parameters, ``micro``: under 100 k for
   tests) with randomly initialised weights;
4. a **brief pre-training** (full parameters, AdamW, batches of 8 x 128-token windows;
   a ``public_share`` of the windows start at a public function, the rest anywhere in the
   standard library) so that the models know Python and the style of a small typed
   function with a docstring before LoRA fine-tuning;
5. ``save_pretrained`` of model and tokenizer into ``out_dir/<arch>/`` plus a
   ``peerlm-model.json`` manifest; the directory then loads with
   ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``.

Builds are deterministic under ``seed`` and cached: a directory whose manifest carries the
same configuration hash (shapes, steps, seed, corpus digest) is left as it is.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sysconfig
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

from peerlm.agent.tasks.copy_drills import CORPUS_SEED, copy_drills
from peerlm.agent.tasks.world import DEFAULT_PRIVATE_CATEGORIES

# torch, tokenizers and transformers are imported where a model is built, not here: a
# request that the cache or the shipped models answer (every `peerlm up` after the first,
# `peerlm models list`) then costs no ~5 CPU seconds of imports.
if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

__all__ = [
    "ARCHITECTURES",
    "DEFAULT_HIDDEN",
    "MANIFEST_NAME",
    "SPECIAL_TOKEN",
    "BuildEvent",
    "ModelInfo",
    "Size",
    "build_models",
    "public_corpus",
    "read_manifest",
    "stdlib_corpus",
]

Size = Literal["tiny", "micro"]

ARCHITECTURES: tuple[str, ...] = ("gpt2", "gpt_neox", "bloom", "qwen2")
MANIFEST_NAME = "peerlm-model.json"
SPECIAL_TOKEN = "<|endoftext|>"

# Bump when the build procedure changes in a way that changes the weights: cached models of
# an older format are rebuilt.
_FORMAT = 3

#: Categories left out of pre-training by default: the default world's private ones.
DEFAULT_HIDDEN: tuple[str, ...] = DEFAULT_PRIVATE_CATEGORIES


@dataclass(frozen=True)
class _Shape:
    vocab: int
    hidden: int
    layers: int
    heads: int
    intermediate: int
    context: int
    kv_heads: int | None = None


# Vocabulary sizes differ per architecture on purpose (tokenizer heterogeneity); hidden
# sizes and depths differ too so the families are not the same network under four names.
_SHAPES: Mapping[tuple[str, str], _Shape] = MappingProxyType(
    {
        ("gpt2", "tiny"): _Shape(2048, 128, 4, 4, 512, 512),
        ("gpt_neox", "tiny"): _Shape(3072, 160, 3, 4, 640, 512),
        ("bloom", "tiny"): _Shape(4096, 128, 3, 4, 512, 512),
        ("qwen2", "tiny"): _Shape(6144, 192, 3, 4, 512, 512, kv_heads=2),
        ("gpt2", "micro"): _Shape(512, 32, 1, 2, 128, 256),
        ("gpt_neox", "micro"): _Shape(640, 32, 1, 2, 128, 256),
        ("bloom", "micro"): _Shape(768, 32, 1, 2, 128, 256),
        ("qwen2", "micro"): _Shape(1024, 48, 1, 2, 96, 256, kv_heads=1),
    }
)


@dataclass(frozen=True)
class _Recipe:
    """How one size is built: corpus, pre-training batch shape and optimiser."""

    corpus_bytes: int
    steps: int
    batch: int
    seq_len: int
    lr: float
    public_per_category: int = 0
    public_share: float = 0.0
    split_digits: bool = False
    #: The copy phase: ``copy_steps`` more steps after the main pre-training,
    #: on rows that start at one of ``copy_drills`` drills (``peerlm.agent.tasks.copy_drills``)
    #: with probability ``drill_share`` and at a public function otherwise, with a fresh
    #: AdamW at the constant ``copy_lr``. The drills teach copying a constant from the
    #: docstring into the body; the main phase never sees them.
    copy_drills: int = 0
    drill_share: float = 0.0
    copy_steps: int = 0
    copy_lr: float = 0.0


_RECIPES: Mapping[str, _Recipe] = MappingProxyType(
    {
        # ~70 ms a step for these shapes on 2 CPU cores: 1000 steps ~ 70-110 s per model.
        "tiny": _Recipe(
            corpus_bytes=4_000_000,
            steps=1000,
            batch=8,
            seq_len=128,
            lr=4e-3,
            public_per_category=150,
            public_share=0.75,
            copy_drills=20_000,
            drill_share=0.8,
            copy_steps=1500,
            copy_lr=2e-3,
        ),
        # Tests: a tokenizer trained on 256 kB and a handful of steps, ~1 s per model.
        "micro": _Recipe(
            corpus_bytes=256_000,
            steps=4,
            batch=4,
            seq_len=64,
            lr=2e-3,
            public_per_category=4,
            public_share=0.5,
        ),
    }
)


#: Architectures whose copy phase runs longer than their size's recipe says. The rotary
#: ones learn to copy more slowly: after the recipe's 1,500 steps gpt_neox tiny copied 0 of
#: 60 held-out drills, and 50 %, 75 % and 83 % when its copy phase went on for 1,000, 2,000
#: and 3,000 more steps; built with 4,500, 62 %. qwen2 tiny, then of 2 layers, copied 1 of
#: 60 after 2,000 more steps; with a third layer (its shape above) and 4,500, 23 %
#: (docs/models.md, "The copy phase").
_COPY_STEPS: Mapping[tuple[str, str], int] = MappingProxyType(
    {("gpt_neox", "tiny"): 4500, ("qwen2", "tiny"): 4500}
)


def _recipe(arch: str, size: str) -> _Recipe:
    """The recipe ``arch`` is built by at ``size``: the size's, with the architecture's own
    copy-phase length where :data:`_COPY_STEPS` names one."""
    recipe = _RECIPES[size]
    copy_steps = _COPY_STEPS.get((arch, size))
    return recipe if copy_steps is None else replace(recipe, copy_steps=copy_steps)


@dataclass(frozen=True)
class BuildEvent:
    """Progress of :func:`build_models`, one per phase change and per pre-training step."""

    arch: str
    phase: Literal["tokenizer", "pretrain", "save", "done", "cached", "shipped"]
    step: int = 0
    total: int = 0
    loss: float | None = None

    @property
    def finished(self) -> bool:
        """The model is in place: built, found in the cache or copied from the shipped ones."""
        return self.phase in ("done", "cached", "shipped")


@dataclass
class ModelInfo:
    """One built model: where it is and what it is (also the manifest's content)."""

    arch: str
    size: str
    path: str
    model_type: str
    vocab_size: int
    parameters: int
    hidden_size: int
    layers: int
    context: int
    steps: int
    final_loss: float | None
    build_seconds: float
    config_hash: str
    corpus_sha256: str
    corpus_bytes: int
    seed: int
    cached: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dictionary."""
        return asdict(self)


# ---------------------------------------------------------------------------------- corpus


def stdlib_corpus(max_bytes: int) -> tuple[list[str], str]:
    """Texts of the standard library's top-level modules, sorted by name, about ``max_bytes``.

    Whole files are taken in order until the budget is reached (the last one is cut), so
    the sample is the same on every machine with the same Python. Returns the texts and
    the SHA-256 of what was taken (part of the build's cache key).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise RuntimeError(f"no Python sources under {root}: cannot build a corpus")
    texts: list[str] = []
    digest = hashlib.sha256()
    used = 0
    for path in files:
        if used >= max_bytes:
            break
        data = path.read_bytes()[: max_bytes - used]
        used += len(data)
        digest.update(path.name.encode() + b"\0" + data + b"\0")
        texts.append(data.decode("utf-8", errors="replace"))
    return texts, digest.hexdigest()


def public_corpus(
    n_per_category: int, hidden: Sequence[str] = DEFAULT_HIDDEN
) -> tuple[list[str], str]:
    """Complete functions (prompt + reference) of the public bank problems, and their SHA-256.

    See :func:`peerlm.agent.tasks.bank.public_problems`: a seed of their own, and federation
    data exclude these functions, so pre-training on them leaks no evaluation problem.
    Categories in ``hidden`` (the world's private categories) are left out entirely.
    """
    from peerlm.agent.tasks.bank import public_problems

    texts = [p.prompt + p.reference for p in public_problems(n_per_category, hidden=hidden)]
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode("utf-8") + b"\0")
    return texts, digest.hexdigest()


@dataclass(frozen=True)
class _Corpus:
    stdlib: list[str]
    public: list[str]
    sha256: str
    hidden: tuple[str, ...] = ()
    drills: list[str] = field(default_factory=list)

    @property
    def texts(self) -> list[str]:
        """What the tokenizer is trained on: the drills' random constants are left out, so
        they add no merges of their own."""
        return [*self.stdlib, *self.public]

    @property
    def n_bytes(self) -> int:
        return sum(len(t.encode("utf-8")) for t in [*self.texts, *self.drills])


def _corpus(recipe: _Recipe, hidden: Sequence[str]) -> _Corpus:
    stdlib, stdlib_sha = stdlib_corpus(recipe.corpus_bytes)
    public, public_sha = public_corpus(recipe.public_per_category, hidden)
    key = f"{stdlib_sha}:{public_sha}"
    drills: list[str] = []
    if recipe.copy_drills:
        drills = copy_drills(recipe.copy_drills, CORPUS_SEED)
        digest = hashlib.sha256()
        for text in drills:
            digest.update(text.encode("utf-8") + b"\0")
        key += f":{digest.hexdigest()}"
    sha = hashlib.sha256(key.encode()).hexdigest()
    return _Corpus(stdlib, public, sha, tuple(hidden), drills)


# ------------------------------------------------------------------------------- tokenizer


# Qwen2's pre-tokenisation regex. transformers (v5) loads every ``qwen2`` checkpoint through
# ``Qwen2Tokenizer``, which rebuilds the pipeline (NFC, this split, byte level) around the
# saved vocabulary and merges: training with the same pipeline keeps the tokenizer an agent
# loads identical to the one the model was pre-trained with.
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _train_tokenizer(
    arch: str, texts: Sequence[str], vocab_size: int, context: int, *, split_digits: bool = False
) -> PreTrainedTokenizerFast:
    """A byte-level BPE (any byte sequence encodes; decode inverts encode) for ``arch``.

    GPT-2, GPT-NeoX and BLOOM use GPT-2's byte-level pre-tokenisation; Qwen2 its own split
    regex with NFC normalisation, as the real families do.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    if arch == "qwen2":
        tok.normalizer = normalizers.NFC()  # type: ignore[assignment]
        tok.pre_tokenizer = pre_tokenizers.Sequence(  # type: ignore[assignment]
            [
                pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif split_digits:
        # One token per digit, as Qwen2's split already does: a number is then the same
        # tokens wherever it appears (GPT-2's regex merges digit runs by frequency, so
        # "17" in a docstring and in the body could become different tokens).
        tok.pre_tokenizer = pre_tokenizers.Sequence(  # type: ignore[assignment]
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # type: ignore[assignment]
    tok.decoder = decoders.ByteLevel()  # type: ignore[assignment]
    trainer = trainers.BpeTrainer(  # type: ignore[call-arg]
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[SPECIAL_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKEN,
        eos_token=SPECIAL_TOKEN,
        pad_token=SPECIAL_TOKEN,
        unk_token=SPECIAL_TOKEN,
        model_max_length=context,
    )


def _save_tokenizer(tokenizer: PreTrainedTokenizerFast, directory: Path) -> None:
    tokenizer.save_pretrained(directory)
    # transformers 5 writes its new class name, which 4.x cannot resolve; the classic name
    # loads as the same tokenizers-backed class in both.
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _check_reload(directory: Path, trained: PreTrainedTokenizerFast, texts: Sequence[str]) -> None:
    """Fail the build if ``AutoTokenizer`` would give agents a different tokenizer."""
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(directory)
    for text in texts:
        a = trained.backend_tokenizer.encode(text, add_special_tokens=False).ids
        b = loaded.backend_tokenizer.encode(text, add_special_tokens=False).ids
        if a != b or len(loaded) != len(trained):
            raise RuntimeError(
                f"AutoTokenizer.from_pretrained({directory}) loads {type(loaded).__name__}, "
                "which tokenizes differently from the trained tokenizer"
            )


# ---------------------------------------------------------------------------------- config


def _model_config(arch: str, shape: _Shape, vocab: int, special_id: int) -> PretrainedConfig:
    from transformers import BloomConfig, GPT2Config, GPTNeoXConfig, Qwen2Config

    ids: dict[str, Any] = {
        "bos_token_id": special_id,
        "eos_token_id": special_id,
        "pad_token_id": special_id,
        "vocab_size": vocab,
    }
    # Dropout off: pre-training is short and LoRA adds its own dropout during fine-tuning.
    if arch == "gpt2":
        return GPT2Config(
            n_embd=shape.hidden,
            n_layer=shape.layers,
            n_head=shape.heads,
            n_inner=shape.intermediate,
            n_positions=shape.context,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **ids,
        )
    if arch == "gpt_neox":
        return GPTNeoXConfig(
            hidden_size=shape.hidden,
            num_hidden_layers=shape.layers,
            num_attention_heads=shape.heads,
            intermediate_size=shape.intermediate,
            max_position_embeddings=shape.context,
            tie_word_embeddings=False,
            **ids,
        )
    if arch == "bloom":
        # BLOOM's MLP width is fixed at 4 x hidden and positions are ALiBi (no table).
        return BloomConfig(
            hidden_size=shape.hidden,
            n_layer=shape.layers,
            n_head=shape.heads,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            **ids,
        )
    if arch == "qwen2":
        return Qwen2Config(
            hidden_size=shape.hidden,
            num_hidden_layers=shape.layers,
            num_attention_heads=shape.heads,
            num_key_value_heads=shape.kv_heads or shape.heads,
            intermediate_size=shape.intermediate,
            max_position_embeddings=shape.context,
            tie_word_embeddings=True,
            **ids,
        )
    raise ValueError(f"unknown architecture {arch!r}; choose from {', '.join(ARCHITECTURES)}")


def _shape(arch: str, size: str) -> _Shape:
    try:
        return _SHAPES[(arch, size)]
    except KeyError:
        raise ValueError(
            f"unknown architecture/size {arch!r}/{size!r}; architectures: "
            f"{', '.join(ARCHITECTURES)}; sizes: tiny, micro"
        ) from None


def _arch_seed(seed: int, arch: str) -> int:
    # Stable across processes (unlike hash()): each architecture gets its own stream.
    return int.from_bytes(hashlib.sha256(f"{seed}:{arch}".encode()).digest()[:4], "little")


def _config_hash(arch: str, size: str, steps: int, seed: int, corpus_sha: str) -> str:
    recipe = _recipe(arch, size)
    key = {
        "format": _FORMAT,
        "arch": arch,
        "size": size,
        "shape": asdict(_shape(arch, size)),
        # An option added later enters the key only when set: at its default the recipe
        # builds what it built before, and existing caches stay valid.
        "recipe": {
            k: v
            for k, v in asdict(recipe).items()
            if k not in ("split_digits", "copy_drills", "drill_share", "copy_steps", "copy_lr") or v
        },
        "steps": steps,
        "seed": seed,
        "corpus_sha256": corpus_sha,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


# -------------------------------------------------------------------------------- manifest


def read_manifest(model_dir: Path) -> ModelInfo | None:
    """The manifest of a built model directory, or None (absent, unreadable, incomplete)."""
    path = model_dir / MANIFEST_NAME
    try:
        data = json.loads(path.read_text())
        if data.pop("format", None) != _FORMAT:
            return None
        info = ModelInfo(**{**data, "path": str(model_dir), "cached": False})
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        if not (model_dir / name).is_file():
            return None
    return info


# -------------------------------------------------------------------------------- pretrain


@dataclass(frozen=True)
class _Stream:
    """Token ids of documents joined by EOS, and where each document starts."""

    ids: torch.Tensor
    starts: torch.Tensor


def _token_stream(tokenizer: PreTrainedTokenizerFast, texts: Sequence[str]) -> _Stream:
    import torch

    eos = int(tokenizer.eos_token_id)  # type: ignore[arg-type]
    ids: list[int] = []
    starts: list[int] = []
    # The backend directly: the wrapper warns about every document longer than the context,
    # which is expected here (windows are cut from the stream afterwards).
    for encoding in tokenizer.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False):
        starts.append(len(ids))
        ids.extend(encoding.ids)
        ids.append(eos)  # a document boundary, as in GPT-2's pre-training
    return _Stream(torch.tensor(ids, dtype=torch.long), torch.tensor(starts, dtype=torch.long))


def _lr_factor(step: int, total: int) -> float:
    """5 % linear warm-up, then cosine decay to 10 % of the peak."""
    warmup = max(1, math.ceil(0.05 * total))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def _windows(
    stdlib: torch.Tensor,
    public: _Stream | None,
    recipe: _Recipe,
    seq: int,
    generator: torch.Generator,
    drills: _Stream | None = None,
) -> torch.Tensor:
    """One batch: ``public_share`` of the rows start at a public function (the model sees
    whole functions from their ``def``), ``drill_share`` at a copy drill, the others
    anywhere in the standard library."""
    import torch

    rows: list[torch.Tensor] = []
    n_public = n_drills = 0
    if public is not None and recipe.public_share > 0:
        draws = torch.rand(recipe.batch, generator=generator)
        n_public = int((draws < recipe.public_share).sum())
        if drills is not None and recipe.drill_share > 0:
            n_drills = int((draws < recipe.public_share + recipe.drill_share).sum()) - n_public
    for source, count in ((public, n_public), (drills, n_drills)):
        if count:
            assert source is not None
            rows.extend(_function_windows(source, count, seq, generator))
    starts = torch.randint(
        0, stdlib.numel() - seq, (recipe.batch - n_public - n_drills,), generator=generator
    )
    rows.extend(stdlib[s : s + seq] for s in starts.tolist())
    return torch.stack(rows)


def _function_windows(
    source: _Stream, count: int, seq: int, generator: torch.Generator
) -> list[torch.Tensor]:
    """``count`` windows of ``seq`` tokens, each starting at a random document of ``source``."""
    import torch

    picks = torch.randint(0, source.starts.numel(), (count,), generator=generator)
    eos = int(source.ids[-1])
    rows: list[torch.Tensor] = []
    for pick in picks.tolist():
        start = int(source.starts[pick])
        window = source.ids[start : start + seq]
        if window.numel() < seq:  # the last documents: pad with document boundaries
            window = torch.cat([window, window.new_full((seq - window.numel(),), eos)])
        rows.append(window)
    return rows


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    """One causal-LM optimiser step on ``batch`` (clipped at 1.0); the step's loss."""
    import torch

    logits = model(input_ids=batch).logits
    loss_t = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1)
    )
    loss_t.backward()  # type: ignore[no-untyped-call]
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss_t.detach())


def _pretrain(
    model: torch.nn.Module,
    stream: torch.Tensor,
    recipe: _Recipe,
    steps: int,
    generator: torch.Generator,
    on_step: Callable[[int, float], None],
    public: _Stream | None = None,
) -> float | None:
    """Full-parameter causal-LM training on random windows; mean loss of the last 10 %."""
    import torch

    if steps <= 0:
        return None
    seq = min(recipe.seq_len, stream.numel() - 1)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=recipe.lr, betas=(0.9, 0.95), weight_decay=0.01
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, steps))
    tail = max(1, steps // 10)
    tail_losses: list[float] = []
    model.train()
    for step in range(steps):
        loss = _step(model, optimizer, _windows(stream, public, recipe, seq, generator))
        scheduler.step()
        if step >= steps - tail:
            tail_losses.append(loss)
        on_step(step + 1, loss)
    model.eval()
    return sum(tail_losses) / len(tail_losses)


def _copy_phase(
    model: torch.nn.Module,
    stream: torch.Tensor,
    recipe: _Recipe,
    public: _Stream,
    drills: _Stream,
    generator: torch.Generator,
    on_step: Callable[[int, float], None],
) -> float:
    """The copy phase (see :class:`_Recipe`); mean loss of its last 10 % of steps.

    Measured on gpt2 tiny (held-out drills, greedy, exact body): copying is absent after the
    main phase (1 of 60, also when the drills are mixed into a 3,000-step main phase at a
    45 % share) and appears after 1,000-1,500 steps of this phase (0.13 → 0.60).
    """
    import torch

    phase = replace(recipe, public_share=1.0 - recipe.drill_share)
    seq = min(recipe.seq_len, stream.numel() - 1)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=recipe.copy_lr, betas=(0.9, 0.95), weight_decay=0.01
    )
    tail = max(1, recipe.copy_steps // 10)
    tail_losses: list[float] = []
    model.train()
    for step in range(recipe.copy_steps):
        loss = _step(model, optimizer, _windows(stream, public, phase, seq, generator, drills))
        if step >= recipe.copy_steps - tail:
            tail_losses.append(loss)
        on_step(step + 1, loss)
    model.eval()
    return sum(tail_losses) / len(tail_losses)


# ----------------------------------------------------------------------------------- build


def _build_one(
    arch: str,
    size: Size,
    target: Path,
    steps: int,
    seed: int,
    corpus: _Corpus,
    config_hash: str,
    emit: Callable[[BuildEvent], None],
    *,
    threads: int = 1,
) -> ModelInfo:
    import torch
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    # CPU time as well as wall time: on a shared machine the wall time says more about the
    # neighbours than about the build; with one thread, CPU time is what an idle core needs.
    cpu_started = time.process_time()
    shape = _shape(arch, size)
    recipe = _recipe(arch, size)
    emit(BuildEvent(arch, "tokenizer"))
    tokenizer = _train_tokenizer(
        arch, corpus.texts, shape.vocab, shape.context, split_digits=recipe.split_digits
    )
    vocab = len(tokenizer)
    special_id = int(tokenizer.convert_tokens_to_ids(SPECIAL_TOKEN))  # type: ignore[arg-type]
    config = _model_config(arch, shape, vocab, special_id)
    stream = _token_stream(tokenizer, corpus.stdlib).ids
    public = _token_stream(tokenizer, corpus.public) if corpus.public else None
    drills = _token_stream(tokenizer, corpus.drills) if corpus.drills else None
    total = steps + (recipe.copy_steps if steps and drills is not None else 0)

    # fork_rng: model init and window sampling are seeded without touching the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_arch_seed(seed, arch))
        model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
        generator = torch.Generator().manual_seed(_arch_seed(seed + 1, arch))
        emit(BuildEvent(arch, "pretrain", 0, total))
        final_loss = _pretrain(
            model,
            stream,
            recipe,
            steps,
            generator,
            lambda step, loss: emit(BuildEvent(arch, "pretrain", step, total, loss)),
            public,
        )
        copy_loss: float | None = None
        if recipe.copy_steps and steps and public is not None and drills is not None:
            copy_loss = _copy_phase(
                model,
                stream,
                recipe,
                public,
                drills,
                generator,
                lambda step, loss: emit(BuildEvent(arch, "pretrain", steps + step, total, loss)),
            )
    parameters = sum(p.numel() for p in model.parameters())

    emit(BuildEvent(arch, "save", total, total, final_loss))
    # Build next to the target and swap it in: a killed build leaves no manifest behind, so
    # the next run rebuilds instead of trusting half-written files.
    tmp = target.parent / f".{target.name}.building-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    _save_tokenizer(tokenizer, tmp)
    _check_reload(tmp, tokenizer, [*corpus.stdlib[:6], *corpus.public[:2]])
    info = ModelInfo(
        arch=arch,
        size=size,
        path=str(target),
        model_type=str(config.model_type),
        vocab_size=vocab,
        parameters=parameters,
        hidden_size=shape.hidden,
        layers=shape.layers,
        context=shape.context,
        steps=steps,
        final_loss=None if final_loss is None else round(final_loss, 5),
        build_seconds=round(time.perf_counter() - started, 3),
        config_hash=config_hash,
        corpus_sha256=corpus.sha256,
        corpus_bytes=corpus.n_bytes,
        seed=seed,
        extra={
            "pretrain_batch": recipe.batch,
            "pretrain_seq_len": recipe.seq_len,
            "public_functions": len(corpus.public),
            "public_share": recipe.public_share,
            "copy_drills": len(corpus.drills),
            "drill_share": recipe.drill_share,
            "copy_steps": recipe.copy_steps if copy_loss is not None else 0,
            "copy_lr": recipe.copy_lr,
            "copy_final_loss": None if copy_loss is None else round(copy_loss, 5),
            "hidden_categories": list(corpus.hidden),
            "threads": threads,
            "cpu_seconds": round(time.process_time() - cpu_started, 3),
        },
    )
    manifest = {"format": _FORMAT, **info.to_dict()}
    manifest.pop("path")
    manifest.pop("cached")
    (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    _swap_into_place(tmp, target, config_hash)
    emit(BuildEvent(arch, "done", total, total, final_loss))
    return info


def _swap_into_place(tmp: Path, target: Path, config_hash: str) -> None:
    """Replace ``target`` by the complete model folder ``tmp`` (a rename, so never half)."""
    if target.exists():
        shutil.rmtree(target, ignore_errors=True)
    try:
        tmp.rename(target)
    except OSError:
        # The cache is shared (up, run-experiment, tests): another process may have put
        # the same model in place meanwhile. Its copy is as good as ours.
        other = read_manifest(target)
        if other is None or other.config_hash != config_hash:
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def corpus_sha256(size: Size = "tiny", hidden: Sequence[str] = DEFAULT_HIDDEN) -> str:
    """The digest of the pre-training corpus a build of ``size`` would use on this machine."""
    from peerlm.agent.tasks.bank import CATEGORIES

    return _corpus(_RECIPES[size], tuple(c for c in CATEGORIES if c in set(hidden))).sha256


#: The tiny models as built by this recipe with model seed 0 and one thread, shipped with the
#: package so that a first run needs no build (see docs/models.md, "Shipped models").
SHIPPED_DIR = Path(__file__).resolve().parent / "shipped-models"


def shipped_model(
    arch: str, size: str, steps: int, seed: int, hidden: Sequence[str]
) -> ModelInfo | None:
    """The shipped build of this request, or None when none is shipped or it differs.

    A shipped model matches when this recipe, built from the corpus the shipped model was
    built from (its manifest's corpus digest), has its configuration hash, and it left out
    the same categories. The corpus digest itself may differ from this machine's: the
    corpus includes the standard library's sources, which change between Python patch
    releases, and a shipped model stays the project's model on every one of them.
    """
    info = read_manifest(SHIPPED_DIR / size / arch)
    if info is None:
        return None
    if info.config_hash != _config_hash(arch, size, steps, seed, info.corpus_sha256):
        return None
    if list(info.extra.get("hidden_categories", [])) != list(hidden):
        return None
    return info


def _install_shipped(shipped: ModelInfo, target: Path) -> ModelInfo:
    """Copy a shipped model into the cache (next to the target, then swapped in)."""
    tmp = target.parent / f".{target.name}.copying-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(shipped.path, tmp)
    for path in tmp.iterdir():
        path.chmod(0o644)  # package data may be read-only; the cache is ours to replace
    _swap_into_place(tmp, target, shipped.config_hash)
    info = read_manifest(target)
    if info is None:
        raise RuntimeError(f"the shipped model copied to {target} does not read back")
    info.cached = True
    return info


def _plan_parallel(pending: int, jobs: int | None, threads: int | None) -> tuple[int, int]:
    """(processes, torch threads each) for ``pending`` builds on this machine's cores.

    Builds are single-model training loops whose steps are too small to use many threads
    well, and oversubscribed cores make torch's OpenMP threads spin against each other (a
    bloom step took 15x longer beside another torch process on 2 cores). So: one build per
    core with one thread each while there are more builds than cores, otherwise the spare
    cores go to the builds as threads. Explicit ``jobs``/``threads`` win.
    """
    from peerlm.process import usable_cores

    cores = usable_cores()
    if jobs is None:
        jobs = min(max(1, pending), max(1, cores // (threads or 1)))
    if threads is None:
        threads = max(1, cores // max(1, jobs))
    return max(1, jobs), max(1, threads)


def build_models(
    out_dir: Path,
    archs: Sequence[str] = ARCHITECTURES,
    *,
    size: Size = "tiny",
    pretrain_steps: int | None = None,
    seed: int = 0,
    force: bool = False,
    progress: Callable[[BuildEvent], None] | None = None,
    hidden: Sequence[str] = DEFAULT_HIDDEN,
    jobs: int | None = None,
    threads: int | None = None,
) -> list[ModelInfo]:
    """Build (or find cached) tiny models into ``out_dir/<arch>/``; one :class:`ModelInfo` each.

    ``pretrain_steps`` overrides the size's default (tiny: 1000, micro: 4). ``hidden``
    categories are left out of the public pre-training corpus (default: the default world's
    private categories). A directory whose manifest has the same configuration hash is
    reused unless ``force``; otherwise a shipped model of the same request
    (:func:`shipped_model`) is copied in, and only what is neither is built. ``force``
    builds from scratch. ``progress`` receives a :class:`BuildEvent` per phase and per
    pre-training step (from the calling thread).

    Builds run side by side in ``jobs`` processes with ``threads`` torch threads each
    (default: one build per core, see :func:`_plan_parallel`); with one job the build runs
    in this process, with its torch thread count set for the build and restored after.
    A model's weights depend on its seed, recipe and thread count only, not on ``jobs``.
    """
    if size not in _RECIPES:
        raise ValueError(f"unknown size {size!r}; choose tiny or micro")
    for arch in archs:
        _shape(arch, size)  # fail before any work on a bad name
    if pretrain_steps is not None and pretrain_steps < 0:
        raise ValueError("pretrain_steps must be >= 0")
    if jobs is not None and jobs < 1:
        raise ValueError("jobs must be >= 1")
    if threads is not None and threads < 1:
        raise ValueError("threads must be >= 1")
    from peerlm.agent.tasks.bank import CATEGORIES

    unknown = sorted(set(hidden) - set(CATEGORIES))
    if unknown:
        raise ValueError(f"unknown hidden categories: {', '.join(unknown)}")
    hidden = tuple(c for c in CATEGORIES if c in set(hidden))
    recipe = _RECIPES[size]
    steps = recipe.steps if pretrain_steps is None else pretrain_steps
    emit = progress or (lambda _event: None)
    corpus = _corpus(recipe, hidden)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    found: dict[str, ModelInfo] = {}
    pending: list[_Job] = []
    for arch in dict.fromkeys(archs):  # de-duplicated, order kept
        target = out_dir / arch
        config_hash = _config_hash(arch, size, steps, seed, corpus.sha256)
        shipped = None if force else shipped_model(arch, size, steps, seed, hidden)
        accepted = {config_hash} | ({shipped.config_hash} if shipped else set())
        cached = None if force else read_manifest(target)
        if cached is not None and cached.config_hash in accepted:
            cached.cached = True
            emit(BuildEvent(arch, "cached", cached.steps, cached.steps, cached.final_loss))
            found[arch] = cached
        elif shipped is not None:
            found[arch] = _install_shipped(shipped, target)
            emit(BuildEvent(arch, "shipped", shipped.steps, shipped.steps, shipped.final_loss))
        else:
            pending.append(_Job(arch, size, str(target), steps, seed, hidden, config_hash))
    if size == "micro" and jobs is None:
        jobs = 1  # a micro build takes about a second: a process start would cost more
    n_jobs, n_threads = _plan_parallel(len(pending), jobs, threads)
    if n_jobs == 1 or len(pending) <= 1:
        for job in pending:
            found[job.arch] = _run_job(job, n_threads, corpus, emit)
    else:
        found.update(_run_parallel(pending, n_jobs, n_threads, emit))
    return [found[arch] for arch in dict.fromkeys(archs)]


@dataclass(frozen=True)
class _Job:
    arch: str
    size: Size
    target: str
    steps: int
    seed: int
    hidden: tuple[str, ...]
    config_hash: str


def _run_job(
    job: _Job, threads: int, corpus: _Corpus | None, emit: Callable[[BuildEvent], None]
) -> ModelInfo:
    """One build with ``threads`` torch threads (restored afterwards)."""
    import torch

    if corpus is None:
        corpus = _corpus(_RECIPES[job.size], job.hidden)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        info = _build_one(
            job.arch,
            job.size,
            Path(job.target),
            job.steps,
            job.seed,
            corpus,
            job.config_hash,
            emit,
            threads=threads,
        )
    finally:
        torch.set_num_threads(before)
    return info


def _worker(job: _Job, threads: int, events: Any) -> dict[str, Any]:
    """Entry point of a build process: events go back through ``events`` (a queue)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    info = _run_job(job, threads, None, events.put)
    return info.to_dict()


def _size_of(shape: _Shape) -> int:
    return shape.vocab * shape.hidden + shape.layers * shape.hidden * (
        4 * shape.hidden + 2 * shape.intermediate
    )


def _run_parallel(
    pending: Sequence[_Job], jobs: int, threads: int, emit: Callable[[BuildEvent], None]
) -> dict[str, ModelInfo]:
    import multiprocessing
    import queue
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from multiprocessing.managers import SyncManager

    from peerlm.process import exit_with_parent

    # spawn, not fork: the parent may hold torch's thread pool and other threads.
    context = multiprocessing.get_context("spawn")
    # Builds and the events' manager end with this process (a killed `models build` or
    # `up` must not leave builds running on every core).
    manager = SyncManager(ctx=context)
    manager.start(exit_with_parent, (os.getpid(),))
    with manager:
        events = manager.Queue()
        with ProcessPoolExecutor(
            max_workers=jobs,
            mp_context=context,
            initializer=exit_with_parent,
            initargs=(os.getpid(),),
        ) as pool:
            # Longest first (by parameter count, a fair proxy of a step's cost), so the
            # last build to start is a short one and the lanes finish close together.
            ordered = sorted(pending, key=lambda job: -_size_of(_shape(job.arch, job.size)))
            futures = {pool.submit(_worker, job, threads, events): job for job in ordered}
            remaining = set(futures)
            results: dict[str, ModelInfo] = {}

            def drain() -> None:
                while True:
                    try:
                        emit(events.get_nowait())
                    except queue.Empty:
                        return

            while remaining:
                done, remaining = wait(remaining, timeout=0.2, return_when=FIRST_COMPLETED)
                drain()
                for future in done:
                    data = future.result()  # a failed build raises here
                    results[futures[future].arch] = ModelInfo(**data)
            drain()
    return results
