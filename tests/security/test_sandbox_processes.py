"""Generated code cannot act on the agent or on another process of its uid, and leaves no
System V or message-queue object behind: as root and as the image's uid 10001, on this
kernel's Landlock ABI and with the child's Landlock capped at ABI 3 (no signal scoping).

The programs (tests/security/sandbox_process_battery.py) aim ``prlimit64``,
``setpriority``, ``sched_setscheduler``, ``sched_setaffinity``, ``kill`` and signal-driven
I/O (``fcntl`` ``F_SETOWN``/``F_SETOWN_EX`` + ``F_SETSIG``, ``ioctl`` ``FIOSETOWN``) at the
runner (the sandbox's parent, standing for the agent) and at a victim of the runner's uid,
renice the whole uid, and make System V shared memory, semaphores, message queues and a
POSIX message queue. Before the deny-by-default filter, as uid 10001, every call but
``kill`` succeeded (and, at ABI 3, signal-driven I/O delivered ``SIGKILL`` to the victim
and signals to the runner); as root and uid 10001 each run left its IPC objects behind.
The runner runs in its own process, so a program that killed it fails the test rather
than ending pytest.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import prometheus_client
import pytest
from peerlm.agent.eval import sandbox

from tests.security import sandbox_process_battery
from tests.security.test_sandbox_confinement import (
    UNPRIVILEGED,
    _launcher,
    needs_confinement,
)

RUNNER = Path(sandbox_process_battery.__file__).resolve()
SANDBOX_PY = Path(sandbox.__file__).resolve()
SITE_PACKAGES = str(Path(prometheus_client.__file__).resolve().parent.parent)


def _run(user: str, landlock_abi: int | None) -> dict[str, Any]:
    prefix, python = _launcher(user)
    argv = [*prefix, python, str(RUNNER), str(SANDBOX_PY)]
    if landlock_abi is not None:
        argv.append(str(landlock_abi))
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": SITE_PACKAGES, "LC_ALL": "C.UTF-8"}
    done = subprocess.run(argv, capture_output=True, check=False, cwd="/", env=env, timeout=300)
    # The runner (the agent's stand-in) survived every program and reported.
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    # structlog's default logger writes the forbidden-call warnings to stdout first.
    result: dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    if user == "uid 10001":
        assert result["uid"] == UNPRIVILEGED
    return result


@needs_confinement
@pytest.mark.parametrize("landlock_abi", [None, 3], ids=["kernel ABI", "Landlock ABI 3"])
@pytest.mark.parametrize("user", ["this uid", "uid 10001"])
def test_calls_on_other_processes_and_ipc_objects_are_killed_and_change_nothing(
    user: str, landlock_abi: int | None
) -> None:
    result = _run(user, landlock_abi)
    outcomes = result["programs"]
    assert set(outcomes) == set(sandbox_process_battery.programs(1, "/q"))
    honest = outcomes.pop("honest_self")
    # The self-directed forms (pid 0, its own pid, its own descriptors) still work.
    assert honest["status"] == "passed" and "GOT" in honest["stdout"], honest
    if landlock_abi is not None:
        assert f"landlock ABI {landlock_abi}" in honest["notes"], honest["notes"]
    for name, outcome in outcomes.items():
        assert outcome["confined"], (name, outcome["notes"])
        # Killed by the filter at the call: failed, flagged, nothing done after it.
        assert outcome["status"] == "failed" and outcome["forbidden_call"], (name, outcome)
        assert "ESCAPED" not in outcome["stdout"], (name, outcome)
        # Limits, nice value, scheduler, affinity of the runner and the victim unchanged;
        # the victim alive; no signal reached the runner.
        assert outcome["changed"] == [], (name, outcome)
        assert outcome["victim_alive"], (name, outcome)
        assert outcome["signals_to_parent"] == [], (name, outcome)
    assert result["forbidden_total"] == len(outcomes)  # each counted
    # Nothing outlived a run: no System V object of a sandbox uid, no message queue.
    assert result["ipc_left"] == {"shm": [], "sem": [], "msg": []}
    assert not result["mq_left"]
