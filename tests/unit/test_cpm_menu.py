"""The protocol menu K_rec: admissibility by parameter space and support, the unchanged default."""

from __future__ import annotations

import hashlib
from typing import Literal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from peerlm.services.cpm import MENU, AdmissibilityMask, Capabilities, Matchmaker, Pairing
from peerlm.services.cpm.menu import (
    MAX_ADVERTISED_PROTOCOLS,
    SAME_SPACE_PROTOCOLS,
    check_param_space,
    check_protocols,
)


def _profiles(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    return {f"a{k:04d}": rng.uniform(-1, 1, 32) for k in range(n)}


def _names_digest(
    n: int,
    matching: Literal["greedy", "blossom"],
    capabilities: dict[str, Capabilities] | None,
    rounds: int = 3,
    seed: int = 7,
) -> str:
    m = Matchmaker(32, seed=seed, matching=matching)
    rng = np.random.default_rng(seed)
    h = hashlib.sha256()
    for _ in range(rounds):
        profiles = _profiles(rng, n)
        caps = (
            None
            if capabilities is None
            else {a: capabilities.get(a, Capabilities()) for a in profiles}
        )
        for p in m.select(profiles, caps):
            h.update(f"{p.sender}>{p.receiver}/{p.protocol}/{p.role};".encode())
            m.observe(p, float(rng.normal()))
    return h.hexdigest()


# Recorded with the matchmaker before the menu existed (commit 487a4b2): the single-protocol
# default must select the same pairs, in the same order, with or without capabilities.
_BEFORE_MENU = {
    (12, "greedy"): "2bdbfcfca2b306f5d763593a68bcc4260af7d7afd8c60dd85fe2f77f700060b4",
    (12, "blossom"): "171e0c0a8dee6c449d7d7b73ae6f4d83b1e0a862699cca8bc568d725ecd57add",
    (150, "greedy"): "6b285fd6c274d1d534b8bca07dcac96f8be02cbbf8811b1f437c181b0c7f3f60",
}


@pytest.mark.parametrize(("n", "matching"), list(_BEFORE_MENU))
def test_default_menu_selects_as_before_the_menu(
    n: int, matching: Literal["greedy", "blossom"]
) -> None:
    assert _names_digest(n, matching, None) == _BEFORE_MENU[(n, matching)]
    # Capabilities given (as the CPM always gives them): undeclared agents, declared ones,
    # several parameter spaces; on the akd-only menu all of it is admissible.
    caps = {
        f"a{k:04d}": Capabilities(f"space-{k % 3}" if k % 2 else "", ("akd", "pmix"))
        for k in range(n)
    }
    assert _names_digest(n, matching, {}) == _BEFORE_MENU[(n, matching)]
    assert _names_digest(n, matching, caps) == _BEFORE_MENU[(n, matching)]


def test_default_menu_is_bit_identical_with_capabilities() -> None:
    rng = np.random.default_rng(3)
    a, b = Matchmaker(32, seed=1), Matchmaker(32, seed=1)
    for _ in range(4):
        profiles = _profiles(rng, 40)
        caps = {x: Capabilities("ps1:abc") for x in profiles}
        left, right = a.select(profiles), b.select(profiles, caps)
        assert left == right  # names, ucb, mean and the context bits
        assert a.last_candidates == b.last_candidates
        for p in left:
            reward = float(rng.normal())
            a.observe(p, reward)
            b.observe(p, reward)


def _admissible(p: Pairing, caps: dict[str, Capabilities]) -> bool:
    s, r = caps.get(p.sender, Capabilities()), caps.get(p.receiver, Capabilities())
    if not (s.supports(p.protocol) and r.supports(p.protocol)):
        return False
    if p.protocol in SAME_SPACE_PROTOCOLS:
        return bool(s.param_space) and s.param_space == r.param_space
    return True


_caps = st.builds(
    Capabilities,
    st.sampled_from(["", "ps-a", "ps-b"]),
    st.lists(st.sampled_from(MENU), unique=True, max_size=4).map(tuple),
)


@settings(max_examples=60, deadline=None)
@given(
    caps=st.lists(_caps, min_size=2, max_size=16),
    matching=st.sampled_from(["greedy", "blossom"]),
    seed=st.integers(0, 2**16),
)
def test_an_inadmissible_protocol_is_never_selected(
    caps: list[Capabilities], matching: Literal["greedy", "blossom"], seed: int
) -> None:
    rng = np.random.default_rng(seed)
    m = Matchmaker(32, seed=seed, protocols=MENU, matching=matching)
    named = {f"a{k:03d}": c for k, c in enumerate(caps)}
    for _ in range(3):
        profiles = {a: rng.uniform(-1, 1, 32) for a in named}
        pairings = m.select(profiles, named)
        agents = [x for p in pairings for x in (p.sender, p.receiver)]
        assert len(agents) == len(set(agents))
        for p in pairings:
            assert _admissible(p, named), p
            # Teach the bandit to love what is forbidden: the mask must still hold.
            m.observe(p, 1.0)
        # Greedy pairs every agent it can (Algorithm 2): no two left-over agents may share
        # an admissible tuple.
        if matching == "greedy":
            left = sorted(set(named) - set(agents))
            mask = AdmissibilityMask(left, named, MENU, ("one_way",))
            if len(left) >= 2:
                li, ri = np.triu_indices(len(left), 1)
                assert not mask.pairs(li.astype(np.intp), ri.astype(np.intp)).any()


def test_merges_pair_only_within_a_parameter_space() -> None:
    names = ["a", "b", "c", "d", "e"]
    spaces = {"a": "ps-1", "b": "ps-2", "c": "ps-1", "d": "ps-2", "e": ""}
    caps = {n: Capabilities(spaces[n], ("akd", "pmix", "svd_hka")) for n in names}
    m = Matchmaker(32, seed=0, protocols=("pmix", "svd_hka"))
    rng = np.random.default_rng(0)
    pairings = m.select({n: rng.uniform(-1, 1, 32) for n in names}, caps)
    assert {frozenset((p.sender, p.receiver)) for p in pairings} == {
        frozenset("ac"),
        frozenset("bd"),
    }
    # "e" declared no parameter space: with merges only, nobody can pair with it.
    assert all("e" not in (p.sender, p.receiver) for p in pairings)
    assert m.last_candidates == 2 * 2 * 2  # two admissible pairs, two directions, two merges


def test_large_rounds_mask_the_prefiltered_candidates() -> None:
    rng = np.random.default_rng(5)
    names = [f"a{k:03d}" for k in range(160)]
    caps = {
        n: Capabilities(f"ps-{k % 4}", MENU if k % 5 else ("akd",)) for k, n in enumerate(names)
    }
    m = Matchmaker(32, seed=2, protocols=MENU, prefilter_min_agents=64)
    for _ in range(3):
        pairings = m.select({n: rng.uniform(-1, 1, 32) for n in names}, caps)
        assert len(pairings) >= 70
        for p in pairings:
            assert _admissible(p, caps)
            m.observe(p, 1.0 if p.protocol == "svd_hka" else -1.0)


def test_the_bandit_learns_which_protocol_to_recommend() -> None:
    """Rewards favour svd_hka within a space: once learnt, same-space pairs get it."""
    rng = np.random.default_rng(11)
    names = [f"a{k:02d}" for k in range(12)]
    gain = {"akd": 0.0, "akd_logits": 0.1, "pmix": 0.2, "svd_hka": 1.0}
    # The protocols the gains name (not the whole menu, which may grow).
    menu = tuple(gain)
    caps = {n: Capabilities("ps-1", menu) for n in names}
    m = Matchmaker(32, seed=4, protocols=menu, beta=0.1)
    for _ in range(40):
        for p in m.select({n: rng.uniform(0, 1, 32) for n in names}, caps):
            m.observe(p, gain[p.protocol] + float(rng.normal(0, 0.1)))
    chosen = m.select({n: rng.uniform(0, 1, 32) for n in names}, caps)
    assert chosen
    assert all(p.protocol == "svd_hka" for p in chosen)


def test_an_agent_that_advertises_nothing_does_akd_only() -> None:
    caps = {"a": Capabilities("ps-1"), "b": Capabilities("ps-1")}
    m = Matchmaker(32, seed=0, protocols=MENU)
    rng = np.random.default_rng(0)
    for _ in range(5):
        [p] = m.select({"a": rng.uniform(-1, 1, 32), "b": rng.uniform(-1, 1, 32)}, caps)
        assert p.protocol == "akd"
        m.observe(p, -1.0)  # akd looks bad; still the only admissible protocol


@pytest.mark.parametrize(
    "value",
    ["x" * 129, "has space", "tab\t", "ünicode", "semi;colon", "\x00"],
)
def test_bad_parameter_spaces_are_refused(value: str) -> None:
    with pytest.raises(ValueError, match="parameter_space"):
        check_param_space(value)


def test_good_parameter_spaces_pass() -> None:
    for value in ["", "ps1:" + "a" * 64, "x" * 128, "a.b-c_d:e"]:
        assert check_param_space(value) == value


@pytest.mark.parametrize(
    "values",
    [
        ["akd"] * 2,
        ["Akd"],
        ["akd-logits"],
        [""],
        ["x" * 33],
        [f"p{k}" for k in range(MAX_ADVERTISED_PROTOCOLS + 1)],
    ],
)
def test_bad_protocol_lists_are_refused(values: list[str]) -> None:
    with pytest.raises(ValueError):
        check_protocols(values)


def test_unknown_but_well_formed_protocols_are_kept() -> None:
    assert check_protocols(["akd", "h_ties", "future_thing"]) == ("akd", "h_ties", "future_thing")
