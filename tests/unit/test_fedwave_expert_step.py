"""A FedWave expert's local loss (Eq. 2 / Eq. 8) on the tiny models and the code chain."""

from __future__ import annotations

import pytest
import torch
from peerlm.agent.fedwave.assembly import AssembledModel, prompt_ids
from peerlm.agent.fedwave.code_chain import build_code_chain
from peerlm.agent.fedwave.collab_loss import CollabLossSettings
from peerlm.agent.fedwave.expert_step import (
    encode_stage_examples,
    expert_loss,
    router_features,
)
from peerlm.agent.fedwave.router import MoERouter, RouterSettings
from peerlm.agent.fedwave.settings import FedWaveSettings
from peerlm.agent.fedwave.vclayer import VCCausalLM, VCLayer, VCLayerSettings, masked_mean
from peerlm.agent.fedwave.workflow import Workflow
from peerlm.agent.models.lora import LoraSettings, apply_lora
from peerlm.agent.models.tiny import ARCHITECTURES, SHIPPED_DIR
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, AutoTokenizer

CHAIN = Workflow.model_validate(
    {"stages": [{"name": n, "agents": [f"{n}-1"]} for n in ("specify", "implement", "test")]}
)
SIZE = VCLayerSettings(d_vc=16, heads=2)


@pytest.fixture(autouse=True)
def _offline(offline_hub: None) -> None:
    """Every load here is from the shipped tiny models (tests/conftest.py)."""


def expert(arch: str, seed: int = 0) -> tuple[VCCausalLM, object, int]:
    path = SHIPPED_DIR / "tiny" / arch
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(path)
    width = int(base.config.hidden_size)
    lm = apply_lora(base, LoraSettings(r=4, dropout=0.0))
    with torch.no_grad():  # a trained adapter: B is no longer zero
        for name, param in lm.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    layer = VCLayer(width, SIZE, generator=torch.Generator().manual_seed(seed + 1))
    return VCCausalLM(lm, layer), AutoTokenizer.from_pretrained(path), width


def batch_for(tokenizer: object, stage: str = "implement", n: int = 4):  # type: ignore[no-untyped-def]
    split = build_code_chain(CHAIN, per_stage=n, n_test=0, n_public=0, seed=0)
    return encode_stage_examples(tokenizer, split.private[stage][f"{stage}-1"], 96)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_eq8_on_every_architecture_trains_lora_vclayer_and_router_only(arch: str) -> None:
    model, tokenizer, width = expert(arch)
    batch = batch_for(tokenizer)
    pred = VCLayer(width, SIZE, generator=torch.Generator().manual_seed(7))
    succ = VCLayer(width, SIZE, generator=torch.Generator().manual_seed(8))
    router = MoERouter(width, 3, generator=torch.Generator().manual_seed(0))
    loss = expert_loss(model, batch, stage_index=1, predecessor=pred, successor=succ, router=router)
    assert loss.router is not None and loss.alpha is not None
    assert loss.alpha.shape == (batch.input_ids.shape[0], 3)
    gamma = CollabLossSettings().gamma
    assert loss.total.item() == pytest.approx(
        loss.router.total.item() + gamma * loss.vc.total.item()
    )
    assert loss.vc.cons.item() > 0 and loss.vc.pos.item() > 0
    loss.total.backward()
    trained = {
        n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0
    }
    assert any("lora_" in n for n in trained)
    assert {f"vclayer.{n}" for n in ("w_q", "w_k", "w_v", "w_o", "stage_embedding")} <= trained
    assert all("lora_" in n or n.startswith("vclayer.") for n in trained)
    assert all(p.grad is not None for p in router.parameters())
    assert all(p.grad is None for layer in (pred, succ) for p in layer.parameters())


