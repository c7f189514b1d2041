"""SIGKILL the CPM while rewards stream in; the restart must hold every acknowledged reward
exactly once, and the restored bandit must equal the one rebuilt from the ledger."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from peerlm.wire.v1 import cpm_pb2
from tests.cpm_harness import CpmProcess, Pki

pytestmark = pytest.mark.integration

MANUAL = {"PEERLM_CPM_MIN_QUORUM": "1000", "PEERLM_CPM_ROUND_INTERVAL_S": "3600"}
AGENTS = [f"a{i}" for i in range(6)]


def _ledger(db: Path) -> tuple[list[tuple[str, np.ndarray, float]], np.ndarray, np.ndarray, int]:
    con = sqlite3.connect(db)
    rows = con.execute(
        "SELECT directive_id, context, normalised_reward FROM directives WHERE status='rewarded'"
    ).fetchall()
    d, a_inv, b, n = con.execute("SELECT context_dim, a_inv, b, n_updates FROM bandit").fetchone()
    con.close()
    ledger = [(i, np.frombuffer(c, "<f8"), float(r)) for i, c, r in rows]
    return ledger, np.frombuffer(a_inv, "<f8").reshape(d, d), np.frombuffer(b, "<f8"), int(n)


async def _issue_directives(cpm: CpmProcess, rounds: int) -> list[cpm_pb2.Directive]:
    stubs = {a: cpm.pki.stub(cpm.target, a) for a in AGENTS}
    admin_ch, admin = cpm.pki.stub(cpm.target, "admin")
    rng = np.random.default_rng(7)
    for r in range(1, rounds + 1):
        for a in AGENTS:
            feats = [float(x) for x in rng.uniform(0, 1, 32)]
            await stubs[a][1].SubmitProfile(cpm_pb2.SubmitProfileRequest(round=r, features=feats))
        await admin.TriggerMatchmaking(cpm_pb2.TriggerMatchmakingRequest())
    found: dict[str, cpm_pb2.Directive] = {}
    for a in AGENTS:
        call = stubs[a][1].StreamDirectives(cpm_pb2.StreamDirectivesRequest())
        for _ in range(rounds):
            d = await call.read()
            found[d.directive_id] = d
        call.cancel()
    for ch, _ in stubs.values():
        await ch.close()
    await admin_ch.close()
    return list(found.values())


async def _report(cpm: CpmProcess, d: cpm_pb2.Directive, reward: float) -> str:
    ch, stub = cpm.pki.stub(cpm.target, d.student)
    try:
        await stub.ReportReward(
            cpm_pb2.ReportRewardRequest(directive_id=d.directive_id, reward=reward), timeout=10
        )
        return "OK"
    except grpc.aio.AioRpcError as err:
        return err.code().name
    finally:
        await ch.close()


@pytest.mark.slow
async def test_sigkill_mid_stream_keeps_every_acknowledged_reward_once(tmp_path: Path) -> None:
    cpm = CpmProcess(Pki.create(tmp_path), tmp_path / "cpm.db", tmp_path, MANUAL).start()
    directives = await _issue_directives(cpm, rounds=10)
    assert len(directives) == 30
    rewards = {d.directive_id: float(i) / 10 - 1.0 for i, d in enumerate(directives)}

    acked: set[str] = set()
    killed = asyncio.Event()

    async def one(d: cpm_pb2.Directive, i: int) -> None:
        # Staggered starts: the CPM group-commits concurrent rewards, and on a fast machine
        # 30 simultaneous reports can all be acknowledged in one batch before the kill lands;
        # spread out, the kill falls while later reports are still to come or in flight.
        await asyncio.sleep(0.05 * i)
        if await _report(cpm, d, rewards[d.directive_id]) == "OK":
            acked.add(d.directive_id)
            if len(acked) >= 8 and not killed.is_set():
                killed.set()
                cpm.kill()

    await asyncio.gather(*(one(d, i) for i, d in enumerate(directives)))
    assert killed.is_set(), "the CPM should have been killed mid-stream"
    assert 8 <= len(acked) < 30

    cpm.start()
    ledger, a_inv, b, n_updates = _ledger(tmp_path / "cpm.db")
    committed = {i for i, _, _ in ledger}
    assert acked <= committed, "an acknowledged reward was lost"
    assert n_updates == len(committed), "a reward was applied twice or not at all"
    # The restored bandit equals the one rebuilt from the committed ledger.
    dim = a_inv.shape[0]
    a = np.eye(dim) + sum(np.outer(x, x) for _, x, _ in ledger)
    np.testing.assert_allclose(a_inv, np.linalg.inv(a), rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(b, sum(r * x for _, x, r in ledger), rtol=1e-9, atol=1e-12)

    # Every directive can now be settled exactly once.
    results = {d.directive_id: await _report(cpm, d, rewards[d.directive_id]) for d in directives}
    for i, code in results.items():
        assert code == ("ALREADY_EXISTS" if i in committed else "OK"), (i, code)
    # The bandit table is a snapshot (written every snapshot_every rewards and at
    # shutdown); the ledger is what a reward's acknowledgement waits for.
    final_ledger, _, _, _ = _ledger(tmp_path / "cpm.db")
    assert len(final_ledger) == 30
    assert cpm.terminate() == 0
    _, _, _, n_final = _ledger(tmp_path / "cpm.db")
    assert n_final == 30


async def test_sigterm_drains_feeds_and_exits_cleanly(tmp_path: Path) -> None:
    cpm = CpmProcess(Pki.create(tmp_path, agents=2), tmp_path / "cpm.db", tmp_path, MANUAL).start()
    ch, stub = cpm.pki.stub(cpm.target, "a0")
    call = stub.StreamDirectives(cpm_pb2.StreamDirectivesRequest())
    await stub.SubmitProfile(cpm_pb2.SubmitProfileRequest(round=1, features=[0.1] * 32))
    # Stop only once the feed is open on the server: a feed that reaches the CPM after its
    # stop began is refused as UNAVAILABLE by design (seen in CI), not drained.
    deadline = time.monotonic() + 30
    while "directive_feed_opened" not in cpm.log():
        assert time.monotonic() < deadline, cpm.log()[-3000:]
        await asyncio.sleep(0.05)
    loop = asyncio.get_running_loop()
    rc = await loop.run_in_executor(None, cpm.terminate)
    assert rc == 0
    # The feed ended with OK (drained), not with a transport error.
    async for _ in call:
        pass
    assert await call.code() == grpc.StatusCode.OK
    await ch.close()
    assert "cpm_stopped" in cpm.log()


async def test_the_robust_normaliser_survives_a_sigkill_exactly(tmp_path: Path) -> None:
    """``PEERLM_CPM_REWARD_NORMALISER=robust`` with a window of 16 and a snapshot every 7
    rewards: 15 rewards, SIGKILL (one reward only in the ledger), restart, 15 more. Every
    normalised reward in the ledger is what one normaliser fed the 30 raw rewards in
    ledger order gives, bit for bit: the window came back exactly."""
    from peerlm.services.cpm import RobustRewardNormaliser

    env = {
        **MANUAL,
        "PEERLM_CPM_REWARD_NORMALISER": "robust",
        "PEERLM_CPM_REWARD_WINDOW": "16",
        "PEERLM_CPM_SNAPSHOT_EVERY": "7",
    }
    cpm = CpmProcess(Pki.create(tmp_path), tmp_path / "cpm.db", tmp_path, env).start()
    directives = await _issue_directives(cpm, rounds=10)
    rng = np.random.default_rng(3)
    rewards = {d.directive_id: float(rng.normal(0.0, 0.2)) for d in directives}
    for d in directives[:15]:
        assert await _report(cpm, d, rewards[d.directive_id]) == "OK"
    cpm.kill()
    cpm.start()
    for d in directives[15:]:
        assert await _report(cpm, d, rewards[d.directive_id]) == "OK"
    assert cpm.terminate() == 0
    con = sqlite3.connect(tmp_path / "cpm.db")
    rows = con.execute(
        "SELECT reward, normalised_reward FROM directives WHERE status='rewarded'"
        " ORDER BY reward_seq"
    ).fetchall()
    window = con.execute("SELECT reward_window FROM bandit").fetchone()[0]
    con.close()
    assert len(rows) == 30
    fresh = RobustRewardNormaliser(16, clip_sigmas=3.0)
    assert [z for _, z in rows] == [fresh.update(r) for r, _ in rows]
    assert np.frombuffer(window, "<f8").tolist() == [r for r, _ in rows[-16:]]
