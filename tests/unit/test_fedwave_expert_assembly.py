"""π_SFT in the agent daemon: which experts are pulled, what an arriving adapter must be,
which expert stands for each stage, an assembly with a stage missing, and the phase
(assembly, DPO, scores) on tiny gpt2 leaving the agent's own expert unchanged."""

from __future__ import annotations

import json
import math

import pytest
import torch
from peerlm.agent.adapter_codec import AdapterSpec, encode_adapter
from peerlm.agent.fedproxy.admission import state_norm
from peerlm.agent.fedwave.assembly import AssembledModel, assembled_generate
from peerlm.agent.fedwave.code_chain import StageExample
from peerlm.agent.fedwave.dpo_phase import build_preference_pairs
from peerlm.agent.fedwave.errors import FedWaveError
from peerlm.agent.fedwave.exchange import (
    PartKind,
    PullTarget,
    RoundParts,
    ShapeBounds,
    accept_part,
    plan_expert_pulls,
)
from peerlm.agent.fedwave.expert_assembly import (
    assemble_and_align,
    choose_stage_experts,
    expert_copy,
)
from peerlm.agent.fedwave.generation import greedy_generate
from peerlm.agent.fedwave.params import AssemblySettings, DPOSettings, VCLayerSettings
from peerlm.agent.fedwave.part_admission import screen_round
from peerlm.agent.fedwave.router import MoERouter
from peerlm.agent.fedwave.router_codec import router_shapes
from peerlm.agent.fedwave.text_metrics import METRIC_NAMES
from peerlm.agent.fedwave.vclayer import VCCausalLM, VCLayer
from peerlm.agent.fedwave.workflow import Workflow
from peerlm.agent.models.lora import LoraSettings, apply_lora
from peerlm.agent.models.tiny import SHIPPED_DIR
from peft import get_peft_model_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer

PATH = SHIPPED_DIR / "tiny" / "gpt2"
WORKFLOW = Workflow.model_validate(
    {
        "stages": [
            {"name": "specify", "agents": ["s2", "s1"]},
            {"name": "implement", "agents": ["i1"]},
            {"name": "test", "agents": ["t1"]},
        ]
    }
)


@pytest.fixture(autouse=True)
def _offline(offline_hub: None) -> None:
    """Every load here is from the shipped tiny models (tests/conftest.py)."""


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(PATH)


def _expert(seed: int) -> VCCausalLM:
    torch.manual_seed(seed)
    lm = apply_lora(AutoModelForCausalLM.from_pretrained(PATH), LoraSettings(dropout=0.0))
    with torch.no_grad():  # experts that differ: random LoRA B factors (peft starts B at 0)
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    layer = VCLayer(int(lm.config.hidden_size), generator=torch.Generator().manual_seed(seed))
    return VCCausalLM(lm, layer).eval()


def _spec(model: VCCausalLM, **over: object) -> AdapterSpec:
    shapes = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(model.lm).items()}
    base: dict[str, object] = {
        "shapes": shapes,
        "model_type": "gpt2",
        "tokenizer_hash": "t" * 64,
        "lora_r": 8,
        "lora_alpha": 16.0,
        "lora_json": json.dumps({"r": 8, "alpha": 16.0}),
    }
    base.update(over)
    return AdapterSpec(**base)  # type: ignore[arg-type]


def _bounds(model: VCCausalLM, spec: AdapterSpec | None) -> ShapeBounds:
    d = model.vclayer.hidden_size
    return ShapeBounds(
        router_shapes=router_shapes(MoERouter(d, 3)),
        hidden_size=d,
        vclayer=VCLayerSettings(),
        adapter=spec,
    )


def _adapter(model: VCCausalLM) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model.lm).items()}


def test_an_agent_pulls_the_adapter_and_vclayer_of_every_agent_of_the_other_stages() -> None:
    assert plan_expert_pulls(WORKFLOW, "i1") == sorted(
        PullTarget(a, k) for a in ("s1", "s2", "t1") for k in (PartKind.ADAPTER, PartKind.VCLAYER)
    )
    # Its own stage's agents are not pulled: their stage's expert is the agent itself.
    assert {t.agent for t in plan_expert_pulls(WORKFLOW, "s1")} == {"i1", "t1"}


