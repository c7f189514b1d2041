"""An expert's FedWave state between rounds through a real CheckpointStore: packed,
saved atomically, loaded and unpacked to the same bits; a checkpoint that does not fit, is
not finite or is not MACed under the agent's key is refused before anything is used."""

from __future__ import annotations

import random
import secrets
from pathlib import Path

import pytest
import torch
from peerlm.agent.checkpoint import CheckpointStore
from peerlm.agent.fedwave.expert_checkpoint import (
    KEY_FILE,
    ExpertCheckpointError,
    load_or_create_key,
    pack_expert_state,
    unpack_expert_state,
)
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


def _keyed(tmp_path: Path) -> tuple[dict, dict, bytes, dict]:  # type: ignore[type-arg]
    key = load_or_create_key(tmp_path / KEY_FILE)
    router = MoERouter(WIDTH, 3, generator=torch.Generator().manual_seed(1))
    tensors, state = pack_expert_state(
        3, adapter={}, router=router.state_dict(), vclayer=VCLayer(WIDTH, SIZE),
        predecessor=None, successor=None, report={"stage": "test"}, rng=random.Random(1),
        key=key,
    )  # fmt: skip
    args = {"router_shapes": router_shapes(router), "hidden_size": WIDTH, "vclayer": SIZE}
    return tensors, state, key, args


def test_the_checkpoint_key_is_private_and_kept(tmp_path: Path) -> None:
    key = load_or_create_key(tmp_path / KEY_FILE)
    assert len(key) == 32 and (tmp_path / KEY_FILE).stat().st_mode & 0o777 == 0o600
    assert load_or_create_key(tmp_path / KEY_FILE) == key  # never overwritten
    (tmp_path / KEY_FILE).chmod(0o644)
    with pytest.raises(ValueError, match="readable by its owner only"):
        load_or_create_key(tmp_path / KEY_FILE)


def test_a_nan_router_with_recomputed_hashes_is_refused_on_restore(tmp_path: Path) -> None:
    """Hostile-member audit: whoever can write the state directory swapped in a NaN router
    and recomputed the store's (unkeyed) SHA-256s; the expert loaded it. The store still
    verifies it (its hashes are recomputed here by a fresh save), but the HMAC under the
    agent's own key does not match, and the values are checked whatever the MAC says."""
    tensors, state, key, args = _keyed(tmp_path)
    store = CheckpointStore(tmp_path / "ck")
    store.save(3, tensors, state)
    good = store.load_latest()
    assert good is not None
    assert unpack_expert_state(good.tensors, good.state, key=key, **args).round == 3
    poisoned = dict(tensors)
    poisoned["router/fc2.bias"] = torch.full_like(tensors["router/fc2.bias"], float("nan"))
    store.save(4, poisoned, {**state, "round": 4})  # fresh, valid store hashes
    loaded = store.load_latest()
    assert loaded is not None and loaded.round == 4  # the unkeyed hashes verify
    with pytest.raises(ExpertCheckpointError, match="MAC") as err:
        unpack_expert_state(loaded.tensors, loaded.state, key=key, **args)
    assert err.value.reason == "mac"
    with pytest.raises(ExpertCheckpointError, match="finite") as err:
        unpack_expert_state(loaded.tensors, loaded.state, key=None, **args)
    assert err.value.reason == "non_finite"
    # A finite forgery without the key, or a checkpoint without a MAC, is refused too.
    unkeyed = {k: v for k, v in state.items() if k != "mac"}
    for forged in (unkeyed, {**state, "mac": "0" * 64}):
        with pytest.raises(ExpertCheckpointError, match="MAC"):
            unpack_expert_state(tensors, forged, key=key, **args)
    other = secrets.token_bytes(32)
    with pytest.raises(ExpertCheckpointError, match="MAC"):
        unpack_expert_state(tensors, state, key=other, **args)
