"""The backup command docs/operations.md gives copies a live WAL database consistently."""

from __future__ import annotations

import re
import shlex
import sqlite3
import subprocess
import sys
from pathlib import Path

from tests.deploy_tools import ROOT


def _documented_command() -> list[str]:
    ops = (ROOT / "docs" / "operations.md").read_text()
    block = re.search(r"<!-- backup-command -->\n```bash\n(.+?)\n```", ops, flags=re.S)
    assert block is not None, "docs/operations.md lost its backup command"
    return shlex.split(block.group(1))


def test_backup_of_a_live_wal_database_holds_every_committed_row(tmp_path: Path) -> None:
    db = tmp_path / "cpm.db"
    live = sqlite3.connect(db)
    live.execute("PRAGMA journal_mode=WAL")
    live.execute("PRAGMA wal_autocheckpoint=0")  # committed rows stay in the -wal file
    live.execute("CREATE TABLE rewards(id INTEGER PRIMARY KEY, value REAL)")
    live.executemany("INSERT INTO rewards(value) VALUES (?)", [(i / 10,) for i in range(500)])
    live.commit()
    assert (tmp_path / "cpm.db-wal").stat().st_size > 0
    # A plain copy of the main file alone misses what sits in the WAL.
    naive = tmp_path / "naive.db"
    naive.write_bytes(db.read_bytes())
    assert "rewards" not in {r[0] for r in sqlite3.connect(naive).execute(
        "SELECT name FROM sqlite_master")}  # fmt: skip

    words = _documented_command()
    assert words[0] == "python3"
    argv = [sys.executable, *words[1:-2], str(db), str(tmp_path / "cpm-backup.db")]
    subprocess.run(argv, check=True, cwd=tmp_path)
    live.close()
    backup = sqlite3.connect(tmp_path / "cpm-backup.db")
    assert backup.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    assert backup.execute("SELECT count(*), sum(value) FROM rewards").fetchone() == (500, 12475.0)
