"""FedWave's assembled π_SFT (top-2 mixture under the router) and its DPO phase, on tiny gpt2."""

from __future__ import annotations

import math

import pytest
import torch
from peerlm.agent.fedwave.assembly import AssembledModel, assembled_generate
from peerlm.agent.fedwave.dpo import dpo_loss
from peerlm.agent.fedwave.dpo_phase import (
    PreferencePair,
    build_preference_pairs,
    encode_pairs,
    pair_logprobs,
    run_dpo_phase,
)
from peerlm.agent.fedwave.errors import FedWaveError
from peerlm.agent.fedwave.generation import greedy_generate
from peerlm.agent.fedwave.router import MoERouter
from peerlm.agent.fedwave.vclayer import VCCausalLM, VCLayer
from peerlm.agent.models.lora import LoraSettings, apply_lora
from peerlm.agent.models.tiny import SHIPPED_DIR
from transformers import AutoModelForCausalLM, AutoTokenizer

PATH = SHIPPED_DIR / "tiny" / "gpt2"


@pytest.fixture(autouse=True)
def _offline(offline_hub: None) -> None:
    """Every load here is from the shipped tiny models (tests/conftest.py)."""


def _expert(seed: int) -> VCCausalLM:
    torch.manual_seed(seed)
    lm = apply_lora(AutoModelForCausalLM.from_pretrained(PATH), LoraSettings(dropout=0.0))
    # Make the experts differ: random LoRA B factors (peft starts B at zero).
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    layer = VCLayer(int(lm.config.hidden_size), generator=torch.Generator().manual_seed(seed))
    return VCCausalLM(lm, layer).eval()


def _forcing_router(d: int, logits: list[float]) -> MoERouter:
    """A router whose logits are ``logits`` whatever the input (zero first layer)."""
    router = MoERouter(d, len(logits))
    with torch.no_grad():
        router.fc1.weight.zero_()
        router.fc1.bias.zero_()
        router.fc2.weight.zero_()
        router.fc2.bias.copy_(torch.tensor(logits))
    return router


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(PATH)


@pytest.fixture(scope="module")
def experts() -> list[VCCausalLM]:
    return [_expert(s) for s in (1, 2, 3)]


def test_the_assembly_mixes_exactly_the_top_two_experts(
    experts: list[VCCausalLM], tokenizer
) -> None:  # type: ignore[no-untyped-def]
    d = experts[0].vclayer.hidden_size
    # α ∝ exp([0, 2, 1]): the top 2 are experts 1 and 2 with weights ∝ e², e¹.
    model = AssembledModel(experts, _forcing_router(d, [0.0, 2.0, 1.0])).eval()
    ids = torch.tensor([[5, 17, 300, 2000, 9], [40, 41, 1024, 7, 8]])
    with torch.no_grad():
        out = model(ids)
        p1 = torch.softmax(experts[1](ids).logits, -1)
        p2 = torch.softmax(experts[2](ids).logits, -1)
    w1, w2 = math.e**2 / (math.e**2 + math.e), math.e / (math.e**2 + math.e)
    assert out.routing.experts.tolist() == [[1, 2], [1, 2]]
    assert out.routing.weights[0].tolist() == pytest.approx([w1, w2], abs=1e-6)
    expected = torch.log(w1 * p1 + w2 * p2)
    assert torch.allclose(out.logits, expected, atol=1e-5)
    # Expert 0 takes no part: changing it changes nothing.
    p0 = torch.softmax(experts[0](ids).logits, -1)
    assert not torch.allclose(torch.log(p0), expected, atol=1e-2)


def test_with_top_1_generation_is_that_experts_own(experts: list[VCCausalLM], tokenizer) -> None:  # type: ignore[no-untyped-def]
    d = experts[0].vclayer.hidden_size
    model = AssembledModel(experts, _forcing_router(d, [0.0, 0.0, 3.0]), top_k=1)
    sources = ["def add(a, b):\n    "]
    outputs, routings = assembled_generate(model, tokenizer, sources, max_new_tokens=8)
    assert routings[0].experts.tolist() == [[2]]
    assert outputs == greedy_generate(experts[2], tokenizer, sources, max_new_tokens=8)


