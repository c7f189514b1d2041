"""Which test problems measure what, per client: own skills, lacked skills, public.

Every metric of ``peerlm run-experiment`` is reported on three slices of the global test
set, per client:

* **own**: the private categories the client holds training data of (its skills);
* **lacked**: the private categories it holds no (or next to no) data of; here only
  collaboration can help, so this is the slice where strategies should differ;
* **public**: the public categories, those of the pre-training corpus and of everybody's
  reach.

The split into public and private categories belongs to the world (the federation data);
:func:`public_categories` reads it from the data's manifest when the world declares one
(``public_categories`` in ``manifest.json``) and otherwise treats every category as
private, which is the old world: every model saw every category in pre-training, so
"public" is empty and own/lacked follow the Dirichlet split alone.

A client *owns* a private category when it holds at least ``own_min`` of its training
problems and at least ``own_share`` of them: a Dirichlet(0.1) split leaves stray single
problems with most clients, which make no skill. Everything private that is not owned is
lacked.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SLICES", "ClientSlices", "client_slices", "public_categories"]

#: Slice names, in report order.
SLICES: tuple[str, ...] = ("own", "lacked", "public")


@dataclass(frozen=True)
class ClientSlices:
    """The categories of each slice for one client."""

    own: frozenset[str]
    lacked: frozenset[str]
    public: frozenset[str]

    def of(self, category: str) -> str | None:
        """The slice ``category`` falls in for this client (``None``: none of them)."""
        for name in SLICES:
            if category in getattr(self, name):
                return name
        return None

    def to_dict(self) -> dict[str, list[str]]:
        """JSON form, categories sorted."""
        return {name: sorted(getattr(self, name)) for name in SLICES}


def client_slices(
    train_counts: Mapping[str, int],
    categories: Sequence[str],
    public: Collection[str],
    *,
    own_min: int = 3,
    own_share: float = 0.1,
) -> ClientSlices:
    """The slices of a client with ``train_counts`` training problems per category."""
    unknown = set(public) - set(categories)
    if unknown:
        raise ValueError(f"public categories not in the world: {sorted(unknown)}")
    total = sum(train_counts.values())
    private = [c for c in categories if c not in public]
    own = {
        c
        for c in private
        if train_counts.get(c, 0) >= own_min and train_counts.get(c, 0) >= own_share * total
    }
    return ClientSlices(frozenset(own), frozenset(set(private) - own), frozenset(public))


def public_categories(data_dir: Path) -> tuple[str, ...]:
    """The world's public categories from ``data_dir/manifest.json`` (empty if it declares
    none: the old world, where every category was in pre-training)."""
    path = data_dir / "manifest.json"
    if not path.is_file():
        return ()
    manifest = json.loads(path.read_text())
    declared = manifest.get("public_categories")
    if declared is None:
        declared = manifest.get("parameters", {}).get("public_categories")
    if declared is None:
        return ()
    if not isinstance(declared, list) or not all(isinstance(c, str) for c in declared):
        raise ValueError(f"{path}: public_categories must be a list of category names")
    return tuple(declared)
