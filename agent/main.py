"""The ``peerlm agent`` process: logging, event loop, signals, summary on exit."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from dataclasses import asdict

from peerlm.config import AgentSettings
from peerlm.logs import configure_logging

__all__ = ["run_agent"]


def run_agent(settings: AgentSettings) -> int:
    """Run the daemon; print its summary as one JSON line on stdout. Returns an exit code."""
    log = configure_logging("agent", _label(settings), settings.log_format, settings.log_level)

    async def main() -> int:
        from peerlm.agent.daemon import AgentDaemon

        daemon = await AgentDaemon.create(settings, log)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, daemon.stop)
        try:
            summary = await daemon.run()
        finally:
            await daemon.close()
        sys.stdout.write(json.dumps(asdict(summary)) + "\n")
        sys.stdout.flush()
        log.info("agent_stopped", rounds=summary.rounds_completed)
        return 1 if summary.errors and summary.rounds_completed == 0 else 0

    try:
        import uvloop

        return uvloop.run(main())
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        return asyncio.run(main())


def _label(settings: AgentSettings) -> str:
    from peerlm.pki.identity import identity_from_certificate_pem

    if settings.tls.cert is None:
        return f"spiffe://{settings.federation}/agent/(insecure-dev)"
    try:
        return identity_from_certificate_pem(settings.tls.cert.read_bytes()).spiffe_uri
    except (OSError, ValueError):
        return f"(unreadable certificate {settings.tls.cert})"
