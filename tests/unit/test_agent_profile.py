"""The agent profile layout the CPM relies on, and the AKD schedules."""

from __future__ import annotations

import numpy as np
import pytest
from peerlm.agent.daemon import linear_schedule
from peerlm.agent.profile import FAMILIES, AgentMetrics, build_profile, family_index
from peerlm.services.cpm.profile import PERFORMANCE_INDEX, validate_profile


def _metrics(**kw: float) -> AgentMetrics:
    base = dict(
        pass_at_1=0.25, pass_at_5=0.5, val_loss=2.0, prev_pass_at_1=0.1, prev_val_loss=2.5,
        trainable_share=0.02, trainable_parameters=40_000, last_reward=0.3, exchanges=3,
        round=2, total_rounds=10,
    )  # fmt: skip
    base.update(kw)
    return AgentMetrics(**base)  # type: ignore[arg-type]


def test_layout_and_validity() -> None:
    counts = np.arange(12, dtype=np.float64)
    p = build_profile("bloom", _metrics(), counts)
    validate_profile(p, 32)
    assert p[:8].sum() == 1.0 and p[FAMILIES.index("bloom")] == 1.0
    assert p[PERFORMANCE_INDEX] == 0.25  # the Hetero-Greedy baseline reads pass@1 here
    np.testing.assert_allclose(p[20:32], counts / counts.sum())
    assert p[12] == pytest.approx(0.15) and p[13] == pytest.approx(-0.05)


def test_families() -> None:
    assert family_index("qwen3") == family_index("qwen2")
    assert family_index("some_new_arch") == FAMILIES.index("other")


def test_laplace_noise_keeps_a_distribution() -> None:
    counts = np.array([10.0] + [0.0] * 11)
    noisy = build_profile("gpt2", _metrics(), counts, dp_epsilon=0.5, rng=np.random.default_rng(0))[
        20:32
    ]
    assert noisy.min() >= 0 and noisy.sum() == pytest.approx(1.0)
    assert not np.allclose(noisy, counts / counts.sum())
    with pytest.raises(ValueError):
        build_profile("gpt2", _metrics(), counts, dp_epsilon=0.0)


def test_diverged_loss_stays_finite() -> None:
    p = build_profile("gpt2", _metrics(val_loss=1e9, prev_val_loss=float("inf")), np.ones(12))
    assert np.isfinite(p).all()


def test_linear_schedules_match_table_6() -> None:
    assert linear_schedule(0.2, 0.5, 1, 20) == pytest.approx(0.2)
    assert linear_schedule(0.2, 0.5, 20, 20) == pytest.approx(0.5)
    assert linear_schedule(2.5, 1.5, 11, 21) == pytest.approx(2.0)
    assert linear_schedule(0.2, 0.5, 1, 1) == 0.5
