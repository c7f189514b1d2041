"""``cpm_menu_overlay``'s overlay view: each client's signature by the agent's own step, the
network-wide P of the previous round, and the exact top-k by cosine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from peerlm.agent import AgentOverlaySettings, LoraSettings, ModelHost
from peerlm.agent.models.tiny import build_models
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
def path(micro_models_dir: Path) -> Path:
    [info] = build_models(micro_models_dir, ("gpt2",), size="micro")
    return Path(info.path)


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
    view = OverlayView(settings, p_quantile=0.9, p_max=1 << 20)
    first = view.step(hosts)
    # By hand: each client's own P_min in the first round (no announcement yet), then the
    # exact top-2 by the signatures' cosine.
    trackers = {n: ImportanceTracker(settings.importance_beta) for n in sorted(hosts)}
    signatures, p_mins = [], []
    for name in sorted(hosts):
        weights, space = flatten_adapter(hosts[name].adapter_state())
        scores = trackers[name].update(weights)
        p_min = minimal_p(weights, scores, settings.tau_min)
        signatures.append(make_signature(weights, scores, p_min, space))
        p_mins.append(p_min)
    assert first == nearest(sorted(hosts), cosine_matrix(signatures), 2)
    assert first["agent-0"][0] == "agent-1" and first["agent-1"][0] == "agent-0"
    assert all(len(v) == 2 and name not in v for name, v in first.items())
    # The next round is published at the P announced from this round's reports.
    assert view.network_p == network_p(p_mins, 0.9, 1 << 20)
    second = view.step(hosts)
    assert set(second) == set(hosts) and second["agent-0"][0] == "agent-1"
