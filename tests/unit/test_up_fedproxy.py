"""`peerlm up --fedproxy`: the flags it refuses (before anything is touched) and the cohort
result it builds from the agents' reports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from peerlm.app.cli import app
from peerlm.app.devfed_fedproxy import OWNER, cohort_names, cohort_summary


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--fedproxy", "--workflow"], "leave out --workflow"),
        (["--fedproxy", "--simulated"], "leave out --simulated"),
        (["--fedproxy", "--overlay"], "leave out --overlay"),
        (["--fedproxy", "--resume"], "leave out --resume"),
        (["--fedproxy", "--protocols", "akd,pmix"], "leave out --protocols"),
        (["--fedproxy", "--reward", "val"], "leave out --reward"),
        (["--fedproxy", "--heterogeneity", "low"], "leave out --heterogeneity"),
        (["--fedproxy", "--overlay", "--resume"], "leave out --overlay, --resume"),
        (["--proxy-ratio", "0.3"], "add --fedproxy"),
        (["--fedproxy", "--proxy-ratio", "1.0"], "[0, 1)"),
        (["--fedproxy", "--proxy-ratio", "-0.1"], "[0, 1)"),
        (["--fedproxy", "--family", "gtp2"], "unknown family"),
        (["--round-deadline", "30"], "add --fedproxy"),
        (["--fedproxy", "--round-deadline", "0"], "must be positive"),
        (["--fedproxy", "-n", "1"], "-n"),  # an owner needs at least one member
    ],
)
def test_a_flag_that_makes_no_sense_with_fedproxy_is_refused_before_anything_is_touched(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    state = tmp_path / "fed"
    (state / "agents" / OWNER).mkdir(parents=True)
    db = state / "cpm.db"
    db.write_bytes(b"bandit")
    result = CliRunner().invoke(app, ["up", "--state-dir", str(state), *flags])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()), result.output
    assert db.read_bytes() == b"bandit"
    assert (state / "agents" / OWNER).is_dir()
    assert not (state / "pki").exists()


def test_the_cohort_is_the_owner_and_its_members() -> None:
    assert cohort_names(3) == [OWNER, "member-1", "member-2"]


def _merge(round_: int, merged: list[str], missing: list[str] = [], **refused: str) -> Any:  # noqa: B006
    return {
        "round": round_,
        "outcome": "complete" if not missing and not refused else "partial",
        "merged": merged,
        "missing": missing,
        "refused": refused,
    }


def test_the_summary_names_the_rounds_merged_without_a_member_and_checks_its_proxies() -> None:
    """member-2 died in round 2 (missing at the deadline) and was not there in round 3
    (refused by the transfer); member-1 pulled rounds 1-4, one of which it got other bits
    of than the owner published (a digest that differs is not counted)."""
    owner = {
        "name": OWNER,
        "errors": [],
        "fedproxy": {
            "role": "owner",
            "rounds": 3,
            "proxy_sha256": {"1": "a", "2": "b", "3": "c", "4": "d"},
            "merges": [
                _merge(1, ["member-1", "member-2"]),
                _merge(2, ["member-1"], ["member-2"]),
                _merge(3, ["member-1"], **{"member-2": "transfer_unavailable"}),
            ],
            "heldout_texts": 8,
            "heldout_before": 2.0,
            "heldout_after": 1.5,
            "kept_blocks": [0, 3],
            "source_layers": 4,
        },
    }
    m1 = {
        "name": "member-1",
        "errors": [],
        "fedproxy": {
            "rounds": 3,
            "bytes_received": 40,
            "bytes_sent": 30,
            "heldout_before": 3.0,
            "heldout_after": 2.5,
            "proxy_sha256": {"1": "a", "2": "b", "3": "x", "4": "d"},
        },
    }
    m2 = {"name": "member-2", "errors": ["killed"], "fedproxy": {}}
    cohort = cohort_summary([owner, m1, m2])
    assert cohort["rounds"] == 3 and cohort["kept_blocks"] == [0, 3]
    assert (cohort["owner_heldout_before"], cohort["owner_heldout_after"]) == (2.0, 1.5)
    first, second = cohort["members"]
    assert first["merged_rounds"] == [1, 2, 3] and first["absent"] == []
    assert (first["proxies_pulled"], first["proxies_as_published"]) == (4, 3)
    assert (first["bytes_down"], first["bytes_up"]) == (40, 30)
    assert second["merged_rounds"] == [1]
    assert second["absent"] == ["2: deadline", "3: transfer_unavailable"]
    assert second["proxies_pulled"] == 0 and second["errors"] == ["killed"]
