"""The model host on micro models: LoRA training, AKD (Eq. 2), generation, adapter I/O."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from peerlm.agent.modelhost import (
    DEFAULT_STOPS,
    AdapterMismatchError,
    ModelHost,
    TokenizerMismatchError,
    family_of,
    truncate_at_stops,
)
from peerlm.agent.models.lora import LoraSettings
from peerlm.agent.models.tiny import ARCHITECTURES, build_models
from peerlm.agent.training import (
    TrainSettings,
    encode_example,
    fit_lengths,
    lr_factor,
    max_token_chars,
    split_prompt,
    text_budget,
)
from safetensors.torch import load, load_file

LOCAL = [
    'def add(a, b):\n    """Return the sum."""\n    return a + b\n',
    'def is_even(n):\n    """True if n is even."""\n    return n % 2 == 0\n',
    'def last(xs):\n    """Last element."""\n    return xs[-1]\n',
    'def square(x):\n    """x squared."""\n    return x * x\n',
]
PROMPTS = [
    'def reverse(s):\n    """Reverse a string."""\n',
    'def count_vowels(s):\n    """Number of vowels."""\n',
    'def maximum(xs):\n    """Largest element."""\n',
]
TEACHER = [
    (PROMPTS[0], "    return s[::-1]\n"),
    (PROMPTS[1], "    return sum(1 for c in s if c in 'aeiou')\n"),
    (
        PROMPTS[2],
        "    best = xs[0]\n    for x in xs:\n        best = max(best, x)\n    return best\n",
    ),
]
FAST = TrainSettings(learning_rate=1e-2, batch_size=4, grad_accumulation=2, seed=0)


@pytest.fixture(autouse=True, scope="module")
def _offline(offline_hub: None) -> None:
    """Every load here is from a local directory (tests/conftest.py)."""


@pytest.fixture(scope="module")
def models(micro_models_dir: Path) -> dict[str, Path]:
    infos = build_models(micro_models_dir, size="micro")
    return {i.arch: Path(i.path) for i in infos}


def host(models: dict[str, Path], arch: str = "gpt2", seed: int = 0, r: int = 8) -> ModelHost:
    return ModelHost.load(models[arch], LoraSettings(r=r), device="cpu", seed=seed)


def adapters_equal(a: ModelHost, b: ModelHost) -> bool:
    sa, sb = a.adapter_state(), b.adapter_state()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ------------------------------------------------------------------------------- loading


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_load_and_properties(models: dict[str, Path], arch: str) -> None:
    h = ModelHost.load(models[arch], LoraSettings(), device="auto")
    assert h.model_type == arch and h.family == arch
    assert h.device == "cpu"  # no CUDA here: auto means CPU, float32
    assert next(h.model.parameters()).dtype == torch.float32
    assert 0 < h.trainable_parameters < h.total_parameters
    assert h.trainable_share == pytest.approx(h.trainable_parameters / h.total_parameters)
    assert 0 < h.trainable_share < 0.5
    assert h.vocab_size == len(h.tokenizer)
    json.dumps(h.describe())


def test_vocabularies_and_families(models: dict[str, Path]) -> None:
    sizes = {arch: host(models, arch).vocab_size for arch in ARCHITECTURES}
    assert len(set(sizes.values())) == len(ARCHITECTURES)
    assert family_of("llama") == family_of("mistral") == "llama"
    assert family_of("t5") == "other"


def test_bad_device_is_refused(models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="device"):
        ModelHost.load(models["gpt2"], device="tpu")


def test_initial_adapter_is_seeded(models: dict[str, Path]) -> None:
    assert adapters_equal(host(models, seed=5), host(models, seed=5))
    assert not adapters_equal(host(models, seed=5), host(models, seed=6))


# ------------------------------------------------------------------------------ training


def test_train_local_lowers_eval_loss(models: dict[str, Path]) -> None:
    h = host(models)
    before, ppl = h.eval_loss(LOCAL)
    assert ppl == pytest.approx(math.exp(before))
    stats = h.train_local(LOCAL, FAST, steps=25)
    after, _ = h.eval_loss(LOCAL)
    assert after < before - 0.1
    assert stats.steps == 25 and len(stats.step_losses) == 25
    assert stats.tokens > 0 and stats.examples == 25 * len(LOCAL)
    assert math.isfinite(stats.mean_loss) and stats.local_loss == stats.mean_loss
    assert not h.model.training


def test_train_local_default_steps_and_determinism(models: dict[str, Path]) -> None:
    settings = TrainSettings(learning_rate=1e-2, batch_size=2, grad_accumulation=2, epochs=2)
    a, b = host(models), host(models)
    sa = a.train_local(LOCAL * 2, settings)
    sb = b.train_local(LOCAL * 2, settings)
    assert sa.steps == 2 * math.ceil(8 / 4)
    assert sa.step_losses == sb.step_losses
    assert adapters_equal(a, b)


def _factors(h: ModelHost, kind: str) -> dict[str, torch.Tensor]:
    return {k: v for k, v in h.adapter_state().items() if f".lora_{kind}." in k}


def test_frozen_lora_a_trains_only_b_in_every_training_call(models: dict[str, Path]) -> None:
    """FFA-LoRA's freeze: local, AKD and HKA training leave A bit-identical and move B; the
    default host trains both, and unfreezing trains A again."""
    from peerlm.agent.merging.lora_merge import ClientAdapter

    default = host(models)
    assert not default.frozen_lora_a
    h = host(models)
    h.frozen_lora_a = True
    assert h.frozen_lora_a
    # Exactly the B factors remain trainable.
    b_entries = sum(v.numel() for v in _factors(h, "B").values())
    assert h.trainable_parameters == b_entries < default.trainable_parameters
    a0, b0 = _factors(h, "A"), _factors(h, "B")
    teacher = host(models, seed=3)
    teacher.train_local(LOCAL, FAST, steps=2)
    client = ClientAdapter(teacher.adapter_state(), r=8, alpha=teacher.lora.alpha, examples=4)
    h.train_local(LOCAL, FAST, steps=3)
    h.train_akd(LOCAL, TEACHER, 0.5, FAST, steps=2)
    h.train_hka(TEACHER, [client], FAST, steps=2)
    assert h.trainable_parameters == b_entries  # HKA's adapter switching did not unfreeze A
    a1, b1 = _factors(h, "A"), _factors(h, "B")
    assert a1.keys() == a0.keys() and all(torch.equal(a1[k], a0[k]) for k in a0)
    assert any(not torch.equal(b1[k], b0[k]) for k in b0)
    default.train_local(LOCAL, FAST, steps=3)
    assert any(not torch.equal(_factors(default, "A")[k], a0[k]) for k in a0)
    h.frozen_lora_a = False
    assert h.trainable_parameters == default.trainable_parameters
    h.train_local(LOCAL, FAST, steps=1)
    assert any(not torch.equal(_factors(h, "A")[k], a0[k]) for k in a0)


def test_pairs_train_on_the_completion_only(models: dict[str, Path]) -> None:
    h = host(models)
    whole = encode_example(h.tokenizer, TEACHER[0][0] + TEACHER[0][1], 256)
    pair = encode_example(h.tokenizer, TEACHER[0], 256)
    assert whole is not None and pair is not None
    head, indent = split_prompt(h.tokenizer, TEACHER[0][0])
    assert indent == "\n"  # gpt2: the prompt's trailing newline starts the completion
    prompt_len = len(h.tokenizer(head)["input_ids"])
    assert all(label == -100 for label in pair.labels[:prompt_len])
    assert pair.labels[prompt_len:] == pair.input_ids[prompt_len:]
    assert pair.input_ids[-1] == h.tokenizer.eos_token_id
    assert 0 < pair.targets < whole.targets


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize(
    "prompt",
    [
        'def f(x: int) -> int:\n    """Return x times 7.\n\n    >>> f(1)\n    7\n    """\n    ',
        'def g(s):\n    """Reverse."""\n',
        "def h():\n\t",
    ],
)
def test_split_prompt_gives_the_tokens_of_the_whole_text(
    models: dict[str, Path], arch: str, prompt: str
) -> None:
    """Training pairs and generation see exactly the tokens of prompt + completion as one
    text (what pre-training saw), whatever the prompt's trailing whitespace."""
    tok = host(models, arch).tokenizer
    completion = "return x * 7\n" if prompt.endswith(" ") else "    return 1\n"
    pair = encode_example(tok, (prompt, completion), 256)
    whole = encode_example(tok, prompt + completion, 256)
    assert pair is not None and whole is not None
    assert pair.input_ids == whole.input_ids


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_a_hosts_cached_encodings_are_those_of_encode_example(
    models: dict[str, Path], arch: str
) -> None:
    """The host keeps each example's encoding and each prompt's cut (they recur every
    round); what it hands out, again and again, is what encode_example computes."""
    h = host(models, arch)
    tok = h.tokenizer
    examples: list[Any] = [
        ('def f(x):\n    """Double x."""\n    ', "return x * 2\n"),
        ("def g():\n    ", "pass\n"),
        "plain text, trained on every token",
        ("p" * 5000, "a long prompt is cut to the budget\n"),
        ("", ""),  # nothing to learn: dropped
    ]
    direct = [
        encode_example(tok, ex, 64, max_chars=text_budget(max_token_chars(tok), 64))
        for ex in examples
    ]
    expected = [(e.input_ids, e.labels) for e in direct if e is not None]
    for _ in range(2):  # the second pass comes from the caches
        got = h._encode_all(examples, 64)
        assert [(e.input_ids, e.labels) for e in got] == expected
    got[0].input_ids.append(7)  # a caller's list is its own: the cache is not changed
    assert [(e.input_ids, e.labels) for e in h._encode_all(examples, 64)] == expected


