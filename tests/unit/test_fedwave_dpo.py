"""FedWave's DPO loss (Eq. 10) and the sequence quantities it is fed, by hand and on a tiny LM."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peerlm.agent.fedwave.dpo import DEFAULT_BETA, DPOSettings, dpo_loss
from peerlm.agent.fedwave.sequence_losses import per_sample_sft_loss, response_logprobs
from peerlm.agent.models.tiny import SHIPPED_DIR
from transformers import AutoModelForCausalLM, AutoTokenizer


@pytest.fixture(autouse=True)
def _offline(offline_hub: None) -> None:
    """Every load here is from the shipped tiny models (tests/conftest.py)."""


def v(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


def test_dpo_loss_by_hand() -> None:
    # pair 1: policy margin 1, reference margin 0 -> z = 0.1; pair 2: -2 and 0 -> z = -0.2
    terms = dpo_loss(v(-1, -3), v(-2, -1), v(-1.5, -2), v(-1.5, -2), beta=0.1)
    expected = [math.log1p(math.exp(-0.1)), math.log1p(math.exp(0.2))]
    assert terms.losses.tolist() == pytest.approx(expected)
    assert terms.loss.item() == pytest.approx(sum(expected) / 2)
    assert terms.chosen_rewards.tolist() == pytest.approx([0.05, -0.1])
    assert terms.rejected_rewards.tolist() == pytest.approx([-0.05, 0.1])
    assert terms.reward_accuracy == 0.5
    assert DEFAULT_BETA == DPOSettings().beta == 0.1


def test_dpo_starts_at_log2_and_only_the_policy_gets_gradient() -> None:
    pc, pr = v(-4.0).requires_grad_(), v(-5.0).requires_grad_()
    rc, rr = v(-4.0).requires_grad_(), v(-5.0).requires_grad_()
    terms = dpo_loss(pc, pr, rc, rr)
    assert terms.loss.item() == pytest.approx(math.log(2))  # π = π_ref
    terms.loss.backward()
    # d/dπ_c of −log σ(β Δ) at Δ = 0 is −β/2; +β/2 for π_r.
    assert pc.grad is not None and pc.grad.item() == pytest.approx(-0.05)
    assert pr.grad is not None and pr.grad.item() == pytest.approx(0.05)
    assert rc.grad is None and rr.grad is None


def test_dpo_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(v(0), v(0), v(0), v(0), beta=0)
    with pytest.raises(ValueError, match="one length"):
        dpo_loss(v(0, 1), v(0), v(0), v(0))


def test_sequence_quantities_by_hand() -> None:
    # Vocabulary 3; position 0 predicts token 1, position 1 predicts token 2.
    logits = torch.zeros(1, 3, 3)
    logits[0, 1] = torch.tensor([0.0, 0.0, math.log(2.0)])  # p(2) = 2/4 after position 1
    ids = torch.tensor([[0, 1, 2]])
    mask = torch.tensor([[0, 1, 1]])  # score tokens 1 and 2
    lp = response_logprobs(logits, ids, mask)
    assert lp.item() == pytest.approx(math.log(1 / 3) + math.log(1 / 2))
    only_last = torch.tensor([[0, 0, 1]])
    assert response_logprobs(logits, ids, only_last).item() == pytest.approx(math.log(0.5))
    sft = per_sample_sft_loss(logits, ids, mask)
    assert sft.item() == pytest.approx(-(math.log(1 / 3) + math.log(1 / 2)) / 2)
    assert per_sample_sft_loss(logits, ids, torch.zeros_like(ids)).item() == 0.0
    with pytest.raises(ValueError, match="does not match"):
        response_logprobs(logits, ids, mask[:, :2])


def test_dpo_steps_on_a_tiny_model_raise_the_chosen_margin() -> None:
    """Eq. 10 trains a real tiny LM: the policy's preference margin over π_ref grows."""
    path = SHIPPED_DIR / "tiny" / "gpt2"
    tokenizer = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(path)
    reference = copy.deepcopy(policy).eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    prompt = "def add(a, b):\n"
    chosen, rejected = "    return a + b\n", "    return a - b\n"
    n_prompt = len(tokenizer(prompt)["input_ids"])

    def batch(response: str) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor([tokenizer(prompt + response)["input_ids"]])
        mask = torch.zeros_like(ids)
        mask[:, n_prompt:] = 1
        return ids, mask

    (cid, cmask), (rid, rmask) = batch(chosen), batch(rejected)
    with torch.no_grad():
        ref_c = response_logprobs(reference(cid).logits, cid, cmask)
        ref_r = response_logprobs(reference(rid).logits, rid, rmask)
    optimiser = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    losses = []
    for _ in range(5):
        optimiser.zero_grad()
        pc = response_logprobs(policy(cid).logits, cid, cmask)
        pr = response_logprobs(policy(rid).logits, rid, rmask)
        terms = dpo_loss(pc, pr, ref_c, ref_r)
        terms.loss.backward()
        optimiser.step()
        losses.append(terms.loss.item())
    assert losses[0] == pytest.approx(math.log(2), abs=1e-5)
    assert losses[-1] < losses[0] - 0.01
    assert terms.reward_accuracy == 1.0


LOGP = st.floats(-50, 0, allow_nan=False)


@settings(max_examples=40, deadline=None)
@given(pc=LOGP, pr=LOGP, rc=LOGP, rr=LOGP, beta=st.floats(0.01, 1.0))
def test_swapping_chosen_and_rejected_mirrors_the_margin(
    pc: float, pr: float, rc: float, rr: float, beta: float
) -> None:
    """−log σ(z) − (−log σ(−z)) = −z, and the loss is positive."""
    ahead = dpo_loss(v(pc), v(pr), v(rc), v(rr), beta=beta).loss.item()
    swapped = dpo_loss(v(pr), v(pc), v(rr), v(rc), beta=beta).loss.item()
    z = beta * ((pc - pr) - (rc - rr))
    assert ahead - swapped == pytest.approx(-z, abs=1e-9)
    assert ahead > 0 and swapped > 0
