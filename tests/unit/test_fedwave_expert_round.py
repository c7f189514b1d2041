"""The expert round's pure step: every agent concludes with the same router (Eq. 9 weighted
by n_i); a missing agent is left out and said; the trainer trains on the shipped tiny gpt2."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from peerlm.agent.fedwave.code_chain import build_code_chain
from peerlm.agent.fedwave.exchange import PartKind, PullTarget, RoundParts
from peerlm.agent.fedwave.expert_round import (
    ExpertTrainer,
    adjacent_vclayers,
    conclude_round,
    mean_vclayer,
    router_digest,
)
from peerlm.agent.fedwave.params import RouterSettings
from peerlm.agent.fedwave.router import MoERouter
from peerlm.agent.fedwave.router_codec import DecodedRouter, router_shapes
from peerlm.agent.fedwave.settings import FedWaveSettings
from peerlm.agent.fedwave.vclayer import VCLayer, VCLayerSettings
from peerlm.agent.fedwave.workflow import Workflow
from peerlm.agent.models.lora import LoraSettings, apply_lora
from peerlm.agent.models.tiny import SHIPPED_DIR
from transformers import AutoModelForCausalLM, AutoTokenizer

WORKFLOW = Workflow.model_validate(
    {
        "stages": [
            {"name": "specify", "agents": ["s1", "s2"]},
            {"name": "implement", "agents": ["i1"]},
            {"name": "test", "agents": ["t1"]},
        ]
    }
)
WIDTH = 16
SIZE = VCLayerSettings(d_vc=8, heads=2)
SAMPLES = {"s1": 3, "s2": 5, "i1": 7, "t1": 11}


def trained_routers() -> dict[str, dict[str, torch.Tensor]]:
    """Four routers that differ (as after each agent's local training)."""
    out = {}
    for k, agent in enumerate(sorted(SAMPLES)):
        router = MoERouter(WIDTH, 3, generator=torch.Generator().manual_seed(k + 10))
        out[agent] = {n: t.detach().clone() for n, t in router.state_dict().items()}
    return out


def parts_for(
    me: str, routers: dict[str, dict[str, torch.Tensor]], absent: frozenset[str] = frozenset()
) -> RoundParts:
    parts = RoundParts(4)
    for agent, state in routers.items():
        if agent == me:
            continue
        if agent in absent:
            parts.missing[PullTarget(agent, PartKind.ROUTER)] = "late"
        else:
            parts.routers[agent] = DecodedRouter(state, SAMPLES[agent], 4)
    return parts


def shapes() -> dict[str, tuple[int, ...]]:
    return router_shapes(MoERouter(WIDTH, 3))


def test_every_agent_concludes_with_the_same_router_weighted_by_n_i() -> None:
    routers = trained_routers()
    ends = {
        me: conclude_round(
            WORKFLOW,
            me,
            routers[me],
            SAMPLES[me],
            parts_for(me, routers),
            shapes(),
            max_weight_ratio=None,
            rule="fedavg",  # the paper's rule, n_i-weighted (the default is the median)
        )
        for me in routers
    }
    digests = {c.digest for c in ends.values()}
    assert len(digests) == 1
    total = sum(SAMPLES.values())
    for name in routers["s1"]:
        expected = sum(
            routers[a][name].double() * SAMPLES[a] / total for a in sorted(routers)
        ).float()
        for end in ends.values():
            # Eq. 9 to float32 precision (the float64 sum's order is fedavg_routers' own);
            # bit equality among the agents is the digest above.
            assert torch.allclose(end.router[name], expected, rtol=0, atol=1e-7), name
            assert end.complete and end.members == ("i1", "s1", "s2", "t1")
    # Unweighted, it would differ: the weights matter.
    plain = {n: torch.stack([r[n] for r in routers.values()]).mean(0) for n in routers["s1"]}
    assert router_digest(plain) not in digests


def test_a_missing_agent_leaves_the_rest_aggregated_and_said() -> None:
    routers = trained_routers()
    late = frozenset({"t1"})
    ends = {
        me: conclude_round(
            WORKFLOW, me, routers[me], SAMPLES[me], parts_for(me, routers, late), shapes()
        )
        for me in ("s1", "s2", "i1")
    }
    assert len({c.digest for c in ends.values()}) == 1
    for end in ends.values():
        assert end.members == ("i1", "s1", "s2") and not end.complete
        assert end.missing == {"t1/router": "late"}
    full = conclude_round(
        WORKFLOW, "s1", routers["s1"], SAMPLES["s1"], parts_for("s1", routers), shapes()
    )
    assert full.digest != ends["s1"].digest


def test_the_neighbours_vclayers_are_the_stage_mean_or_the_kept_one() -> None:
    layers = {
        a: VCLayer(WIDTH, SIZE, generator=torch.Generator().manual_seed(k))
        for k, a in enumerate(("s1", "s2", "t1"))
    }
    before, after = adjacent_vclayers(WORKFLOW, "i1", layers)
    assert before is not None and after is not None
    assert torch.allclose(before.w_q, (layers["s1"].w_q + layers["s2"].w_q) / 2)
    assert torch.equal(after.w_q, layers["t1"].w_q)
    kept = VCLayer(WIDTH, SIZE)
    before2, after2 = adjacent_vclayers(WORKFLOW, "i1", {}, predecessor=kept)
    assert before2 is kept and after2 is None
    assert adjacent_vclayers(WORKFLOW, "s1", layers)[0] is None  # the first stage
    with pytest.raises(ValueError, match="no VCLayer"):
        mean_vclayer([])


def _tiny_gpt2_chain() -> tuple[Any, Any, int, Workflow]:
    """The shipped tiny gpt2 with LoRA (seeded), its tokenizer, its width and the code chain."""
    path = SHIPPED_DIR / "tiny" / "gpt2"
    torch.manual_seed(0)
    lm = apply_lora(AutoModelForCausalLM.from_pretrained(path), LoraSettings(r=4, dropout=0.0))
    chain = Workflow.model_validate(
        {"stages": [{"name": n, "agents": [n]} for n in ("specify", "implement", "test")]}
    )
    return lm, AutoTokenizer.from_pretrained(path), int(lm.config.hidden_size), chain


def test_the_trainer_lowers_its_loss_and_trains_its_router(offline_hub: None) -> None:
    lm, tokenizer, width, chain = _tiny_gpt2_chain()
    settings = FedWaveSettings(workflow=chain, vclayer=SIZE)
    split = build_code_chain(chain, per_stage=8, n_test=4, n_public=0, seed=0)
    router = settings.initial_router(width)
    start = router_digest(router.state_dict())
    trainer = ExpertTrainer(
        lm,
        tokenizer,
        settings.initial_vclayer(width, 1),
        router,
        stage_index=1,
        examples=split.of_agent("implement"),
        learning_rate=5e-3,
        batch_size=4,
        max_length=96,
    )
    held_out = [item.example(1) for item in split.test]
    before = trainer.heldout_loss(held_out)
    pred, succ = settings.initial_vclayer(width, 0), settings.initial_vclayer(width, 2)
    losses = trainer.train(12, predecessor=pred, successor=succ)
    after = trainer.heldout_loss(held_out)
    assert before is not None and after is not None and after < before
    assert sum(losses[-3:]) < sum(losses[:3])
    assert router_digest(router.state_dict()) != start
    with pytest.raises(ValueError, match="steps"):
        trainer.train(0, predecessor=None, successor=None)
    # A stop that cannot wait: training ends before the next step.
    stop = threading.Event()
    stop.set()
    stopped = ExpertTrainer(
        lm, tokenizer, trainer.vclayer, router, stage_index=1, examples=trainer.examples,
        interrupt=stop,
    )  # fmt: skip
    assert stopped.train(5, predecessor=pred, successor=succ) == []


def test_the_agents_router_steps_at_its_own_learning_rate(offline_hub: None) -> None:
    """The daemon's trainer gives the router its own AdamW group. Adam's first
    step moves every parameter with a gradient by about its group's lr, so one step shows
    the two rates apart (the router's 1e-2 against the expert's 1e-4)."""
    lm, tokenizer, width, chain = _tiny_gpt2_chain()
    settings = FedWaveSettings(
        workflow=chain, vclayer=SIZE, router=RouterSettings(learning_rate=1e-2)
    )
    split = build_code_chain(chain, per_stage=8, n_test=2, n_public=0, seed=0)
    router = settings.initial_router(width)
    vclayer = settings.initial_vclayer(width, 1)
    trainer = ExpertTrainer(
        lm, tokenizer, vclayer, router, stage_index=1, examples=split.of_agent("implement"),
        learning_rate=1e-4, router_lr=settings.router.learning_rate, batch_size=4,
        max_length=64,
    )  # fmt: skip
    r0 = {k: v.clone() for k, v in router.state_dict().items()}
    v0 = {k: v.clone() for k, v in vclayer.state_dict().items()}
    trainer.train(1, predecessor=None, successor=None)
    router_step = max(float((router.state_dict()[k] - r0[k]).abs().max()) for k in r0)
    vclayer_step = max(float((vclayer.state_dict()[k] - v0[k]).abs().max()) for k in v0)
    assert router_step == pytest.approx(1e-2, rel=0.05)
    assert vclayer_step == pytest.approx(1e-4, rel=0.05)


def test_an_honest_router_of_a_round_passes_the_default_norm_bound(offline_hub: None) -> None:
    """12 AdamW steps at the default router lr (1e-2) move the small-initialised
    router by more than its own norm (ratio 1 alone would refuse it, as it split the
    workflow's routers in CI); the default root-mean-square floor admits it."""
    from peerlm.agent.fedwave.part_admission import router_norm_refusal

    lm, tokenizer, width, chain = _tiny_gpt2_chain()
    settings = FedWaveSettings(workflow=chain, vclayer=SIZE)
    assert settings.router.learning_rate == 1e-2
    split = build_code_chain(chain, per_stage=48, n_test=2, n_public=0, seed=0)
    router = settings.initial_router(width)
    trainer = ExpertTrainer(
        lm, tokenizer, settings.initial_vclayer(width, 1), router, stage_index=1,
        examples=split.of_agent("implement"), learning_rate=5e-3,
        router_lr=settings.router.learning_rate, batch_size=4, max_length=64,
    )  # fmt: skip
    base = {k: v.clone() for k, v in router.state_dict().items()}
    trainer.train(12, predecessor=None, successor=None)
    trained = router.state_dict()
    assert router_norm_refusal(base, trained, max_ratio=1.0) is not None
    assert (
        router_norm_refusal(
            base,
            trained,
            max_ratio=settings.max_router_update_ratio or 0.0,
            max_rms=settings.max_router_update_rms,
        )
        is None
    )


def test_a_round_replayed_from_its_checkpointed_state_trains_the_same_bits(
    offline_hub: None,
) -> None:
    """An expert killed after publishing round t's part but before saving round t replays
    round t from its round t−1 checkpoint; the others may already have averaged its first
    part, so the replay must publish the same router bits or the workflow ends split (as
    test_fedwave_resume once did in CI). With LoRA dropout on, the trainer draws its torch
    seed from the checkpointed sampler RNG, whatever the process's global torch RNG did."""
    import copy

    path = SHIPPED_DIR / "tiny" / "gpt2"
    torch.manual_seed(0)
    lm = apply_lora(AutoModelForCausalLM.from_pretrained(path), LoraSettings(r=4, dropout=0.1))
    tokenizer = AutoTokenizer.from_pretrained(path)
    width = int(lm.config.hidden_size)
    chain = Workflow.model_validate(
        {"stages": [{"name": n, "agents": [n]} for n in ("specify", "implement", "test")]}
    )
    settings = FedWaveSettings(workflow=chain, vclayer=SIZE)
    split = build_code_chain(chain, per_stage=8, n_test=2, n_public=0, seed=0)
    router = settings.initial_router(width)
    trainer = ExpertTrainer(
        lm, tokenizer, settings.initial_vclayer(width, 1), router, stage_index=1,
        examples=split.of_agent("implement"), learning_rate=5e-3, batch_size=4, max_length=64,
    )  # fmt: skip
    trainer.train(2, predecessor=None, successor=None)  # rounds before the checkpoint
    saved = (
        copy.deepcopy(lm.state_dict()),
        copy.deepcopy(router.state_dict()),
        copy.deepcopy(trainer.vclayer.state_dict()),
        trainer.rng.getstate(),
    )

    def play() -> tuple[str, str, str]:
        trainer.train(3, predecessor=None, successor=None)
        lora = {k: v for k, v in lm.state_dict().items() if "lora_" in k}
        return (
            router_digest(router.state_dict()),
            router_digest(trainer.vclayer.state_dict()),
            router_digest(lora),
        )

    first = play()
    lm.load_state_dict(saved[0])
    router.load_state_dict(saved[1])
    trainer.vclayer.load_state_dict(saved[2])
    trainer.rng.setstate(saved[3])
    torch.manual_seed(12345)  # a new process: its global RNG is anywhere
    assert play() == first
    # And the draw moves on: the next round is not the same round again.
    assert all(a != b for a, b in zip(play(), first, strict=True))
