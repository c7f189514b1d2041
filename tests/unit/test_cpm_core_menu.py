"""The CPM core and the protocol menu: declarations validated, stored, and obeyed."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import pytest
from peerlm.services.cpm import MENU, CpmSettings
from peerlm.services.cpm.core import CpmCore, CpmError
from peerlm.services.cpm.store import MemoryCpmStore, SqliteCpmStore
from pydantic import ValidationError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _profile(i: int) -> list[float]:
    return [float(x) for x in np.random.default_rng(i).uniform(0, 1, 32)]


def _menu_core(store: MemoryCpmStore | SqliteCpmStore | None = None) -> CpmCore:
    settings = CpmSettings(protocols=MENU, init=True, directive_ttl_s=60)
    return CpmCore(settings, store or MemoryCpmStore(), Clock())


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"param_space": "x" * 129}, "param_space"),
        ({"param_space": "white space"}, "param_space"),
        ({"protocols": ["akd", "akd"]}, "protocols"),
        ({"protocols": ["Bad"]}, "protocols"),
        ({"protocols": [f"p{k}" for k in range(17)]}, "protocols"),
    ],
)
def test_bad_declarations_are_refused_and_change_nothing(
    kwargs: dict[str, object], reason: str
) -> None:
    c = _menu_core()
    c.submit_profile("a", 1, _profile(0), "h:1", connected=2, param_space="ps-1")
    before = [(p.agent, p.round, p.param_space, p.protocols) for p in c.agents()]
    with pytest.raises(CpmError) as e:
        c.submit_profile("a", 2, _profile(1), "h:1", connected=2, **kwargs)  # type: ignore[arg-type]
    assert (e.value.code, e.value.reason) == ("INVALID_ARGUMENT", reason)
    assert [(p.agent, p.round, p.param_space, p.protocols) for p in c.agents()] == before
    assert c.pending == 1


def test_directives_name_only_admissible_protocols() -> None:
    c = _menu_core()
    spaces = {"a": "ps-1", "b": "ps-1", "c": "ps-2", "d": "ps-2", "e": "", "f": ""}
    for i, (agent, space) in enumerate(spaces.items()):
        c.submit_profile(
            agent, 1, _profile(i), f"h:{i + 1}", connected=6, param_space=space, protocols=MENU
        )
    for _ in range(6):
        match = c.matchmake()
        for d in match.directives:
            same = spaces[d.teacher] and spaces[d.teacher] == spaces[d.student]
            assert d.protocol == "akd" or same, d
            # Reward what is inadmissible across spaces most: the mask still holds.
            c.report_reward(d.student, d.directive_id, 1.0 if d.protocol != "akd" else -1.0)
        for i, (agent, space) in enumerate(spaces.items()):
            c.submit_profile(
                agent, 1, _profile(i), f"h:{i + 1}", connected=6, param_space=space, protocols=MENU
            )


def test_declarations_survive_a_restart_and_old_databases_migrate(tmp_path: Path) -> None:
    db = tmp_path / "cpm.db"
    # A database from before the menu: the profiles table has no declaration columns.
    old = sqlite3.connect(db)
    old.execute(
        "CREATE TABLE profiles (agent TEXT PRIMARY KEY, round INTEGER NOT NULL, "
        "features BLOB NOT NULL, endpoint TEXT NOT NULL, received_at REAL NOT NULL)"
    )
    old.execute(
        "INSERT INTO profiles VALUES ('old', 3, ?, 'h:9', 1.0)",
        (np.zeros(32, "<f8").tobytes(),),
    )
    old.commit()
    old.close()
    store = SqliteCpmStore(db)
    c = _menu_core(store)
    [legacy] = c.agents()
    assert (legacy.agent, legacy.param_space, legacy.protocols) == ("old", "", ())
    c.submit_profile(
        "a", 1, _profile(0), "h:1", connected=2, param_space="ps1:ab", protocols=["akd", "pmix"]
    )
    store.close()
    store = SqliteCpmStore(db)
    c2 = CpmCore(CpmSettings(protocols=MENU, directive_ttl_s=60), store, Clock())
    got = {p.agent: (p.param_space, p.protocols) for p in c2.agents()}
    assert got == {"old": ("", ()), "a": ("ps1:ab", ("akd", "pmix"))}
    store.close()


@pytest.mark.parametrize("protocols", [("h_ties",), ("akd", "lora"), ()])
def test_the_cpm_menu_is_checked_at_start(protocols: tuple[str, ...]) -> None:
    with pytest.raises(ValidationError):
        CpmSettings(protocols=protocols)


def test_the_default_menu_is_akd_only() -> None:
    assert CpmSettings().protocols == ("akd",)
