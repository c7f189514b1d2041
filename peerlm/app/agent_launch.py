"""How ``peerlm up`` starts one of its agents: the command line of a ``peerlm agent``
process reading the configuration ``up`` wrote for it."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["agent_argv"]


def agent_argv(configs: Path) -> Callable[[int, str, str], list[str]]:
    """The launcher ``DevFederation`` calls with (index, agent name, CPM target): this
    interpreter running ``peerlm agent`` on ``configs/<name>.yaml`` against that CPM."""

    def argv(i: int, name: str, target: str) -> list[str]:
        return [
            sys.executable, "-m", "peerlm", "agent", "--config", str(configs / f"{name}.yaml"),
            "--cpm", target,
        ]  # fmt: skip

    return argv
