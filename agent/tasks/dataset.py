"""Problems, JSONL files, the non-IID client split, the transfer set and federation data.

A federation's data is built from the task bank (:mod:`peerlm.agent.tasks.bank`) in one
deterministic pass (:func:`build_federation_data`); see ``docs/tasks.md`` for the layout.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from peerlm.agent.tasks.bank import CATEGORIES, function_key, generate_bank, public_problems
from peerlm.agent.tasks.world import (
    Slice,
    World,
    WorldSpec,
    assign_skills,
    weighted_interleave,
)

from peerlm.atomic_file import write_atomic

__all__ = [
    "DEFAULT_MIN_PER_CLIENT",
    "MANIFEST_FORMAT",
    "MAX_FIELD_BYTES",
    "PROBLEM_FIELDS",
    "Manifest",
    "Problem",
    "build_federation_data",
    "category_histogram",
    "category_index",
    "dirichlet_partition",
    "problem_slices",
    "read_jsonl",
    "read_manifest",
    "split_validation",
    "transfer_set",
    "transfer_set_sha256",
    "write_jsonl",
]

PROBLEM_FIELDS = ("task_id", "category", "prompt", "reference", "tests", "entry_point")
#: Largest accepted field, in UTF-8 bytes: far above any real problem, small enough that a
#: hostile file cannot make a reader hold gigabytes.
MAX_FIELD_BYTES = 64 * 1024
# A JSON line holds six fields; escaping can grow text up to 6x (\uXXXX).
_MAX_LINE_BYTES = 6 * len(PROBLEM_FIELDS) * MAX_FIELD_BYTES + 4096
DEFAULT_MIN_PER_CLIENT = 8
MANIFEST_FORMAT = 2


@dataclass(frozen=True)
class Problem:
    """One code-generation problem.

    ``prompt`` is a function signature and docstring (for the bank: ending in a newline and
    four spaces, so a model continues with the body); ``prompt + reference`` is the complete
    function; ``tests`` is a program of asserts run after it (:meth:`program`).
    """

    task_id: str
    category: str
    prompt: str
    reference: str
    tests: str
    entry_point: str

    def __post_init__(self) -> None:
        for name in PROBLEM_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"field {name!r} must be a string, not {type(value).__name__}")
            size = len(value.encode("utf-8", "surrogatepass"))
            if size > MAX_FIELD_BYTES:
                raise ValueError(f"field {name!r} is {size} bytes; the limit is {MAX_FIELD_BYTES}")
        if not self.task_id:
            raise ValueError("field 'task_id' must not be empty")
        if not self.entry_point.isidentifier():
            raise ValueError(f"field 'entry_point' is not an identifier: {self.entry_point!r}")

    def program(self, completion: str) -> str:
        """The program the sandbox runs: prompt, completion, then the tests."""
        return self.prompt + completion + "\n" + self.tests

    def to_dict(self) -> dict[str, str]:
        """The problem as a JSON-ready mapping of its six fields."""
        return {name: getattr(self, name) for name in PROBLEM_FIELDS}

    @classmethod
    def from_dict(cls, obj: object) -> Problem:
        """Validate a decoded JSON object; ``ValueError`` names the first problem found."""
        if not isinstance(obj, Mapping):
            raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
        missing = [name for name in PROBLEM_FIELDS if name not in obj]
        if missing:
            raise ValueError(f"missing field(s): {', '.join(missing)}")
        unknown = sorted(str(key) for key in obj if key not in PROBLEM_FIELDS)
        if unknown:
            raise ValueError(f"unknown field(s): {', '.join(unknown)}")
        try:
            return cls(**{name: obj[name] for name in PROBLEM_FIELDS})
        except TypeError as exc:
            raise ValueError(str(exc)) from None

    def to_json(self) -> str:
        """One line of JSON: sorted keys, no spaces, non-ASCII kept as UTF-8."""
        return json.dumps(self.to_dict(), sort_keys=True, ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Problem:
        """Parse :meth:`to_json` output (``ValueError`` on anything else)."""
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"invalid JSON: {exc}") from None
        return cls.from_dict(obj)


# ------------------------------------------------------------------------------- JSONL


def read_jsonl(path: str | os.PathLike[str]) -> list[Problem]:
    """Read one :class:`Problem` per non-blank line.

    Raises ``ValueError("<path>:<line>: <reason>")`` for invalid UTF-8 or JSON, a missing,
    unknown or non-string field, or a field over :data:`MAX_FIELD_BYTES`.
    """
    problems: list[Problem] = []
    with open(path, "rb") as handle:
        lineno = 0
        while True:
            raw = handle.readline(_MAX_LINE_BYTES + 1)
            if not raw:
                break
            lineno += 1
            if len(raw) > _MAX_LINE_BYTES:
                raise ValueError(f"{path}:{lineno}: line longer than {_MAX_LINE_BYTES} bytes")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not UTF-8 ({exc.reason})") from None
            if not text.strip():
                continue
            try:
                problems.append(Problem.from_json(text))
            except ValueError as exc:
                raise ValueError(f"{path}:{lineno}: {exc}") from None
    return problems


def write_jsonl(path: str | os.PathLike[str], problems: Iterable[Problem]) -> None:
    """Write problems one per line, atomically: a reader sees the old file or the new one."""
    data = "".join(problem.to_json() + "\n" for problem in problems).encode("utf-8")
    _atomic_write(Path(path), data)


def _atomic_write(path: Path, data: bytes) -> None:
    # Task files are data anyone on the host may read (the sandbox's user included).
    write_atomic(path, data, mode=0o644)


# ---------------------------------------------------------------------- categories


def category_index(category: str) -> int:
    """Position of a bank category in the profile's category histogram."""
    try:
        return CATEGORIES.index(category)
    except ValueError:
        raise ValueError(
            f"unknown category {category!r}: expected one of {', '.join(CATEGORIES)}"
        ) from None


