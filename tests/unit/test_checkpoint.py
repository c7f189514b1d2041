"""Checkpoints: atomic save and verified load, pruning, corruption fallback, crash safety."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from peerlm.agent import checkpoint as ckpt
from peerlm.agent.checkpoint import CheckpointError, CheckpointStore


def _adapter(round_: int) -> dict[str, torch.Tensor]:
    return {
        "layers.0.lora_A": torch.full((4, 8), float(round_)),
        "layers.0.lora_B": torch.arange(32, dtype=torch.bfloat16).reshape(8, 4) + round_,
    }


def _state(round_: int) -> dict[str, Any]:
    return {"round": round_, "history": [{"loss": 1.0 / (round_ + 1)}], "name": "a1"}


def _assert_is_round(checkpoint: ckpt.Checkpoint | None, round_: int) -> None:
    assert checkpoint is not None
    assert checkpoint.round == round_
    assert checkpoint.state == _state(round_)
    expected = _adapter(round_)
    assert set(checkpoint.tensors) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(checkpoint.tensors[name], tensor)
        assert checkpoint.tensors[name].dtype == tensor.dtype


def _entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ck")
    assert store.load_latest() is None  # no directory yet
    path = store.save(1, _adapter(1), _state(1))
    assert path == tmp_path / "ck" / "round-000001"
    assert _entries(tmp_path / "ck") == ["LATEST", "round-000001"]
    assert (tmp_path / "ck" / "LATEST").read_text() == "round-000001\n"
    assert sorted(p.name for p in path.iterdir()) == ["adapter.safetensors", "state.json"]
    record = json.loads((path / "state.json").read_text())
    assert record["round"] == 1 and len(record["adapter_sha256"]) == 64
    _assert_is_round(store.load_latest(), 1)
    _assert_is_round(store.load(1), 1)
    # A view of a larger tensor (shared storage) saves fine.
    base = torch.zeros(16)
    store.save(2, {"a": base[:8], "b": base[8:]}, {})
    assert store.load(2).tensors["a"].shape == (8,)


def test_invalid_input_touches_nothing(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    with pytest.raises(ValueError):
        store.save(1, _adapter(1), {"loss": float("nan")})
    with pytest.raises(TypeError):
        store.save(1, _adapter(1), {"x": object()})
    with pytest.raises(TypeError):
        store.save(1, {"a": [1, 2]}, {})  # type: ignore[dict-item]
    with pytest.raises(ValueError):
        store.save(-1, _adapter(1), {})
    assert _entries(tmp_path) == []
    with pytest.raises(ValueError):
        CheckpointStore(tmp_path, keep=0)


def test_daemon_state_is_saved_with_non_finite_floats_as_null(tmp_path: Path) -> None:
    # The daemon's state may hold a NaN loss or an infinite score; the store refuses them
    # (above), so the daemon writes them as null, and a string that spells "NaN" stays.
    from peerlm.agent.daemon import _jsonable

    state = {
        "round": 3,
        "history": [{"loss": float("nan"), "peer": "NaNo-NaN"}, {"loss": 0.5}],
        "scores": [float("inf"), -float("inf"), 1.0],
        "at": Path("/x"),
    }
    clean = _jsonable(state)
    assert clean == {
        "round": 3,
        "history": [{"loss": None, "peer": "NaNo-NaN"}, {"loss": 0.5}],
        "scores": [None, None, 1.0],
        "at": "/x",
    }
    store = CheckpointStore(tmp_path)
    store.save(3, _adapter(3), clean)
    loaded = store.load_latest()
    assert loaded is not None and loaded.state == clean


def test_pruning_keeps_the_newest(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    for r in range(1, 6):
        store.save(r, _adapter(r), _state(r))
    assert store.rounds() == [4, 5]
    assert _entries(tmp_path) == ["LATEST", "round-000004", "round-000005"]
    # Re-saving a round replaces it; an older round than the newest is kept while it is
    # the one just saved.
    store.save(5, _adapter(5), _state(5))
    store.save(2, _adapter(2), _state(2))
    assert store.rounds() == [2, 4, 5]
    _assert_is_round(store.load_latest(), 5)


@pytest.mark.parametrize(
    "damage",
    ["flip_adapter", "truncate_adapter", "delete_adapter", "bad_json", "edit_state", "wrong_round"],
)
def test_corrupt_latest_falls_back_to_newest_complete(tmp_path: Path, damage: str) -> None:
    store = CheckpointStore(tmp_path)
    for r in (1, 2, 3):
        store.save(r, _adapter(r), _state(r))
    newest = tmp_path / "round-000003"
    adapter, state = newest / "adapter.safetensors", newest / "state.json"
    if damage == "flip_adapter":
        data = bytearray(adapter.read_bytes())
        data[-1] ^= 0xFF
        adapter.write_bytes(bytes(data))
    elif damage == "truncate_adapter":
        adapter.write_bytes(adapter.read_bytes()[:-10])
    elif damage == "delete_adapter":
        adapter.unlink()
    elif damage == "bad_json":
        state.write_text("{not json")
    elif damage == "edit_state":
        record = json.loads(state.read_text())
        record["state"]["round"] = 99
        state.write_text(json.dumps(record))
    elif damage == "wrong_round":
        record = json.loads(state.read_text())
        record["round"] = 7
        state.write_text(json.dumps(record))
    with pytest.raises(CheckpointError):
        store.load(3)
    _assert_is_round(store.load_latest(), 2)
    # The corrupt directory was moved aside, not deleted, and no longer counts.
    assert store.rounds() == [1, 2]
    assert any(name.startswith(".corrupt-round-000003") for name in _entries(tmp_path))
    store.save(4, _adapter(4), _state(4))
    _assert_is_round(store.load_latest(), 4)


def test_missing_or_stale_latest_pointer_is_not_trusted(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(1, _adapter(1), _state(1))
    store.save(2, _adapter(2), _state(2))
    (tmp_path / "LATEST").unlink()
    _assert_is_round(store.load_latest(), 2)
    (tmp_path / "LATEST").write_text("round-000001\n")  # a crash before the pointer moved
    _assert_is_round(store.load_latest(), 2)


class SimulatedCrash(BaseException):
    """Stands for kill -9: a BaseException skips the store's orderly-failure cleanup."""