def test_an_arriving_adapter_must_fit_this_host_or_is_refused_with_its_reason() -> None:
    model = _expert(1)
    spec = _spec(model)
    bounds = _bounds(model, spec)
    state = _adapter(model)
    part = accept_part(WORKFLOW, "t1", PartKind.ADAPTER, 2, encode_adapter(state, spec), bounds)
    assert part.adapter is not None and part.adapter.keys() == state.keys()
    assert all(torch.equal(part.adapter[k], state[k]) for k in state)

    def refused(data: bytes, b: ShapeBounds = bounds, agent: str = "t1") -> str:
        with pytest.raises(FedWaveError) as err:
            accept_part(WORKFLOW, agent, PartKind.ADAPTER, 2, data, b)
        return err.value.reason

    poisoned = dict(state)
    first = sorted(poisoned)[0]
    poisoned[first] = poisoned[first].clone()
    poisoned[first].view(-1)[0] = float("nan")
    assert refused(encode_adapter(poisoned, spec)) == "non_finite"
    wrong = {k: torch.zeros(v.shape[0], v.shape[1] + 1) for k, v in state.items()}
    wrong_spec = _spec(model, shapes={k: tuple(v.shape) for k, v in wrong.items()})
    assert refused(encode_adapter(wrong, wrong_spec)) == "shape"
    # Another backbone: the same shapes, another base model.
    assert refused(encode_adapter(state, _spec(model, model_type="qwen2"))) == "model_type"
    assert refused(encode_adapter(state, spec) + b"\0" * spec.max_encoded_bytes()) == "too_large"
    assert refused(b"not safetensors") == "decode"
    assert refused(encode_adapter(state, spec), agent="mallory") == "not_in_workflow"
    assert refused(encode_adapter(state, spec), b=_bounds(model, None)) == "bad_kind"


def test_each_stage_is_one_agents_expert_and_a_stage_without_one_is_missing() -> None:
    layer = VCLayer(8, VCLayerSettings(d_vc=8, heads=2))
    parts = RoundParts(3)
    parts.adapters = {"s1": {}, "s2": {}, "t1": {}}
    parts.vclayers = {"s1": layer, "s2": layer}  # t1's VCLayer did not arrive
    choice = choose_stage_experts(WORKFLOW, "i1", parts)
    assert choice.experts == {0: "s1", 1: "i1"}  # the first of the stage by name
    assert choice.missing == ("test",)


def test_a_missing_expert_is_never_routed_to(tokenizer) -> None:  # type: ignore[no-untyped-def]
    experts = [_expert(1), None, _expert(3)]
    d = experts[0].vclayer.hidden_size  # type: ignore[union-attr]
    router = MoERouter(d, 3)
    with torch.no_grad():  # the missing expert would be the router's first choice
        router.fc1.weight.zero_()
        router.fc2.weight.zero_()
        router.fc2.bias.copy_(torch.tensor([0.0, 5.0, 1.0]))
    model = AssembledModel(experts, router)
    assert model.available == (0, 2) and model.n_experts == 3
    ids = torch.tensor([tokenizer.encode("def f(x):")])
    routing = model.route(ids)
    assert float(routing.alpha[0, 1]) == 0.0
    assert math.isclose(float(routing.alpha[0].sum()), 1.0, rel_tol=1e-6)
    assert routing.experts[0].tolist() == [2, 0]
    pair = build_preference_pairs(model, tokenizer, ["def f(x):"], max_new_tokens=3)[0]
    assert (pair.chosen_expert, pair.rejected_expert) == (2, 0)
    # One expert present: top-1 whatever top_k says, and that expert's own output.
    alone = AssembledModel([None, None, experts[2]], router)
    texts, routings = assembled_generate(alone, tokenizer, ["def f(x):"], max_new_tokens=3)
    assert routings[0].experts.tolist() == [[2]]
    assert texts == greedy_generate(experts[2], tokenizer, ["def f(x):"], max_new_tokens=3)
    with pytest.raises(FedWaveError) as err:
        AssembledModel([None, None, None], router)
    assert err.value.reason == "config"