def category_histogram(
    problems: Iterable[Problem], *, ignore_unknown: bool = False
) -> npt.NDArray[np.float64]:
    """Normalised counts over :data:`~peerlm.agent.tasks.bank.CATEGORIES`, shape (12,).

    All zeros for no problems. A category outside the bank (e.g. ``humaneval``) raises
    ``ValueError`` unless ``ignore_unknown``, in which case it is left out.
    """
    counts = np.zeros(len(CATEGORIES), dtype=np.float64)
    for problem in problems:
        if ignore_unknown and problem.category not in CATEGORIES:
            continue
        counts[category_index(problem.category)] += 1.0
    total = counts.sum()
    return counts / total if total > 0 else counts


def _category_order(categories: Iterable[str]) -> list[str]:
    present = set(categories)
    known = [c for c in CATEGORIES if c in present]
    return known + sorted(present - set(CATEGORIES))


# ------------------------------------------------------------------------ partitions


def dirichlet_partition(
    problems: Sequence[Problem],
    n_clients: int,
    alpha: float = 0.1,
    seed: int = 0,
    min_per_client: int = DEFAULT_MIN_PER_CLIENT,
) -> list[list[Problem]]:
    """Split problems over clients with per-category Dirichlet(alpha) proportions.

    The standard label-skew split: for each category (in bank order), shuffle its problems
    and cut them at the cumulative sums of proportions drawn from Dirichlet(alpha, ...,
    alpha) over the clients. Small alpha gives each client few categories; large alpha
    gives every client nearly the bank's mix. Deterministic for a seed and input order.

    Repair rule, so every client gets at least ``min_per_client`` problems: while some
    client is short, the smallest client (lowest index on ties) takes one problem from the
    largest client (lowest index on ties), out of that donor's most populous category (bank
    order on ties). Moving from the largest holding keeps the skew as intact as possible.
    Raises ``ValueError`` when there are fewer than ``n_clients * min_per_client`` problems.
    Each client's list is sorted by ``task_id``.
    """
    if n_clients < 1:
        raise ValueError(f"n_clients must be at least 1, got {n_clients}")
    if not (alpha > 0 and np.isfinite(alpha)):
        raise ValueError(f"alpha must be a positive number, got {alpha!r}")
    if min_per_client < 0:
        raise ValueError(f"min_per_client must not be negative, got {min_per_client}")
    if len(problems) < n_clients * min_per_client:
        raise ValueError(
            f"{len(problems)} problems cannot give {n_clients} clients {min_per_client} each; "
            "generate more problems or lower min_per_client"
        )
    rng = np.random.default_rng(seed)
    by_category: dict[str, list[int]] = {}
    for position, problem in enumerate(problems):
        by_category.setdefault(problem.category, []).append(position)
    order = _category_order(by_category)
    # holdings[client][category] = positions of problems
    holdings: list[dict[str, list[int]]] = [{c: [] for c in order} for _ in range(n_clients)]
    for category in order:
        members = np.array(by_category[category])
        shuffled = members[rng.permutation(len(members))]
        share = rng.dirichlet(np.full(n_clients, alpha))
        if not np.all(np.isfinite(share)) or share.sum() <= 0:
            # alpha -> 0 can underflow every gamma draw; the limit is one client taking all.
            share = np.eye(n_clients)[rng.integers(n_clients)]
        cuts = np.floor(np.cumsum(share)[:-1] * len(shuffled)).astype(int)
        for client, part in enumerate(np.split(shuffled, cuts)):
            holdings[client][category] = [int(p) for p in part]
    _repair(holdings, order, min_per_client)
    return [
        sorted(
            (problems[p] for members in client.values() for p in members),
            key=lambda problem: problem.task_id,
        )
        for client in holdings
    ]