def _count_steps(monkeypatch: pytest.MonkeyPatch, crash_at: int | None) -> list[str]:
    """Wrap every file-system step of a save; raise SimulatedCrash at step ``crash_at``."""
    steps: list[str] = []
    for name in ("_write_durable", "_fsync_dir", "_rename", "_replace"):
        original = getattr(ckpt, name)

        def wrapped(*args: Any, _name: str = name, _orig: Any = original, **kw: Any) -> Any:
            if crash_at is not None and len(steps) == crash_at:
                raise SimulatedCrash(_name)
            steps.append(_name)
            return _orig(*args, **kw)

        monkeypatch.setattr(ckpt, name, wrapped)
    return steps


@pytest.mark.parametrize("resave", [False, True])
def test_crash_between_any_two_steps_leaves_a_complete_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, resave: bool
) -> None:
    # Round 2 after round 1 with keep=1 prunes round 1; re-saving round 1 moves the old
    # directory aside first. Between them every kind of step is exercised.
    target = 1 if resave else 2
    CheckpointStore(tmp_path / "probe", keep=1).save(1, _adapter(1), _state(1))
    with monkeypatch.context() as m:
        steps = _count_steps(m, None)
        CheckpointStore(tmp_path / "probe", keep=1).save(target, _adapter(target), _state(target))
    total = len(steps)
    assert total >= 9, steps
    for crash_at in range(total):
        directory = tmp_path / f"crash{crash_at}"
        store = CheckpointStore(directory, keep=1)
        store.save(1, _adapter(1), _state(1))
        with monkeypatch.context() as m:
            _count_steps(m, crash_at)
            with pytest.raises(SimulatedCrash):
                store.save(target, _adapter(target), _state(target))
        recovered = CheckpointStore(directory, keep=1).load_latest()
        assert recovered is not None, crash_at
        assert recovered.round in (1, target), crash_at
        _assert_is_round(recovered, recovered.round)
        leftovers = [n for n in _entries(directory) if n.startswith((".tmp-", ".del-", ".old-"))]
        assert leftovers == [], (crash_at, leftovers)
        CheckpointStore(directory, keep=1).save(3, _adapter(3), _state(3))
        _assert_is_round(CheckpointStore(directory).load_latest(), 3)


