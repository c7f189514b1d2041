"""FedProxy against a hostile member: an update inside the total norm bound that targets
another member's vocabulary, or climbs its loss, must not wreck that member's model."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peerlm.agent.fedproxy.admission import (
    frozen_refusal,
    group_refusal,
    norm_refusal,
    state_norm,
    token_embedding_keys,
    update_norm,
)
from peerlm.agent.fedproxy.hties import h_ties, support_clip, task_vectors
from peerlm.agent.fedproxy.member import frozen_embeddings, proxy_from, text_loss, text_trainer
from peerlm.agent.fedproxy.proxy import build_proxy
from peerlm.agent.models.tiny import SHIPPED_DIR
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

State = dict[str, torch.Tensor]
# The victim's skill and the honest member's, in disjoint vocabularies as far as the tiny
# tokenizer allows; the attacker knows (or guesses) the victim's vocabulary.
VICTIM = [f"while queue_{i}:\n    node = queue_{i}.pop()\n    seen.add(node)\n" for i in range(16)]
HONEST = [f"def add_{i}(a, b):\n    return a + b + {i}\n" for i in range(16)]


@pytest.fixture(scope="module")
def proxy() -> PreTrainedModel:
    full = AutoModelForCausalLM.from_pretrained(SHIPPED_DIR / "tiny" / "gpt2")
    return build_proxy(full, (0, 3), ratio=0.5)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    tok = AutoTokenizer.from_pretrained(SHIPPED_DIR / "tiny" / "gpt2")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _member_update(proxy: PreTrainedModel, tokenizer: Any, texts: list[str], seed: int) -> State:
    """What an honest member sends: trained with the token embeddings frozen."""
    model = proxy_from(proxy.config.to_dict(), proxy.state_dict())
    with frozen_embeddings(model):
        text_trainer(tokenizer, texts, steps=3, learning_rate=5e-3, seed=seed)(model, None)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def cohort(proxy: PreTrainedModel, tokenizer: Any) -> dict[str, Any]:
    base = {k: v.detach().clone() for k, v in proxy.state_dict().items()}
    return {
        "base": base,
        "victim": _member_update(proxy, tokenizer, VICTIM[::2], 0),
        "honest": _member_update(proxy, tokenizer, HONEST, 1),
        "loss": text_loss(tokenizer, VICTIM[1::2]),  # the victim's own held-out texts
    }


def _victim_rows_attack(proxy: PreTrainedModel, tokenizer: Any, base: State) -> State:
    """The audit's update: the embedding rows of the victim's vocabulary (tokens the honest
    member does not use) replaced, 0.42x the proxy's norm in all: inside the norm bound."""
    ids = {t for text in VICTIM for t in tokenizer(text)["input_ids"]}
    ids -= {t for text in HONEST for t in tokenizer(text)["input_ids"]}
    rows = torch.tensor(sorted(ids))
    gen = torch.Generator().manual_seed(7)
    out = {k: v.clone() for k, v in base.items()}
    keys = token_embedding_keys(proxy)
    noise = torch.randn((len(rows), base[keys[0]].shape[1]), generator=gen)
    noise *= 0.42 * state_norm(base) / float(noise.norm()) / len(keys) ** 0.5
    for key in keys:  # tied: the same tensor under both names
        out[key][rows] += noise
    return out


