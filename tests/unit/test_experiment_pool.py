"""Key differences pooled over worlds (stratified bootstrap, experiment_pool)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peerlm.app.experiment_pool import main, pool_results
from peerlm.app.experiment_stats import paired_bootstrap, paired_share, stratified_bootstrap


def _world(world_seed: int, per_strategy: dict[str, float], seeds: int = 2) -> dict[str, Any]:
    """A minimal results.json of one world: two clients, ``lacked`` = two problems each;
    strategy s has NLL ``offset + seed + problem index`` (so strategies differ by a constant)."""
    units = {"own": [], "lacked": [[0, 0], [0, 1], [1, 0], [1, 1]], "public": []}
    runs: dict[str, Any] = {}
    for name, offset in per_strategy.items():
        runs[name] = {
            str(s): {
                "clients": {
                    c: {
                        "nll": [offset + s + 2 * i, offset + s + 2 * i + 1],
                        "pass@1": [0.0, 0.5],
                        "struct": [0.0, 0.0],
                    }
                    for i, c in enumerate(("c0", "c1"))
                }
            }
            for s in range(seeds)
        }
    return {
        "plan": {"seeds": list(range(seeds)), "world_seed": world_seed},
        "units": units,
        "clients": [{"name": "c0"}, {"name": "c1"}],
        "runs": runs,
    }


@settings(max_examples=20, deadline=None)
@given(
    seeds=st.integers(1, 4),
    units=st.integers(1, 6),
    data=st.data(),
)
def test_one_stratum_is_the_tables_paired_bootstrap(seeds: int, units: int, data: Any) -> None:
    """With one world the pooled estimates are the per-world table's, to the bit."""
    cells = st.floats(-5, 5, allow_nan=False)
    values = {
        n: np.asarray(data.draw(st.lists(st.lists(cells, min_size=units, max_size=units),
                                         min_size=seeds, max_size=seeds)))
        for n in ("a", "b", "top")
    }  # fmt: skip
    means, diffs, shares = stratified_bootstrap(
        [values], [("a", "b")], shares=[("a", "b", "top")], replicates=200
    )
    ref_means, ref_diffs = paired_bootstrap(values, [("a", "b")], replicates=200)
    assert means == ref_means and diffs == ref_diffs
    ref_share = paired_share(values, "a", "b", "top", replicates=200)
    # Bit for bit, NaN included: a share whose oracle gain is ~0 has no interval (NaN).
    pooled = shares.get(("a", "b", "top"))
    assert (pooled is None) == (ref_share is None)
    if pooled is not None and ref_share is not None:
        assert np.array_equal(
            [pooled.mean, pooled.low, pooled.high],
            [ref_share.mean, ref_share.low, ref_share.high],
            equal_nan=True,
        )


def test_worlds_count_once_whatever_their_seeds() -> None:
    """World 0 (2 seeds) has a - b = -1 in every cell, world 1 (5 seeds) -3: pooled -2,
    with no width (every cell's difference is fixed within its world)."""
    w0 = _world(0, {"a": 0.0, "b": 1.0}, seeds=2)
    w1 = _world(1, {"a": 0.0, "b": 3.0}, seeds=5)
    out = pool_results([w0, w1], [("a", "b")])
    nll = out["lacked"]["nll"]
    assert [w["a_vs_b"]["delta"] for w in nll["worlds"]] == pytest.approx([-1.0, -3.0])
    assert nll["pooled"]["a_vs_b"]["delta"] == pytest.approx(-2.0)
    assert nll["pooled"]["a_vs_b"]["ci95"] == pytest.approx([-2.0, -2.0])
    assert set(out) == {"lacked"}


def test_the_share_pools_gains_not_ratios() -> None:
    """Share of top's gain over base reached by a: world 0's gain is 1 (a's 0.5), world
    1's is 3 (a's 0.5): pooled, a's mean gain 0.5 over top's mean gain 2 = 0.25 (not the
    mean of the two worlds' ratios, 0.33)."""
    w0 = _world(0, {"a": 0.5, "base": 1.0, "top": 0.0})
    w1 = _world(1, {"a": 2.5, "base": 3.0, "top": 0.0})
    out = pool_results([w0, w1], [], shares=[("a", "base", "top")])
    row = out["lacked"]["nll"]["pooled"]["share_a_base_top"]
    assert row["share"] == pytest.approx(0.25)


