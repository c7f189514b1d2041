"""An expert's FedWave state between rounds through a real CheckpointStore: packed,
saved atomically, loaded and unpacked to the same bits; a checkpoint that does not fit is
refused before anything is used."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from peerlm.agent.checkpoint import CheckpointStore
from peerlm.agent.fedwave.expert_checkpoint import pack_expert_state, unpack_expert_state
from peerlm.agent.fedwave.router import MoERouter
from peerlm.agent.fedwave.router_codec import router_shapes
from peerlm.agent.fedwave.vclayer import VCLayer, VCLayerSettings

WIDTH = 16
SIZE = VCLayerSettings(d_vc=8, heads=2)


def _saved(tmp_path: Path, *, successor: bool = True) -> tuple[CheckpointStore, dict]:  # type: ignore[type-arg]
    router = MoERouter(WIDTH, 3, generator=torch.Generator().manual_seed(1))
    own, before = VCLayer(WIDTH, SIZE), VCLayer(WIDTH, SIZE)
    after = VCLayer(WIDTH, SIZE) if successor else None
    rng = random.Random("peerlm-test")
    rng.random()
    adapter = {"base_model.lora_A.weight": torch.randn(4, WIDTH)}
    tensors, state = pack_expert_state(
        3, adapter=adapter, router=router.state_dict(), vclayer=own, predecessor=before,
        successor=after, report={"stage": "implement", "train_loss": [float("nan"), 1.5]},
        rng=rng,
    )  # fmt: skip
    store = CheckpointStore(tmp_path / "ck")
    store.save(3, tensors, state)
    expect = {"router": router, "own": own, "before": before, "adapter": adapter, "rng": rng}
    return store, expect


def test_an_expert_state_round_trips_through_the_checkpoint_store(tmp_path: Path) -> None:
    store, expect = _saved(tmp_path, successor=False)
    checkpoint = store.load_latest()
    assert checkpoint is not None and checkpoint.round == 3
    got = unpack_expert_state(
        checkpoint.tensors, checkpoint.state, router_shapes=router_shapes(expect["router"]),
        hidden_size=WIDTH, vclayer=SIZE,
    )  # fmt: skip
    assert got.round == 3 and got.successor is None and got.predecessor is not None
    for name, tensor in expect["router"].state_dict().items():
        assert torch.equal(got.router[name], tensor)
    for name, tensor in expect["own"].state_dict().items():
        assert torch.equal(got.vclayer[name], tensor)
    for name, tensor in expect["before"].state_dict().items():
        assert torch.equal(got.predecessor.state_dict()[name], tensor)
    assert torch.equal(got.adapter["base_model.lora_A.weight"], expect["adapter"][
        "base_model.lora_A.weight"
    ])  # fmt: skip
    # The NaN loss is stored as null (the checkpoint's JSON refuses NaN).
    assert got.report == {"stage": "implement", "train_loss": [None, 1.5]}
    again = random.Random()
    again.setstate(got.rng)
    assert again.random() == expect["rng"].random()


def test_a_checkpoint_of_another_shape_is_refused(tmp_path: Path) -> None:
    store, expect = _saved(tmp_path)
    checkpoint = store.load_latest()
    assert checkpoint is not None
    other = MoERouter(WIDTH, 4)
    with pytest.raises(ValueError, match="router shapes"):
        unpack_expert_state(
            checkpoint.tensors, checkpoint.state, router_shapes=router_shapes(other),
            hidden_size=WIDTH, vclayer=SIZE,
        )  # fmt: skip
    with pytest.raises(ValueError, match="does not fit"):
        unpack_expert_state(
            checkpoint.tensors, checkpoint.state,
            router_shapes=router_shapes(expect["router"]), hidden_size=WIDTH * 2, vclayer=SIZE,
        )  # fmt: skip
    with pytest.raises(ValueError, match="not a FedWave expert"):
        unpack_expert_state(
            checkpoint.tensors, {"round": 3}, router_shapes=router_shapes(expect["router"]),
            hidden_size=WIDTH, vclayer=SIZE,
        )  # fmt: skip
