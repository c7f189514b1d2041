"""OnePeFT's Heterogeneous Knowledge Alignment and one-shot mode on micro models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from peerlm.agent.adapter_codec import AdapterError
from peerlm.agent.merging.hka import TEACHER_PREFIX, mixture_kl_sum, teacher_adapters
from peerlm.agent.merging.lora_merge import ClientAdapter
from peerlm.agent.merging.onepeft import one_shot
from peerlm.agent.modelhost import ModelHost
from peerlm.agent.models.lora import LoraSettings
from peerlm.agent.models.tiny import build_models
from peerlm.agent.training import TrainSettings, collate

PUBLIC = [
    ('def add(a: int, b: int) -> int:\n    """Sum.\n    """\n    ', "return a + b\n"),
    ('def neg(x: int) -> int:\n    """Negate.\n    """\n    ', "return -x\n"),
    ('def first(xs: list[int]) -> int:\n    """First.\n    """\n    ', "return xs[0]\n"),
]
SKILL_A = [("def double(x: int) -> int:\n    ", "return x * 2\n")] * 2
SKILL_B = [("def rev(s: str) -> str:\n    ", "return s[::-1]\n")] * 2
FAST = TrainSettings(learning_rate=2e-2, batch_size=3, grad_accumulation=1, seed=0)


@pytest.fixture(autouse=True, scope="module")
def _offline(offline_hub: None) -> None:
    """Every load here is from a local directory (tests/conftest.py)."""


@pytest.fixture(scope="module")
def gpt2(micro_models_dir: Path) -> Path:
    infos = build_models(micro_models_dir, size="micro")
    return next(Path(i.path) for i in infos if i.arch == "gpt2")


def host(path: Path, r: int = 8, alpha: float = 16.0, seed: int = 0) -> ModelHost:
    return ModelHost.load(
        path, LoraSettings(r=r, alpha=alpha, dropout=0.0), device="cpu", seed=seed
    )


def trained_client(path: Path, data: list[tuple[str, str]], r: int, seed: int) -> ClientAdapter:
    h = host(path, r=r, alpha=2.0 * r, seed=seed)
    h.train_local(data, FAST, steps=6)
    return ClientAdapter(h.adapter_state(), r=r, alpha=2.0 * r, examples=len(data), name=str(seed))


@pytest.fixture(scope="module")
def clients(gpt2: Path) -> list[ClientAdapter]:
    # Heterogeneous ranks (the FlexLoRA setting): 4 and 16 around the student's 8.
    return [trained_client(gpt2, SKILL_A, 4, 1), trained_client(gpt2, SKILL_B, 16, 2)]


def _probs_with(path: Path, client: ClientAdapter, items: list) -> torch.Tensor:
    """The teacher distribution computed the slow way: a fresh host loaded with the client."""
    h = host(path, r=client.r, alpha=client.alpha)
    h.load_adapter_state(client.state)
    ids, mask, _ = collate(items, h._pad_id, torch.device("cpu"))
    with torch.no_grad():
        return F.softmax(h.model(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)


def test_teachers_switched_on_one_base_equal_separately_loaded_models(
    gpt2: Path, clients: list[ClientAdapter]
) -> None:
    student = host(gpt2)
    before = student.adapter_state()
    items = student._encode_all(PUBLIC, 64)
    ids, mask, labels = collate(items, student._pad_id, torch.device("cpu"))
    with teacher_adapters(student.model, clients, [3.0, 1.0]) as teachers:
        assert teachers.weights == (0.75, 0.25)
        mix = teachers.mixture(ids, mask)
        kl, n = mixture_kl_sum(student.model, items, student._pad_id, teachers)
    expected_mix = 0.75 * _probs_with(gpt2, clients[0], items) + 0.25 * _probs_with(
        gpt2, clients[1], items
    )
    torch.testing.assert_close(mix, expected_mix, rtol=1e-5, atol=1e-6)
    # Eq. 5 by hand: sum over labelled positions of sum_v p log(p / q).
    with torch.no_grad():
        q = F.log_softmax(student.model(input_ids=ids, attention_mask=mask).logits.float(), -1)
    keep = labels[:, 1:] != -100
    p = expected_mix[:, :-1][keep]
    by_hand = (p * (p.clamp_min(1e-30).log() - q[:, :-1][keep])).sum()
    assert n == int(keep.sum()) > 0
    assert float(kl.detach()) == pytest.approx(float(by_hand), rel=1e-4)
    # The teachers are gone, the student's adapter is untouched, active and trainable.
    names = {k for k, _ in student.model.named_parameters() if TEACHER_PREFIX in k}
    assert not names
    assert student.model.active_adapter == "default"
    after = student.adapter_state()
    assert all(torch.equal(before[k], after[k]) for k in before)
    trainable = [k for k, p in student.model.named_parameters() if p.requires_grad]
    assert trainable and all(".default." in k for k in trainable)


def test_a_teacher_that_is_the_student_has_zero_kl(gpt2: Path) -> None:
    student = host(gpt2)
    student.train_local(SKILL_A, FAST, steps=3)
    me = ClientAdapter(student.adapter_state(), r=8, alpha=16.0, examples=1)
    items = student._encode_all(PUBLIC, 64)
    with teacher_adapters(student.model, [me]) as teachers:
        kl, _ = mixture_kl_sum(student.model, items, student._pad_id, teachers)
    assert abs(float(kl.detach())) < 1e-3


def test_hka_moves_the_student_towards_the_mixture(
    gpt2: Path, clients: list[ClientAdapter]
) -> None:
    student = host(gpt2)
    items = student._encode_all(PUBLIC, 64)

    def kl_now() -> float:
        with teacher_adapters(student.model, clients) as teachers:
            kl, n = mixture_kl_sum(student.model, items, student._pad_id, teachers)
        return float(kl) / n

    start = kl_now()
    stats = student.train_hka(PUBLIC, clients, FAST, alpha=0.0, steps=8)
    assert stats.kd_loss is not None and stats.alpha_kd == 1.0
    assert kl_now() < 0.8 * start
    # alpha = 1 is plain CE on D_pub: the KL source is not trained at all.
    ce_only = student.train_hka(PUBLIC, clients, FAST, alpha=1.0, steps=2)
    assert ce_only.kd_loss is None and ce_only.local_loss is not None


def test_bad_teachers_are_refused_before_the_student_changes(
    gpt2: Path, clients: list[ClientAdapter]
) -> None:
    student = host(gpt2)
    before = student.adapter_state()
    nan = {k: v.clone() for k, v in clients[0].state.items()}
    first = next(iter(nan))
    nan[first][0, 0] = float("nan")
    fewer = dict(list(clients[0].state.items())[2:])
    cases = [
        [ClientAdapter(nan, r=4, alpha=8.0, examples=1)],
        [ClientAdapter(fewer, r=4, alpha=8.0, examples=1)],
        [],
    ]
    for bad in cases:
        with pytest.raises(AdapterError):
            student.train_hka(PUBLIC, bad, FAST, steps=1)
        with pytest.raises(AdapterError):
            one_shot(student, bad, PUBLIC, FAST, steps=1)
        after = student.adapter_state()
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert not [k for k, _ in student.model.named_parameters() if TEACHER_PREFIX in k]
    with pytest.raises(ValueError, match="alpha"):
        student.train_hka(PUBLIC, clients, FAST, alpha=1.5, steps=1)
    # HKA failing after the aggregate was loaded (here: an alpha it refuses) restores the
    # adapter the student had, as a refused client does.
    with pytest.raises(ValueError, match="alpha"):
        one_shot(student, clients, PUBLIC, FAST, alpha=1.5, steps=1)
    after = student.adapter_state()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_one_shot_variants_of_table_5(gpt2: Path, clients: list[ClientAdapter]) -> None:
    student = host(gpt2)
    svd_only = one_shot(student, clients, PUBLIC, FAST, hka=False)
    assert svd_only.variant == "svd" and svd_only.hka is None
    assert svd_only.merged.r == 8 and svd_only.merged.weights == (0.5, 0.5)
    loaded = student.adapter_state()
    assert all(torch.equal(loaded[k], svd_only.merged.state[k].to(loaded[k].dtype)) for k in loaded)
    full = one_shot(student, clients, PUBLIC, FAST, steps=3)
    assert full.variant == "svd+hka" and full.hka is not None and full.hka.steps == 3
    # Without SVD the factors are averaged: needs every client at the host's rank.
    with pytest.raises(AdapterError, match="r="):
        one_shot(student, clients, PUBLIC, FAST, svd=False)
    same_rank = [trained_client(gpt2, SKILL_A, 8, 3), trained_client(gpt2, SKILL_B, 8, 4)]
    assert one_shot(student, same_rank, PUBLIC, FAST, svd=False, hka=False).variant == "fedavg"
    hka_only = one_shot(student, same_rank, PUBLIC, FAST, svd=False, steps=2)
    assert hka_only.variant == "hka"
