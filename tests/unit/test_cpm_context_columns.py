"""``context_columns``: the CPM's context built from chosen profile entries only."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from peerlm.services.cpm import (
    COLUMN_GROUPS,
    CpmSettings,
    Matchmaker,
    context_columns,
)
from peerlm.services.cpm.core import settings_fingerprint


def _profiles(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"a{i}": rng.uniform(-1, 1, 32) for i in range(n)}


def test_named_groups_and_indices_resolve_in_order() -> None:
    assert context_columns("all") is None
    assert context_columns("performance") == (8,)
    assert context_columns("performance,static") == (8, *range(8))
    assert context_columns("dynamic") == tuple(range(8, 20))
    assert context_columns(" 20, 3 ") == (20, 3)
    assert set(COLUMN_GROUPS) == {"static", "dynamic", "distribution", "performance"}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "unknown profile column"),
        ("perf", "unknown profile column"),
        ("8,performance", "repeats"),
        ("32", "outside"),
        ("-1", "unknown profile column"),
    ],
)
def test_bad_column_specs_are_refused_with_the_reason(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        context_columns(spec)


def test_settings_refuse_columns_outside_the_profile() -> None:
    with pytest.raises(ValueError, match="outside"):
        CpmSettings(context_columns=(31, 32))
    with pytest.raises(ValueError, match="at least one"):
        CpmSettings(context_columns=())
    assert CpmSettings(profile_dim=40, context_columns=(39,)).context_columns == (39,)


def test_a_matchmaker_on_columns_is_the_matchmaker_of_the_projected_profiles() -> None:
    """Selecting columns inside the CPM equals a CPM fed the projected profiles: the same
    pairs, contexts and learning, while agents keep sending whole profiles."""
    cols = (8, 9, 20, 3)
    chosen = Matchmaker(context_columns=cols, interaction_features=False, seed=3)
    projected = Matchmaker(profile_dim=len(cols), interaction_features=False, seed=3)
    assert chosen.context_dim == projected.context_dim == 2 * 4 + 1 + 2 + 1
    for round_ in range(4):
        full = _profiles(6, round_)
        a = chosen.select(full)
        b = projected.select({k: v[list(cols)] for k, v in full.items()})
        assert [(p.sender, p.receiver) for p in a] == [(p.sender, p.receiver) for p in b]
        for pa, pb in zip(a, b, strict=True):
            np.testing.assert_array_equal(pa.context, pb.context)
            chosen.observe(pa, 0.1 * round_)
            projected.observe(pb, 0.1 * round_)
    np.testing.assert_array_equal(chosen.theta, projected.theta)
    assert chosen.config()["context_columns"] == list(cols)
    assert chosen.config()["profile_dim"] == 32


def test_whole_profiles_are_still_validated_when_columns_are_chosen() -> None:
    m = Matchmaker(context_columns=(8,))
    bad = _profiles(4)
    bad["a1"] = bad["a1"].copy()
    bad["a1"][30] = np.nan  # outside the chosen columns, still refused
    with pytest.raises(ValueError, match="a1"):
        m.select(bad)
    with pytest.raises(ValueError, match="shape"):
        m.select({"a0": np.zeros(8), "a1": np.zeros(8)})
    assert m.n_updates == 0


def test_the_database_fingerprint_keeps_old_federations_and_names_the_columns(
    tmp_path: Path,
) -> None:
    plain = CpmSettings(db=tmp_path / "cpm.db")
    assert "context_columns" not in settings_fingerprint(plain)
    chosen = CpmSettings(db=tmp_path / "cpm.db", context_columns=(8, 9))
    assert '"context_columns": [8, 9]' in settings_fingerprint(chosen)
    assert settings_fingerprint(plain) != settings_fingerprint(chosen)
