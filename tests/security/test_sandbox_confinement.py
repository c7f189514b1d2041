"""Generated code cannot escape the sandbox, as root or as the image's uid 10001.

The same hostile programs (tests/security/sandbox_battery.py) run through the sandbox
twice: from a root caller and from a caller running as uid 10001 without capabilities
(``setpriv``), which is how every shipped deployment runs the agent. Each run happens in a
separate process, so a program that killed its caller would fail the test rather than end
pytest. Where the kernel lacks a required mechanism the battery is skipped and the sandbox
must refuse instead; the refusal (and the operator's opt-out) is also exercised here by
taking Landlock or seccomp away from a process with a seccomp filter, as an old container
runtime profile does.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import prometheus_client
import pytest
from peerlm.agent.eval import sandbox
from peerlm.agent.eval.sandbox import SandboxUnavailable, probe_confinement, run_program

from tests.security import sandbox_battery

UNPRIVILEGED = 10001
IS_ROOT = os.geteuid() == 0
BATTERY = Path(sandbox_battery.__file__).resolve()
SANDBOX_PY = Path(sandbox.__file__).resolve()
SITE_PACKAGES = str(Path(prometheus_client.__file__).resolve().parent.parent)
CONFINEMENT = probe_confinement()
needs_confinement = pytest.mark.skipif(
    not CONFINEMENT.ok, reason=f"this kernel lacks: {'; '.join(CONFINEMENT.missing)}"
)
SETPRIV = shutil.which("setpriv")


def _as_unprivileged() -> list[str]:
    assert SETPRIV is not None
    ids = str(UNPRIVILEGED)
    return [SETPRIV, "--reuid", ids, "--regid", ids, "--clear-groups", "--inh-caps=-all"]


def _launcher(user: str) -> tuple[list[str], str]:
    """The command prefix and interpreter that run a child as ``user`` ("root" or "uid
    10001"); skips the test where this machine cannot switch to uid 10001."""
    if user != "uid 10001":
        return [], sys.executable
    if not IS_ROOT or SETPRIV is None:
        pytest.skip("switching to uid 10001 needs root and setpriv (util-linux)")
    found = _unprivileged_python()
    if found is None:
        pytest.skip(f"no Python {sys.version_info[:2]} that uid 10001 may execute")
    return _as_unprivileged(), found


def _unprivileged_python() -> str | None:
    """An interpreter uid 10001 may execute: this one, or the system's of the same version
    (a pyenv build under /root is closed to other uids)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (
        sys.executable,
        f"/usr/bin/python{version}",
        f"/usr/local/bin/python{version}",
    ):
        if not os.path.exists(candidate):
            continue
        probe = [
            *_as_unprivileged(),
            candidate,
            "-c",
            # The interpreter must run *and* be the one named (its real path reachable), since
            # the sandbox re-executes sys.executable.
            "import os, sys; assert os.access(os.path.realpath(sys.executable), os.X_OK); "
            f"assert sys.version_info[:2] == ({version.replace('.', ', ')})",
        ]
        if subprocess.run(probe, capture_output=True, check=False, cwd="/").returncode == 0:
            return candidate
    return None


@dataclass
class Battery:
    """The targets of one battery run: keys, listeners, a victim process."""

    root: Path
    spec: dict[str, Any]
    tcp: socket.socket
    unix: socket.socket
    victim: subprocess.Popen[bytes]


@pytest.fixture
def battery() -> Iterator[Battery]:
    # Not pytest's tmp_path: its parent is closed to uid 10001.
    root = Path(tempfile.mkdtemp(prefix="peerlm-battery-"))
    root.chmod(0o755)
    pki = root / "pki"
    pki.mkdir(mode=0o700)
    key, vrf = pki / "agent.key", pki / "agent.vrf.key"
    key.write_text("-----BEGIN PRIVATE KEY-----\nSECRET\n-----END PRIVATE KEY-----\n")
    vrf.write_bytes(b"\x01" * 32)
    for path in (key, vrf):
        path.chmod(0o600)
    if IS_ROOT:
        # As in the image: the agent's own uid owns its keys, so only confinement stops a
        # program running under that uid from reading them.
        for path in (pki, key, vrf):
            os.chown(path, UNPRIVILEGED, UNPRIVILEGED)
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(16)
    unix_path = root / "agent.sock"
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(str(unix_path))
    unix.listen(16)
    unix_path.chmod(0o777)
    victim_cmd = ["sleep", "600"]
    if IS_ROOT and SETPRIV is not None:
        victim_cmd = [*_as_unprivileged(), *victim_cmd]
    victim = subprocess.Popen(victim_cmd)
    spec = {
        "key": str(key),
        "vrf_key": str(vrf),
        "tcp_port": tcp.getsockname()[1],
        "unix_path": str(unix_path),
        "victim_pid": victim.pid,
        "escape_name": f"peerlm-escape-{os.getpid()}-{os.urandom(4).hex()}",
    }
    (root / "spec.json").write_text(json.dumps(spec))
    (root / "spec.json").chmod(0o644)
    try:
        yield Battery(root=root, spec=spec, tcp=tcp, unix=unix, victim=victim)
    finally:
        victim.kill()
        victim.wait()
        tcp.close()
        unix.close()
        shutil.rmtree(root, ignore_errors=True)


def _run_battery(prefix: list[str], python: str, battery: Battery) -> dict[str, Any]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": SITE_PACKAGES, "LC_ALL": "C.UTF-8"}
    argv = [*prefix, python, str(BATTERY), str(SANDBOX_PY), str(battery.root / "spec.json")]
    done = subprocess.run(argv, capture_output=True, check=False, cwd="/", env=env, timeout=600)
    # The runner survived (no program killed its caller) and reported every program.
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    # structlog's default logger writes to stdout (forbidden calls are logged): the JSON
    # object is the last line.
    result: dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return result


def _assert_contained(result: dict[str, Any], battery: Battery) -> None:
    # Each attack works for an unconfined process under the same uid: the checks below mean
    # something.
    assert result["can"] == {"read_key": True, "tcp": True, "signal_victim": True}, result["can"]
    programs = sandbox_battery.programs(battery.spec)
    assert result["runs_total"] == len(programs)  # every run counted by status
    assert result["forbidden_total"] == len(sandbox_battery.FORBIDDEN_CALLS)
    for name in programs:
        outcome = result[name]
        assert outcome["confined"], (name, outcome["notes"])
        assert "ESCAPED" not in outcome["stdout"], (name, outcome)
        assert "SECRET" not in outcome["stdout"] + outcome["stderr"], name
        if name == "honest":
            assert outcome["status"] == "passed", outcome["stderr"]
        elif name == "fill_memory":
            assert outcome["status"] == "memory", outcome
        elif name == "sleep_forever":
            assert outcome["status"] == "timeout", outcome
        elif name == "fill_disk":
            wrote = int(outcome["stdout"].split("WROTE", 1)[1].split()[0])
            assert wrote <= sandbox_battery.DISK_BOUND_BYTES, outcome
            assert outcome["status"] == "failed", outcome
        elif name in sandbox_battery.FORBIDDEN_CALLS:
            # Killed by the system-call filter at the call: nothing printed, counted.
            assert outcome["status"] == "failed" and outcome["forbidden_call"], (name, outcome)
        else:
            assert outcome["status"] == "failed", (name, outcome)
            assert "Error" in outcome["stderr"], (name, outcome)
    # Nothing reached the listeners but the runner's own unconfined connection, the victim
    # lives, nothing was written outside.
    battery.tcp.settimeout(5)
    battery.tcp.accept()[0].close()
    for listener in (battery.tcp, battery.unix):
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert battery.victim.poll() is None
    key = Path(battery.spec["key"]).stat()
    assert key.st_mode & 0o777 == 0o600 and key.st_mtime > 0, oct(key.st_mode)
    for directory in ("/tmp", "/var/tmp", "/dev/shm"):
        assert not (Path(directory) / battery.spec["escape_name"]).exists(), directory


@needs_confinement
def test_hostile_programs_are_contained_from_this_uid(battery: Battery) -> None:
    """As root when the tests run as root (uid switch, namespaces, Landlock, seccomp)."""
    result = _run_battery([], sys.executable, battery)
    assert result["uid"] == os.getuid()
    _assert_contained(result, battery)


@needs_confinement
def test_hostile_programs_are_contained_as_uid_10001_without_capabilities(
    battery: Battery,
) -> None:
    if not IS_ROOT or SETPRIV is None:
        pytest.skip("switching to uid 10001 needs root and setpriv (util-linux)")
    python = _unprivileged_python()
    if python is None:
        pytest.skip(f"no Python {sys.version_info[:2]} that uid 10001 may execute")
    result = _run_battery(_as_unprivileged(), python, battery)
    assert result["uid"] == UNPRIVILEGED
    _assert_contained(result, battery)


# A process that loses one mechanism the way a container runtime's seccomp profile takes it
# away: the system call answers ENOSYS (Landlock, seccomp: the sandbox must refuse) or
# EPERM (unshare: Docker's and Kubernetes' default profiles refuse user namespaces to a
# process without CAP_SYS_ADMIN; the sandbox must still confine). The filter is inherited
# by the sandbox's child. The sandbox module is loaded from its file so that an interpreter
# outside the virtual environment (uid 10001's) can run this too.
_TAKE_AWAY = textwrap.dedent(
    """
    import errno, importlib.util, json, sys
    import pyseccomp
    from prometheus_client import CollectorRegistry

    spec = importlib.util.spec_from_file_location("sandbox_under_test", sys.argv[2])
    sandbox = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = sandbox
    spec.loader.exec_module(sandbox)
    what = sys.argv[1]
    f = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    if what == "landlock":
        f.add_rule(pyseccomp.ERRNO(errno.ENOSYS), "landlock_create_ruleset")
    elif what == "seccomp":
        f.add_rule(pyseccomp.ERRNO(errno.ENOSYS), "seccomp")
        f.add_rule(pyseccomp.ERRNO(errno.ENOSYS), "prctl", pyseccomp.Arg(0, pyseccomp.EQ, 22))
    else:
        f.add_rule(pyseccomp.ERRNO(errno.EPERM), "unshare")
    f.load()
    telemetry = sandbox.SandboxTelemetry(CollectorRegistry())
    out = {"probe_missing": list(sandbox.probe_confinement().missing)}
    try:
        sandbox.require_confinement(telemetry=telemetry)
        out["require"] = "ok"
    except sandbox.SandboxUnavailable as exc:
        out["require"] = str(exc)
    runs = {"honest": "print('RAN')\\n", "create": "open('new.txt', 'w').write('x')\\n",
            "key": "open(sys.argv[3]).read()\\n".replace("sys.argv[3]", repr(sys.argv[3]))}
    for name, code in runs.items():
        try:
            r = sandbox.run_program(code, telemetry=telemetry)
            out[name] = {"status": r.status, "confined": r.confined, "notes": list(r.notes),
                         "stdout": r.stdout_tail, "stderr": r.stderr_tail}
        except sandbox.SandboxUnavailable as exc:
            out[name] = str(exc)
    r = sandbox.run_program("print('RAN')\\n", telemetry=telemetry, allow_unconfined=True)
    out["opt_out"] = {"status": r.status, "confined": r.confined, "notes": list(r.notes),
                      "stdout": r.stdout_tail}
    out["refusals"] = telemetry.refusals._value.get()
    out["unconfined"] = telemetry.unconfined._value.get()
    print(json.dumps(out))
    """
)


def _take_away(mechanism: str, user: str, key: Path) -> dict[str, Any]:
    if not CONFINEMENT.seccomp:
        pytest.skip("taking a mechanism away needs seccomp itself")
    prefix, python = _launcher(user)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": SITE_PACKAGES, "LC_ALL": "C.UTF-8"}
    argv = [*prefix, python, "-c", _TAKE_AWAY, mechanism, str(SANDBOX_PY), str(key)]
    done = subprocess.run(argv, capture_output=True, check=False, cwd="/", env=env)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    # structlog's default logger writes to stdout: the warnings come first.
    *logged, last = done.stdout.decode().strip().splitlines()
    out: dict[str, Any] = json.loads(last)
    assert any("sandbox_unconfined_run" in line for line in logged) == (
        not out["opt_out"]["confined"]
    ), logged
    return out


USERS = ["this uid", "uid 10001"]


@pytest.mark.parametrize("user", USERS)
@pytest.mark.parametrize("mechanism", ["landlock", "seccomp"])
def test_sandbox_refuses_without_a_mechanism_unless_the_operator_opts_out(
    mechanism: str, user: str, battery: Battery
) -> None:
    out = _take_away(mechanism, user, Path(battery.spec["key"]))
    if mechanism == "landlock":
        # The start-up probe sees it: the agent refuses to evaluate before any run.
        assert any("Landlock" in reason for reason in out["probe_missing"])
        assert out["require"].startswith("refusing to evaluate generated code: Landlock")
        expected_refusals = 4  # the probe, then each of the three runs
    else:
        # Filter loading cannot be probed without filtering the caller; each run refuses.
        assert out["require"] == "ok"
        expected_refusals = 3
    for name in ("honest", "create", "key"):
        assert isinstance(out[name], str), out[name]  # refused: nothing ran
        assert out[name].startswith("sandbox refused:") and mechanism in out[name].lower()
    opt_out = out["opt_out"]
    assert opt_out["status"] == "passed" and opt_out["stdout"] == "RAN\n"
    assert not opt_out["confined"]
    assert any(note.startswith("UNCONFINED (operator opt-out)") for note in opt_out["notes"])
    assert out["refusals"] == expected_refusals and out["unconfined"] == 1


@pytest.mark.parametrize("user", USERS)
@needs_confinement
def test_without_user_namespaces_still_confined_and_no_file_creation(
    user: str, battery: Battery
) -> None:
    out = _take_away("userns", user, Path(battery.spec["key"]))
    assert out["require"] == "ok" and out["refusals"] == 0 and out["unconfined"] == 0
    honest = out["honest"]
    assert honest["status"] == "passed" and honest["confined"], honest
    assert any("no bounded scratch filesystem" in note for note in honest["notes"])
    create, key = out["create"], out["key"]
    assert create["status"] == "failed" and "PermissionError" in create["stderr"], create
    assert key["status"] == "failed" and "PermissionError" in key["stderr"], key
    assert "SECRET" not in key["stdout"] + key["stderr"]
    assert out["opt_out"]["confined"]  # nothing was missing: the opt-out changed nothing


@pytest.mark.skipif(CONFINEMENT.ok, reason="this kernel has every required mechanism")
def test_sandbox_refuses_on_a_kernel_that_lacks_a_mechanism() -> None:
    with pytest.raises(SandboxUnavailable):
        run_program("print('RAN')\n")