def test_bad_pools_are_refused() -> None:
    w0 = _world(0, {"a": 0.0, "b": 1.0})
    with pytest.raises(ValueError, match="at least two worlds"):
        pool_results([w0], [("a", "b")])
    with pytest.raises(ValueError, match="one world"):
        pool_results([w0, _world(0, {"a": 0.0, "b": 1.0})], [("a", "b")])
    with pytest.raises(ValueError, match="no run of"):
        pool_results([w0, _world(1, {"a": 0.0})], [("a", "b")])
    with pytest.raises(ValueError, match="strategies"):
        stratified_bootstrap(
            [{"a": np.zeros((1, 1)), "b": np.zeros((1, 1))}, {"a": np.zeros((1, 1))}],
            [("a", "b")],
        )
    with pytest.raises(ValueError, match="no strata"):
        stratified_bootstrap([], [])


def test_the_command_line_refuses_a_malformed_pair(tmp_path: Any, capsys: Any) -> None:
    import json

    paths = []
    for w in (0, 1):
        p = tmp_path / f"w{w}.json"
        p.write_text(json.dumps(_world(w, {"a": 0.0, "b": 1.0})))
        paths.append(str(p))
    with pytest.raises(SystemExit) as exc:
        main([*paths, "--pair", "a-b"])
    assert exc.value.code == 2 and "--pair" in capsys.readouterr().err
    assert main([*paths, "--pair", "a:b", "--slice", "lacked", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["lacked"]["nll"]["pooled"]["a_vs_b"]["delta"] == pytest.approx(-1.0)
    # A gzipped results file (how docs/results keeps a run's records) reads the same; a
    # file that is neither JSON nor gzip is refused with exit 2, naming the cause.
    import gzip

    zipped = tmp_path / "w1.json.gz"
    zipped.write_bytes(gzip.compress((tmp_path / "w1.json").read_bytes()))
    assert main([paths[0], str(zipped), "--pair", "a:b", "--slice", "lacked", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == out
    broken = tmp_path / "w2.json.gz"
    broken.write_bytes(b"not gzip")
    with pytest.raises(SystemExit) as exc:
        main([paths[0], str(broken), "--pair", "a:b"])
    assert exc.value.code == 2 and "gzip" in capsys.readouterr().err.lower()


def test_a_share_of_an_unresolved_gain_is_not_reported() -> None:
    """top equals base in every cell of world 1 and gains 1 in world 0: world 1 has no
    share, world 0 and the pooled estimate (mean gain 0.5, resolved) have one."""
    w0 = _world(0, {"a": 0.5, "base": 1.0, "top": 0.0})
    w1 = _world(1, {"a": 1.0, "base": 1.0, "top": 1.0})
    out = pool_results([w0, w1], [], shares=[("a", "base", "top")])["lacked"]["nll"]
    key = "share_a_base_top"
    assert key in out["worlds"][0] and key not in out["worlds"][1]
    assert out["pooled"][key]["share"] == pytest.approx(0.5)


def test_the_world_level_interval_spans_the_worlds_spread_and_needs_three() -> None:
    from peerlm.app.experiment_pool import _world_level

    worlds = [{"a_vs_b": {"delta": d}} for d in (0.1, 0.2, 0.3)]
    got = _world_level(worlds, [("a", "b")])["a_vs_b"]
    assert got["delta"] == pytest.approx(0.2) and got["worlds"] == 3
    low, high = got["ci95"]
    # t(0.975, 2) = 4.303, sd 0.1, n 3: half width 0.2484.
    assert low == pytest.approx(0.2 - 0.2484, abs=1e-3) and high == pytest.approx(0.4484, abs=1e-3)
    assert _world_level(worlds[:2], [("a", "b")])["a_vs_b"]["ci95"] is None
