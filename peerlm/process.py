"""What every long-running peerlm process does the same way at its edges: name itself in
logs, run its event loop, turn SIGTERM/SIGINT into a graceful stop, publish its port, and
(a worker process) end with the process that started it."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from peerlm.atomic_file import write_atomic
from peerlm.config import ServiceSettings

__all__ = [
    "available_memory",
    "exit_with_parent",
    "identity_label",
    "on_stop_signals",
    "run_event_loop",
    "usable_cores",
    "write_port_file",
]

T = TypeVar("T")


def identity_label(settings: ServiceSettings, role: str, dev_name: str | None = None) -> str:
    """The SPIFFE id of the process's certificate, for log lines; a placeholder without one
    (insecure-dev) or when it cannot be read (the security check reports the real error)."""
    from peerlm.pki.identity import identity_from_certificate_pem

    cert = settings.tls.cert
    if cert is None:
        return f"spiffe://{settings.federation}/{role}/{dev_name or '(insecure-dev)'}"
    try:
        return identity_from_certificate_pem(cert.read_bytes()).spiffe_uri
    except (OSError, ValueError):
        return f"(unreadable certificate {cert})"


def on_stop_signals(callback: Callable[[], Any]) -> None:
    """Call ``callback`` on SIGTERM and SIGINT (from within the running event loop)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, callback)


def run_event_loop(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``main()`` to completion on uvloop where available, else asyncio's loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        return asyncio.run(main())
    return uvloop.run(main())


def write_port_file(path: Path, port: int) -> None:
    """Publish the bound port atomically (tests and scripts poll for the file)."""
    write_atomic(path, f"{port}\n".encode(), mode=0o644)


def exit_with_parent(parent: int, poll_s: float = 1.0) -> None:
    """A worker's initializer (``ProcessPoolExecutor(initializer=...)``, a manager's
    ``start``): a daemon thread ends this process once ``parent`` (the pid of the process
    that started it) is gone. Without it a SIGTERM or SIGKILL to the command (a
    ``timeout``, a process manager, a killed shell) leaves its spawned workers running
    their jobs to the end on every core, with nobody to read their results.

    ``parent`` need not be this process's parent: a worker forked by multiprocessing's
    fork server is the server's child. The watch holds a pidfd of ``parent`` (readable
    once it exits, no polling); where pidfds are missing it checks every ``poll_s``
    seconds that ``parent`` still exists."""
    import os
    import select
    import threading
    import time

    try:
        pidfd: int | None = os.pidfd_open(parent)
    except ProcessLookupError:
        os._exit(1)
    except (OSError, AttributeError):
        pidfd = None

    def alive() -> bool:
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def watch() -> None:
        if pidfd is not None:
            select.select([pidfd], [], [])
        else:
            while alive():
                time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


#: Where a cgroup-v2 container's limits are read (the process's own cgroup is mounted here
#: in a container; on a host it is the root cgroup, which has no limit files).
CGROUP_DIR: Path = Path("/sys/fs/cgroup")


def _cgroup_value(path: Path) -> list[str] | None:
    """The fields of a cgroup-v2 limit file, or None (absent, unreadable, or ``max``)."""
    try:
        fields = path.read_text().split()
    except OSError:
        return None
    return None if not fields or fields[0] == "max" else fields


def usable_cores(cgroup: Path = CGROUP_DIR) -> int:
    """The CPU cores this process may run on: its affinity mask where the OS has one (a
    ``taskset`` or a container's cpuset), and no more than a cgroup-v2 CPU quota allows
    (``cpu.max``, rounded up); at least 1."""
    import math
    import os

    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1
    quota = _cgroup_value(cgroup / "cpu.max")
    if quota is not None:
        with contextlib.suppress(ValueError, IndexError, ZeroDivisionError):
            cores = min(cores, math.ceil(int(quota[0]) / int(quota[1])))
    return max(1, cores)


def available_memory(
    meminfo: Path = Path("/proc/meminfo"), cgroup: Path = CGROUP_DIR
) -> int | None:
    """Bytes of memory new processes can take without swapping: the kernel's
    ``MemAvailable``, and no more than a cgroup-v2 limit leaves (``memory.max`` less
    ``memory.current``); None where neither can be read (not Linux, an old kernel)."""
    found: list[int] = []
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
                break
    except (OSError, ValueError, IndexError):
        pass
    limit = _cgroup_value(cgroup / "memory.max")
    used = _cgroup_value(cgroup / "memory.current")
    if limit is not None:
        with contextlib.suppress(ValueError):
            found.append(max(0, int(limit[0]) - (int(used[0]) if used else 0)))
    return min(found) if found else None
