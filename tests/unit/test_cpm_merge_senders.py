"""Several senders per merge directive: the CPM's ``merge_senders`` (co-senders by UCB)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from peerlm.agent.cpm.directives import directive_action
from peerlm.services.cpm import (
    MAX_MERGE_SENDERS,
    MENU,
    MERGE_PROTOCOLS,
    Capabilities,
    CpmSettings,
    Matchmaker,
    Pairing,
)
from peerlm.services.cpm.core import CpmCore, CpmError
from peerlm.services.cpm.menu import SAME_SPACE_PROTOCOLS
from peerlm.services.cpm.service import directive_message
from peerlm.services.cpm.store import MemoryCpmStore, SqliteCpmStore

from peerlm.wire.v1 import cpm_pb2


def _admissible(sender: str, receiver: str, protocol: str, caps: dict[str, Capabilities]) -> bool:
    """The menu's three rules, written out per tuple (the reference of the vectorised mask)."""
    s, r = caps[sender], caps[receiver]
    if not (s.supports(protocol) and r.supports(protocol)):
        return False
    if protocol in SAME_SPACE_PROTOCOLS and (not s.param_space or s.param_space != r.param_space):
        return False
    return protocol not in MERGE_PROTOCOLS or r.senders is None or sender in r.senders


@st.composite
def _federation(draw: st.DrawFn, max_agents: int = 12) -> dict[str, Capabilities]:
    n = draw(st.integers(2, max_agents))
    names = [f"a{k:03d}" for k in range(n)]
    caps = {}
    for name in names:
        others = [x for x in names if x != name]
        reported = draw(st.one_of(st.none(), st.lists(st.sampled_from(others), unique=True)))
        protocols = draw(st.lists(st.sampled_from(MENU), min_size=1, unique=True))
        caps[name] = Capabilities(
            draw(st.sampled_from(["ps-a", "ps-a", "ps-b", ""])),
            tuple(protocols),
            None if reported is None else frozenset(reported),
        )
    return caps


@settings(max_examples=60, deadline=None)
@given(
    caps=_federation(),
    k=st.integers(2, 5),
    matching=st.sampled_from(["greedy", "blossom"]),
    seed=st.integers(0, 2**16),
)
def test_co_senders_are_admissible_distinct_and_at_most_k_minus_one(
    caps: dict[str, Capabilities], k: int, matching: Literal["greedy", "blossom"], seed: int
) -> None:
    """Every co-sender is admissible for (co-sender -> student, the directive's protocol):
    same parameter space, executes the protocol, on the student's overlay list when it
    reported one; never the student or the teacher, never repeated, at most k - 1; and
    only merge directives carry any. The primary pairings are those of merge_senders=1."""
    rng = np.random.default_rng(seed)
    many = Matchmaker(32, seed=seed, protocols=MENU, matching=matching, merge_senders=k)
    one = Matchmaker(32, seed=seed, protocols=MENU, matching=matching)
    for _ in range(3):
        profiles = {a: rng.uniform(-1, 1, 32) for a in caps}
        pairings = many.select(profiles, caps)
        plain = one.select(profiles, caps)
        assert [replace_co(p) for p in pairings] == plain
        for p in pairings:
            co = p.co_senders
            assert len(co) <= k - 1 and len(set(co)) == len(co)
            assert p.sender not in co and p.receiver not in co
            if p.protocol not in MERGE_PROTOCOLS:
                assert co == ()
            for c in co:
                assert _admissible(c, p.receiver, p.protocol, caps), (c, p)
            # Teach both bandits to love merges: the rules must still hold.
            reward = 1.0 if p.protocol in MERGE_PROTOCOLS else -1.0
            many.observe(p, reward)
        for p in plain:
            one.observe(p, 1.0 if p.protocol in MERGE_PROTOCOLS else -1.0)


def replace_co(p: Pairing) -> Pairing:
    """``p`` without co-senders."""
    from dataclasses import replace

    return replace(p, co_senders=())


def _merge_world(
    n: int = 8, seed: int = 0
) -> tuple[dict[str, np.ndarray], dict[str, Capabilities]]:
    rng = np.random.default_rng(seed)
    names = [f"a{k}" for k in range(n)]
    caps = {a: Capabilities("ps", ("svd_hka",)) for a in names}
    return {a: rng.uniform(-1, 1, 32) for a in names}, caps