@pytest.mark.slow
def test_akd_student_with_another_tokenizer_learns_the_teacher_text(
    models: dict[str, Path],
) -> None:
    teacher = host(models, "qwen2")
    # Real teacher predictions from a model with another tokenizer, decoded to text...
    generated = teacher.generate(PROMPTS, max_new_tokens=24, stop=())
    teacher_texts = [(p, c[0]) for p, c in zip(PROMPTS, generated, strict=True)] + TEACHER
    student = host(models, "gpt2")
    assert student.tokenizer_hash != teacher.tokenizer_hash
    before, _ = student.eval_loss(teacher_texts)
    # ...re-encoded by the student's tokenizer inside train_akd (Eq. 2).
    stats = student.train_akd(LOCAL, teacher_texts, 0.5, FAST, steps=25)
    after, _ = student.eval_loss(teacher_texts)
    assert after < before - 0.1
    assert stats.alpha_kd == 0.5
    assert stats.local_loss is not None and stats.kd_loss is not None
    assert stats.mean_loss == pytest.approx(float(np.mean(stats.step_losses)), rel=1e-6)

    # Without distillation the same budget improves the teacher's text less.
    control = host(models, "gpt2")
    control.train_akd(LOCAL, teacher_texts, 0.0, FAST, steps=25)
    control_after, _ = control.eval_loss(teacher_texts)
    assert after < control_after


