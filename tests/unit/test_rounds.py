"""The shared round logic on micro models: schedules, packages in both modes, AKD, Eq. 3."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from peerlm.agent import AgentSettings
from peerlm.agent.acceptance import LOSS_PENALTY_NATS, Verdict, judge
from peerlm.agent.exchange.package import (
    KnowledgePackage,
    LogitsPackage,
    TextItem,
    TextPackage,
    decode_package,
    prompt_sha256,
)
from peerlm.agent.exchange.rounds import (
    Integration,
    RoundConfig,
    build_package,
    choose_package_mode,
    integrate_package,
    linear_schedule,
    logit_entries,
    reward_eq3,
    teacher_completions,
)
from peerlm.agent.modelhost import ModelHost, TokenizerMismatchError
from peerlm.agent.models.lora import LoraSettings
from peerlm.agent.models.tiny import build_models
from peerlm.agent.training import TrainSettings
from peerlm.agent.vetting.guardrail import Guardrail
from prometheus_client import CollectorRegistry

PROMPTS = [
    'def reverse(s: str) -> str:\n    """Reverse s.\n    """\n    ',
    'def double(x: int) -> int:\n    """Return x times 2.\n    """\n    ',
    'def first(xs: list[int]) -> int:\n    """First element.\n    """\n    ',
]
TEXTS = ["return s[::-1]\n", "return x * 2\n", "return xs[0]\n"]
LOCAL = [
    ('def add(a: int, b: int) -> int:\n    """Sum.\n    """\n    ', "return a + b\n"),
    ('def neg(x: int) -> int:\n    """Negate.\n    """\n    ', "return -x\n"),
]
TRANSFER = "ab" * 32
FAST = TrainSettings(learning_rate=1e-2, batch_size=4, grad_accumulation=1, seed=0)


@pytest.fixture(autouse=True, scope="module")
def _offline(offline_hub: None) -> None:
    """Every load here is from a local directory (tests/conftest.py)."""


@pytest.fixture(scope="module")
def models(micro_models_dir: Path) -> dict[str, Path]:
    infos = build_models(micro_models_dir, size="micro")
    return {i.arch: Path(i.path) for i in infos}


def host(models: dict[str, Path], arch: str = "gpt2", seed: int = 0) -> ModelHost:
    return ModelHost.load(models[arch], LoraSettings(r=8), device="cpu", seed=seed)


def config(total: int = 4, steps: int = 6) -> RoundConfig:
    return RoundConfig(total_rounds=total, train=FAST, local_steps=steps)


def package_bytes(
    teacher: ModelHost,
    mode: str,
    completions: list[str] = TEXTS,
    prompts: list[str] = PROMPTS,
) -> bytes:
    """``teacher``'s package of ``completions`` to ``prompts`` (its guardrail lets all by)."""
    return build_package(
        teacher,
        mode=mode,  # type: ignore[arg-type]
        prompts=prompts,
        completions=completions,
        teacher="teacher",
        directive_id="d" * 32,
        transfer_sha256=TRANSFER,
        guardrail=Guardrail([]),
        top_k=8,
    )


def text_package(texts: list[str], teacher: str = "teacher") -> TextPackage:
    """A text package answering :data:`PROMPTS` with ``texts``, built without a guardrail."""
    return TextPackage(
        teacher=teacher,
        directive_id="d" * 32,
        transfer_sha256=TRANSFER,
        model_family="gpt2",
        items=tuple(
            TextItem(str(i), prompt_sha256(p), t)
            for i, (p, t) in enumerate(zip(PROMPTS, texts, strict=True))
        ),
        created_at=1.0,
    )


def integrate(
    student: ModelHost,
    package: KnowledgePackage,
    *,
    kilobytes: float = 1.0,
    round_config: RoundConfig | None = None,
    t: int = 1,
    guardrail: Guardrail | None = None,
    reward_examples: list[tuple[str, str]] | None = None,
    learns: Any = None,
    reward_scope: Any = None,
) -> Integration:
    """:func:`integrate_package` of ``package`` in round ``t`` with the local set
    :data:`LOCAL` (also the validation set) and the transfer set :data:`PROMPTS`."""
    return integrate_package(
        student,
        package,
        kilobytes=kilobytes,
        local_examples=LOCAL,
        val_examples=LOCAL,
        transfer_prompts=PROMPTS,
        config=round_config or config(),
        t=t,
        guardrail=guardrail,
        reward_examples=reward_examples,
        learns=learns,
        reward_scope=reward_scope,
    )


