"""Attack/failure classes on the CPM's state and input ranges, against real CPM processes.

* A deleted or 0-byte database must not silently start a new federation: refused at start
  unless ``--init``.
* A directive row whose status or context does not parse is refused at start, not later.
* uint64 fields beyond SQLite's signed 64-bit INTEGER are INVALID_ARGUMENT (they used to
  come back as UNKNOWN from an OverflowError), counted, with the state unchanged.
"""

from __future__ import annotations

import sqlite3
import urllib.request
from pathlib import Path

import grpc
import pytest

from peerlm.wire.v1 import cpm_pb2
from tests.cpm_harness import CpmProcess, Pki
from tests.ports import free_port

pytestmark = pytest.mark.integration

MANUAL = {"PEERLM_CPM_MIN_QUORUM": "1000", "PEERLM_CPM_ROUND_INTERVAL_S": "3600"}


def _refused(cpm: CpmProcess, init: bool) -> str:
    with pytest.raises(RuntimeError, match="CPM exited 2") as e:
        cpm.start(init=init)
    return str(e.value)


@pytest.mark.parametrize("how", ["deleted", "empty"])
def test_a_lost_database_is_refused_unless_init(tmp_path: Path, how: str) -> None:
    db = tmp_path / "cpm.db"
    cpm = CpmProcess(Pki.create(tmp_path, agents=1), db, tmp_path, MANUAL)
    cpm.start(init=True)
    assert cpm.terminate() == 0
    db.unlink()
    for side in ("-wal", "-shm"):
        (tmp_path / f"cpm.db{side}").unlink(missing_ok=True)
    if how == "empty":
        db.write_bytes(b"")
    assert "--init" in _refused(cpm, init=False)
    # Told to, it starts a new federation; from then on it restarts without --init.
    cpm.start(init=True)
    assert cpm.terminate() == 0
    cpm.start(init=False)
    assert cpm.terminate() == 0


@pytest.mark.parametrize(
    "corruption",
    [
        "UPDATE directives SET status='bogus'",
        "UPDATE directives SET context=x'0102'",
    ],
)
async def test_an_unparseable_directive_is_refused_at_start(
    tmp_path: Path, corruption: str
) -> None:
    db = tmp_path / "cpm.db"
    cpm = CpmProcess(Pki.create(tmp_path, agents=2), db, tmp_path, MANUAL).start()
    stubs = [cpm.pki.stub(cpm.target, f"a{i}") for i in range(2)]
    admin_ch, admin = cpm.pki.stub(cpm.target, "admin")
    for _, stub in stubs:
        await stub.SubmitProfile(cpm_pb2.SubmitProfileRequest(round=1, features=[0.2] * 32))
    assert (await admin.TriggerMatchmaking(cpm_pb2.TriggerMatchmakingRequest())).pairs == 1
    for ch, _ in stubs:
        await ch.close()
    await admin_ch.close()
    assert cpm.terminate() == 0
    con = sqlite3.connect(db)
    con.execute(corruption)
    con.commit()
    con.close()
    message = _refused(cpm, init=False)
    assert "does not parse" in message


async def test_uint64_beyond_sqlite_is_invalid_argument(tmp_path: Path) -> None:
    cpm = CpmProcess(
        Pki.create(tmp_path, agents=1),
        tmp_path / "cpm.db",
        tmp_path,
        MANUAL,
        metrics_port=free_port(),
    )
    cpm.start()
    ch, stub = cpm.pki.stub(cpm.target, "a0")
    admin_ch, admin = cpm.pki.stub(cpm.target, "admin")
    try:
        before = await admin.GetStats(cpm_pb2.GetStatsRequest())
        for call, req in (
            (
                stub.SubmitProfile,
                cpm_pb2.SubmitProfileRequest(round=2**64 - 1, features=[0.1] * 32),
            ),
            (stub.SubmitProfile, cpm_pb2.SubmitProfileRequest(round=2**63, features=[0.1] * 32)),
            (
                stub.ReportReward,
                cpm_pb2.ReportRewardRequest(
                    directive_id="ab" * 16, reward=0.1, kilobytes=2**64 - 1
                ),
            ),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call(req)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            assert "2^63" in (e.value.details() or "")
        after = await admin.GetStats(cpm_pb2.GetStatsRequest())
        assert after.profiles_received == before.profiles_received
        assert list(after.agents) == list(before.agents)
        assert _rejected(cpm, "SubmitProfile") == 2 and _rejected(cpm, "ReportReward") == 1
        # The largest stored value is accepted.
        await stub.SubmitProfile(cpm_pb2.SubmitProfileRequest(round=2**63 - 1, features=[0.1] * 32))
    finally:
        await ch.close()
        await admin_ch.close()
        assert cpm.terminate() == 0


def _rejected(cpm: CpmProcess, rpc: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{cpm.metrics_port}/metrics").read().decode()
    head = f'peerlm_cpm_rejected_requests_total{{reason="out_of_range",rpc="{rpc}"}}'
    for line in body.splitlines():
        if line.startswith(head):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
