"""Overlay narrowing: a merge directive's sender is in the student's reported overlay top-K."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from peerlm.services.cpm import MENU, MERGE_PROTOCOLS, Capabilities, CpmSettings, Matchmaker
from peerlm.services.cpm.core import CpmCore, CpmError
from peerlm.services.cpm.menu import MAX_OVERLAY_PEERS, check_overlay_peers
from peerlm.services.cpm.store import MemoryCpmStore, SqliteCpmStore


def _narrowed_ok(sender: str, receiver: str, protocol: str, caps: dict[str, Capabilities]) -> bool:
    senders = caps[receiver].senders
    return protocol not in MERGE_PROTOCOLS or senders is None or sender in senders


@st.composite
def _federation(draw: st.DrawFn, max_agents: int = 14) -> dict[str, Capabilities]:
    n = draw(st.integers(2, max_agents))
    names = [f"a{k:03d}" for k in range(n)]
    caps = {}
    for name in names:
        others = [x for x in names if x != name]
        reported = draw(st.one_of(st.none(), st.lists(st.sampled_from(others), unique=True)))
        caps[name] = Capabilities(
            draw(st.sampled_from(["ps-a", "ps-a", "ps-b"])),
            MENU,
            None if reported is None else frozenset(reported),
        )
    return caps


@settings(max_examples=60, deadline=None)
@given(
    caps=_federation(),
    matching=st.sampled_from(["greedy", "blossom"]),
    seed=st.integers(0, 2**16),
)
def test_a_merge_never_names_a_sender_outside_the_students_overlay(
    caps: dict[str, Capabilities], matching: Literal["greedy", "blossom"], seed: int
) -> None:
    rng = np.random.default_rng(seed)
    m = Matchmaker(32, seed=seed, protocols=MENU, matching=matching)
    for _ in range(3):
        pairings = m.select({a: rng.uniform(-1, 1, 32) for a in caps}, caps)
        for p in pairings:
            assert _narrowed_ok(p.sender, p.receiver, p.protocol, caps), p
            # Teach the bandit to love merges: the narrowing must still hold.
            m.observe(p, 1.0 if p.protocol in MERGE_PROTOCOLS else -1.0)


def test_large_rounds_narrow_the_prefiltered_candidates() -> None:
    rng = np.random.default_rng(7)
    names = [f"a{k:03d}" for k in range(150)]
    caps = {
        n: Capabilities("ps-0", MENU, frozenset(names[(k + 1) % 150 : (k + 1) % 150 + 3]) or None)
        for k, n in enumerate(names)
    }
    m = Matchmaker(32, seed=3, protocols=("pmix", "svd_hka"), prefilter_min_agents=64)
    seen = 0
    for _ in range(3):
        pairings = m.select({n: rng.uniform(-1, 1, 32) for n in names}, caps)
        for p in pairings:
            assert _narrowed_ok(p.sender, p.receiver, p.protocol, caps), p
            m.observe(p, 1.0)
        seen += len(pairings)
    assert seen > 0


def test_narrowing_is_directional_and_leaves_akd_alone() -> None:
    # b reported only c: a may not merge into b, but b may merge into a (a reported none)
    # and AKD a -> b stays admissible.
    caps = {
        "a": Capabilities("ps", ("akd", "pmix")),
        "b": Capabilities("ps", ("akd", "pmix"), frozenset({"c"})),
    }
    only_merge = Matchmaker(32, seed=0, protocols=("pmix",))
    for _ in range(5):
        [p] = only_merge.select({"a": np.full(32, 0.1), "b": np.full(32, 0.9)}, caps)
        assert (p.sender, p.receiver) == ("b", "a")
    both = Matchmaker(32, seed=0, protocols=("akd", "pmix"))
    tuples = set()
    for seed in range(20):
        both = Matchmaker(32, seed=seed, protocols=("akd", "pmix"), beta=5.0)
        [p] = both.select({"a": np.full(32, 0.1), "b": np.full(32, 0.9)}, caps)
        tuples.add((p.sender, p.receiver, p.protocol))
    assert ("a", "b", "pmix") not in tuples
    assert ("a", "b", "akd") in tuples or ("b", "a", "akd") in tuples


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([f"a{k}" for k in range(MAX_OVERLAY_PEERS + 1)], "at most"),
        (["a1", "a1"], "repeat"),
        (["me"], "itself"),
        (["ghost"], "not an agent"),
        (["x" * 500], "not an agent"),
    ],
)
def test_bad_overlay_lists_are_refused(values: list[str], message: str) -> None:
    known = {f"a{k}" for k in range(100)} | {"me"}
    with pytest.raises(ValueError, match=message):
        check_overlay_peers(values, "me", known.__contains__)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _submit(c: CpmCore, name: str, k: int, overlay: list[str] | None = None) -> None:
    feats = [float(x) for x in np.random.default_rng(k).uniform(0, 1, 32)]
    c.submit_profile(
        name,
        1,
        feats,
        "",
        connected=3,
        param_space="ps",
        protocols=("pmix",),
        overlay_peers=overlay or (),
    )


def test_the_core_refuses_unknown_ids_with_state_unchanged() -> None:
    c = CpmCore(
        CpmSettings(init=True, protocols=("pmix",), directive_ttl_s=60), MemoryCpmStore(), Clock()
    )
    _submit(c, "a", 0)
    _submit(c, "b", 1, ["a"])
    before = c.agents()
    with pytest.raises(CpmError) as e:
        _submit(c, "b", 2, ["a", "ghost"])
    assert (e.value.code, e.value.reason) == ("INVALID_ARGUMENT", "overlay_peers")
    assert c.agents() == before
    with pytest.raises(CpmError) as e:
        _submit(c, "c", 3, ["a"] * 2)
    assert e.value.reason == "overlay_peers" and c.agent_count == 2


def test_the_core_narrows_merge_directives_and_keeps_the_list_across_restarts(
    tmp_path: Path,
) -> None:
    db = tmp_path / "cpm.db"
    settings = CpmSettings(init=True, protocols=("pmix",), directive_ttl_s=60, db=db)
    store = SqliteCpmStore(db)
    c = CpmCore(settings, store, Clock())
    _submit(c, "a", 0)
    _submit(c, "b", 1)
    _submit(c, "c", 2)
    _submit(c, "a", 0, ["c"])  # a's overlay: only c may merge into a
    _submit(c, "b", 1, ["a"])  # b's: only a
    _submit(c, "c", 2, ["b"])  # c's: only b
    store.close()
    store = SqliteCpmStore(db)
    again = CpmCore(settings, store, Clock())
    assert {p.agent: p.overlay_peers for p in again.agents()} == {
        "a": ("c",),
        "b": ("a",),
        "c": ("b",),
    }
    [d] = again.matchmake().directives
    assert (d.teacher, d.student) in {("c", "a"), ("a", "b"), ("b", "c")}
    store.close()