def refused_imports(registry: CollectorRegistry) -> float | None:
    """How many incoming items the student's guardrail refused for an import."""
    return registry.get_sample_value(
        "peerlm_agent_guardrail_incoming_rejected_total",
        {"component": "agent", "reason": "import"},
    )


def test_schedules_follow_table_6() -> None:
    c = RoundConfig.from_settings(AgentSettings(rounds=5))
    assert [round(c.alpha_kd(t), 3) for t in (1, 3, 5)] == [0.2, 0.35, 0.5]
    assert [round(c.kd_temperature(t), 3) for t in (1, 3, 5)] == [2.5, 2.0, 1.5]
    # Run forever: no end to ramp towards, the start values hold.
    forever = RoundConfig.from_settings(AgentSettings(rounds=0))
    assert forever.alpha_kd(50) == 0.2 and forever.kd_temperature(50) == 2.5
    assert linear_schedule(0.2, 0.5, 1, 1) == 0.5
    assert c.train_settings(1).seed != c.train_settings(2).seed


def test_a_peer_alpha_is_constant_for_the_slot_and_ignored_by_the_one_adapter() -> None:
    slot = RoundConfig.from_settings(AgentSettings(rounds=5, peer_alpha_kd=1.0))
    assert [slot.alpha_kd(t) for t in (1, 3, 5)] == [1.0, 1.0, 1.0]
    shared = RoundConfig.from_settings(
        AgentSettings(rounds=5, peer_alpha_kd=1.0, integration="shared")
    )
    assert round(shared.alpha_kd(5), 3) == 0.5  # Table 6's schedule
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError):
            AgentSettings(peer_alpha_kd=bad)


def test_a_slot_learning_rate_is_the_integrations_and_needs_a_slot() -> None:
    s = AgentSettings(rounds=5, learning_rate=5e-3, slot_learning_rate=2e-2)
    config = RoundConfig.from_settings(s)
    assert config.train.learning_rate == 5e-3  # the own adapter's local steps
    integrating = config.integrating()
    assert integrating.train.learning_rate == 2e-2
    assert integrating.slot_learning_rate is None  # applied once
    with pytest.raises(ValueError):  # set by hand, still validated
        dataclasses.replace(config, slot_learning_rate=float("nan")).integrating()
    assert integrating.train.seed == config.train.seed
    plain = RoundConfig.from_settings(AgentSettings(rounds=5))
    assert plain.integrating() is plain
    with pytest.raises(ValueError, match="slot_learning_rate"):
        AgentSettings(slot_learning_rate=2e-2, integration="shared")
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError):
            AgentSettings(slot_learning_rate=bad)


def test_reward_is_eq_3() -> None:
    assert reward_eq3(2.0, 1.5, 10.0, 1.0, 0.001) == pytest.approx(0.49)
    assert reward_eq3(1.0, 1.2, 0.0, 2.0, 0.0) == pytest.approx(-0.4)


def test_logits_only_for_the_teachers_own_tokenizer() -> None:
    assert choose_package_mode("logits", "t" * 64, "t" * 64) == "logits"
    assert choose_package_mode("logits", "t" * 64, "s" * 64) == "text"
    assert choose_package_mode("logits", "t" * 64, None) == "text"
    assert choose_package_mode("text", "t" * 64, "t" * 64) == "text"


def test_logits_package_rebuilds_the_teachers_input(models: dict[str, Path]) -> None:
    teacher = host(models, "gpt2", seed=1)
    package = decode_package(package_bytes(teacher, "logits"))
    assert isinstance(package, LogitsPackage) and package.top_k == 8
    entries = logit_entries(host(models, "gpt2", seed=2), package, PROMPTS)
    direct = teacher.topk_logits(PROMPTS, TEXTS, k=8)
    for entry, reference in zip(entries, direct, strict=True):
        # Column 0 is the teacher's own text: the student's input is exactly the teacher's.
        assert entry["input_ids"].tolist() == reference["input_ids"].tolist()
        assert entry["prompt_length"] == reference["prompt_length"]
        # ...and the other columns are the likeliest other tokens, best first.
        lp = np.asarray(entry["logprobs"], dtype=np.float32)
        assert np.all(np.diff(lp[:, 1:], axis=1) <= 1e-3)
        assert not np.any(entry["ids"][:, 1:] == entry["ids"][:, :1])