_CHILD = """
import os, signal, sys, structlog, torch
from peerlm.agent import checkpoint as ckpt
structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=sys.stderr))
directory, start, crash_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
state = {"armed": False, "steps": 0}

def wrap(name):
    original = getattr(ckpt, name)
    def wrapped(*args, **kw):
        if state["armed"]:
            if state["steps"] == crash_at:
                os.kill(os.getpid(), signal.SIGKILL)  # a real kill -9, between two steps
            state["steps"] += 1
        return original(*args, **kw)
    setattr(ckpt, name, wrapped)

for name in ("_write_durable", "_fsync_dir", "_rename", "_replace"):
    wrap(name)
store = ckpt.CheckpointStore(directory, keep=2)
r = start
while True:
    state["armed"] = crash_at >= 0 and r == start + 2  # the third save of this process
    store.save(r, {"w": torch.full((256, 256), float(r))}, {"round": r, "pad": "x" * 4096})
    print(r, flush=True)
    r += 1
"""


def _check_recovered(directory: Path, acknowledged: int) -> int:
    latest = CheckpointStore(directory, keep=2).load_latest()
    assert latest is not None
    assert latest.round >= acknowledged  # nothing acknowledged is lost
    assert latest.state["round"] == latest.round
    assert torch.equal(latest.tensors["w"], torch.full((256, 256), float(latest.round)))
    assert not [n for n in _entries(directory) if n.startswith((".tmp-", ".del-", ".old-"))]
    return latest.round


@pytest.mark.slow
def test_kill_9_during_saves_never_loses_an_acknowledged_checkpoint(tmp_path: Path) -> None:
    """Child processes die by SIGKILL: at chosen steps inside a save (the third of each
    process, which also prunes), and once from outside at whatever point it is."""
    directory = tmp_path / "ck"
    acknowledged = 0
    for crash_at in (1, 4, 8, -1):
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(directory), str(acknowledged + 1), str(crash_at)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert child.stdout is not None
        if crash_at >= 0:
            lines = child.stdout.read().split()  # until the child kills itself
        else:
            lines = [child.stdout.readline() for _ in range(3)]
            child.send_signal(signal.SIGKILL)
        assert child.wait() == -signal.SIGKILL
        child.stdout.close()
        if crash_at >= 0:
            assert len(lines) == 2, (crash_at, lines)
        acknowledged = int(lines[-1])
        acknowledged = _check_recovered(directory, acknowledged)


def test_roll_back_makes_an_older_round_the_newest(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    for r in (1, 2, 3):
        store.save(r, _adapter(r), _state(r))
    _assert_is_round(store.roll_back(2), 2)
    assert store.rounds() == [1, 2]
    assert (tmp_path / "LATEST").read_text() == "round-000002\n"
    _assert_is_round(store.load_latest(), 2)
    # Playing on after it: the round saved again is the new one.
    store.save(3, _adapter(3), _state(3))
    _assert_is_round(store.load_latest(), 3)


def test_a_roll_back_to_a_missing_or_damaged_round_changes_nothing(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    for r in (2, 3):
        store.save(r, _adapter(r), _state(r))
    before = _entries(tmp_path)
    with pytest.raises(CheckpointError, match="no checkpoint for round 1"):
        store.roll_back(1)
    (tmp_path / "round-000002" / "adapter.safetensors").write_bytes(b"not an adapter")
    with pytest.raises(CheckpointError):
        store.roll_back(2)
    assert _entries(tmp_path) == before
    _assert_is_round(store.load_latest(), 3)


def test_a_crash_during_a_roll_back_leaves_the_state_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rolling back two rounds: killed after the first discard, the newest is still there
    # (the roll-back did not happen), never the round in between.
    store = CheckpointStore(tmp_path)
    for r in (1, 2, 3):
        store.save(r, _adapter(r), _state(r))
    discard = store._discard
    calls: list[str] = []

    def die_after_one(path: Path) -> None:
        if calls:
            raise KeyboardInterrupt  # stands in for the SIGKILL
        calls.append(path.name)
        discard(path)

    monkeypatch.setattr(store, "_discard", die_after_one)
    with pytest.raises(KeyboardInterrupt):
        store.roll_back(1)
    assert calls == ["round-000002"]
    _assert_is_round(CheckpointStore(tmp_path).load_latest(), 3)