def test_the_router_reads_the_base_model_not_the_adapter() -> None:
    model, tokenizer, _ = expert("qwen2")
    batch = batch_for(tokenizer)
    base = AutoModelForCausalLM.from_pretrained(SHIPPED_DIR / "tiny" / "qwen2")
    with torch.no_grad():
        plain = base.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        adapted = model.hidden_states(batch.input_ids, batch.attention_mask)
    mask = batch.attention_mask
    features = router_features(model, batch.input_ids, mask)
    torch.testing.assert_close(features, masked_mean(plain.last_hidden_state, mask))
    assert not torch.allclose(features, masked_mean(adapted, mask))
    assert not features.requires_grad


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_training_routes_on_the_prompt_features_the_assembly_routes_on(arch: str) -> None:
    """The router's training features for an example are the assembled model's
    routing features for its prompt (pooled over the source tokens only)."""
    model, tokenizer, width = expert(arch)
    split = build_code_chain(CHAIN, per_stage=3, n_test=0, n_public=0, seed=0)
    examples = split.private["test"]["test-1"]
    batch = encode_stage_examples(tokenizer, examples, 256)
    router = MoERouter(width, 3, generator=torch.Generator().manual_seed(0))
    assembly = AssembledModel([model, model, model], router)
    loss = expert_loss(model, batch, stage_index=2, predecessor=None, successor=None, router=router)
    assert loss.alpha is not None
    training = router_features(model, batch.input_ids, batch.prompt_mask)
    whole = router_features(model, batch.input_ids, batch.attention_mask)
    for row, example in enumerate(examples):
        ids, _ = prompt_ids(tokenizer, example.source, 10_000)
        prompt = batch.input_ids[row][batch.prompt_mask[row].bool()]
        assert prompt.tolist() == ids  # the source tokens, as inference encodes them
        at_inference = router_features(model, torch.tensor([ids]), None)[0]
        torch.testing.assert_close(training[row], at_inference, rtol=1e-5, atol=1e-5)
        routed = assembly.route(torch.tensor([ids])).alpha[0]
        torch.testing.assert_close(loss.alpha[row].detach(), routed, rtol=1e-5, atol=1e-6)
        # the features pooled over source and target (before the fix) are not these
        assert not torch.allclose(whole[row], at_inference, rtol=1e-3, atol=1e-3)


def test_without_a_router_it_is_eq2_and_steps_lower_it() -> None:
    model, tokenizer, width = expert("gpt2")
    batch = batch_for(tokenizer, stage="test")
    pred = VCLayer(width, SIZE, generator=torch.Generator().manual_seed(3))
    first = expert_loss(model, batch, stage_index=2, predecessor=pred, successor=None, router=None)
    assert first.router is None and first.alpha is None
    assert first.total.item() == pytest.approx(first.sft.item() + 0.5 * first.vc.total.item())
    params = [p for p in model.parameters() if p.requires_grad]
    optimiser = torch.optim.AdamW(params, lr=3e-3)
    for _ in range(4):
        optimiser.zero_grad()
        expert_loss(
            model, batch, stage_index=2, predecessor=pred, successor=None, router=None
        ).total.backward()
        optimiser.step()
    last = expert_loss(model, batch, stage_index=2, predecessor=pred, successor=None, router=None)
    assert last.total.item() < first.total.item()


def test_encoding_scores_only_the_target() -> None:
    _, tokenizer, _ = expert("bloom")
    batch = batch_for(tokenizer, stage="specify", n=2)
    assert batch.input_ids.shape == batch.target_mask.shape == batch.attention_mask.shape
    assert bool((batch.target_mask <= batch.attention_mask).all())
    assert 0 < int(batch.target_mask.sum()) < int(batch.attention_mask.sum())
    with pytest.raises(ValueError, match="no example keeps a target"):
        encode_stage_examples(tokenizer, [], 96)


def test_fedwave_settings_bring_the_parts_together() -> None:
    s = FedWaveSettings.model_validate(
        {"workflow": CHAIN.model_dump(), "router": {"top_k": 2}, "dpo": {"beta": 0.2}}
    )
    assert s.workflow == CHAIN and s.dpo.beta == 0.2 and s.collab.gamma == 0.5
    assert FedWaveSettings().router == RouterSettings()
    with pytest.raises(ValidationError, match="exceeds the workflow"):
        FedWaveSettings.model_validate({"workflow": CHAIN.model_dump(), "router": {"top_k": 4}})
    with pytest.raises(ValidationError, match="extra"):
        FedWaveSettings.model_validate({"server": "x"})


def test_every_agent_starts_the_same_router_and_stages_start_different_vclayers() -> None:
    s = FedWaveSettings.model_validate({"workflow": CHAIN.model_dump(), "seed": 4})
    a, b = s.initial_router(16), s.initial_router(16)
    assert a.n_experts == 3
    assert all(
        torch.equal(x, y)
        for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )
    first, again, second = (
        s.initial_vclayer(16, 0),
        s.initial_vclayer(16, 0),
        s.initial_vclayer(16, 1),
    )
    assert torch.equal(first.w_q, again.w_q) and not torch.equal(first.w_q, second.w_q)
    with pytest.raises(ValueError, match="needs a workflow"):
        FedWaveSettings().initial_router(16)
    with pytest.raises(ValueError, match="negative"):
        s.initial_vclayer(16, -1)