def _repair(holdings: list[dict[str, list[int]]], order: list[str], minimum: int) -> None:
    def size(client: int) -> int:
        return sum(len(members) for members in holdings[client].values())

    clients = range(len(holdings))
    while True:
        sizes = [size(c) for c in clients]
        needy = min(clients, key=lambda c: (sizes[c], c))
        if sizes[needy] >= minimum:
            return
        donor = max(clients, key=lambda c: (sizes[c], -c))
        category = max(order, key=lambda cat: (len(holdings[donor][cat]), -order.index(cat)))
        holdings[needy][category].append(holdings[donor][category].pop())


def split_validation(
    problems: Sequence[Problem], fraction: float, seed: int
) -> tuple[list[Problem], list[Problem]]:
    """Split into (train, validation), keeping input order within each part.

    The validation part has ``round(fraction * n)`` problems, but at least one and at most
    ``n - 1`` when ``n >= 2`` and ``fraction > 0``, so neither part is empty needlessly.
    """
    if not 0 <= fraction < 1:
        raise ValueError(f"fraction must be in [0, 1), got {fraction!r}")
    n = len(problems)
    n_val = round(fraction * n)
    if fraction > 0 and n >= 2:
        n_val = min(max(n_val, 1), n - 1)
    chosen = set(np.random.default_rng(seed).permutation(n)[:n_val].tolist())
    train = [p for i, p in enumerate(problems) if i not in chosen]
    val = [p for i, p in enumerate(problems) if i in chosen]
    return train, val


# ---------------------------------------------------------------------- transfer set


def transfer_set(problems: Iterable[Problem]) -> list[str]:
    """The public transfer set X_u: the prompts of the given problems, in order."""
    return [problem.prompt for problem in problems]