@pytest.mark.slow
def test_student_loss_on_the_teachers_distribution_falls(models: dict[str, Path]) -> None:
    teacher = host(models, "gpt2", seed=1)
    teacher.train_local(list(zip(PROMPTS, TEXTS, strict=True)), FAST, steps=8)
    data = package_bytes(teacher, "logits")
    package = decode_package(data)
    student = host(models, "gpt2", seed=2)
    entries = logit_entries(student, package, PROMPTS)
    before = student.train_akd_logits(LOCAL, entries, 1.0, FAST, temperature=2.0, steps=1)
    result = integrate(
        student,
        package,
        kilobytes=len(data) / 1024,
        round_config=RoundConfig(total_rounds=2, train=FAST, local_steps=12, alpha_kd_end=1.0),
        t=2,
    )
    assert result.mode == "logits" and result.alpha_kd == 1.0
    assert result.temperature == pytest.approx(1.5)  # the last round of the schedule
    assert result.stats.kd_loss is not None and before.kd_loss is not None
    # The KL to the teacher's distribution falls as the student trains on it.
    assert result.stats.step_losses[-1] < result.stats.step_losses[0]
    after = student.train_akd_logits(LOCAL, entries, 1.0, FAST, temperature=2.0, steps=1)
    assert after.kd_loss is not None and after.kd_loss < before.kd_loss
    assert result.reward == pytest.approx(
        result.loss_pre - result.loss_post - 0.001 * len(data) / 1024
    )


def test_logits_of_another_tokenizer_are_refused_and_text_works(models: dict[str, Path]) -> None:
    teacher = host(models, "gpt2", seed=1)
    logits = decode_package(package_bytes(teacher, "logits"))
    student = host(models, "qwen2")
    with pytest.raises(TokenizerMismatchError):
        integrate(student, logits)
    # What the teacher sends a student with another tokenizer: text, which any student uses.
    mode = choose_package_mode("logits", teacher.tokenizer_hash, student.tokenizer_hash)
    text = decode_package(package_bytes(teacher, mode))
    assert isinstance(text, TextPackage)
    result = integrate(student, text)
    assert result.mode == "text" and result.temperature is None and result.alpha_kd == 0.2
    assert math.isfinite(result.reward)


def test_teacher_completions_are_greedy_and_cut(models: dict[str, Path]) -> None:
    teacher = host(models, "bloom")
    out = teacher_completions(teacher, PROMPTS, max_new_tokens=12)
    assert out == teacher_completions(teacher, PROMPTS, max_new_tokens=12)
    # One function body: nothing after a line that starts at column 0.
    assert all(not line[:1].strip() for c in out for line in c.split("\n")[1:])


def test_redacted_and_empty_completions_are_not_learnt_from(models: dict[str, Path]) -> None:
    from peerlm.agent.vetting.guardrail import placeholder

    def learn(texts: list[str]) -> Integration:
        return integrate(host(models, "gpt2"), text_package(texts), round_config=config(steps=2))

    spoiled = ["return " + placeholder("private_text") + "\n", "  \n", ""]
    nothing = learn(spoiled)
    assert nothing.stats.kd_loss is None  # local only
    one_good = learn([spoiled[0], "return x * 2\n", ""])
    assert one_good.stats.kd_loss is not None