def test_co_senders_fill_up_to_k_minus_one_ranked_by_ucb() -> None:
    """With every agent admissible the student gets exactly k - 1 co-senders, in
    descending UCB of (co-sender, student, protocol, role), computed here from built
    contexts (LinUCB.score, float64) after a few rewards have shaped the bandit."""
    profiles, caps = _merge_world()
    m = Matchmaker(32, seed=1, protocols=("svd_hka",), merge_senders=4, score_precision="float64")
    rng = np.random.default_rng(5)
    for _ in range(4):
        for p in m.select(profiles, caps):
            m.observe(p, float(rng.normal()))
    pairings = m.select(profiles, caps)
    assert pairings and all(len(p.co_senders) == 3 for p in pairings)
    feats = m.features
    bounded = {a: feats.bound_profiles(v[None, :])[0] for a, v in profiles.items()}
    for p in pairings:
        others = sorted(a for a in profiles if a not in (p.sender, p.receiver))
        contexts = np.stack(
            [
                feats.single(
                    bounded[c],
                    bounded[p.receiver],
                    p.protocol,
                    p.role,
                    m.trust(c),
                    m.trust(p.receiver),
                )
                for c in others
            ]
        )
        ucb = _score(m, contexts)
        ranked = [others[i] for i in np.argsort(-ucb, kind="stable")[:3]]
        assert list(p.co_senders) == ranked


def _score(m: Matchmaker, contexts: np.ndarray) -> np.ndarray:
    theta = m.theta
    state = m.snapshot()
    quad = np.einsum("ij,jk,ik->i", contexts, state.a_inv, contexts)
    return contexts @ theta + 1.0 * np.sqrt(np.maximum(quad, 0.0))


def test_k_of_one_selects_exactly_as_before() -> None:
    profiles, caps = _merge_world(10, seed=3)
    default = Matchmaker(32, seed=2, protocols=("pmix", "svd_hka"))
    explicit = Matchmaker(32, seed=2, protocols=("pmix", "svd_hka"), merge_senders=1)
    for _ in range(3):
        a, b = default.select(profiles, caps), explicit.select(profiles, caps)
        assert a == b and all(p.co_senders == () for p in a)
        for p, q in zip(a, b, strict=True):
            default.observe(p, 0.3)
            explicit.observe(q, 0.3)
    assert default.snapshot() == explicit.snapshot()


def test_a_student_with_a_short_overlay_list_gets_only_listed_co_senders() -> None:
    _, caps = _merge_world(6)
    caps["a0"] = Capabilities("ps", ("svd_hka",), frozenset({"a1", "a2"}))
    caps["a5"] = Capabilities("other", ("svd_hka",))  # another space: never a sender
    as_student = 0
    for seed in range(20):
        profiles, _ = _merge_world(6, seed=seed)
        m = Matchmaker(32, seed=seed, protocols=("svd_hka",), merge_senders=MAX_MERGE_SENDERS)
        for p in m.select(profiles, caps):
            senders = {p.sender, *p.co_senders}
            assert "a5" not in senders and p.receiver != "a5"
            if p.receiver == "a0":
                assert senders == {"a1", "a2"}
                as_student += 1
            else:  # unnarrowed: every other agent of the space but the student
                assert senders == {"a0", "a1", "a2", "a3", "a4"} - {p.receiver}
    assert as_student > 0


def test_the_reward_updates_the_primary_senders_context_only() -> None:
    """One reward, one update: on the pairing's own context, the teacher's trust only.
    The co-senders change nothing in what the bandit learns (docs/matchmaker.md)."""
    profiles, caps = _merge_world()
    m = Matchmaker(32, seed=0, protocols=("svd_hka",), merge_senders=3)
    ref = Matchmaker(32, seed=0, protocols=("svd_hka",), merge_senders=3)
    [p, *_] = m.select(profiles, caps)
    assert p.co_senders
    m.observe(p, 0.7)
    ref.observe(replace_co(p), 0.7)
    assert m.snapshot() == ref.snapshot() and m.n_updates == 1
    assert m.snapshot().trust == {p.sender: (1, 1)}


