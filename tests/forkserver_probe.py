"""A command for tests/unit/test_forkserver.py: reports what it was started with, then does
what its first argument says (``python -m tests.forkserver_probe ACTION [ARG]``)."""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from pathlib import Path

#: Pools kept alive to the end, as a library's global would keep them.
POOLS: list[object] = []


def main() -> None:
    action, arg = [*sys.argv[1:], "report", ""][:2]
    umask = os.umask(0)
    os.umask(umask)
    report = {
        "argv": sys.argv[1:],
        "probe": os.environ.get("PEERLM_PROBE"),
        "cwd": os.getcwd(),
        "umask": umask,
        "session_leader": os.getsid(0) == os.getpid(),
        "pid": os.getpid(),
        "name": __name__,
    }
    if "numpy" in sys.modules:
        report["numpy"] = float(sys.modules["numpy"].random.random())
    print(json.dumps(report), flush=True)
    if action == "exit":
        sys.exit(int(arg))
    if action == "message":
        sys.exit(arg)
    if action == "raise":
        raise RuntimeError(arg)
    if action == "sleep":
        time.sleep(float(arg))
    if action == "atexit":
        atexit.register(Path(arg).write_text, "atexit ran")
    if action == "pool":
        # A pool nobody shut down: the interpreter's end stops its idle workers.
        from concurrent.futures import ThreadPoolExecutor

        POOLS.append(ThreadPoolExecutor(2))
        POOLS[-1].submit(time.sleep, 0.1).result()
    if action == "unflushed":
        sys.stdout.write("early\n")  # no flush: seen at once only when unbuffered
        time.sleep(float(arg))
    if action == "thread":

        def late() -> None:
            time.sleep(0.5)
            Path(arg).write_text("thread finished")

        threading.Thread(target=late).start()


if __name__ == "__main__":
    main()