def test_the_slot_scope_learns_only_the_accepted_items_and_nothing_when_none_is(
    models: dict[str, Path],
) -> None:
    seen: list[list[str]] = []

    def only_double(prompts: Sequence[str]) -> list[bool]:
        seen.append(list(prompts))
        return ["double" in p for p in prompts]

    student = host(models, "gpt2")
    kept = integrate(student, text_package(TEXTS), round_config=config(steps=2), learns=only_double)
    assert seen == [PROMPTS] and kept.stats.steps == 2 and kept.stats.kd_loss is not None
    # Every item refused: no step at all, the adapter as it was, the losses unchanged and
    # Eq. 3's reward the KB penalty alone.
    before = {k: v.clone() for k, v in student.adapter_state().items()}
    none = integrate(
        student,
        text_package(TEXTS),
        kilobytes=3.0,
        round_config=config(steps=2),
        learns=lambda prompts: [False] * len(prompts),
    )
    assert none.stats.steps == 0 and not none.rolled_back
    assert none.loss_pre == none.loss_post
    assert none.reward == pytest.approx(reward_eq3(1.0, 1.0, 3.0, 1.0, 0.001))
    after = student.adapter_state()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # A logits package is filtered the same way.
    teacher = host(models, "gpt2", seed=1)
    logits = decode_package(package_bytes(teacher, "logits"))
    got = integrate(
        student, logits, round_config=config(steps=2), learns=lambda ps: [False] * len(ps)
    )
    assert got.mode == "logits" and got.stats.steps == 0 and got.temperature is not None
    # Nothing left once the empty and redacted items are dropped: no step either (no
    # fall-back to training the slot on own data).
    blank = integrate(
        student, text_package(["", " ", ""]), round_config=config(steps=2), learns=only_double
    )
    assert blank.stats.steps == 0
    # Logits of another tokenizer are refused whatever the scope leaves of them.
    with pytest.raises(TokenizerMismatchError):
        integrate(host(models, "qwen2"), logits, learns=lambda ps: [False] * len(ps))


def test_incoming_text_items_are_vetted_before_the_student_learns(
    models: dict[str, Path],
) -> None:
    from peerlm.agent.exchange.package import build_text_package

    student = host(models, "gpt2", seed=2)
    # A teacher whose completions open sockets and shells: its own guardrail lets them
    # through (they hold no secret); the student's vetting must not.
    hostile = [
        "import socket\nreturn socket.gethostname()\n",
        "return __import__('subprocess').run(['id'])\n",
        "import os\nreturn os.environ\n",
    ]
    data = build_text_package(
        prompts=PROMPTS,
        completions=hostile,
        teacher="teacher",
        directive_id="d" * 32,
        transfer_sha256=TRANSFER,
        family=student.family,
        guardrail=Guardrail([]),
    )
    package = decode_package(data)
    registry = CollectorRegistry()
    result = integrate(
        student,
        package,
        kilobytes=len(data) / 1024,
        guardrail=Guardrail([], registry=registry),
    )
    # Every item refused: the step is local training only (no distillation loss).
    assert result.stats.kd_loss is None
    assert refused_imports(registry) == 3


def test_incoming_logits_items_are_vetted_through_their_text(models: dict[str, Path]) -> None:
    # The same hostile completions as token ids: the student decodes column 0 with its own
    # (the teacher's) tokenizer and refuses what the text would be refused for. One item is
    # harmless and still taught.
    teacher = host(models, "gpt2", seed=1)
    completions = [
        "import socket\nreturn socket.gethostname()\n",
        "return __import__('subprocess').run(['id'])\n",
        "return xs[0]\n",
    ]
    data = package_bytes(teacher, "logits", completions)
    package = decode_package(data)
    student = host(models, "gpt2", seed=2)
    registry = CollectorRegistry()
    result = integrate(
        student,
        package,
        kilobytes=len(data) / 1024,
        guardrail=Guardrail([], registry=registry),
    )
    assert result.mode == "logits"
    assert result.stats.kd_loss is not None  # the harmless item was learnt from
    assert refused_imports(registry) == 2

    # All items hostile: nothing is distilled, the step is local training only.
    hostile = decode_package(package_bytes(teacher, "logits", completions[:2], PROMPTS[:2]))
    only_local = integrate(student, hostile, guardrail=Guardrail([], registry=registry))
    assert only_local.stats.kd_loss is None


# --------------------------------------------------------------------------- acceptance gate


def _poisoned_package() -> TextPackage:
    """Text crafted to teach garbage: every completion a noise string, inside every limit."""
    rng = np.random.default_rng(7)
    alphabet = list("zqxj#@!~^%&*|<>{}")
    return text_package(
        ["".join(rng.choice(alphabet, size=120)) for _ in PROMPTS], teacher="mallory"
    )


def _poison(
    student: ModelHost,
    margin: float | None,
    reward_examples: list[tuple[str, str]] | None = None,
) -> Integration:
    hard = TrainSettings(learning_rate=1e-1, batch_size=4, grad_accumulation=1, seed=0)
    return integrate(
        student,
        _poisoned_package(),
        round_config=RoundConfig(
            total_rounds=1,
            train=hard,
            local_steps=16,
            alpha_kd_start=1.0,
            alpha_kd_end=1.0,
            acceptance_margin=margin,
        ),
        reward_examples=reward_examples,
    )


