"""The world a federation learns in: public and private categories, and who holds which skill.

KNEXA-FL's claim is that organisations with *complementary* skills end up with better
models by collaborating. The bank's twelve categories are split in two:

- **public** categories are known to everyone: they are in the tiny models' pre-training
  corpus (:func:`peerlm.agent.tasks.bank.public_problems`), in the transfer set and in every
  client's private data;
- **private** categories are absent from pre-training; each lives in the private data of a
  few clients only (its *experts*). A client's *own* skills are the private categories it
  holds; the private categories it does not hold are the skills it *lacks*, where only
  collaboration can help.

:class:`WorldSpec` says how the world is laid out (which categories are private, how many
experts share a skill, how many clients have none, or a Dirichlet(alpha) split instead);
:func:`assign_skills` turns it into a :class:`World` for a number of clients. The test set
covers every category; :meth:`World.slice_of` tells which of the three slices (``own``,
``lacked``, ``public``) a category is for a client. See ``docs/tasks.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np
from peerlm.agent.tasks.bank import CATEGORIES

__all__ = [
    "DEFAULT_PRIVATE_CATEGORIES",
    "SLICES",
    "Layout",
    "Slice",
    "World",
    "WorldSpec",
    "assign_skills",
    "weighted_interleave",
]

Layout = Literal["experts", "dirichlet"]
Slice = Literal["own", "lacked", "public"]
#: The three evaluation slices, in report order.
SLICES: tuple[Slice, ...] = ("own", "lacked", "public")

#: Private by default: four categories whose code is unlike the public ones' (dict
#: comprehensions and ``.get``, f-strings and padding, sequences from ``range``, boolean
#: expressions), so a model that never saw them cannot borrow them from a public category.
DEFAULT_PRIVATE_CATEGORIES: tuple[str, ...] = ("dict", "format", "boolean", "sequence")


@dataclass(frozen=True)
class WorldSpec:
    """How a federation's world is laid out (all counts are per category).

    ``layout="experts"``: private category k (in :data:`private_categories` order) goes to
    ``experts_per_skill`` consecutive skilled clients starting at client k (mod the number
    of skilled clients); its private problems are split evenly between them. The last
    ``unskilled_clients`` clients hold no private category. ``layout="dirichlet"``: each
    private category is split over the skilled clients with Dirichlet(alpha) proportions
    (the paper's label skew); a client *has* the skill when it holds at least
    ``skill_share`` of the category's private problems. Public categories' private problems
    are dealt out evenly (IID) to every client in both layouts: everybody knows them.
    """

    layout: Layout = "experts"
    private_categories: tuple[str, ...] = DEFAULT_PRIVATE_CATEGORIES
    experts_per_skill: int = 1
    unskilled_clients: int = 0
    skill_share: float = 0.2
    per_private_category: int = 200
    per_public_category: int = 60
    test_per_category: int = 20
    transfer_per_private: int = 24
    transfer_per_public: int = 4

    def __post_init__(self) -> None:
        if self.layout not in ("experts", "dirichlet"):
            raise ValueError(f"layout must be 'experts' or 'dirichlet', not {self.layout!r}")
        unknown = [c for c in self.private_categories if c not in CATEGORIES]
        if unknown:
            raise ValueError(
                f"unknown private categories {unknown}: expected some of {', '.join(CATEGORIES)}"
            )
        if len(set(self.private_categories)) != len(self.private_categories):
            raise ValueError("private categories must not repeat")
        if len(self.private_categories) == len(CATEGORIES):
            raise ValueError("at least one category must stay public")
        for name in (
            "experts_per_skill",
            "per_private_category",
            "per_public_category",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        for name in ("unskilled_clients", "test_per_category", "transfer_per_private",
                     "transfer_per_public"):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")
        if not 0 < self.skill_share <= 1:
            raise ValueError("skill_share must be in (0, 1]")
        for kind, total, transfer in (
            ("private", self.per_private_category, self.transfer_per_private),
            ("public", self.per_public_category, self.transfer_per_public),
        ):
            if self.test_per_category + transfer >= total:
                raise ValueError(
                    f"test_per_category + transfer_per_{kind} = "
                    f"{self.test_per_category + transfer} leaves no private data out of "
                    f"per_{kind}_category = {total}; raise per_{kind}_category"
                )

    @property
    def public_categories(self) -> tuple[str, ...]:
        """The categories that are not private, in bank order."""
        return tuple(c for c in CATEGORIES if c not in self.private_categories)

    def per_category(self, category: str) -> int:
        """Problems generated for ``category`` (test + transfer + private pool)."""
        if category in self.private_categories:
            return self.per_private_category
        return self.per_public_category

    def transfer_per_category(self, category: str) -> int:
        """Transfer prompts of ``category``."""
        if category in self.private_categories:
            return self.transfer_per_private
        return self.transfer_per_public

    @property
    def test_size(self) -> int:
        """Problems in the test set: ``test_per_category`` of every category."""
        return self.test_per_category * len(CATEGORIES)

    @property
    def transfer_size(self) -> int:
        """Prompts in the transfer set X_u."""
        return sum(self.transfer_per_category(c) for c in CATEGORIES)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the private categories as a list)."""
        out = asdict(self)
        out["private_categories"] = list(self.private_categories)
        return out

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> WorldSpec:
        """Inverse of :meth:`to_dict`; ``ValueError`` on unknown or malformed fields."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(str(k) for k in obj if k not in known)
        if unknown:
            raise ValueError(f"unknown world field(s): {', '.join(unknown)}")
        fields = dict(obj)
        if "private_categories" in fields:
            fields["private_categories"] = tuple(str(c) for c in fields["private_categories"])
        try:
            return cls(**fields)
        except TypeError as exc:
            raise ValueError(str(exc)) from None


@dataclass(frozen=True)
class World:
    """A laid-out world: the categories and each client's own private skills."""

    public_categories: tuple[str, ...]
    private_categories: tuple[str, ...]
    skills: tuple[tuple[str, ...], ...]  # per client, in private_categories order

    @property
    def n_clients(self) -> int:
        """Number of clients."""
        return len(self.skills)

    def own(self, client: int) -> tuple[str, ...]:
        """Private categories ``client`` holds."""
        return self.skills[client]

    def lacked(self, client: int) -> tuple[str, ...]:
        """Private categories ``client`` does not hold (only collaboration can teach them)."""
        return tuple(c for c in self.private_categories if c not in self.skills[client])

    def slice_of(self, client: int, category: str) -> Slice:
        """Which evaluation slice ``category`` is for ``client``."""
        if category in self.public_categories:
            return "public"
        if category in self.skills[client]:
            return "own"
        if category in self.private_categories:
            return "lacked"
        raise ValueError(f"category {category!r} is not in this world")

    def slices(self, client: int) -> dict[Slice, tuple[str, ...]]:
        """The categories of each slice for ``client`` (a slice may be empty)."""
        return {"own": self.own(client), "lacked": self.lacked(client),
                "public": self.public_categories}  # fmt: skip

    def experts(self, category: str) -> tuple[int, ...]:
        """The clients holding private ``category``."""
        return tuple(i for i, own in enumerate(self.skills) if category in own)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "public_categories": list(self.public_categories),
            "private_categories": list(self.private_categories),
            "skills": [list(s) for s in self.skills],
        }

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> World:
        """Inverse of :meth:`to_dict` (``ValueError`` if malformed)."""
        try:
            return cls(
                public_categories=tuple(str(c) for c in obj["public_categories"]),
                private_categories=tuple(str(c) for c in obj["private_categories"]),
                skills=tuple(tuple(str(c) for c in s) for s in obj["skills"]),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed world: {exc!r}") from None


def assign_skills(
    spec: WorldSpec,
    n_clients: int,
    private_counts: Mapping[str, int],
    *,
    alpha: float = 0.1,
    seed: int = 0,
) -> tuple[World, dict[str, list[list[int]]]]:
    """Lay out ``spec`` for ``n_clients``: the world and, per private category, which of its
    private-pool positions (0 .. count-1, already shuffled by the caller) go to each client.
    """
    if n_clients < 1:
        raise ValueError(f"n_clients must be at least 1, got {n_clients}")
    skilled = n_clients - spec.unskilled_clients
    if skilled < 1:
        raise ValueError(
            f"unskilled_clients = {spec.unskilled_clients} leaves no skilled client "
            f"out of {n_clients}"
        )
    if spec.layout == "experts" and spec.experts_per_skill > skilled:
        raise ValueError(
            f"experts_per_skill = {spec.experts_per_skill} exceeds the {skilled} skilled clients"
        )
    shares: dict[str, list[list[int]]] = {}
    rng = np.random.default_rng(seed)
    for k, category in enumerate(spec.private_categories):
        count = private_counts[category]
        parts: list[list[int]] = [[] for _ in range(n_clients)]
        if spec.layout == "experts":
            holders = [(k + j) % skilled for j in range(spec.experts_per_skill)]
            for holder, chunk in zip(
                holders, np.array_split(np.arange(count), len(holders)), strict=True
            ):
                parts[holder] = [int(p) for p in chunk]
        else:
            share = rng.dirichlet(np.full(skilled, alpha))
            if not np.all(np.isfinite(share)) or share.sum() <= 0:
                share = np.eye(skilled)[rng.integers(skilled)]
            cuts = np.floor(np.cumsum(share)[:-1] * count).astype(int)
            for client, chunk in enumerate(np.split(np.arange(count), cuts)):
                parts[client] = [int(p) for p in chunk]
        shares[category] = parts
    skills = tuple(
        tuple(
            c
            for c in spec.private_categories
            if shares[c][i]
            and len(shares[c][i]) >= spec.skill_share * max(1, private_counts[c]) - 1e-9
        )
        for i in range(n_clients)
    )
    world = World(spec.public_categories, spec.private_categories, skills)
    return world, shares


def weighted_interleave(columns: Sequence[Sequence[Any]]) -> list[Any]:
    """Merge columns so that every prefix holds each column in proportion to its length.

    Item j of a column of length n sits at (j + 0.5) / n; ties keep column order. A prefix
    of the transfer set (``--transfer-limit``) or the test set therefore covers all
    categories in the world's proportions.
    """
    keyed = [
        ((j + 0.5) / len(column), index, item)
        for index, column in enumerate(columns)
        for j, item in enumerate(column)
    ]
    keyed.sort(key=lambda entry: (entry[0], entry[1]))
    return [item for _, _, item in keyed]
