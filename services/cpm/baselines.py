"""Non-learning pairing policies with the :class:`~.matchmaker.Matchmaker` interface.

Each exposes ``select(profiles) -> list[Pairing]`` and ``observe(pairing, reward) ->
float`` so a benchmark can swap them for the learnt matchmaker. ``observe`` validates
the reward like the matchmaker (``ValueError`` if non-finite or absurd) and returns it
unchanged: nothing is learnt, so there is no normalised value to report.

Their pairings carry ``role="one_way"`` and, as ``context``, the paper's plain
concatenation ``[p_s, p_r]`` (length ``2 d_p``) — informative for logs, never used for
learning. ``ucb`` and ``mean`` hold the policy's own score for the pair (0 for random,
the JS divergence for Hetero-Greedy, the true reward for the oracle).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from peerlm.protocols import DEFAULT_PROTOCOL

from .matching import max_weight_disjoint
from .matchmaker import MAX_TEACHERS_PER_STUDENT, Pairing
from .normalise import check_reward
from .profile import PROFILE_LAYOUT, ProfileLayout, validate_profiles

__all__ = [
    "HeteroGreedyMatchmaker",
    "OracleMatchmaker",
    "RandomMatchmaker",
    "js_divergence",
    "js_divergence_matrix",
]

_ROLE = "one_way"
# Row block for the (rows, N, k) temporaries of the JS matrix (~16 MB at k = 12).
_JS_BLOCK_ELEMENTS = 1 << 21


def _budget(pair_budget: int | None, n: int) -> int:
    return n // 2 if pair_budget is None else max(0, min(pair_budget, n // 2))


def _sorted_matrix(
    profiles: Mapping[str, ArrayLike], dim: int
) -> tuple[list[str], NDArray[np.float64]]:
    if any(not isinstance(a, str) for a in profiles):
        raise ValueError("agent ids must be strings")
    ids = sorted(profiles)
    return ids, validate_profiles(ids, [profiles[a] for a in ids], dim)


def _pairing_context(mat: NDArray[np.float64], s: int, r: int) -> NDArray[np.float64]:
    return np.concatenate([mat[s], mat[r]])


def _make(
    ids: Sequence[str], mat: NDArray[np.float64], s: int, r: int, protocol: str, score: float
) -> Pairing:
    return Pairing(
        sender=ids[s],
        receiver=ids[r],
        protocol=protocol,
        role=_ROLE,
        context=_pairing_context(mat, s, r),
        ucb=score,
        mean=score,
    )


class RandomMatchmaker:
    """Random disjoint pairs with a random direction and protocol (the paper's Random-P2P).

    Seeded: two instances with the same seed return the same sequence of rounds for the
    same profiles. Agents are shuffled from sorted-id order, so the mapping's iteration
    order does not matter.

    ``pairing="per_student"`` is the random counterpart of the
    :class:`~.matchmaker.Matchmaker`'s: every agent, in a random order, is the student of a
    teacher drawn uniformly among the other agents that teach fewer than
    ``teacher_capacity`` students (``None``: any number); ``K_p`` bounds the pairings up
    to ``N``. With ``teachers_per_student`` k > 1 each student draws k distinct teachers
    so (as many as have room), and ``K_p`` bounds the pairings up to ``k N``.
    """

    def __init__(
        self,
        pair_budget: int | None = None,
        protocols: Sequence[str] = (DEFAULT_PROTOCOL,),
        seed: int = 0,
        *,
        profile_dim: int = 32,
        pairing: Literal["disjoint", "per_student"] = "disjoint",
        teacher_capacity: int | None = None,
        teachers_per_student: int = 1,
    ) -> None:
        if not protocols:
            raise ValueError("at least one protocol is required")
        if pairing not in ("disjoint", "per_student"):
            raise ValueError(f"pairing must be 'disjoint' or 'per_student', got {pairing!r}")
        if teacher_capacity is not None and teacher_capacity < 1:
            raise ValueError(f"teacher_capacity must be >= 1, got {teacher_capacity!r}")
        k, most = teachers_per_student, MAX_TEACHERS_PER_STUDENT
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= most:
            raise ValueError(f"teachers_per_student must be an integer in [1, {most}], got {k!r}")
        if teachers_per_student > 1 and pairing != "per_student":
            raise ValueError("teachers_per_student > 1 needs pairing 'per_student'")
        self._pairing = pairing
        self._capacity = teacher_capacity
        self._teachers = int(teachers_per_student)
        self._pair_budget = pair_budget
        self._protocols = tuple(protocols)
        self._rng = np.random.default_rng(seed)
        self._dim = profile_dim

    def select(self, profiles: Mapping[str, ArrayLike]) -> list[Pairing]:
        """``K_p`` disjoint random pairs; the first of each shuffled pair teaches."""
        ids, mat = _sorted_matrix(profiles, self._dim)
        if self._pairing == "per_student":
            return self._per_student(ids, mat)
        budget = _budget(self._pair_budget, len(ids))
        if budget == 0:
            return []
        perm = self._rng.permutation(len(ids))
        protocol = self._rng.integers(0, len(self._protocols), size=budget)
        return [
            _make(
                ids,
                mat,
                int(perm[2 * k]),
                int(perm[2 * k + 1]),
                self._protocols[int(protocol[k])],
                0.0,
            )
            for k in range(budget)
        ]

    def _per_student(self, ids: Sequence[str], mat: NDArray[np.float64]) -> list[Pairing]:
        n = len(ids)
        if n < 2:
            return []
        most = n * self._teachers
        budget = most if self._pair_budget is None else max(0, min(self._pair_budget, most))
        capacity = n if self._capacity is None else self._capacity
        load = np.zeros(n, dtype=np.intp)
        out: list[Pairing] = []
        for r in self._rng.permutation(n).tolist():
            # One teacher at a time, so that with k = 1 the draws are exactly those of a
            # single-teacher round (the same seed gives the same pairs).
            mine: set[int] = set()  # this student's teachers so far
            for _ in range(self._teachers):
                if len(out) == budget:
                    return out
                room = [s for s in range(n) if s != r and load[s] < capacity and s not in mine]
                if not room:
                    break
                s = room[int(self._rng.integers(0, len(room)))]
                mine.add(s)
                load[s] += 1
                protocol = self._protocols[int(self._rng.integers(0, len(self._protocols)))]
                out.append(_make(ids, mat, s, r, protocol, 0.0))
        return out

    def observe(self, pairing: Pairing, reward: float) -> float:
        """Validates ``reward`` and returns it; nothing is learnt."""
        return check_reward(reward)


def js_divergence(p: ArrayLike, q: ArrayLike) -> float:
    """Base-2 Jensen–Shannon divergence of two histograms (normalised first), in [0, 1]."""
    mat = np.vstack([np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)])
    return float(js_divergence_matrix(mat)[0, 1])


def _as_distributions(hist: NDArray[np.float64]) -> NDArray[np.float64]:
    # DP noise can push bins below zero or the sum off 1: clip, then renormalise; an
    # all-zero row carries no information and is read as the uniform distribution.
    h = np.clip(hist, 0.0, None)
    sums = h.sum(axis=1, keepdims=True)
    empty = sums[:, 0] <= 0
    h[empty] = 1.0
    sums[empty] = h.shape[1]
    out: NDArray[np.float64] = h / sums
    return out


def _entropy2(h: NDArray[np.float64]) -> NDArray[np.float64]:
    logs = np.log2(h, out=np.zeros_like(h), where=h > 0)
    ent: NDArray[np.float64] = -(h * logs).sum(axis=-1)
    return ent


def js_divergence_matrix(hist: NDArray[np.float64]) -> NDArray[np.float64]:
    """Pairwise base-2 JS divergence of the rows of ``hist`` (N, k): an (N, N) matrix.

    ``JS(p, q) = H((p + q) / 2) - (H(p) + H(q)) / 2`` with entropies in bits, so it lies
    in [0, 1] (1 for disjoint supports). Rows are clipped at 0 and renormalised; an
    all-zero row counts as uniform.
    """
    h = _as_distributions(np.asarray(hist, dtype=np.float64))
    n, k = h.shape
    ent = _entropy2(h)
    out = np.empty((n, n), dtype=np.float64)
    step = max(1, _JS_BLOCK_ELEMENTS // max(1, n * k))
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        mix = 0.5 * (h[lo:hi, None, :] + h[None, :, :])
        out[lo:hi] = _entropy2(mix) - 0.5 * (ent[lo:hi, None] + ent[None, :])
    np.clip(out, 0.0, 1.0, out=out)
    np.fill_diagonal(out, 0.0)
    return out


class HeteroGreedyMatchmaker:
    """Algorithm 4 (Heuristic-P2P / Hetero-Greedy): maximise data heterogeneity.

    Scores every unordered pair by the base-2 JS divergence of their distribution
    histograms (profile ``[20:32]``), takes disjoint pairs greedily in descending score
    up to ``K_p``, and lets the higher performer teach (performance ``u_i`` = profile
    ``[8]``, the agent's pass@1). Algorithm 4 writes the directed pair as ``(a_s, a_t)``
    with ``a_t = argmax u``; here ``a_t`` is read as the teacher (= ``sender``). Ties —
    in JS or in performance — fall to sorted agent id (the lower id first / teaching),
    so the heuristic is deterministic without a seed.
    """

    def __init__(
        self,
        pair_budget: int | None = None,
        protocol: str = DEFAULT_PROTOCOL,
        profile_dim: int = 32,
        *,
        layout: ProfileLayout = PROFILE_LAYOUT,
    ) -> None:
        if profile_dim < layout.dim:
            raise ValueError(f"Hetero-Greedy reads the {layout.dim}-entry profile layout")
        self._pair_budget = pair_budget
        self._protocol = protocol
        self._dim = profile_dim
        self._layout = layout

    def select(self, profiles: Mapping[str, ArrayLike]) -> list[Pairing]:
        """Greedy disjoint pairs by descending JS divergence; the higher pass@1 teaches."""
        ids, mat = _sorted_matrix(profiles, self._dim)
        n = len(ids)
        budget = _budget(self._pair_budget, n)
        if budget == 0:
            return []
        js = js_divergence_matrix(mat[:, self._layout.distribution])
        left, right = np.triu_indices(n, 1)
        scores = js[left, right]
        # Stable sort of pairs enumerated in (i, j) order: ties fall to the lower ids.
        order = np.argsort(-scores, kind="stable")
        perf = mat[:, self._layout.performance_index]
        used = bytearray(n)
        out: list[Pairing] = []
        for e in order.tolist():
            i, j = int(left[e]), int(right[e])
            if used[i] or used[j]:
                continue
            used[i] = used[j] = 1
            teacher, student = (j, i) if perf[j] > perf[i] else (i, j)
            out.append(_make(ids, mat, teacher, student, self._protocol, float(scores[e])))
            if len(out) == budget:
                break
        return out

    def observe(self, pairing: Pairing, reward: float) -> float:
        """Validates ``reward`` and returns it; nothing is learnt."""
        return check_reward(reward)


RewardFn = Callable[[str, str, str], float]


class OracleMatchmaker:
    """The benchmark's upper bound: exact max-weight matching on the *true* rewards.

    Given ``reward_fn(sender, receiver, protocol)`` (the environment's expected reward),
    it evaluates every ordered pair and protocol — ``N (N - 1) P`` calls per round — and
    returns the maximum-weight matching of ``min(K_p, N // 2)`` pairs over each pair's
    best direction and protocol (blossom, see :mod:`.matching`). Meant for benchmark
    sizes (tens to a few hundred agents). Exact ties between directions or protocols
    fall to the lower-id sender, then the earlier protocol.
    """

    def __init__(
        self,
        reward_fn: RewardFn,
        pair_budget: int | None = None,
        protocols: Sequence[str] = (DEFAULT_PROTOCOL,),
        *,
        profile_dim: int = 32,
    ) -> None:
        if not protocols:
            raise ValueError("at least one protocol is required")
        self._fn = reward_fn
        self._pair_budget = pair_budget
        self._protocols = tuple(protocols)
        self._dim = profile_dim

    def select(self, profiles: Mapping[str, ArrayLike]) -> list[Pairing]:
        """The reward-maximising disjoint pairing for this round."""
        ids, mat = _sorted_matrix(profiles, self._dim)
        n = len(ids)
        budget = _budget(self._pair_budget, n)
        if budget == 0:
            return []
        left, right = np.triu_indices(n, 1)
        best: list[tuple[float, int, int, str]] = []
        for i, j in zip(left.tolist(), right.tolist(), strict=True):
            options = [
                (float(self._fn(ids[s], ids[r], proto)), -order, s, r, proto)
                for order, (s, r, proto) in enumerate(
                    (s, r, proto) for s, r in ((i, j), (j, i)) for proto in self._protocols
                )
            ]
            value, _, s, r, proto = max(options)
            best.append((value, s, r, proto))
        weights = np.array([b[0] for b in best], dtype=np.float64)
        if not np.all(np.isfinite(weights)):
            raise ValueError("reward_fn returned a non-finite value")
        edges = max_weight_disjoint(left, right, weights, budget, n)
        return [_make(ids, mat, best[e][1], best[e][2], best[e][3], best[e][0]) for e in edges]

    def observe(self, pairing: Pairing, reward: float) -> float:
        """Validates ``reward`` and returns it; nothing is learnt."""
        return check_reward(reward)
