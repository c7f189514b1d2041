"""Experiment runs in worker processes: a LocalOnly+ track crosses processes as bytes."""

from __future__ import annotations

import multiprocessing
import resource
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

from peerlm.app.experiment_run import LocalPhase, OwnRound
from peerlm.app.experiment_workers import pack_track, unpack_track
from peerlm.app.experiment_world import OwnMemo

#: Below the tensors a track holds: torch's reducer would need a descriptor for each.
_FD_LIMIT = 256
_TENSORS = 2_000


def _few_descriptors() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (_FD_LIMIT, hard))


def _track(packed: bool) -> Any:
    state = {f"layer{k}.lora_A.weight": torch.full((2, 3), float(k)) for k in range(_TENSORS)}
    phase = LocalPhase(state, 1.0, 2.0, 0.5, None)  # type: ignore[arg-type]
    memo = OwnMemo(results={"test-nll|p|d": [0.25]}, outcomes={"prog": "passed"})
    track = [{"agent-0": OwnRound(phase, state, memo)}]
    return pack_track(track) if packed else track


def _round_trip(packed: bool) -> str:
    """In a worker with few descriptors: the track back, or why it did not come."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=ctx, initializer=_few_descriptors) as pool:
        try:
            got = pool.submit(_track, packed).result(timeout=120)
        except Exception as exc:  # the worker's pickling error, re-raised here
            return f"failed: {type(exc).__name__}"
    (round_one,) = unpack_track(got) if packed else got
    own = round_one["agent-0"]
    assert len(own.trained) == _TENSORS
    assert torch.equal(own.trained["layer7.lora_A.weight"], torch.full((2, 3), 7.0))
    assert own.phase.adapter.keys() == own.trained.keys()
    assert own.memo is not None and own.memo.results == {"test-nll|p|d": [0.25]}
    assert own.memo.outcomes == {"prog": "passed"}
    return "ok"


def test_a_track_with_more_tensors_than_descriptors_comes_back_from_a_worker() -> None:
    # In a child interpreter: the spawned pool's resource tracker ends with it.
    root = Path(__file__).resolve().parents[2]
    code = "from tests.unit.test_experiment_workers import _round_trip; print(_round_trip(True))"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "ok"