def transfer_set_sha256(prompts: Sequence[str]) -> str:
    """SHA-256 (hex) pinning a transfer set.

    Canonical encoding: the prompts as one JSON array, in order (teacher predictions are
    matched to prompts by position), UTF-8, ``ensure_ascii=False``, separators ``,`` and
    ``:`` with no spaces.
    """
    encoded = json.dumps(list(prompts), ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(encoded.encode("utf-8", "surrogatepass")).hexdigest()


# -------------------------------------------------------------------- federation data


@dataclass(frozen=True)
class Manifest:
    """``manifest.json`` of a federation data directory (see ``docs/tasks.md``).

    ``spec`` is the :class:`~peerlm.agent.tasks.world.WorldSpec` the data were built with
    and ``world`` the resulting layout (each client's own skills), from which
    :meth:`World.slice_of <peerlm.agent.tasks.world.World.slice_of>` gives every test
    problem's slice for a client.
    """

    seed: int
    alpha: float
    n_clients: int
    val_fraction: float
    min_per_client: int
    categories: tuple[str, ...]
    transfer_sha256: str
    test_size: int
    transfer_size: int
    client_sizes: tuple[tuple[int, int], ...]  # (train, val) per client
    files: tuple[tuple[str, str], ...]  # (relative path, sha256), sorted by path
    spec: WorldSpec
    world: World
    format: int = MANIFEST_FORMAT

    def parameters(self) -> dict[str, Any]:
        """The arguments that produced this data (what makes a rebuild identical)."""
        return {
            "seed": self.seed,
            "alpha": self.alpha,
            "n_clients": self.n_clients,
            "val_fraction": self.val_fraction,
            "min_per_client": self.min_per_client,
            "spec": self.spec.to_dict(),
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, as written to ``manifest.json``."""
        return {
            "format": self.format,
            **self.parameters(),
            "categories": list(self.categories),
            "transfer_sha256": self.transfer_sha256,
            "world": self.world.to_dict(),
            "sizes": {
                "test": self.test_size,
                "transfer": self.transfer_size,
                "clients": [{"train": t, "val": v} for t, v in self.client_sizes],
            },
            "files": dict(self.files),
        }

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Manifest:
        """Inverse of :meth:`to_dict`; ``ValueError`` if the object does not fit."""
        try:
            if obj["format"] != MANIFEST_FORMAT:
                raise ValueError(
                    f"unsupported manifest format {obj['format']!r} (this peerlm writes "
                    f"{MANIFEST_FORMAT}; rebuild the data with --force)"
                )
            return cls(
                seed=int(obj["seed"]),
                alpha=float(obj["alpha"]),
                n_clients=int(obj["n_clients"]),
                val_fraction=float(obj["val_fraction"]),
                min_per_client=int(obj["min_per_client"]),
                categories=tuple(str(c) for c in obj["categories"]),
                transfer_sha256=str(obj["transfer_sha256"]),
                test_size=int(obj["sizes"]["test"]),
                transfer_size=int(obj["sizes"]["transfer"]),
                client_sizes=tuple(
                    (int(c["train"]), int(c["val"])) for c in obj["sizes"]["clients"]
                ),
                files=tuple(sorted((str(k), str(v)) for k, v in obj["files"].items())),
                spec=WorldSpec.from_dict(obj["spec"]),
                world=World.from_dict(obj["world"]),
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"malformed manifest: {exc!r}") from None


def read_manifest(out_dir: str | os.PathLike[str]) -> Manifest:
    """Load ``out_dir/manifest.json`` (``ValueError`` if malformed)."""
    path = Path(out_dir) / "manifest.json"
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a JSON object")
    try:
        return Manifest.from_dict(obj)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def build_federation_data(
    out_dir: str | os.PathLike[str],
    n_clients: int,
    alpha: float = 0.1,
    seed: int = 0,
    *,
    world: WorldSpec | None = None,
    val_fraction: float = 0.2,
    min_per_client: int = DEFAULT_MIN_PER_CLIENT,
    overwrite: bool = False,
) -> Manifest:
    """Generate the bank and write a federation's data under ``out_dir``.

    ``world`` (default :class:`~peerlm.agent.tasks.world.WorldSpec`: four private
    categories, one expert each) says which categories are private and who holds them;
    ``alpha`` is used by its ``dirichlet`` layout only. Per category, the first
    ``test_per_category`` problems (after a seeded shuffle) go to the test set, the next
    ``transfer_per_<kind>`` to the transfer set, the rest to the private pool: a private
    category's pool goes to its experts only, a public category's is dealt evenly to all
    clients. Each client's share is split into train and validation.

    Layout: ``clients/<i>/train.jsonl`` and ``val.jsonl``, ``transfer.jsonl`` (the public
    transfer set X_u as full problems: the prompts are what teachers decode on and what
    ``transfer_sha256`` pins, the tests measure pass@1 on X_u), ``test.jsonl`` and
    ``manifest.json``, written last. Test and transfer sets are interleaved so that every
    prefix covers the categories in proportion. No function of the public pre-training
    corpus (:func:`~peerlm.agent.tasks.bank.public_problems`) is in any part. The same
    arguments write byte-identical files. A directory built with other arguments is refused
    unless ``overwrite``, which first removes its ``clients/``.
    """
    spec = world or WorldSpec()
    out = Path(out_dir)
    if not (alpha > 0 and np.isfinite(alpha)):
        raise ValueError(f"alpha must be a positive number, got {alpha!r}")
    # Never a function of the public pre-training corpus (tiny models saw those).
    public = {function_key(p) for p in public_problems()}
    counts = {c: spec.per_category(c) for c in CATEGORIES}
    problems = generate_bank(counts, seed, exclude=public)
    rng = np.random.default_rng(seed)
    by_category: dict[str, list[Problem]] = {c: [] for c in CATEGORIES}
    for problem in problems:
        by_category[problem.category].append(problem)
    tests: list[list[Problem]] = []
    transfers: list[list[Problem]] = []
    pools: dict[str, list[Problem]] = {}
    for category in CATEGORIES:
        members = by_category[category]
        shuffled = [members[i] for i in rng.permutation(len(members))]
        n_test, n_transfer = spec.test_per_category, spec.transfer_per_category(category)
        tests.append(shuffled[:n_test])
        transfers.append(shuffled[n_test : n_test + n_transfer])
        pools[category] = shuffled[n_test + n_transfer :]
    test = weighted_interleave(tests)
    transfer = weighted_interleave(transfers)

    layout, shares = assign_skills(
        spec,
        n_clients,
        {c: len(pools[c]) for c in spec.private_categories},
        alpha=alpha,
        seed=seed,
    )
    holdings: list[list[Problem]] = [[] for _ in range(n_clients)]
    for category in spec.private_categories:
        for client, positions in enumerate(shares[category]):
            holdings[client].extend(pools[category][p] for p in positions)
    offset = 0
    for category in spec.public_categories:
        # Dealt round-robin, starting where the last category stopped: sizes stay even.
        for j, problem in enumerate(pools[category]):
            holdings[(offset + j) % n_clients].append(problem)
        offset = (offset + len(pools[category])) % n_clients
    for client, held in enumerate(holdings):
        if len(held) < min_per_client:
            raise ValueError(
                f"client {client} would hold {len(held)} problems, fewer than min_per_client "
                f"= {min_per_client}; raise per_public_category or lower min_per_client"
            )
    clients = [sorted(held, key=lambda p: p.task_id) for held in holdings]
    # A distinct, seed-derived stream per client (7919: any prime keeps them apart).
    splits = [
        split_validation(client, val_fraction, seed * 7919 + i) for i, client in enumerate(clients)
    ]

    existing = out / "manifest.json"
    params: dict[str, Any] = {
        "seed": seed,
        "alpha": float(alpha),
        "n_clients": n_clients,
        "val_fraction": float(val_fraction),
        "min_per_client": min_per_client,
        "spec": spec.to_dict(),
    }
    if existing.exists():
        try:
            previous: dict[str, Any] | None = read_manifest(out).parameters()
        except ValueError:
            previous = None  # an older format: different arguments by definition
        if previous != params:
            if not overwrite:
                raise FileExistsError(
                    f"{out} holds data built with {previous}; "
                    "pass overwrite=True (--force) to replace it"
                )
            shutil.rmtree(out / "clients", ignore_errors=True)
        existing.unlink()  # an interrupted rebuild must not leave a valid-looking manifest

    contents: dict[str, list[Problem]] = {"test.jsonl": test, "transfer.jsonl": transfer}
    for i, (train, val) in enumerate(splits):
        contents[f"clients/{i}/train.jsonl"] = train
        contents[f"clients/{i}/val.jsonl"] = val
    files: list[tuple[str, str]] = []
    for relative, items in contents.items():
        write_jsonl(out / relative, items)
        files.append((relative, _sha256_file(out / relative)))
    manifest = Manifest(
        seed=seed,
        alpha=float(alpha),
        n_clients=n_clients,
        val_fraction=float(val_fraction),
        min_per_client=min_per_client,
        categories=CATEGORIES,
        transfer_sha256=transfer_set_sha256(transfer_set(transfer)),
        test_size=len(test),
        transfer_size=len(transfer),
        client_sizes=tuple((len(train), len(val)) for train, val in splits),
        files=tuple(sorted(files)),
        spec=spec,
        world=layout,
    )
    text = json.dumps(manifest.to_dict(), indent=2, sort_keys=True) + "\n"
    _atomic_write(existing, text.encode("utf-8"))
    return manifest


def problem_slices(world: World, client: int, problems: Iterable[Problem]) -> list[Slice]:
    """The slice (``own``, ``lacked``, ``public``) of each problem for ``client``."""
    return [world.slice_of(client, p.category) for p in problems]


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
