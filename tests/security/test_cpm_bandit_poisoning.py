"""Attack class: colluding members poison the CPM's bandit with accepted input only.

Two agents submit profiles whose entries sit at the validator's bound (+-1e6), are matched
with each other round after round, and report small honest rewards. Before the fix the
Sherman–Morrison-maintained ``A^-1`` went indefinite after ~130 updates, every later
ReportReward failed with UNKNOWN, and a restarted CPM refused to start. Here, against a
real CPM process over mTLS, every reward must be acknowledged, a third honest agent must
still be served, and a SIGKILLed CPM must come back with a valid bandit.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import pytest

from peerlm.wire.v1 import cpm_pb2
from tests.cpm_harness import CpmProcess, Pki

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MANUAL = {"PEERLM_CPM_MIN_QUORUM": "1000", "PEERLM_CPM_ROUND_INTERVAL_S": "3600"}
ROUNDS = 220


def _bandit(db: Path) -> tuple[np.ndarray, int]:
    con = sqlite3.connect(db)
    d, a_inv, n = con.execute("SELECT context_dim, a_inv, n_updates FROM bandit").fetchone()
    con.close()
    return np.frombuffer(a_inv, "<f8").reshape(d, d), int(n)


async def test_profiles_at_the_bound_cannot_break_the_bandit(tmp_path: Path) -> None:
    cpm = CpmProcess(Pki.create(tmp_path, agents=3), tmp_path / "cpm.db", tmp_path, MANUAL)
    cpm.start()
    try:
        await _attack_and_restart(cpm, tmp_path)
    finally:
        if cpm.proc is not None and cpm.proc.poll() is None:
            cpm.kill()


async def _attack_and_restart(cpm: CpmProcess, tmp_path: Path) -> None:
    stubs = {a: cpm.pki.stub(cpm.target, a) for a in ("a0", "a1", "a2")}
    admin_ch, admin = cpm.pki.stub(cpm.target, "admin")
    feeds = {a: stubs[a][1].StreamDirectives(cpm_pb2.StreamDirectivesRequest()) for a in stubs}
    rng = np.random.default_rng(0)
    try:
        for r in range(1, ROUNDS + 1):
            for a in ("a0", "a1"):
                feats = [float(v) for v in rng.choice([-1e6, 1e6, 0.0, 1.0], size=32)]
                await stubs[a][1].SubmitProfile(
                    cpm_pb2.SubmitProfileRequest(round=r, features=feats)
                )
            out = await admin.TriggerMatchmaking(cpm_pb2.TriggerMatchmakingRequest())
            assert out.pairs == 1
            d = await feeds["a0"].read()
            await feeds["a1"].read()
            ack = await stubs[d.student][1].ReportReward(
                cpm_pb2.ReportRewardRequest(
                    directive_id=d.directive_id, reward=float(rng.uniform(0, 0.01))
                ),
                timeout=10,
            )
            assert ack.bandit_updates == r
        # An honest member is still matched and its reward learnt from.
        for a in ("a0", "a2"):
            await stubs[a][1].SubmitProfile(
                cpm_pb2.SubmitProfileRequest(round=ROUNDS + 1, features=[0.5] * 32)
            )
        await admin.TriggerMatchmaking(cpm_pb2.TriggerMatchmakingRequest())
        d = await feeds["a2"].read()
        ack = await stubs[d.student][1].ReportReward(
            cpm_pb2.ReportRewardRequest(directive_id=d.directive_id, reward=0.3), timeout=10
        )
        assert ack.bandit_updates == ROUNDS + 1
    finally:
        for f in feeds.values():
            f.cancel()
        for ch, _ in stubs.values():
            await ch.close()
        await admin_ch.close()
    # A SIGKILLed CPM restarts over its own bandit, which is symmetric positive definite.
    cpm.kill()
    cpm.start()
    a_inv, n = _bandit(tmp_path / "cpm.db")
    assert n == ROUNDS + 1
    assert np.array_equal(a_inv, a_inv.T)
    assert np.linalg.eigvalsh(a_inv).min() > 0
    assert cpm.terminate() == 0, cpm.log()[-3000:]


async def test_a_cpm_starts_over_a_bandit_an_older_cpm_left_indefinite(tmp_path: Path) -> None:
    """The state the attack left behind (indefinite ``A^-1``, no ``A``) no longer stops a
    start: the CPM rebuilds the bandit from the reward ledger and counts it."""
    db = tmp_path / "cpm.db"
    cpm = CpmProcess(Pki.create(tmp_path, agents=2), db, tmp_path, MANUAL).start()
    stubs = {a: cpm.pki.stub(cpm.target, a) for a in ("a0", "a1")}
    admin_ch, admin = cpm.pki.stub(cpm.target, "admin")
    try:
        for r in range(1, 6):
            for _, stub in stubs.values():
                await stub.SubmitProfile(cpm_pb2.SubmitProfileRequest(round=r, features=[0.3] * 32))
            await admin.TriggerMatchmaking(cpm_pb2.TriggerMatchmakingRequest())
        feed = stubs["a0"][1].StreamDirectives(cpm_pb2.StreamDirectivesRequest())
        for _ in range(5):
            d = await feed.read()
            await stubs[d.student][1].ReportReward(
                cpm_pb2.ReportRewardRequest(directive_id=d.directive_id, reward=0.2)
            )
        feed.cancel()
    finally:
        for ch, _ in stubs.values():
            await ch.close()
        await admin_ch.close()
    assert cpm.terminate() == 0
    con = sqlite3.connect(db)
    (dim,) = con.execute("SELECT context_dim FROM bandit").fetchone()
    poisoned = (-np.eye(dim)).astype("<f8").tobytes()
    con.execute("UPDATE bandit SET a_inv=?, a=NULL", (poisoned,))
    con.commit()
    con.close()
    cpm.start()
    try:
        a_inv, n = _bandit(db)
        assert n == 5
        assert np.linalg.eigvalsh(a_inv).min() > 0
        assert '"how": "rebuilt' in cpm.log()
    finally:
        assert cpm.terminate() == 0