def _loss_climb_attack(
    proxy: PreTrainedModel, tokenizer: Any, base: State, scale: float = 0.3
) -> State:
    """An update in the direction that raises the loss on the victim's kind of text, on
    every parameter but the embeddings, ``scale`` x the proxy's norm."""
    model = proxy_from(proxy.config.to_dict(), base)
    batch = tokenizer(VICTIM[::2], return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    model(**batch, labels=labels).loss.backward()
    frozen = set(token_embedding_keys(model))
    grads = {n: p.grad for n, p in model.named_parameters() if n not in frozen}
    total = sum(float(g.norm() ** 2) for g in grads.values() if g is not None) ** 0.5
    out = {k: v.clone() for k, v in base.items()}
    for name, grad in grads.items():
        if grad is not None:
            out[name] += grad * (scale * state_norm(base) / total)
    return out


def _victim_loss(cohort: dict[str, Any], proxy: PreTrainedModel, state: State) -> float:
    return float(cohort["loss"](proxy_from(proxy.config.to_dict(), state)))


@pytest.mark.slow
@pytest.mark.parametrize("attack", [_victim_rows_attack, _loss_climb_attack])
def test_a_crafted_update_inside_the_norm_bound_does_not_wreck_the_victims_model(
    attack: Any, cohort: dict[str, Any], proxy: PreTrainedModel, tokenizer: Any
) -> None:
    base = cohort["base"]
    hostile = attack(proxy, tokenizer, base)
    # Inside the total norm bound: the check the owner had before lets it through.
    assert norm_refusal(base, hostile, max_ratio=1.0) is None
    members = [cohort["victim"], cohort["honest"], hostile]
    before = _victim_loss(cohort, proxy, base)
    paper = _victim_loss(cohort, proxy, h_ties(base, members).state)
    robust = _victim_loss(cohort, proxy, h_ties(base, members, robust=True).state)
    print(
        f"\n{attack.__name__}: victim's held-out loss {before:.3f}; after the paper's "
        f"H-TIES {paper:.3f}; after the robust merge {robust:.3f}"
    )
    # The paper's merge takes the attacker's entries wherever its mass dominates...
    assert paper > before + 1.0
    # ... the robust merge bounds every coordinate by an honest member's own step: the
    # victim stays within the harm margin its report would roll back
    # (fedproxy.harm_margin, 0.5 nats); what is left is the member-side gate's.
    assert robust < before + 0.5


def test_the_owner_refuses_the_row_attack_before_any_merge(
    cohort: dict[str, Any], proxy: PreTrainedModel, tokenizer: Any
) -> None:
    base = cohort["base"]
    hostile = _victim_rows_attack(proxy, tokenizer, base)
    keys = token_embedding_keys(proxy)
    assert keys == ("lm_head.weight", "transformer.wte.weight")
    assert "frozen" in (frozen_refusal(base, hostile, keys) or "")
    assert "row" in (group_refusal(base, hostile, max_ratio=0.5) or "")
    # Honest members' updates pass both, far inside the group bound.
    for name in ("victim", "honest"):
        assert frozen_refusal(base, cohort[name], keys) is None
        assert group_refusal(base, cohort[name], max_ratio=0.1) is None


def test_the_group_bound_lets_a_bias_at_zero_move_and_refuses_nan() -> None:
    base = {"w": torch.ones(4, 4), "b": torch.zeros(4)}
    moved = {"w": torch.ones(4, 4), "b": torch.full((4,), 0.1)}
    assert group_refusal(base, moved, max_ratio=0.5) is None
    one_row = {"w": torch.ones(4, 4), "b": torch.zeros(4)}
    one_row["w"][2, 0] += 1.5  # 0.75 x the row's norm, 0.375 x the tensor's
    assert "row 2" in (group_refusal(base, one_row, max_ratio=0.5) or "")
    nan = {"w": torch.ones(4, 4), "b": torch.tensor([0.0, float("nan"), 0.0, 0.0])}
    assert group_refusal(base, nan, max_ratio=0.5) is not None
    assert group_refusal(base, nan, max_ratio=None) is None


def test_frozen_embeddings_are_put_back_whatever_the_trainer_does(
    proxy: PreTrainedModel,
) -> None:
    model = proxy_from(proxy.config.to_dict(), proxy.state_dict())
    before = model.get_input_embeddings().weight.detach().clone()
    with frozen_embeddings(model):
        assert not model.get_input_embeddings().weight.requires_grad
        with torch.no_grad():
            model.get_input_embeddings().weight.add_(1.0)
    assert torch.equal(model.get_input_embeddings().weight, before)
    assert model.get_input_embeddings().weight.requires_grad


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.lists(st.floats(-10, 10, allow_nan=False), min_size=3, max_size=3),
        min_size=2,
        max_size=5,
    ),
    st.integers(0, 4),
)
def test_no_robust_merged_coordinate_moves_further_than_the_other_clients(
    rows: list[list[float]], hostile: int
) -> None:
    """Whichever one client is hostile, every coordinate of the robust merge moves at most
    as far as some other client moved it."""
    base = {"w": torch.zeros(3, dtype=torch.float64)}
    clients = [{"w": torch.tensor(r, dtype=torch.float64)} for r in rows]
    hostile %= len(clients)
    merged = h_ties(base, clients, robust=True).state["w"]
    others = torch.stack([c["w"] for i, c in enumerate(clients) if i != hostile]).abs()
    assert bool((merged.abs() <= others.max(dim=0).values + 1e-12).all())
    clipped = support_clip(task_vectors(base, clients))
    for k, tau in enumerate(clipped):
        rest = torch.stack([c["w"] for i, c in enumerate(clients) if i != k]).abs()
        assert bool((tau["w"].abs() <= rest.max(dim=0).values).all())


def test_one_client_is_merged_as_is_by_the_robust_merge() -> None:
    base = {"w": torch.zeros(3, dtype=torch.float64)}
    client = {"w": torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)}
    assert torch.equal(h_ties(base, [client], robust=True).state["w"], client["w"])
    assert update_norm(base, client) == pytest.approx(float(client["w"].norm()))