@pytest.mark.parametrize("k", [0, -1, MAX_MERGE_SENDERS + 1])
def test_bad_merge_senders_are_refused(k: int) -> None:
    with pytest.raises(ValueError, match="merge_senders"):
        Matchmaker(32, merge_senders=k)
    with pytest.raises(ValueError, match="merge_senders"):
        CpmSettings(merge_senders=k)
    assert CpmSettings(merge_senders=MAX_MERGE_SENDERS).merge_senders == MAX_MERGE_SENDERS


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _submit(c: CpmCore, names: list[str]) -> None:
    for k, name in enumerate(names):
        feats = [float(x) for x in np.random.default_rng(k).uniform(0, 1, 32)]
        c.submit_profile(
            name,
            1,
            feats,
            f"127.0.0.1:{6000 + k}",
            connected=len(names),
            param_space="ps",
            protocols=("akd", "svd_hka"),
        )


def test_the_core_issues_streams_stores_and_replays_co_senders(tmp_path: Path) -> None:
    """Co-senders go into the ledger with their endpoints, onto the wire (the student's
    and the teacher's copy), survive a restart, and the ledger replay after a restart
    reproduces the bandit bit for bit (one update per reward, the teacher's context)."""
    db = tmp_path / "cpm.db"
    names = ["a", "b", "c", "d", "e", "f"]
    settings = CpmSettings(
        init=True,
        db=db,
        protocols=("svd_hka",),
        merge_senders=3,
        directive_ttl_s=60,
        snapshot_every=1000,  # everything replayed from the ledger
    )
    store = SqliteCpmStore(db)
    c = CpmCore(settings, store, Clock())
    _submit(c, names)
    directives = c.matchmake().directives
    assert len(directives) == 3
    endpoints = {n: f"127.0.0.1:{6000 + k}" for k, n in enumerate(names)}
    for d in directives:
        assert len(d.co_senders) == 2
        assert all(e == endpoints[n] for n, e in d.co_senders)
        assert {d.teacher, d.student}.isdisjoint(n for n, _ in d.co_senders)
        for recipient in (d.student, d.teacher):
            msg = directive_message(d, recipient)
            assert [(a.name, a.endpoint) for a in msg.co_senders] == list(d.co_senders)
    first, *rest = directives
    c.report_reward(first.student, first.directive_id, 0.4)
    expected = c.matchmaker.snapshot()
    store.close()  # like a SIGKILL: no snapshot written
    store = SqliteCpmStore(db)
    again = CpmCore(settings, store, Clock())
    assert again.rewards_replayed == 1 and again.matchmaker.snapshot() == expected
    reopened = {d.directive_id: d for d in again.open_directives_for(rest[0].student)}
    assert reopened[rest[0].directive_id].co_senders == rest[0].co_senders
    store.close()


def test_akd_directives_never_carry_co_senders() -> None:
    c = CpmCore(
        CpmSettings(init=True, protocols=("akd",), merge_senders=4, directive_ttl_s=60),
        MemoryCpmStore(),
        Clock(),
    )
    _submit(c, ["a", "b", "c", "d"])
    directives = c.matchmake().directives
    assert directives and all(d.co_senders == () for d in directives)
    assert all(not directive_message(d, d.student).co_senders for d in directives)


@pytest.mark.parametrize("protocol", ["akd", "akd_logits"])
@pytest.mark.parametrize("role", [cpm_pb2.EXCHANGE_ROLE_STUDENT, cpm_pb2.EXCHANGE_ROLE_TEACHER])
def test_an_agent_refuses_co_senders_on_a_protocol_that_is_not_a_merge(
    protocol: str, role: cpm_pb2.ExchangeRole.ValueType
) -> None:
    assert directive_action(protocol, role, MENU, MERGE_PROTOCOLS, co_senders=1) == "refuse"
    assert directive_action(protocol, role, MENU, MERGE_PROTOCOLS, co_senders=0) != "refuse"
    assert directive_action("svd_hka", role, MENU, MERGE_PROTOCOLS, co_senders=3) != "refuse"


def test_large_rounds_choose_co_senders_among_the_prefiltered_partners() -> None:
    """From prefilter_min_agents on, a student's co-senders come from its candidate
    partners of the round (top-k by the cheap score plus random ones), still admissible,
    distinct and at most k - 1; the overlay lists still narrow them."""
    rng = np.random.default_rng(11)
    names = [f"a{k:03d}" for k in range(150)]
    caps = {
        n: Capabilities(
            "ps-a" if k % 5 else "ps-b",
            ("akd", "svd_hka"),
            frozenset(names[(k + 1) % 150 : (k + 1) % 150 + 6]) if k % 3 == 0 else None,
        )
        for k, n in enumerate(names)
    }
    m = Matchmaker(32, seed=3, protocols=("akd", "svd_hka"), merge_senders=4, beta=0.1)
    filled = 0
    for _ in range(3):
        for p in m.select({n: rng.uniform(-1, 1, 32) for n in names}, caps):
            co = p.co_senders
            assert len(co) <= 3 and len(set(co)) == len(co)
            assert p.sender not in co and p.receiver not in co
            for c in co:
                assert p.protocol == "svd_hka" and _admissible(c, p.receiver, p.protocol, caps)
            filled += len(co) == 3
            m.observe(p, 1.0 if p.protocol == "svd_hka" else -1.0)
    assert filled > 0