@pytest.mark.slow
def test_alpha_zero_ignores_the_teacher_and_one_ignores_local(models: dict[str, Path]) -> None:
    other_teacher = [(p, "    pass\n") for p, _ in TEACHER]
    a, b, c = host(models), host(models), host(models)
    sa = a.train_akd(LOCAL, TEACHER, 0.0, FAST, steps=5)
    b.train_akd(LOCAL, other_teacher, 0.0, FAST, steps=5)
    c.train_local(LOCAL, FAST, steps=5)
    assert sa.kd_loss is None and sa.local_loss is not None
    assert adapters_equal(a, b) and adapters_equal(a, c)

    d, e = host(models), host(models)
    sd = d.train_akd(LOCAL, TEACHER, 1.0, FAST, steps=5)
    e.train_akd(LOCAL[:1], TEACHER, 1.0, FAST, steps=5)
    assert sd.local_loss is None and sd.kd_loss is not None
    assert adapters_equal(d, e)


@pytest.mark.parametrize("alpha", [-0.1, 1.5, float("nan")])
def test_alpha_out_of_range_raises(models: dict[str, Path], alpha: float) -> None:
    with pytest.raises(ValueError, match="alpha_kd"):
        host(models).train_akd(LOCAL, TEACHER, alpha, FAST, steps=1)