def test_the_phase_assembles_aligns_and_scores_and_leaves_the_own_expert_unchanged(
    tokenizer,  # type: ignore[no-untyped-def]
) -> None:
    own, other = _expert(1), _expert(2)
    before = {k: v.clone() for k, v in own.state_dict().items()}
    parts = RoundParts(2)
    parts.adapters = {"s1": _adapter(other)}
    parts.vclayers = {"s1": other.vclayer}
    router = MoERouter(own.vclayer.hidden_size, 3, generator=torch.Generator().manual_seed(0))
    held_out = [
        StageExample("p/0", "implement", "def add(a, b):\n", "    return a + b\n"),
        StageExample("p/1", "implement", "def neg(x):\n", "    return -x\n"),
    ]
    out = assemble_and_align(
        WORKFLOW,
        "i1",
        own,
        router,
        parts,
        tokenizer,
        held_out,
        ["Write a function named inc that adds one to x."],
        settings=AssemblySettings(enabled=True, dpo_steps=2, max_new_tokens=4),
        dpo=DPOSettings(),
        top_k=2,
    )
    assert out.experts == {"specify": "s1", "implement": "i1"}
    assert out.missing_stages == ["test"]
    assert set(out.pi_sft) == set(METRIC_NAMES)
    assert 0.0 <= out.routed_own <= 1.0
    # One pair per prompt of the chain the requirement starts (requirement, signature,
    # function), each between the experts present.
    assert out.dpo_pairs == 3
    if out.dpo_informative:
        assert out.pi_sft_dpo is not None and len(out.dpo_losses) == 2
        assert math.isclose(out.dpo_losses[0], math.log(2), abs_tol=1e-3)
    # DPO trained copies: the agent's own expert is bit for bit what the rounds left.
    after = own.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_an_expert_copy_holds_the_pulled_adapter_and_vclayer() -> None:
    own, other = _expert(1), _expert(2)
    copy = expert_copy(own, _adapter(other), other.vclayer)
    theirs = get_peft_model_state_dict(other.lm)
    assert all(torch.equal(get_peft_model_state_dict(copy.lm)[k], v) for k, v in theirs.items())
    layer = copy.vclayer.state_dict()
    assert all(torch.equal(layer[k], v) for k, v in other.vclayer.state_dict().items())
    assert copy.lm is not own.lm and copy.vclayer is not other.vclayer


def test_a_finite_but_huge_adapter_passes_the_codec_and_is_refused_by_the_norm_bound() -> None:
    model = _expert(1)
    spec = _spec(model)
    own = _adapter(model)
    huge = {k: torch.full_like(v, 1e30) for k, v in own.items()}
    parts = RoundParts(2)
    for agent, state in (("s1", own), ("t1", huge)):
        blob = encode_adapter(state, spec)
        parts.add(accept_part(WORKFLOW, agent, PartKind.ADAPTER, 2, blob, _bounds(model, spec)))
    refused = screen_round(
        parts,
        base_router=MoERouter(model.vclayer.hidden_size, 3).state_dict(),
        own_vclayer=model.vclayer,
        max_router_update_ratio=None,
        max_vclayer_norm_ratio=None,
        own_adapter_norm=state_norm(own),
        max_adapter_norm_ratio=10.0,
    )
    assert list(refused) == [PullTarget("t1", PartKind.ADAPTER)]
    assert "fedwave.assembly.max_adapter_norm_ratio" in refused[PullTarget("t1", PartKind.ADAPTER)]
    assert parts.rejected == {PullTarget("t1", PartKind.ADAPTER): "norm"}
    assert sorted(parts.adapters) == ["s1"]


def test_a_router_sure_of_a_missing_expert_leaves_the_present_ones_an_even_share() -> None:
    experts = [_expert(1), None, _expert(3)]
    router = MoERouter(experts[0].vclayer.hidden_size, 3)  # type: ignore[union-attr]
    with torch.no_grad():  # softmax of (−1e4, 1e4, −1e4): exact zeros but the missing one
        router.fc1.weight.zero_()
        router.fc2.weight.zero_()
        router.fc2.bias.copy_(torch.tensor([-1e4, 1e4, -1e4]))
    routing = AssembledModel(experts, router).route(torch.tensor([[1, 2, 3]]))
    assert routing.alpha[0].tolist() == [0.5, 0.0, 0.5]
    assert torch.isfinite(routing.weights).all()