def test_poisoned_text_is_rolled_back_and_reported_negative(models: dict[str, Path]) -> None:
    # Without the gate the poisoned update stays and the held-out loss is worse.
    ungated = host(models, "gpt2", seed=3)
    ungated.train_local(LOCAL, FAST, steps=8)
    kept = _poison(ungated, None)
    assert not kept.rolled_back and kept.loss_post > kept.loss_pre + 0.05

    student = host(models, "gpt2", seed=3)
    student.train_local(LOCAL, FAST, steps=8)
    before = student.adapter_state()
    result = _poison(student, 0.05)
    assert result.rolled_back
    assert result.reward < 0 and result.loss_post > result.loss_pre  # what the CPM hears
    after = student.adapter_state()
    assert all(torch.equal(after[k], before[k]) for k in before)  # the student is unharmed
    assert student.eval_loss(LOCAL)[0] == pytest.approx(result.loss_pre)


def test_judge_bounds_the_reported_loss() -> None:
    assert judge(1.0, 1.05, 0.1) == Verdict(False, 1.05)
    assert judge(1.0, 1.2, 0.1) == Verdict(True, 1.2)
    assert judge(1.0, math.nan, None) == Verdict(True, 1.0 + LOSS_PENALTY_NATS)
    assert judge(1.0, 1e9, 0.1) == Verdict(True, 1.0 + LOSS_PENALTY_NATS)
    assert judge(1.0, 5.0, None) == Verdict(False, 5.0)  # no gate: measured, kept


def test_reference_nll_is_per_byte_and_falls_when_the_reference_is_learnt(
    models: dict[str, Path],
) -> None:
    from peerlm.agent.exchange.rounds import reference_nll
    from peerlm.agent.tasks.dataset import Problem

    problems = [
        Problem(f"t/{i}", "string", p, t, "assert True\n", p.split("(")[0][4:])
        for i, (p, t) in enumerate(zip(PROMPTS, TEXTS, strict=True))
    ]
    student = host(models, "qwen2")
    before = reference_nll(student, problems)
    raw = student.sequence_logprobs([(p.prompt, p.reference) for p in problems])
    for value, logp, p in zip(before, raw, problems, strict=True):
        assert value == pytest.approx(-logp / len(p.reference.encode()))
        assert math.isfinite(value) and value > 0
    student.train_local(list(zip(PROMPTS, TEXTS, strict=True)), FAST, steps=8)
    after = reference_nll(student, problems)
    assert sum(after) < sum(before)


# ------------------------------------------------------------------------ the probe reward

#: A labelled public probe: the teacher's answers to :data:`PROMPTS` (what it brings).
PROBE = list(zip(PROMPTS, TEXTS, strict=True))


def test_a_probe_reward_is_measured_on_the_probe_and_the_gate_on_val(
    models: dict[str, Path],
) -> None:
    """With ``reward_examples`` the reward's L_pre and L_post are the probe's (where the
    teacher's skill shows), not the validation data's."""
    student = host(models, "gpt2", seed=4)
    probe_pre = student.eval_loss(PROBE)[0]
    result = integrate(student, text_package(TEXTS), reward_examples=PROBE)
    assert result.loss_pre == pytest.approx(probe_pre)
    assert result.loss_post == pytest.approx(student.eval_loss(PROBE)[0])
    assert result.loss_post < result.loss_pre  # the package taught exactly the probe
    assert result.reward == reward_eq3(result.loss_pre, result.loss_post, 1.0, 1.0, 0.001)
    # The same exchange measured on val (the paper's Eq. 3) reports other losses.
    same = host(models, "gpt2", seed=4)
    val_pre = same.eval_loss(LOCAL)[0]
    on_val = integrate(same, text_package(TEXTS))
    assert on_val.loss_pre == pytest.approx(val_pre)
    assert val_pre != pytest.approx(probe_pre)


def test_a_rolled_back_update_reports_the_gates_loss_whatever_the_probe(
    models: dict[str, Path],
) -> None:
    """A poisoned package is judged and undone on val; the CPM still hears a negative
    reward from the gate's measurement, not the probe's (which the rollback restored)."""
    student = host(models, "gpt2", seed=3)
    student.train_local(LOCAL, FAST, steps=8)
    val_pre = student.eval_loss(LOCAL)[0]
    result = _poison(student, 0.05, reward_examples=PROBE)
    assert result.rolled_back and result.reward < 0
    assert result.loss_pre == pytest.approx(val_pre)


