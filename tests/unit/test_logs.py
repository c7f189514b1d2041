"""Every log line of a process carries component and identity, library lines included."""

from __future__ import annotations

import json
import subprocess
import sys


def test_structlog_and_stdlib_lines_carry_component_and_identity() -> None:
    code = (
        "import logging, warnings\n"
        "from peerlm.logs import configure_logging\n"
        "log = configure_logging('cpm', 'spiffe://acme/cpm/cpm', 'json', 'info')\n"
        "log.info('ours', x=1)\n"
        "logging.getLogger('grpc._cython').warning('library says %s', 'hi')\n"
        "logging.getLogger('transformers').info('too chatty: not shown')\n"
        "warnings.warn('deprecated thing')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stderr.splitlines() if line.strip()]
    assert [line["event"].split(":")[0] for line in lines][:2] == ["ours", "library says hi"]
    for line in lines:
        assert line["component"] == "cpm" and line["identity"] == "spiffe://acme/cpm/cpm"
    library = lines[1]
    assert library["logger"] == "grpc._cython" and library["level"] == "warning"
    assert not any("too chatty" in line["event"] for line in lines)
    assert any("deprecated thing" in line["event"] for line in lines)
