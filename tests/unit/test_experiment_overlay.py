"""``cpm_menu_overlay``'s overlay view: each client's signature by the agent's own step, the
network-wide P of the previous round, and the exact top-k by cosine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from peerlm.agent import AgentOverlaySettings, LoraSettings, ModelHost
from peerlm.overlay.signature import (
    ImportanceTracker,
    cosine_matrix,
    flatten_adapter,
    make_signature,
    minimal_p,
    network_p,
)

from peerlm.app.experiment_overlay import OverlayView, nearest


@pytest.fixture(autouse=True, scope="module")
def _offline(offline_hub: None) -> None:
    """Every load here is from a local directory (tests/conftest.py)."""


@pytest.fixture(scope="module")
def path(micro_gpt2: Path) -> Path:
    return micro_gpt2


def _hosts(path: Path, n: int) -> dict[str, ModelHost]:
    hosts = {}
    for i in range(n):
        host = ModelHost.load(str(path), LoraSettings(r=4, alpha=8.0), device="cpu", seed=i)
        state = host.adapter_state()
        gen = np.random.default_rng(i)
        # Give B weights too (a fresh adapter's B is zero), some shared direction between
        # agents 0 and 1 so that they are each other's nearest.
        shared = np.random.default_rng(99)
        for k, v in state.items():
            if "lora_B" in k:
                own = gen.standard_normal(v.shape).astype(np.float32)
                common = shared.standard_normal(v.shape).astype(np.float32)
                state[k] = v.new_tensor(own + (4.0 * common if i < 2 else 0.0))
        host.load_adapter_state(state)
        hosts[f"agent-{i}"] = host
    return hosts


def test_nearest_orders_by_similarity_and_breaks_ties_by_name() -> None:
    names = ["a", "b", "c", "d"]
    sim = np.array(
        [
            [1.0, 0.2, 0.9, 0.2],
            [0.2, 1.0, 0.1, 0.1],
            [0.9, 0.1, 1.0, 0.5],
            [0.2, 0.1, 0.5, 1.0],
        ]
    )
    got = nearest(names, sim, 2)
    assert got["a"] == ("c", "b")  # b and d tie at 0.2: the lower name
    assert got["b"] == ("a", "c")  # c and d tie at 0.1
    assert got["c"] == ("a", "d")
    assert nearest(names, sim, 10)["d"] == ("c", "a", "b")  # k past n - 1: every other


def test_the_view_is_the_agents_signature_step_with_the_previous_rounds_network_p(
    path: Path,
) -> None:
    hosts = _hosts(path, 4)
    settings = AgentOverlaySettings(k=2)
    view = OverlayView(settings)
    q, p_max = settings.protocol.p_quantile, settings.protocol.p_max
    # By hand: at join each client publishes at its own P_min (no announcement yet) ...
    trackers = {n: ImportanceTracker(settings.importance_beta) for n in sorted(hosts)}
    joined = []
    for name in sorted(hosts):
        weights, _space = flatten_adapter(hosts[name].adapter_state())
        joined.append(minimal_p(weights, trackers[name].update(weights), settings.tau_min))
    view.join(hosts)
    assert view.listed == {}  # joining searches nothing: no list to report yet
    assert view.network_p == network_p(joined, q, p_max)
    # ... and its first step publishes at the P announced from those reports, then takes
    # the exact top-2 by the signatures' cosine.
    announced = view.network_p
    signatures, p_mins = [], []
    for name in sorted(hosts):
        weights, space = flatten_adapter(hosts[name].adapter_state())
        scores = trackers[name].update(weights)
        p_mins.append(minimal_p(weights, scores, settings.tau_min))
        signatures.append(make_signature(weights, scores, min(announced, len(weights)), space))
    first, sims = view.step(hosts)
    similarity = cosine_matrix(signatures)
    assert first == nearest(sorted(hosts), similarity, 2)
    assert first["agent-0"][0] == "agent-1" and first["agent-1"][0] == "agent-0"
    assert all(len(v) == 2 and name not in v for name, v in first.items())
    assert sims["agent-0"]["agent-1"] == pytest.approx(similarity[0, 1])
    assert view.listed == first  # what each reports with its next profile
    assert view.network_p == network_p(p_mins, q, p_max)


def test_candidates_of_another_parameter_space_are_left_out() -> None:
    names = ["a", "b", "c"]
    sim = np.array([[1.0, 0.0, -0.5], [0.0, 1.0, 0.0], [-0.5, 0.0, 1.0]])
    # b is of another space: a's only candidate is c, however dissimilar.
    assert nearest(names, sim, 2, ["x", "y", "x"]) == {"a": ("c",), "b": (), "c": ("a",)}
