"""Programs that act on other processes or leave IPC objects behind, runnable under any uid.

As a script (``python sandbox_process_battery.py SANDBOX_PY [LANDLOCK_ABI]``) it starts a
victim (``sleep``, under the runner's own uid), loads the sandbox module from its file, runs
every program of :func:`programs` through ``run_program`` and prints one JSON object (its
last line of output): each program's outcome, what changed in the runner (the agent: the
sandbox's parent) and in the victim (another process of the same uid), the signals the
runner received, and the System V and message-queue objects the runs left behind (removed
again before exit). ``LANDLOCK_ABI`` caps the Landlock ABI the sandbox's child sees, so
this kernel's sandbox behaves as on an older kernel (ABI 3: no signal scoping).
The tests in ``test_sandbox_processes.py`` run it as root and as uid 10001.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Any

_LIMITS = {
    "cpu": resource.RLIMIT_CPU,
    "nofile": resource.RLIMIT_NOFILE,
    "fsize": resource.RLIMIT_FSIZE,
}
_IPC_FILES = ("shm", "sem", "msg")
#: The column of /proc/sysvipc/<kind> that holds the creator's uid.
_CUID_COLUMN = {"shm": 9, "sem": 6, "msg": 9}
#: Signals a program may direct at the runner through an owned descriptor.
_WATCHED_SIGNALS = (signal.SIGUSR2, signal.SIGIO)
_F_SETSIG, _F_SETOWN_EX, _F_OWNER_PID, _FIOSETOWN = 10, 15, 1, 0x8901


def programs(victim: int, mq_name: str) -> dict[str, str]:
    """Each attack (a program prints ``ESCAPED`` once its call succeeded), and one honest
    program that uses the self-directed forms of the same calls and must pass."""
    out: dict[str, str] = {}
    for target, pid in (("parent", "os.getppid()"), ("victim", str(victim))):
        # Towards the runner a signal it survives and records; towards the victim, SIGKILL.
        sig = int(signal.SIGUSR2 if target == "parent" else signal.SIGKILL)
        pipe = "import fcntl, os\nr, w = os.pipe()\n"
        arm = "fcntl.fcntl(r, fcntl.F_SETFL, os.O_ASYNC | os.O_NONBLOCK)\nos.write(w, b'x')\n"
        out |= {
            f"prlimit_{target}": "import os, resource\n"
            f"pid = {pid}\n"
            "soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)\n"
            "resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft - 1, hard))\n"
            "resource.prlimit(pid, resource.RLIMIT_CPU, (10**6, resource.RLIM_INFINITY))\n"
            "resource.prlimit(pid, resource.RLIMIT_FSIZE, (2**40, resource.RLIM_INFINITY))\n"
            "print('ESCAPED')\n",
            f"setpriority_{target}": "import os, posix\n"
            f"posix.setpriority(posix.PRIO_PROCESS, {pid}, 19)\nprint('ESCAPED')\n",
            f"sched_setscheduler_{target}": "import os, posix\n"
            f"posix.sched_setscheduler({pid}, posix.SCHED_IDLE, posix.sched_param(0))\n"
            "print('ESCAPED')\n",
            f"sched_setaffinity_{target}": "import os, posix\n"
            f"posix.sched_setaffinity({pid}, {{min(posix.sched_getaffinity(0))}})\n"
            "print('ESCAPED')\n",
            f"fcntl_setown_{target}": pipe + f"fcntl.fcntl(r, fcntl.F_SETOWN, {pid})\n"
            f"fcntl.fcntl(r, {_F_SETSIG}, {sig})\n" + arm + "print('ESCAPED')\n",
            f"fcntl_setown_ex_{target}": pipe + "import struct\n"
            f"fcntl.fcntl(r, {_F_SETOWN_EX}, struct.pack('ii', {_F_OWNER_PID}, {pid}))\n"
            f"fcntl.fcntl(r, {_F_SETSIG}, {sig})\n" + arm + "print('ESCAPED')\n",
            # FIOSETOWN is F_SETOWN by ioctl; sockets (a pair is all it may make) honour it.
            f"ioctl_fiosetown_{target}": "import _socket, fcntl, os, struct\n"
            "a, b = _socket.socketpair()\n"
            f"fcntl.ioctl(a.fileno(), {_FIOSETOWN}, struct.pack('i', {pid}))\n"
            "fcntl.fcntl(a.fileno(), fcntl.F_SETFL, os.O_ASYNC | os.O_NONBLOCK)\n"
            "b.send(b'x')\nprint('ESCAPED')\n",
            f"kill_{target}": f"import os, posix\nposix.kill({pid}, {sig})\nprint('ESCAPED')\n",
        }
    libc = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    out |= {
        "setpriority_whole_uid": "import posix\nposix.setpriority(posix.PRIO_USER, 0, 19)\n"
        "print('ESCAPED')\n",
        "sysv_shm": libc
        + "i = libc.shmget(0, 1 << 20, 0o1600)\nassert i >= 0, os.strerror(ctypes.get_errno())\n"
        "assert libc.shmat(i, None, 0) not in (None, -1)\nprint('ESCAPED')\n",
        "sysv_sem": libc
        + "assert libc.semget(0, 8, 0o1600) >= 0, os.strerror(ctypes.get_errno())\n"
        "print('ESCAPED')\n",
        "sysv_msg": libc + "assert libc.msgget(0, 0o1600) >= 0, os.strerror(ctypes.get_errno())\n"
        "print('ESCAPED')\n",
        "posix_mq": libc
        + f"q = libc.mq_open({mq_name.encode()!r}, os.O_CREAT | os.O_RDWR, 0o600, None)\n"
        "assert q >= 0, os.strerror(ctypes.get_errno())\nprint('ESCAPED')\n",
        # The same calls aimed at itself, as glibc and CPython make them: must pass.
        "honest_self": "import os, posix, resource, signal\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (soft - 1, hard))\n"
        "assert resource.prlimit(0, resource.RLIMIT_NOFILE) == (soft - 1, hard)\n"
        "nice = min(19, posix.getpriority(posix.PRIO_PROCESS, 0) + 1)\n"
        "posix.setpriority(posix.PRIO_PROCESS, 0, nice)\n"
        "assert posix.getpriority(posix.PRIO_PROCESS, 0) == nice\n"
        "assert posix.sched_getaffinity(0) and posix.sched_getscheduler(0) >= 0\n"
        "posix.sched_setaffinity(0, posix.sched_getaffinity(0))\n"
        "posix.kill(posix.getpid(), 0)\n"
        "signal.signal(signal.SIGUSR1, lambda *a: print('GOT'))\n"
        "signal.raise_signal(signal.SIGUSR1)\n"
        "import fcntl\nr, w = os.pipe()\nfcntl.fcntl(r, fcntl.F_SETFL, os.O_NONBLOCK)\n"
        "assert fcntl.fcntl(r, fcntl.F_GETFD) & fcntl.FD_CLOEXEC\n",
    }
    return out


def _state(pid: int) -> dict[str, Any]:
    """What a program could change in process ``pid`` (readable by its owner and root)."""
    return {
        "limits": {name: list(resource.prlimit(pid, which)) for name, which in _LIMITS.items()},
        "nice": os.getpriority(os.PRIO_PROCESS, pid),
        "scheduler": os.sched_getscheduler(pid),
        "affinity": sorted(os.sched_getaffinity(pid)),
    }


def _sandbox_uid(uid: int, sandbox: Any) -> bool:
    """Whether a sandbox child started by this runner may run under ``uid``."""
    if os.getuid() != 0:
        return uid == os.getuid()
    base, fallback = int(sandbox.SANDBOX_UID_BASE), int(sandbox.FALLBACK_UID)
    return uid >= base or uid == fallback


def _ipc_objects(sandbox: Any) -> dict[str, list[list[str]]]:
    """The System V objects of this IPC namespace that a sandbox child of this runner could
    have created (each a line of /proc/sysvipc/*): other processes' objects are left alone."""
    found: dict[str, list[list[str]]] = {}
    for name in _IPC_FILES:
        with open(f"/proc/sysvipc/{name}", encoding="ascii") as handle:
            rows = [line.split() for line in handle.read().splitlines()[1:]]
        found[name] = [row for row in rows if _sandbox_uid(int(row[_CUID_COLUMN[name]]), sandbox)]
    return found


def _remove_ipc(kind: str, row: list[str]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    remove = {"shm": libc.shmctl, "sem": libc.semctl, "msg": libc.msgctl}[kind]
    remove(int(row[1]), 0, None)  # IPC_RMID


def _load_sandbox(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("peerlm_sandbox_process_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _cap_landlock_abi(sandbox: Any, abi: int, where: str) -> None:
    """Make the sandbox's child see Landlock ABI ``min(kernel, abi)``: a ``landlockpy``
    placed first on the child's binding path that loads the real one and caps its ABI."""
    real = importlib.util.find_spec("landlockpy")
    assert real is not None and real.origin is not None
    shim = os.path.join(where, "landlockpy")
    os.makedirs(shim)
    with open(os.path.join(shim, "__init__.py"), "w", encoding="utf-8") as handle:
        handle.write(
            "import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('landlockpy', {real.origin!r}, "
            f"submodule_search_locations=[{os.path.dirname(real.origin)!r}])\n"
            "module = importlib.util.module_from_spec(spec)\n"
            "sys.modules['landlockpy'] = module\nspec.loader.exec_module(module)\n"
            "kernel_abi = module.abi_version\n"
            f"module.abi_version = lambda: min({abi}, kernel_abi())\n"
        )
    paths = sandbox._binding_paths

    def capped() -> str:
        return os.pathsep.join([where, paths()])

    sandbox._binding_paths = capped


def main() -> None:
    sandbox = _load_sandbox(sys.argv[1])
    received: list[int] = []
    for watched in _WATCHED_SIGNALS:
        signal.signal(watched, lambda signum, _frame: received.append(signum))
    scratch = tempfile.mkdtemp(prefix="peerlm-process-battery-")
    victim = subprocess.Popen(["sleep", "600"])
    mq_name = f"/peerlm-battery-{os.getpid()}"
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        if len(sys.argv) > 2:
            _cap_landlock_abi(sandbox, int(sys.argv[2]), os.path.join(scratch, "shim"))
        from prometheus_client import CollectorRegistry

        telemetry = sandbox.SandboxTelemetry(CollectorRegistry())
        results: dict[str, Any] = {"uid": os.getuid(), "programs": {}}
        ipc_before = _ipc_objects(sandbox)
        limits = {"timeout_s": 5.0, "memory_mb": 128, "file_size_mb": 1}
        for name in programs(victim.pid, mq_name):
            code = programs(victim.pid, mq_name)[name]  # aimed at the victim alive now
            before = {"parent": _state(os.getpid()), "victim": _state(victim.pid)}
            r = sandbox.run_program(code, telemetry=telemetry, **limits)
            alive = victim.poll() is None
            after = {"parent": _state(os.getpid()), "victim": _state(victim.pid) if alive else {}}
            results["programs"][name] = {
                "status": r.status,
                "returncode": r.returncode,
                "forbidden_call": getattr(r, "forbidden_call", False),
                "stdout": r.stdout_tail,
                "stderr": r.stderr_tail,
                "confined": r.confined,
                "notes": list(r.notes),
                "changed": [who for who in before if before[who] != after[who]],
                "victim_alive": alive,
                "signals_to_parent": [int(s) for s in received],
            }
            received.clear()
            if not alive:  # a later program needs a victim to aim at
                victim = subprocess.Popen(["sleep", "600"])
        ipc_after = _ipc_objects(sandbox)
        left: dict[str, list[list[str]]] = {}
        for kind in _IPC_FILES:
            left[kind] = [row for row in ipc_after[kind] if row not in ipc_before[kind]]
            for row in left[kind]:
                _remove_ipc(kind, row)
        results["ipc_left"] = left
        queue = libc.mq_open(mq_name.encode(), os.O_RDONLY, 0, None)
        results["mq_left"] = queue >= 0
        if queue >= 0:
            os.close(queue)
            libc.mq_unlink(mq_name.encode())
        forbidden = getattr(telemetry, "forbidden", None)
        results["forbidden_total"] = 0 if forbidden is None else forbidden._value.get()
        print(json.dumps(results))
    finally:
        victim.kill()
        victim.wait()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
