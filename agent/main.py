"""The ``peerlm agent`` process: logging, event loop, signals, summary on exit."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from peerlm.agent.settings import AgentSettings

from peerlm.logs import configure_logging
from peerlm.process import identity_label, on_stop_signals, run_event_loop

__all__ = ["run_agent"]


def run_agent(settings: AgentSettings) -> int:
    """Run the daemon; print its summary as one JSON line on stdout. Returns an exit code."""
    log = configure_logging(
        "agent", identity_label(settings, "agent"), settings.log_format, settings.log_level
    )

    async def main() -> int:
        from peerlm.agent.daemon import AgentDaemon

        daemon = await AgentDaemon.create(settings, log)
        on_stop_signals(daemon.stop)
        try:
            summary = await daemon.run()
        finally:
            await daemon.close()
        sys.stdout.write(json.dumps(asdict(summary)) + "\n")
        sys.stdout.flush()
        log.info("agent_stopped", rounds=summary.rounds_completed)
        return 1 if summary.errors and summary.rounds_completed == 0 else 0

    return run_event_loop(main)