def test_a_database_made_under_one_k_is_refused_under_another(tmp_path: Path) -> None:
    """K > 1 merge rewards are group rewards: a database keeps the K it was made under,
    and one made under a single sender keeps the fingerprint it had before K existed."""
    from peerlm.services.cpm.core import settings_fingerprint

    db = tmp_path / "cpm.db"
    one = CpmSettings(db=db, protocols=("svd_hka",))
    assert "merge_senders" not in settings_fingerprint(one)
    three = CpmSettings(init=True, db=db, protocols=("svd_hka",), merge_senders=3)
    assert '"merge_senders": 3' in settings_fingerprint(three)
    store = SqliteCpmStore(db)
    CpmCore(three, store, Clock())
    store.close()
    for other in (1, 2):
        store = SqliteCpmStore(db)
        with pytest.raises(ValueError, match="different bandit settings"):
            CpmCore(CpmSettings(db=db, protocols=("svd_hka",), merge_senders=other), store, Clock())
        store.close()
    store = SqliteCpmStore(db)
    CpmCore(CpmSettings(db=db, protocols=("svd_hka",), merge_senders=3), store, Clock())
    store.close()


@pytest.mark.parametrize("role", [cpm_pb2.EXCHANGE_ROLE_STUDENT, cpm_pb2.EXCHANGE_ROLE_TEACHER])
def test_an_agent_refuses_more_co_senders_than_any_cpm_sends(
    role: cpm_pb2.ExchangeRole.ValueType,
) -> None:
    """A merge directive may name at most MAX_MERGE_SENDERS - 1 co-senders (the CPM's
    bound, the proto's "at most 15"). One naming more (a compromised or buggy control
    plane: tens of thousands fit one message) is refused whole, before the student walks
    the list, instead of being deduplicated name by name on its event loop."""
    from peerlm.agent.cpm.directives import MAX_CO_SENDERS
    from peerlm.services.cpm import MAX_MERGE_SENDERS

    most = MAX_MERGE_SENDERS - 1
    assert most == MAX_CO_SENDERS
    assert directive_action("svd_hka", role, MENU, MERGE_PROTOCOLS, co_senders=most) != "refuse"
    assert directive_action("pmix", role, MENU, MERGE_PROTOCOLS, co_senders=most + 1) == "refuse"
    assert directive_action("svd_hka", role, MENU, MERGE_PROTOCOLS, co_senders=50_000) == "refuse"


def test_only_the_student_rewards_a_k_sender_directive_and_only_once() -> None:
    """Hostile members around a directive with co-senders: a co-sender (named in it, but
    not its receiver) or the teacher reporting its reward is PERMISSION_DENIED, a replay of
    the student's report is ALREADY_EXISTS; the bandit moves once, on the student's report."""
    c = CpmCore(
        CpmSettings(init=True, protocols=("svd_hka",), merge_senders=3, directive_ttl_s=60),
        MemoryCpmStore(),
        Clock(),
    )
    _submit(c, ["a", "b", "c", "d", "e", "f"])
    d = c.matchmake().directives[0]
    assert len(d.co_senders) == 2
    before = c.matchmaker.snapshot()
    for intruder in (*(n for n, _ in d.co_senders), d.teacher):
        with pytest.raises(CpmError) as err:
            c.report_reward(intruder, d.directive_id, 1e6)
        assert err.value.code == "PERMISSION_DENIED"
    assert c.matchmaker.snapshot() == before
    c.report_reward(d.student, d.directive_id, 0.3)
    after = c.matchmaker.snapshot()
    assert after.n_updates == before.n_updates + 1
    with pytest.raises(CpmError) as err:
        c.report_reward(d.student, d.directive_id, 0.3)
    assert err.value.code == "ALREADY_EXISTS"
    assert c.matchmaker.snapshot() == after