def test_akd_needs_both_sources_it_weighs(models: dict[str, Path]) -> None:
    h = host(models)
    with pytest.raises(ValueError, match="teacher"):
        h.train_akd(LOCAL, [], 0.3, FAST, steps=1)
    with pytest.raises(ValueError, match="local"):
        h.train_akd([], TEACHER, 0.3, FAST, steps=1)


# ---------------------------------------------------------------------------- logit mode


def test_logit_mode_with_the_same_tokenizer(models: dict[str, Path]) -> None:
    teacher = host(models, "gpt2", seed=1)
    teacher.train_local([p + c for p, c in TEACHER], FAST, steps=10)
    package = teacher.topk_logits(
        [p for p, _ in TEACHER], [c for _, c in TEACHER], k=8, temperature=2.0
    )
    assert len(package) == len(TEACHER)
    for entry in package:
        n = len(entry["input_ids"]) - entry["prompt_length"]
        assert entry["ids"].shape == entry["logprobs"].shape == (n, 8)
        assert entry["ids"].dtype == np.int32 and entry["logprobs"].dtype == np.float32
        # Column 0: the completion's own token; then the best others, best first.
        assert entry["ids"][:, 0].tolist() == entry["input_ids"][entry["prompt_length"] :].tolist()
        assert np.all(np.diff(entry["logprobs"][:, 1:], axis=1) <= 1e-6)
        assert entry["tokenizer_hash"] == teacher.tokenizer_hash

    student = host(models, "gpt2", seed=2)
    settings = TrainSettings(learning_rate=1e-2, batch_size=4, grad_accumulation=1)
    stats = student.train_akd_logits(LOCAL, package, 1.0, settings, temperature=1.5, steps=15)
    assert stats.kd_loss is not None and math.isfinite(stats.kd_loss)
    # Every step sees the whole package, so step losses trace the KL objective.
    assert stats.step_losses[-1] < stats.step_losses[0]
    mixed = host(models, "gpt2", seed=2).train_akd_logits(
        LOCAL, package, 0.5, settings, temperature=2.0, steps=3
    )
    assert mixed.local_loss is not None and mixed.kd_loss is not None


def test_logit_mode_refuses_another_tokenizer(models: dict[str, Path]) -> None:
    package = host(models, "gpt2").topk_logits(["def f():\n"], ["    return 1\n"], k=4)
    with pytest.raises(TokenizerMismatchError, match="tokenizer"):
        host(models, "qwen2").train_akd_logits(LOCAL, package, 0.5, FAST, steps=1)


def test_logit_mode_rejects_malformed_entries(models: dict[str, Path]) -> None:
    h = host(models, "gpt2")
    [entry] = h.topk_logits(["def f():\n"], ["    return 1\n"], k=4)
    broken = {**entry, "ids": entry["ids"][:-1]}
    with pytest.raises(ValueError, match="malformed"):
        h.train_akd_logits(LOCAL, [broken], 0.5, FAST, steps=1)
    outside = {**entry, "ids": entry["ids"] + h.vocab_size}
    with pytest.raises(ValueError, match="vocabulary"):
        h.train_akd_logits(LOCAL, [outside], 0.5, FAST, steps=1)


# ---------------------------------------------------------------------------- generation


