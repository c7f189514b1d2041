"""How tests start a real ``peerlm agent`` process: forked from the module's fork server
(``agent_forks``, tests/conftest.py), as ``peerlm up`` starts its agents."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from peerlm.app.devfed import AGENT_ENV
from peerlm.forkserver import ChildProcess, ForkServer


def start_agent(forks: ForkServer, config: Path, log: Path) -> ChildProcess:
    """``peerlm agent --config config``: its summary on a stdout pipe (text), its log (JSON
    lines) appended to ``log``."""
    with log.open("a") as err:
        return forks.spawn(
            [sys.executable, "-m", "peerlm", "agent", "--config", str(config)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, **AGENT_ENV},
        )
