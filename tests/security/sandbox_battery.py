"""Hostile programs for the sandbox, runnable as a script under any uid.

As a script (``python sandbox_battery.py SANDBOX_PY SPEC_JSON``) it loads the sandbox module
from its file (so an interpreter outside the project's virtual environment, usable by an
unprivileged uid, can run it), runs every program of :func:`programs` through
``run_program`` and prints one JSON object: each program's outcome, plus what the runner
itself could do unconfined (which shows that each attack would have worked without the
sandbox). The tests in ``test_sandbox_confinement.py`` run it as root and as uid 10001.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
from typing import Any

#: Programs whose attack is a call the system-call filter answers by killing the run.
FORBIDDEN_CALLS = frozenset({"kill_parent", "kill_victim", "kill_everything", "signal_via_ctypes"})
#: The sandbox's scratch tmpfs holds max(8, 4 * file_size_mb) MiB; file_size_mb is 1 here.
DISK_BOUND_BYTES = 16 * 1024 * 1024


def programs(spec: dict[str, Any]) -> dict[str, str]:
    """Each attack; a program prints ``ESCAPED`` only when its attack succeeded."""
    key, vrf = spec["key"], spec["vrf_key"]
    port, unix_path, victim = spec["tcp_port"], spec["unix_path"], spec["victim_pid"]
    escape = spec["escape_name"]
    stream_inet = "import _socket\ns = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\n"
    stream_unix = "import _socket\ns = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)\n"
    pki = os.path.dirname(key)
    return {
        "read_key": f"print(open({key!r}).read())\nprint('ESCAPED')\n",
        "read_vrf_key": f"print(open({vrf!r}, 'rb').read())\nprint('ESCAPED')\n",
        "list_key_dir": f"import os\nprint(os.listdir({pki!r}))\nprint('ESCAPED')\n",
        # Landlock does not govern a path's metadata: the filter refuses chmod and utime.
        "chmod_key": f"import posix\nposix.chmod({key!r}, 0o644)\nprint('ESCAPED')\n",
        "utime_key": f"import posix\nposix.utime({key!r}, (0, 0))\nprint('ESCAPED')\n",
        "read_parent_environ": "import os\n"
        "print(open(f'/proc/{os.getppid()}/environ', 'rb').read())\nprint('ESCAPED')\n",
        "tcp_via__socket": stream_inet + f"s.settimeout(2)\ns.connect(('127.0.0.1', {port}))\n"
        "s.sendall(b'KEY')\nprint('ESCAPED')\n",
        "tcp_via_socket": "import socket\n"
        f"socket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'KEY')\n"
        "print('ESCAPED')\n",
        "tcp_via_socket_class": "import socket\ns = socket.socket()\n"
        f"s.connect(('127.0.0.1', {port}))\nprint('ESCAPED')\n",
        "udp_via__socket": "import _socket\n"
        "s = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)\n"
        f"s.sendto(b'KEY', ('127.0.0.1', {port}))\nprint('ESCAPED')\n",
        "unix_via__socket": stream_unix
        + f"s.connect({unix_path!r})\ns.sendall(b'KEY')\nprint('ESCAPED')\n",
        "unix_via_socket": "import socket\ns = socket.socket(socket.AF_UNIX)\n"
        f"s.connect({unix_path!r})\nprint('ESCAPED')\n",
        "abstract_unix": stream_unix + "s.connect('\\0peerlm-battery')\nprint('ESCAPED')\n",
        "kill_parent": "import os, posix\nposix.kill(os.getppid(), 9)\nprint('ESCAPED')\n",
        "kill_victim": f"import posix\nposix.kill({victim}, 9)\nprint('ESCAPED')\n",
        "kill_everything": "import posix\nposix.kill(-1, 9)\nprint('ESCAPED')\n",
        "signal_via_ctypes": "import ctypes, os\n"
        f"assert ctypes.CDLL(None).kill({victim}, 9) == 0\nprint('ESCAPED')\n",
        "fork_bomb": "import posix\nwhile True:\n    posix.fork()\n",
        "fork_via_ctypes": "import ctypes\nassert ctypes.CDLL(None).fork() >= 0\n"
        "print('ESCAPED')\n",
        "thread": "import threading\nthreading.Thread(target=print).start()\nprint('ESCAPED')\n",
        "exec_shell": "import posix\nposix.execv('/bin/sh', ['sh', '-c', 'echo ESCAPED'])\n",
        "fill_memory": "xs = []\nwhile True:\n    xs.append(b' ' * 10**6)\n",
        "fill_disk": "total = 0\ntry:\n"
        "    for i in range(100):\n"
        "        with open(f'fill{i}', 'wb') as f:\n"
        "            for _ in range(1024):\n"
        "                f.write(b'x' * 1024)\n                total += 1024\n"
        "finally:\n    print('WROTE', total)\n",
        "write_tmp": f"open('/tmp/{escape}', 'w').write('x')\nprint('ESCAPED')\n",
        "write_var_tmp": f"open('/var/tmp/{escape}', 'w').write('x')\nprint('ESCAPED')\n",
        "write_dev_shm": f"open('/dev/shm/{escape}', 'w').write('x')\nprint('ESCAPED')\n",
        "sleep_forever": "import time\ntime.sleep(10**6)\n",
        "honest": "def add(a, b):\n    return a + b\n\n"
        "import collections, math, re\nassert add(2, 3) == 5\n"
        "assert collections.Counter('aab')['a'] == 2 and math.gcd(12, 8) == 4\n"
        "assert re.sub('a', 'b', 'aa') == 'bb'\n",
    }


def _load_sandbox(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("peerlm_agent_sandbox_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _unconfined_abilities(spec: dict[str, Any]) -> dict[str, bool]:
    """What this runner, unconfined and under the same uid, can do."""
    can: dict[str, bool] = {}
    try:
        with open(spec["key"], "rb"):
            can["read_key"] = True
    except OSError:
        can["read_key"] = False
    try:
        with socket.create_connection(("127.0.0.1", spec["tcp_port"]), timeout=2):
            can["tcp"] = True
    except OSError:
        can["tcp"] = False
    try:
        os.kill(spec["victim_pid"], 0)
        can["signal_victim"] = True
    except OSError:
        can["signal_victim"] = False
    return can


def main() -> None:
    sandbox = _load_sandbox(sys.argv[1])
    with open(sys.argv[2], encoding="utf-8") as handle:
        spec = json.load(handle)
    from prometheus_client import CollectorRegistry

    telemetry = sandbox.SandboxTelemetry(CollectorRegistry())
    results: dict[str, Any] = {"uid": os.getuid(), "can": _unconfined_abilities(spec)}
    limits = {"timeout_s": 3.0, "memory_mb": 128, "file_size_mb": 1}
    for name, code in programs(spec).items():
        r = sandbox.run_program(code, telemetry=telemetry, **limits)
        results[name] = {
            "status": r.status,
            "stdout": r.stdout_tail,
            "stderr": r.stderr_tail,
            "confined": r.confined,
            "network_isolated": r.network_isolated,
            "notes": list(r.notes),
            "forbidden_call": r.forbidden_call,
        }
    results["runs_total"] = sum(
        s.value
        for metric in telemetry.runs.collect()
        for s in metric.samples
        if s.name.endswith("_total")
    )
    results["forbidden_total"] = telemetry.forbidden._value.get()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