def test_an_answered_scope_measures_a_package_on_the_probe_of_what_it_answers(
    models: dict[str, Path],
) -> None:
    """``reward_scope`` (``answered``): a package is measured on the probe problems of the
    categories its items answer; one that answers none of the probe's categories earns
    Eq. 3's KB penalty alone, with its losses unchanged, whatever it trained."""
    from peerlm.agent.exchange.reward_probe import AnsweredProbe

    # X_u's labels: the first prompt is of "strings", the others of "numbers"; the probe
    # holds one problem of each and one of a category X_u does not have.
    other = ('def upper(s: str) -> str:\n    """Upper case.\n    """\n    ', "return s.upper()\n")
    probe = [(*PROBE[0], "strings"), (*PROBE[1], "numbers"), (*other, "dates")]
    scope = AnsweredProbe.of(probe, PROMPTS, ["strings", "numbers", "numbers"])
    assert scope([PROMPTS[1], PROMPTS[2]]) == [PROBE[1]]
    assert scope([PROMPTS[0], "a prompt outside X_u"]) == [PROBE[0]]
    assert scope([]) == []
    with pytest.raises(ValueError, match="labels"):
        AnsweredProbe.of(probe, PROMPTS, ["strings"])

    # One item, answering the "strings" prompt: measured on the "strings" probe problem.
    student = host(models, "gpt2", seed=4)
    strings_pre = student.eval_loss([PROBE[0]])[0]
    whole = text_package(TEXTS)
    one = dataclasses.replace(whole, items=whole.items[:1])
    result = integrate(student, one, reward_examples=[p[:2] for p in probe], reward_scope=scope)
    assert result.loss_pre == pytest.approx(strings_pre)
    assert result.loss_post == pytest.approx(student.eval_loss([PROBE[0]])[0])
    assert result.loss_post < result.loss_pre
    assert result.reward == reward_eq3(result.loss_pre, result.loss_post, 1.0, 1.0, 0.001)

    # No item: trained on local data (the slot's Eq. 2 without a teacher) but measured on
    # nothing of the probe: the reward is the KB penalty alone.
    empty = dataclasses.replace(whole, items=())
    again = host(models, "gpt2", seed=4)
    val_pre = again.eval_loss(LOCAL)[0]
    nothing = integrate(again, empty, kilobytes=2.0, reward_scope=scope)
    assert nothing.stats.steps > 0
    assert nothing.loss_pre == nothing.loss_post == pytest.approx(val_pre)
    assert nothing.reward == pytest.approx(-0.002)


def test_an_answered_reward_scope_needs_a_reward_file(tmp_path: Path) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="reward_file"):
        AgentSettings(reward_scope="answered")
    probe = tmp_path / "probe.jsonl"
    assert AgentSettings(reward_scope="answered", reward_file=probe).reward_scope == "answered"
    assert AgentSettings().reward_scope == "all"


def test_a_routed_reward_scope_keeps_what_the_slot_answers(tmp_path: Path) -> None:
    """``reward_scope: routed``: the answered scope narrowed to the probe problems the input
    router sends to the peer slot; with no router nothing is measured. It needs a probe
    file and a slot."""
    from peerlm.agent.exchange.reward_probe import AnsweredProbe
    from pydantic import ValidationError

    probe = [(*PROBE[0], "strings"), (*PROBE[1], "numbers")]
    scope = AnsweredProbe.of(probe, PROMPTS, ["strings", "numbers", "numbers"])
    to_slot = scope.routed(lambda prompts: [p == PROBE[1][0] for p in prompts])
    assert to_slot(PROMPTS) == [PROBE[1]]
    assert to_slot([PROMPTS[0]]) == []  # its category's probe problem stays with the own adapter
    assert scope.routed(None)(PROMPTS) == []
    assert scope(PROMPTS) == [PROBE[0], PROBE[1]]  # the answered scope is unchanged
    file = tmp_path / "probe.jsonl"
    with pytest.raises(ValidationError, match="reward_file"):
        AgentSettings(reward_scope="routed")
    with pytest.raises(ValidationError, match="integration 'separate'"):
        AgentSettings(reward_scope="routed", reward_file=file, integration="shared")
    assert AgentSettings(reward_scope="routed", reward_file=file).reward_scope == "routed"