@pytest.mark.slow
def test_generate_is_batched_deterministic_and_greedy(models: dict[str, Path]) -> None:
    for arch in ARCHITECTURES:
        h = host(models, arch)
        out = h.generate(PROMPTS, max_new_tokens=16, n=2)
        assert len(out) == len(PROMPTS) and all(len(group) == 2 for group in out)
        assert all(isinstance(text, str) for group in out for text in group)
        assert all(group[0] == group[1] for group in out)  # greedy: n identical copies
        assert out == h.generate(PROMPTS, max_new_tokens=16, n=2)
        # Left padding does not change what each prompt gets.
        single = [h.generate([p], max_new_tokens=16)[0][0] for p in PROMPTS]
        assert [group[0] for group in out] == single, arch


def test_sampling_is_seeded(models: dict[str, Path]) -> None:
    h = host(models, "bloom")
    a = h.generate(PROMPTS[:2], max_new_tokens=12, temperature=1.0, n=3, seed=7)
    b = h.generate(PROMPTS[:2], max_new_tokens=12, temperature=1.0, n=3, seed=7)
    assert a == b and all(len(group) == 3 for group in a)
    torch.manual_seed(0)
    expected = torch.rand(1)
    torch.manual_seed(0)
    h.generate(PROMPTS[:1], max_new_tokens=4, temperature=1.0, seed=3)
    assert torch.equal(torch.rand(1), expected)  # the caller's RNG is untouched


def test_empty_and_overlong_inputs(models: dict[str, Path]) -> None:
    h = host(models, "qwen2")
    assert [len(group) for group in h.generate(["", "x = "], max_new_tokens=4)] == [1, 1]
    long_text = "def f(x):\n    return x\n" * 400  # far beyond the 256-token context
    loss, _ = h.eval_loss([long_text], max_length=4096)
    assert math.isfinite(loss)
    long_pair = ("# prompt\n" * 500, "    return 1\n" * 500)
    stats = h.train_local([long_pair], FAST, steps=1)
    assert 0 < stats.tokens <= 256


def test_generate_cuts_at_stop_sequences(models: dict[str, Path]) -> None:
    h = host(models, "gpt_neox")
    [[free]] = h.generate(PROMPTS[:1], max_new_tokens=32, stop=())
    assert len(free) >= 6, free
    stop = free[3:6]  # a sequence the greedy completion is known to contain
    [[cut]] = h.generate(PROMPTS[:1], max_new_tokens=32, stop=(stop,))
    assert cut == free[: free.index(stop)]
    for group in h.generate(PROMPTS, max_new_tokens=32):
        assert not any(s in group[0] for s in DEFAULT_STOPS)


def test_default_stops_leave_just_the_function_body() -> None:
    body = "    return a + b\n"
    for tail in (
        "\ndef sub(a, b):\n    return a - b\n",
        "\n\nclass X:\n    pass\n",
        "\nif __name__ == '__main__':\n    main()\n",
        "\nprint(add(1, 2))\n",
        "\n# tests\n",
        "\nassert add(1, 2) == 3\n",
    ):
        assert truncate_at_stops(body + tail, DEFAULT_STOPS).rstrip("\n") == body.rstrip("\n")
    assert truncate_at_stops("    x = 1\n    # fine\n", DEFAULT_STOPS) == "    x = 1\n    # fine\n"


# ------------------------------------------------------------------------------ adapters


def test_adapter_bytes_round_trip(models: dict[str, Path], tmp_path: Path) -> None:
    a = host(models, "gpt2", seed=0)
    a.train_local(LOCAL, FAST, steps=5)
    b = host(models, "gpt2", seed=9)
    assert a.eval_loss(LOCAL) != b.eval_loss(LOCAL)
    b.load_adapter_bytes(a.adapter_bytes())
    assert b.eval_loss(LOCAL) == a.eval_loss(LOCAL)
    assert adapters_equal(a, b)

    path = a.save_adapter(tmp_path / "adapter.safetensors")
    tensors = load_file(str(path))  # plain safetensors, LoRA weights only
    assert tensors and all("lora_" in k for k in tensors)
    c = host(models, "gpt2", seed=4)
    c.load_adapter(path)
    assert c.eval_loss(LOCAL) == a.eval_loss(LOCAL)
    c.load_adapter_state(a.adapter_state())
    assert adapters_equal(a, c)


