"""The experiment's world: what every strategy and seed of a run share."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from peerlm.app.experiment_plan import ExperimentPlan
from peerlm.app.experiment_world import build_clients, prepare_world

pytestmark = pytest.mark.slow


def test_every_build_of_a_client_shares_its_one_router(
    micro_models_dir: Path, tmp_path: Path
) -> None:
    """A router is fitted once per client and process (a function of the world's data),
    and each build of the clients, for any seed, hands out that one."""
    plan = ExperimentPlan(
        agents=2, rounds=1, strategies=("local_plus", "random"), seeds=(0, 1), size="micro",
        local_steps=1, transfer_limit=3, test_limit=3, samples=1, warmup_steps=0,
    )  # fmt: skip
    world = prepare_world(plan, micro_models_dir, tmp_path / "data", lambda *_: None)
    first = build_clients(world, 0)
    again = build_clients(world, 1)
    assert sorted(world.routers) == [0, 1]
    for a, b, i in zip(first, again, range(2), strict=True):
        assert a.router is not None and a.router is b.router is world.routers[i]
        assert a.host is not b.host  # the models themselves are each build's own
    # Without routers nothing is fitted or attached.
    bare = build_clients(world, 0, routers=False)
    assert all(c.router is None for c in bare)
    # What a worker process receives: the routers, and no guardrail (a guardrail's bound
    # logger does not pickle; the worker builds its own).
    sent = pickle.loads(pickle.dumps(world))
    assert sent.guardrails == {} and sorted(sent.routers) == [0, 1]
    assert [c.guardrail is not None for c in build_clients(sent, 0)] == [True, True]
