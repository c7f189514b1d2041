"""Which test problems measure what, per client: own skills, lacked skills, public.

Every metric of ``peerlm run-experiment`` is reported on three slices of the global test
set, per client (the world's layout, :class:`~peerlm.agent.tasks.world.World`):

* **own**: the private categories the client holds training data of (its skills);
* **lacked**: the private categories it holds none of; here only collaboration can help,
  so this is the slice where strategies should differ;
* **public**: the public categories, those of the pre-training corpus and of everybody's
  reach.

A unit of the statistics is a (client, test problem) pair; a slice's units are those whose
problem's category falls in that slice for that client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from peerlm.agent import World

__all__ = ["SLICES", "ClientSlices", "slices_of_world"]

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


def slices_of_world(world: World, client: int) -> ClientSlices:
    """``client``'s slices in ``world``."""
    if not 0 <= client < world.n_clients:
        raise ValueError(f"client {client} is not in a world of {world.n_clients} clients")
    return ClientSlices(
        frozenset(world.own(client)),
        frozenset(world.lacked(client)),
        frozenset(world.public_categories),
    )