def test_adapter_of_another_base_is_refused(models: dict[str, Path]) -> None:
    data = host(models, "gpt2").adapter_bytes()
    bloom = host(models, "bloom")
    with pytest.raises(AdapterMismatchError, match="gpt2"):
        bloom.load_adapter_bytes(data)
    with pytest.raises(AdapterMismatchError, match="missing"):
        bloom.load_adapter_bytes(data, strict=False)
    with pytest.raises(AdapterMismatchError, match="shape"):
        host(models, "gpt2", r=4).load_adapter_bytes(data)
    with pytest.raises(AdapterMismatchError):
        bloom.load_adapter_bytes(b"\x00" * 4)


def test_encoded_adapter_is_made_once_per_version(models: dict[str, Path]) -> None:
    h = host(models, "gpt2", seed=0)
    first = h.encoded_adapter()
    assert h.encoded_adapter() is first  # no re-encoding, no second SHA-256 pass
    assert h.adapter_bytes() is first.data
    h.train_local(LOCAL, FAST, steps=1)
    trained = h.encoded_adapter()
    assert trained is not first and trained.data != first.data
    h.load_adapter_bytes(first.data)
    reloaded = h.encoded_adapter()
    assert reloaded is not trained
    want, got = load(first.data), load(reloaded.data)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


class _RecordingTokenizer:
    """The host's real tokenizer, noting the length of every text it is asked to encode."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.lengths: list[int] = []

    def __call__(self, text: str, **kwargs: Any) -> Any:
        self.lengths.append(len(text))
        return self.inner(text, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)


def test_a_huge_teacher_text_is_cut_before_it_is_tokenised(models: dict[str, Path]) -> None:
    """A 60 MiB completion once made the student tokenise all of it (16 MiB: 3.6 GB)."""
    h = host(models, "gpt2")
    recorder = _RecordingTokenizer(h.tokenizer)
    h.tokenizer = recorder
    huge = "    return x + 1  # again and again\n" * 200_000  # 7 MB of text
    loss, _ = h.eval_loss([("def f(x):\n", huge)], max_length=64)
    assert math.isfinite(loss)
    budget = text_budget(max_token_chars(recorder.inner), 64)
    assert budget < 100_000 and max(recorder.lengths) <= budget + 16
    # Honest texts are never cut: the same tokens as an uncut encoding.
    short = ("def f(x):\n", "    return x\n")
    assert encode_example(recorder.inner, short, 64, max_chars=budget) == encode_example(
        recorder.inner, short, 64
    )


def test_non_finite_adapter_is_refused(models: dict[str, Path]) -> None:
    h = host(models)
    state = h.adapter_state()
    name = next(iter(state))
    state[name] = torch.full_like(state[name], float("nan"))
    with pytest.raises(AdapterMismatchError, match="finite"):
        h.load_adapter_state(state)


# ------------------------------------------------------------------------- small helpers


def test_lr_factor_warms_up_then_decays() -> None:
    factors = [lr_factor(s, 100, 0.02, "linear") for s in range(100)]
    assert 0 < factors[0] < factors[1] < factors[2] == 1.0
    assert all(a >= b for a, b in itertools.pairwise(factors[2:]))
    assert factors[-1] > 0
    assert lr_factor(50, 100, 0.02, "constant") == 1.0
    assert lr_factor(0, 2, 0.02, "linear") == 1.0  # no warm-up step is wasted at lr 0


def test_fit_lengths_respects_the_budget() -> None:
    for p in (0, 5, 40, 300):
        for c in (1, 5, 40, 300):
            kp, kc = fit_lengths(list(range(p)), list(range(c)), 64)
            assert kp <= p and kc <= c and kp + kc <= 64
            if p + c <= 64:
                assert (kp, kc) == (p, c)
            else:
                assert kp + kc == 64
