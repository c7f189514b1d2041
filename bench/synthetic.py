"""A synthetic federation for benchmarking matchmakers (pure, seeded, no I/O).

This is the controlled environment of the KNEXA-FL "profiler ablation" (paper, Figure 2 and
Figure 3): no model is trained; each client is a small latent state and every knowledge
exchange moves that state by a known rule, so the *true* expected reward of every possible
(teacher -> student) pair is available for an oracle and for regret.

Latent state of client ``i`` (hidden from the matchmaker)
-----------------------------------------------------------
* ``family f_i`` in 8 model families. High heterogeneity draws families uniformly from all 8;
  low heterogeneity draws them from 2 families picked per seed.
* ``d_i``: data distribution over 12 task categories, ``Dirichlet(alpha)``; ``alpha = 0.1``
  (the paper's partition) for high heterogeneity, ``alpha = 10`` for low.
* ``n_i``: local data set size, uniform in [30, 150].
* ``cap_i``: model capacity (family capacity ~ U(0.6, 0.95) times an individual U(0.9, 1)).
* ``s_i[k]``: skill (per-category pass rate) in [0, cap_i]. Initial skill is
  ``cap_i * min(1, g_i * (0.25 + A[f_i, k]) + 0.25 * (1 - exp(-n_i d_i[k] / 20)))`` with a
  client ability ``g_i ~ Beta(2, 5)``, a family aptitude ``A[f, k] ~ Beta(2, 2)`` and a lift
  from local data in category ``k``.
* a hidden family compatibility ``C[f_s, f_r]`` in [-1, 1] (directed): 1 on the diagonal
  (same tokenizer and architecture), off the diagonal a symmetric ``N(0.35, 0.45)`` part plus
  a directed ``N(0, 0.15)`` part, clipped. About a fifth of family pairs are incompatible
  (``C < 0``): distilling from them gives negative transfer.

Local pass@1 of client ``i`` is ``P_i = sum_k d_i[k] s_i[k]`` (skill weighted by the client's
own distribution); the network pass@1 is the mean of ``P_i`` over clients.

An exchange teacher ``s`` -> student ``r`` (AKD)
--------------------------------------------------
With ``c = C[f_s, f_r]``, target ``t_k = min(s_s[k], cap_r)`` and ``gap_k = t_k - s_r[k]``::

    Delta_k = eta * (max(c, 0) * (gap_k if gap_k > 0 else psi * gap_k)
                     - max(-c, 0) * phi * s_r[k])

(``eta = 0.08``: each exchange closes a few percent of the gap, so the network does not
saturate within a few rounds; ``psi = 0.3``: a weaker teacher pulls the student down a little;
``phi = 0.5``: strength of negative transfer.) The student's skill moves by ``Delta`` and stays
in ``[0, cap_r]``; teachers are unchanged (one-way role). The student's local loss is
``L = 2.5 (1 - P) + 0.3`` so the expected reward (paper Eq. 3) is::

    E[r_sr] = gamma * (L_pre - L_post) - delta * KB_s
            = gamma * 2.5 * sum_k d_r[k] Delta_k - delta * KB_s

with ``gamma = 10``, ``delta = 0.003`` per KB and ``KB_s`` the size of a text-AKD package
(128 transfer prompts times a family-dependent mean answer length of 60-140 tokens times 2
bytes). So the reward is driven by complementarity (the teacher's skill where the student is
weak, weighted by the student's data distribution) and by compatibility, minus a
communication cost. The *observed* reward adds Gaussian noise with std ``reward_noise = 0.2``.
Every round, before matchmaking, each client also trains locally:
``s_i[k] += 0.003 * d_i[k] * (cap_i - s_i[k])``.

Profiles (``d_p = 32``; what a real agent could report, nothing more)
----------------------------------------------------------------------
``[0:8]`` family one-hot; ``[8:20]`` dynamic: ``8`` pass@1 on a local validation set
(``P_i`` + ``N(0, 0.02)``), ``9`` local loss, ``10`` perplexity / 10, ``11`` delta pass@1 and
``12`` delta loss since the previous round (both from the reported values), ``13`` pass@5-like
``1 - (1 - p)^5``, ``14`` CodeBLEU-like score, ``15`` best and ``16`` worst validation accuracy
over the client's own categories (``d_i[k] >= 1/12``), ``17`` log data-set size /
log 1000, ``18`` last reward received as a student, ``19`` running success rate of received
exchanges (share of positive rewards, EMA, prior 0.5); ``[20:32]`` the client's category
histogram (empirical, from ``n_i`` samples, plus ``N(0, 0.01)`` noise, renormalised).
The latent skills, abilities, capacities and ``C`` never enter a profile except through these
measurements.

Determinism: everything derives from ``numpy.random.SeedSequence(seed)``; construction,
profile noise and reward noise use separate streams, so two copies built with the same seed
that receive the same number of pairs per round see the same noise (common random numbers).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
import numpy.typing as npt
from peerlm.services.cpm import PROFILE_LAYOUT

__all__ = [
    "DYNAMIC_SLICE",
    "FAMILY_SLICE",
    "HISTOGRAM_SLICE",
    "N_CATEGORIES",
    "N_FAMILIES",
    "PROFILE_DIM",
    "Heterogeneity",
    "OracleMatchmaker",
    "PairLike",
    "SyntheticConfig",
    "SyntheticFederation",
    "js_divergence",
    "max_weight_matching",
]

FloatArray = npt.NDArray[np.float64]
Heterogeneity = Literal["high", "low"]

# The profile layout agents send and the CPM validates (its one definition).
PROFILE_DIM = PROFILE_LAYOUT.dim
FAMILY_SLICE = PROFILE_LAYOUT.static
DYNAMIC_SLICE = PROFILE_LAYOUT.dynamic
HISTOGRAM_SLICE = PROFILE_LAYOUT.distribution
N_FAMILIES = FAMILY_SLICE.stop - FAMILY_SLICE.start
N_CATEGORIES = HISTOGRAM_SLICE.stop - HISTOGRAM_SLICE.start

_LOSS_SCALE = 2.5
_LOSS_FLOOR = 0.3
_TRANSFER_PROMPTS = 128
_BYTES_PER_TOKEN = 2


class PairLike(Protocol):
    """Anything with a teacher (``sender``) and a student (``receiver``), e.g. ``Pairing``."""

    @property
    def sender(self) -> str: ...

    @property
    def receiver(self) -> str: ...


@dataclass(frozen=True)
class SyntheticConfig:
    """Parameters of the synthetic federation (defaults documented in the module docstring)."""

    alpha_high: float = 0.1
    alpha_low: float = 10.0
    families_low: int = 2
    eta: float = 0.08
    weaker_teacher_pull: float = 0.3
    negative_transfer: float = 0.5
    local_rate: float = 0.003
    gamma: float = 10.0
    delta_per_kb: float = 0.003
    reward_noise: float = 0.2
    profile_noise: float = 0.02
    histogram_noise: float = 0.01
    compat_mean: float = 0.35
    compat_std: float = 0.45
    compat_directed_std: float = 0.15
    success_ema: float = 0.3


def js_divergence(p: npt.ArrayLike, q: npt.ArrayLike) -> float:
    """Jensen-Shannon divergence of two distributions, base 2 (in [0, 1])."""
    pa = np.asarray(p, dtype=np.float64)
    qa = np.asarray(q, dtype=np.float64)
    pa = pa / pa.sum()
    qa = qa / qa.sum()
    m = 0.5 * (pa + qa)

    def _kl(a: FloatArray, b: FloatArray) -> float:
        mask = a > 0
        return float(np.sum(a[mask] * np.log2(a[mask] / b[mask])))

    return max(0.0, 0.5 * _kl(pa, m) + 0.5 * _kl(qa, m))


def max_weight_matching(
    weights: FloatArray, method: Literal["auto", "networkx", "milp"] = "auto"
) -> list[tuple[int, int]]:
    """Exact maximum-weight matching of maximum cardinality on a complete graph.

    ``weights`` is a symmetric ``(n, n)`` matrix (the diagonal is ignored). Among the
    matchings with ``floor(n / 2)`` edges, returns one of largest total weight, as ``(i, j)``
    with ``i < j``, sorted. ``"networkx"`` runs Edmonds' blossom algorithm on weights shifted
    to be positive (every candidate has the same size, so a shift does not move the
    optimum); ``"milp"`` solves the same problem as a 0/1 program with scipy's HiGHS (about
    3x faster at 64 agents; scipy is optional); ``"auto"`` takes the MILP when scipy is
    importable and ``n >= 32``.
    """
    n = weights.shape[0]
    if n < 2:
        return []
    iu, ju = np.triu_indices(n, 1)
    w = np.asarray(weights, dtype=np.float64)[iu, ju]
    if method == "auto":
        method = "milp" if n >= 32 and _have_scipy() else "networkx"
    if method == "milp":
        return _milp_matching(n, iu, ju, w)
    import networkx as nx

    shift = 1.0 - float(w.min())
    graph = nx.Graph()
    graph.add_weighted_edges_from(
        (int(i), int(j), float(x + shift)) for i, j, x in zip(iu, ju, w, strict=True)
    )
    matching = nx.max_weight_matching(graph, maxcardinality=True)
    return sorted((min(a, b), max(a, b)) for a, b in matching)


def _have_scipy() -> bool:
    try:
        import scipy.optimize  # type: ignore[import-untyped]  # noqa: F401
    except ImportError:  # pragma: no cover - scipy ships with the bench extra's deps
        return False
    return True


def _milp_matching(
    n: int, iu: npt.NDArray[np.intp], ju: npt.NDArray[np.intp], w: FloatArray
) -> list[tuple[int, int]]:
    from scipy.optimize import Bounds, LinearConstraint, milp  # type: ignore[import-untyped]
    from scipy.sparse import csr_matrix  # type: ignore[import-untyped]

    m = len(w)
    rows = np.concatenate([iu, ju])
    cols = np.concatenate([np.arange(m), np.arange(m)])
    incidence = csr_matrix((np.ones(2 * m), (rows, cols)), shape=(n, m))
    k = n // 2
    # Every vertex in at most one edge, exactly floor(n/2) edges (maximum cardinality).
    constraints = [
        LinearConstraint(incidence, 0.0, 1.0),
        LinearConstraint(np.ones((1, m)), k, k),
    ]
    res = milp(
        -w,
        constraints=constraints,
        integrality=np.ones(m),
        bounds=Bounds(0.0, 1.0),
        options={"mip_rel_gap": 0.0},
    )
    if res.x is None:  # pragma: no cover - the program is always feasible
        raise RuntimeError(f"matching MILP failed: {res.message}")
    chosen = np.flatnonzero(res.x > 0.5)
    return sorted((int(iu[e]), int(ju[e])) for e in chosen)


def _ends(pair: PairLike | tuple[str, str]) -> tuple[str, str]:
    if isinstance(pair, tuple):
        return pair[0], pair[1]
    return pair.sender, pair.receiver


class SyntheticFederation:
    """A seeded synthetic federation of ``n_clients`` agents (see the module docstring).

    Use: ``profiles()`` -> matchmaker ``select`` -> ``step(pairs)`` -> matchmaker ``observe``.
    ``expected_reward`` / ``expected_reward_matrix`` give the true expected rewards in the
    current state (for oracles and regret); ``step`` samples the observed rewards and applies
    the skill updates.
    """

    def __init__(
        self,
        n_clients: int,
        heterogeneity: Heterogeneity = "high",
        seed: int = 0,
        config: SyntheticConfig | None = None,
    ) -> None:
        if n_clients < 2:
            raise ValueError("a federation needs at least 2 clients")
        if heterogeneity not in ("high", "low"):
            raise ValueError(f"heterogeneity must be 'high' or 'low', not {heterogeneity!r}")
        self.n_clients = n_clients
        self.heterogeneity: Heterogeneity = heterogeneity
        self.seed = seed
        self.config = config or SyntheticConfig()
        cfg = self.config
        init_ss, profile_ss, reward_ss = np.random.SeedSequence(seed).spawn(3)
        rng = np.random.default_rng(init_ss)
        self._profile_rng = np.random.default_rng(profile_ss)
        self._reward_rng = np.random.default_rng(reward_ss)

        width = max(2, len(str(n_clients - 1)))
        self.names: tuple[str, ...] = tuple(f"c{i:0{width}d}" for i in range(n_clients))
        self._index = {name: i for i, name in enumerate(self.names)}

        # Families, their aptitudes, capacities, package sizes and hidden compatibility.
        aptitude = rng.beta(2.0, 2.0, size=(N_FAMILIES, N_CATEGORIES))
        family_cap = rng.uniform(0.6, 0.95, size=N_FAMILIES)
        answer_tokens = rng.uniform(60.0, 140.0, size=N_FAMILIES)
        sym = rng.normal(cfg.compat_mean, cfg.compat_std, size=(N_FAMILIES, N_FAMILIES))
        sym = np.triu(sym, 1)
        sym = sym + sym.T
        directed = rng.normal(0.0, cfg.compat_directed_std, size=(N_FAMILIES, N_FAMILIES))
        compat = np.clip(sym + directed, -1.0, 1.0)
        np.fill_diagonal(compat, 1.0)
        self._compat_families: FloatArray = compat

        if heterogeneity == "high":
            alpha = cfg.alpha_high
            families = rng.integers(0, N_FAMILIES, size=n_clients)
        else:
            alpha = cfg.alpha_low
            pool = rng.choice(N_FAMILIES, size=cfg.families_low, replace=False)
            families = pool[rng.integers(0, cfg.families_low, size=n_clients)]
        self.families: npt.NDArray[np.int64] = families.astype(np.int64)
        dist = rng.dirichlet(np.full(N_CATEGORIES, alpha), size=n_clients)
        dist = np.maximum(dist, 1e-12)
        self.distribution: FloatArray = dist / dist.sum(axis=1, keepdims=True)
        self.data_size: npt.NDArray[np.int64] = rng.integers(30, 151, size=n_clients)
        ability = rng.beta(2.0, 5.0, size=n_clients)
        self.capacity: FloatArray = family_cap[families] * rng.uniform(0.9, 1.0, size=n_clients)
        counts = self.data_size[:, None] * self.distribution
        lift = 0.25 * (1.0 - np.exp(-counts / 20.0))
        base = ability[:, None] * (0.25 + aptitude[families])
        self.skills: FloatArray = self.capacity[:, None] * np.minimum(1.0, base + lift)
        self._package_kb: FloatArray = (
            _TRANSFER_PROMPTS * answer_tokens[families] * _BYTES_PER_TOKEN / 1024.0
        )
        # Pairwise directed compatibility between clients: C[f_s, f_r].
        self._compat: FloatArray = compat[np.ix_(families, families)]

        # Reported histogram: empirical counts from n_i samples plus small noise (fixed).
        hist = np.stack(
            [
                rng.multinomial(int(n), p * (1.0 - 1e-9)) / float(n)
                for n, p in zip(self.data_size, self.distribution, strict=True)
            ]
        )
        hist = np.clip(hist + rng.normal(0.0, cfg.histogram_noise, size=hist.shape), 0.0, None)
        sums = hist.sum(axis=1, keepdims=True)
        self._histogram: FloatArray = np.where(
            sums > 0, hist / np.where(sums > 0, sums, 1.0), 1 / 12
        )

        self.round = 0
        self._last_reward = np.zeros(n_clients)
        self._success = np.full(n_clients, 0.5)
        self._prev_reported: FloatArray | None = None
        self._profiles: FloatArray = self._make_profiles()

    # ------------------------------------------------------------------ observation
    def client_pass_at_1(self) -> FloatArray:
        """True local pass@1 of every client (skill weighted by its own distribution)."""
        result: FloatArray = np.einsum("ik,ik->i", self.distribution, self.skills)
        return result

    def mean_pass_at_1(self) -> float:
        """True network pass@1: the mean local pass@1 over clients."""
        return float(self.client_pass_at_1().mean())

    def profiles(self) -> dict[str, FloatArray]:
        """This round's noisy 32-dim profiles (the same object values until the next ``step``)."""
        return {name: self._profiles[i].copy() for i, name in enumerate(self.names)}

    def profile_matrix(self) -> FloatArray:
        """This round's profiles as an ``(n_clients, 32)`` array, rows in ``names`` order."""
        return self._profiles.copy()

    def _make_profiles(self) -> FloatArray:
        cfg = self.config
        rng = self._profile_rng
        n = self.n_clients
        noise = rng.normal(0.0, cfg.profile_noise, size=(n, 5))
        true_p = self.client_pass_at_1()
        p = np.clip(true_p + noise[:, 0], 0.0, 1.0)
        loss = _LOSS_SCALE * (1.0 - p) + _LOSS_FLOOR + noise[:, 1]
        own = self.distribution >= 1.0 / N_CATEGORIES
        best = np.where(own, self.skills, -np.inf).max(axis=1)
        worst = np.where(own, self.skills, np.inf).min(axis=1)
        reported = np.stack([p, loss], axis=1)
        prev = reported if self._prev_reported is None else self._prev_reported
        self._prev_reported = reported
        prof = np.zeros((n, PROFILE_DIM))
        prof[np.arange(n), self.families] = 1.0
        dyn = prof[:, DYNAMIC_SLICE]
        dyn[:, 0] = p
        dyn[:, 1] = loss
        dyn[:, 2] = np.exp(loss) / 10.0
        dyn[:, 3] = p - prev[:, 0]
        dyn[:, 4] = loss - prev[:, 1]
        dyn[:, 5] = 1.0 - (1.0 - p) ** 5
        dyn[:, 6] = np.clip(0.2 + 0.5 * p + noise[:, 2], 0.0, 1.0)
        dyn[:, 7] = np.clip(best + noise[:, 3], 0.0, 1.0)
        dyn[:, 8] = np.clip(worst + noise[:, 4], 0.0, 1.0)
        dyn[:, 9] = np.log(self.data_size) / math.log(1000.0)
        dyn[:, 10] = self._last_reward
        dyn[:, 11] = self._success
        prof[:, HISTOGRAM_SLICE] = self._histogram
        return prof

    # ------------------------------------------------------------------ dynamics
    def _skill_delta(
        self, senders: npt.NDArray[np.intp], receivers: npt.NDArray[np.intp]
    ) -> FloatArray:
        """Skill change of each receiver when taught by the matching sender, ``(m, 12)``."""
        cfg = self.config
        c = self._compat[senders, receivers][:, None]
        s_r = self.skills[receivers]
        target = np.minimum(self.skills[senders], self.capacity[receivers][:, None])
        gap = target - s_r
        pull = np.where(gap > 0, gap, cfg.weaker_teacher_pull * gap)
        delta = cfg.eta * (
            np.maximum(c, 0.0) * pull - np.maximum(-c, 0.0) * cfg.negative_transfer * s_r
        )
        new = np.clip(s_r + delta, 0.0, self.capacity[receivers][:, None])
        result: FloatArray = new - s_r
        return result

    def _expected(
        self, senders: npt.NDArray[np.intp], receivers: npt.NDArray[np.intp]
    ) -> FloatArray:
        cfg = self.config
        delta = self._skill_delta(senders, receivers)
        dp = np.einsum("mk,mk->m", self.distribution[receivers], delta)
        result: FloatArray = (
            cfg.gamma * _LOSS_SCALE * dp - cfg.delta_per_kb * self._package_kb[senders]
        )
        return result

    def expected_reward(self, sender: str, receiver: str) -> float:
        """True expected (un-normalised, Eq. 3) reward of ``sender`` teaching ``receiver`` now."""
        s, r = self._index[sender], self._index[receiver]
        if s == r:
            raise ValueError("a client cannot teach itself")
        return float(self._expected(np.array([s]), np.array([r]))[0])

    def expected_reward_matrix(self) -> FloatArray:
        """``E[i, j]`` = true expected reward of ``i`` teaching ``j``; the diagonal is ``nan``."""
        n = self.n_clients
        ss, rr = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
        e = self._expected(ss.ravel(), rr.ravel()).reshape(n, n)
        np.fill_diagonal(e, np.nan)
        return e

    def expected_total(self, pairs: Iterable[PairLike | tuple[str, str]]) -> float:
        """Sum of the true expected rewards of ``pairs`` in the current state."""
        return float(sum(self.expected_reward(*_ends(p)) for p in pairs))

    def optimal_pairs(
        self,
        expected: FloatArray | None = None,
        method: Literal["auto", "networkx", "milp"] = "auto",
    ) -> list[tuple[str, str]]:
        """The oracle's pairs: an exact max-weight matching of ``floor(N/2)`` directed pairs.

        Each unordered pair is weighted by the better of its two directions on the true
        expected rewards, and oriented that way. ``expected`` may pass this round's
        :meth:`expected_reward_matrix` to avoid recomputing it.
        """
        e = self.expected_reward_matrix() if expected is None else expected
        best = np.fmax(e, e.T)
        np.fill_diagonal(best, 0.0)
        pairs = []
        for i, j in max_weight_matching(best, method):
            s, r = (i, j) if e[i, j] >= e[j, i] else (j, i)
            pairs.append((self.names[s], self.names[r]))
        return pairs

    def optimal_value(self, expected: FloatArray | None = None) -> float:
        """Total true expected reward of the oracle's pairs in the current state."""
        e = self.expected_reward_matrix() if expected is None else expected
        return float(sum(e[self._index[s], self._index[r]] for s, r in self.optimal_pairs(e)))

    def index(self, name: str) -> int:
        """Row of client ``name`` in the matrices (``names`` order)."""
        return self._index[name]

    def js_matrix(self) -> FloatArray:
        """Pairwise JS divergence (base 2) of the clients' TRUE data distributions."""
        d = self.distribution
        mix = 0.5 * (d[:, None, :] + d[None, :, :])

        def _entropy(x: FloatArray) -> FloatArray:
            logs = np.log2(x, out=np.zeros_like(x), where=x > 0)
            out: FloatArray = -(x * logs).sum(axis=-1)
            return out

        ent = _entropy(d)
        js = _entropy(mix) - 0.5 * (ent[:, None] + ent[None, :])
        np.fill_diagonal(js, 0.0)
        result: FloatArray = np.clip(js, 0.0, 1.0)
        return result

    def js_divergence(self, a: str, b: str) -> float:
        """JS divergence (base 2) between the TRUE data distributions of two clients."""
        return js_divergence(self.distribution[self._index[a]], self.distribution[self._index[b]])

    def step(
        self, pairs: Sequence[PairLike | tuple[str, str]], *, several_teachers: bool = False
    ) -> list[float]:
        """Run one round of exchanges; return the observed (noisy) reward of each pair.

        All exchanges use the pre-round state (they run in parallel); then every client
        trains locally, the round counter advances and fresh profiles are drawn. A client may
        take part in at most one pair per round; with ``several_teachers`` a student may
        learn from several distinct teachers in the round (a CPM's ``teachers_per_student``),
        their skill gains added up, as long as no student also teaches in it.
        """
        ends = [_ends(p) for p in pairs]
        seen: set[str] = set()
        for s, r in ends:
            if s == r:
                raise ValueError(f"self-pair {s!r}")
        if several_teachers:
            if len(set(ends)) != len(ends):
                raise ValueError("a (teacher, student) pair appears twice in one round")
            if {s for s, _ in ends} & {r for _, r in ends}:
                raise ValueError("a student of several teachers cannot also teach that round")
        else:
            for s, r in ends:
                if s in seen or r in seen:
                    raise ValueError("pairs must be disjoint: a client appears twice in one round")
                seen.update((s, r))
        senders = np.array([self._index[s] for s, _ in ends], dtype=np.intp)
        receivers = np.array([self._index[r] for _, r in ends], dtype=np.intp)
        cfg = self.config
        noise = self._reward_rng.normal(0.0, cfg.reward_noise, size=len(ends))
        rewards: list[float] = []
        if ends:
            expected = self._expected(senders, receivers)
            delta = self._skill_delta(senders, receivers)
            observed = expected + noise
            # Unbuffered: a student of several teachers gains each lesson's delta, within
            # what one lesson may reach (each delta is bounded, their sum need not be).
            np.add.at(self.skills, receivers, delta)
            if several_teachers:
                np.clip(self.skills, 0.0, self.capacity[:, None], out=self.skills)
            self._last_reward[receivers] = observed
            a = cfg.success_ema
            self._success[receivers] = (1 - a) * self._success[receivers] + a * (observed > 0)
            rewards = [float(x) for x in observed]
        # Phase 1 of the next round: local training on private data.
        gap = self.capacity[:, None] - self.skills
        self.skills += cfg.local_rate * self.distribution * gap
        self.round += 1
        self._profiles = self._make_profiles()
        return rewards

    def copy(self) -> SyntheticFederation:
        """A fresh federation in the same initial state (same seed and config)."""
        return SyntheticFederation(self.n_clients, self.heterogeneity, self.seed, self.config)


class OracleMatchmaker:
    """The upper bound: pairs by exact max-weight matching on the environment's TRUE rewards.

    Not a real matchmaker (it reads hidden state); it is bound to one environment.
    """

    def __init__(self, env: SyntheticFederation) -> None:
        self.env = env

    def select_pairs(self) -> list[tuple[str, str]]:
        """The oracle's directed (teacher, student) pairs for the current round."""
        return self.env.optimal_pairs()