def test_bad_inputs_are_refused(experts: list[VCCausalLM]) -> None:
    d = experts[0].vclayer.hidden_size
    with pytest.raises(FedWaveError, match="routes over 2 experts but 3") as wrong:
        AssembledModel(experts, MoERouter(d, 2))
    assert wrong.value.reason == "shape"
    with pytest.raises(FedWaveError, match="top_k"):
        AssembledModel(experts, MoERouter(d, 3), top_k=4)
    broken = _expert(9)
    with torch.no_grad():
        next(p for n, p in broken.named_parameters() if "lora_A" in n)[0, 0] = float("nan")
    with pytest.raises(FedWaveError, match=r"expert 1: .*lora_A.* NaN") as nan:
        AssembledModel([experts[0], broken, experts[2]], MoERouter(d, 3))
    assert nan.value.reason == "non_finite"
    with pytest.raises(FedWaveError, match="share one width"):
        AssembledModel(experts, MoERouter(d + 1, 3))


def test_preference_pairs_come_from_the_top_and_the_lowest_expert(
    experts: list[VCCausalLM], tokenizer
) -> None:  # type: ignore[no-untyped-def]
    d = experts[0].vclayer.hidden_size
    model = AssembledModel(experts, _forcing_router(d, [1.0, -2.0, 3.0]))
    prompt = "def add(a, b):\n    "
    pairs = build_preference_pairs(model, tokenizer, [prompt], max_new_tokens=6)
    assert len(pairs) == 1 and pairs[0].informative
    pair = pairs[0]
    assert (pair.chosen_expert, pair.rejected_expert) == (2, 1)
    assert pair.chosen == greedy_generate(experts[2], tokenizer, [prompt], max_new_tokens=6)[0]
    assert pair.rejected == greedy_generate(experts[1], tokenizer, [prompt], max_new_tokens=6)[0]
    assert pair.alpha[2] > pair.alpha[0] > pair.alpha[1]


def test_the_phase_loss_equals_eq10_by_hand_and_training_moves_only_the_experts(tokenizer) -> None:  # type: ignore[no-untyped-def]
    experts = [_expert(s) for s in (4, 5, 6)]
    d = experts[0].vclayer.hidden_size
    model = AssembledModel(experts, _forcing_router(d, [2.0, 1.0, 0.0]))
    pair = PreferencePair(
        "def add(a, b):\n    ", "return a + b", "return a * b", 0, 2, (0.6, 0.3, 0.1)
    )
    chosen = encode_pairs(tokenizer, [(pair.prompt, pair.chosen)])
    rejected = encode_pairs(tokenizer, [(pair.prompt, pair.rejected)])
    with torch.no_grad():
        c0, r0 = float(pair_logprobs(model, chosen)), float(pair_logprobs(model, rejected))
    router_before = {k: v.clone() for k, v in model.router.state_dict().items()}
    report = run_dpo_phase(model, tokenizer, [pair], steps=3, batch_size=1, lr=5e-3)
    # The first step's loss is at π = π_ref: log 2 exactly.
    assert report.losses[0] == pytest.approx(math.log(2), abs=1e-5)
    with torch.no_grad():
        c1, r1 = float(pair_logprobs(model, chosen)), float(pair_logprobs(model, rejected))
    by_hand = -math.log(1 / (1 + math.exp(-0.1 * ((c1 - r1) - (c0 - r0)))))
    again = dpo_loss(torch.tensor([c1]), torch.tensor([r1]), torch.tensor([c0]), torch.tensor([r0]))
    assert float(again.loss) == pytest.approx(by_hand, rel=1e-5)
    assert by_hand < math.log(2) and report.reward_accuracy == 1.0
    assert all(torch.equal(v, model.router.state_dict()[k]) for k, v in router_before.items())
    with pytest.raises(ValueError, match="at least one informative"):
        run_dpo_phase(
            model, tokenizer, [PreferencePair("x", "y", "y", 0, 1, (0.5, 0.5, 0.0))], steps=1
        )
