"""``peerlm bench cpm``: matchmakers on the synthetic federation (KNEXA-FL Figures 2 and 3).

Every method runs on its *own* :class:`~.synthetic.SyntheticFederation` built from the same
seed (same initial state, same noise streams), for ``rounds`` rounds: profiles ->
``select`` -> ``step`` (rewards) -> ``observe``. Metrics per (N, heterogeneity, method),
over seeds (see ``docs/bench-cpm.md`` for the full definitions):

* ``final_pass_at_1``: true network pass@1, mean of the last ``final_window`` rounds;
  ``initial_pass_at_1``: before round 1 (the same for every method).
* ``gain_vs_random_pct``: relative improvement over random pairing of the pass@1 *gained*
  by collaboration, ``100 * (mean dP_method / mean dP_random - 1)`` with
  ``dP = final_pass_at_1 - initial_pass_at_1`` (means over seeds; paired bootstrap CI).
* ``pass_ratio_vs_random_pct``: ``100 * (final P_method / final P_random - 1)``, the same
  comparison on the absolute pass@1 (it depends on the initial level, so it is smaller).
* ``fraction_of_oracle``: ``mean dP_method / mean dP_oracle``.
* ``cum_expected_reward``: sum over rounds of the TRUE expected rewards of the chosen pairs.
* ``regret_*``: cumulative regret against the oracle: every round, the best total true
  expected reward achievable in the method's *own* current state (exact max-weight matching
  of ``floor(N/2)`` pairs) minus the true expected reward of the pairs chosen; reported
  after ``T/4``, ``T/2`` and ``T`` rounds, and ``regret_ratio = R(T) / R(T/2)`` (linear
  growth gives 2, sub-linear less); ``regret_rate_final`` is the mean per-round regret over
  the last ``final_window`` rounds.
* ``js_mean``: mean base-2 JS divergence of the true data distributions of chosen pairs.
* ``rewards_per_s``: ``observe`` calls per second of time spent inside ``observe`` during
  the run (learning methods only); ``select_ms``: mean ``select`` latency.

A separate speed section times ``select`` at N = 1000 with pre-filtering and N = 200
without, raw ``observe`` throughput, and compares with mabwiser's ``LinUCB`` (optional).
"""

from __future__ import annotations

import cProfile
import io
import math
import os
import pstats
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
from numpy.typing import ArrayLike
from peerlm.bench.synthetic import (
    N_CATEGORIES,
    N_FAMILIES,
    PROFILE_DIM,
    Heterogeneity,
    SyntheticFederation,
)
from peerlm.services.cpm import (
    CheapScore,
    ContextFeatures,
    HeteroGreedyMatchmaker,
    LinUCB,
    Matchmaker,
    OracleMatchmaker,
    Pairing,
    RandomMatchmaker,
    RewardNormaliser,
    exact_top_k,
    greedy_disjoint,
    retain_freed_memory,
    top_k_partners,
)

from peerlm.protocols import DEFAULT_PROTOCOL

__all__ = [
    "EXTRA_METHODS",
    "METHODS",
    "METHOD_LABELS",
    "METRIC_KEYS",
    "BenchParams",
    "RunResult",
    "RunSpec",
    "mabwiser_available",
    "make_policy",
    "render_report",
    "run_benchmark",
    "run_one",
    "speed_report",
    "summarise",
    "write_plots",
]

FloatArray = npt.NDArray[np.float64]

#: Methods run in every setting.
METHODS: tuple[str, ...] = (
    "linucb-paper",
    "linucb",
    "linucb-blossom",
    "random",
    "hetero-greedy",
    "oracle",
)
#: Methods of the mabwiser comparison, run in the (``mabwiser_n``, high) setting only.
EXTRA_METHODS: tuple[str, ...] = ("linucb-notrust", "mabwiser-linucb")
METHOD_LABELS: Mapping[str, str] = {
    "linucb-paper": "LinUCB (paper context)",
    "linucb": "LinUCB (+interactions)",
    "linucb-blossom": "LinUCB (+interactions, blossom)",
    "random": "Random",
    "hetero-greedy": "Hetero-Greedy",
    "oracle": "Oracle",
    "linucb-notrust": "LinUCB (+interactions, no trust)",
    "mabwiser-linucb": "mabwiser LinUCB (same context)",
    "linucb-robust": "LinUCB (+interactions, robust reward normaliser)",
}
#: Methods that only :func:`run_one` runs (a comparison outside the tables).
OTHER_METHODS: tuple[str, ...] = ("linucb-robust",)
_LEARNING = frozenset({"linucb-paper", "linucb", "linucb-blossom", *EXTRA_METHODS, *OTHER_METHODS})
#: Keys of every row of ``report["results"]``.
METRIC_KEYS: tuple[str, ...] = (
    "n",
    "heterogeneity",
    "method",
    "seeds",
    "initial_pass_at_1",
    "final_pass_at_1",
    "final_pass_at_1_ci",
    "gain_vs_random_pct",
    "gain_vs_random_ci",
    "pass_ratio_vs_random_pct",
    "fraction_of_oracle",
    "cum_expected_reward",
    "regret_q1",
    "regret_half",
    "regret_final",
    "regret_ratio",
    "regret_rate_final",
    "js_mean",
    "rewards_per_s",
    "select_ms",
)
_BETA = 1.0
_REPEATS = 3
# Two-sided 95% Student t critical values by degrees of freedom (1..30); 1.96 beyond.
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


@dataclass(frozen=True)
class BenchParams:
    """What to run. The defaults are the full benchmark; :meth:`quick` is for tests."""

    sizes: tuple[int, ...] = (8, 16, 32, 64)
    heterogeneities: tuple[Heterogeneity, ...] = ("high", "low")
    seeds: int = 5
    rounds: int = 100
    methods: tuple[str, ...] = METHODS
    final_window: int = 10
    jobs: int = 1
    speed: bool = True
    speed_n_prefilter: int = 1000
    speed_n_exact: int = 200
    speed_calls: int = 20
    #: select() latency vs N (one BLAS/OpenMP thread; wall and process CPU time).
    speed_scaling_sizes: tuple[int, ...] = (1000, 5000, 10_000)
    speed_scaling_calls: int = 5
    observe_updates: int = 100_000
    mabwiser: bool = True
    mabwiser_n: int = 32
    mabwiser_updates: int = 2_000

    @classmethod
    def quick(cls) -> BenchParams:
        """Small settings that finish in a few seconds (for tests and smoke runs)."""
        return cls(
            sizes=(8, 16),
            seeds=2,
            rounds=12,
            final_window=3,
            speed_n_prefilter=200,
            speed_n_exact=40,
            speed_calls=3,
            speed_scaling_sizes=(100, 200),
            speed_scaling_calls=2,
            observe_updates=2_000,
            mabwiser_n=8,
            mabwiser_updates=100,
        )


@dataclass(frozen=True)
class RunSpec:
    """One run: a method on one seeded federation."""

    n: int
    heterogeneity: Heterogeneity
    seed: int
    method: str
    rounds: int


@dataclass
class RunResult:
    """Per-round traces and timings of one run."""

    spec: RunSpec
    pass_curve: list[float]
    regret_curve: list[float]
    reward_curve: list[float]
    js_sum: float = 0.0
    js_count: int = 0
    observe_calls: int = 0
    observe_s: float = 0.0
    select_calls: int = 0
    select_s: float = 0.0
    wall_s: float = 0.0


class Policy(Protocol):
    """The select/observe interface shared by the matchmaker and its baselines."""

    def select(self, profiles: Mapping[str, ArrayLike]) -> list[Pairing]:
        """Disjoint pairings for this round."""
        ...

    def observe(self, pairing: Pairing, reward: float) -> float:
        """Feed back one reward."""
        ...


class _TrueRewards:
    """``reward_fn`` for the library's oracle: reads this round's true reward matrix."""

    def __init__(self, env: SyntheticFederation) -> None:
        self._env = env
        self.matrix: FloatArray = env.expected_reward_matrix()

    def __call__(self, sender: str, receiver: str, protocol: str) -> float:
        return float(self.matrix[self._env.index(sender), self._env.index(receiver)])


class _MabwiserPolicy:
    """mabwiser's LinUCB (one model per protocol arm) behind the select/observe interface.

    Arms in mabwiser are fixed, so the (teacher, student) choice cannot be an arm; instead
    there is one arm per protocol (here: ``akd``) and every candidate direction is a
    *context* scored by ``predict_expectations`` (which includes mabwiser's UCB bonus).
    The pairs are then taken by the same greedy disjoint pass as Algorithm 2, over the same
    context vectors as ``Matchmaker(interaction_features=True, trust_features=False)``.
    Rewards are z-scored by the same running normaliser before ``partial_fit`` (one call per
    reward, like ``Matchmaker.observe``). Until the first reward, pairs are random (mabwiser
    cannot predict before ``fit``).
    """

    def __init__(self, seed: int, profile_dim: int = PROFILE_DIM, alpha: float = _BETA) -> None:
        from mabwiser.mab import MAB, LearningPolicy

        self._mab = MAB(
            arms=[DEFAULT_PROTOCOL],
            learning_policy=LearningPolicy.LinUCB(alpha=alpha, l2_lambda=1.0),
            seed=seed,
        )
        self._features = ContextFeatures(profile_dim, interaction=True, trust=False)
        self._normaliser = RewardNormaliser()
        self._fitted = False
        self._rng = np.random.default_rng(seed)

    def select(self, profiles: Mapping[str, ArrayLike]) -> list[Pairing]:
        ids = sorted(profiles)
        mat = np.stack([np.asarray(profiles[a], dtype=np.float64) for a in ids])
        n = len(ids)
        ss, rr = np.nonzero(~np.eye(n, dtype=bool))
        senders, receivers = ss.astype(np.intp), rr.astype(np.intp)
        zeros = np.zeros(len(senders), dtype=np.intp)
        contexts = self._features.build(mat, None, senders, receivers, zeros, zeros)
        perm = self._rng.permutation(len(senders))
        if self._fitted:
            scores = _expectations(self._mab.predict_expectations(contexts))
            order = perm[np.argsort(-scores[perm], kind="stable")]
        else:
            order = perm
        chosen = greedy_disjoint(senders, receivers, order, n // 2, n)
        return [
            Pairing(
                sender=ids[int(senders[c])],
                receiver=ids[int(receivers[c])],
                protocol=DEFAULT_PROTOCOL,
                role="one_way",
                context=contexts[c],
                ucb=0.0,
                mean=0.0,
            )
            for c in chosen
        ]

    def observe(self, pairing: Pairing, reward: float) -> float:
        r = self._normaliser.update(float(reward))
        x = np.asarray(pairing.context, dtype=np.float64)[None, :]
        if self._fitted:
            self._mab.partial_fit([DEFAULT_PROTOCOL], [r], x)
        else:
            self._mab.fit([DEFAULT_PROTOCOL], [r], x)
            self._fitted = True
        return r


def _expectations(out: Any) -> FloatArray:
    rows = out if isinstance(out, list) else [out]
    return np.array([float(d[DEFAULT_PROTOCOL]) for d in rows], dtype=np.float64)


def mabwiser_available() -> bool:
    """True when ``mabwiser`` (the optional ``bench`` extra) can be imported."""
    try:
        import mabwiser.mab  # noqa: F401
    except ImportError:
        return False
    return True


def make_policy(method: str, seed: int, env: SyntheticFederation) -> tuple[Policy, Any]:
    """The policy for ``method`` and, for the oracle, its true-reward reader."""
    if method == "linucb-paper":
        return Matchmaker(seed=seed, interaction_features=False, trust_features=False), None
    if method == "linucb":
        return Matchmaker(seed=seed), None
    if method == "linucb-blossom":
        return Matchmaker(seed=seed, matching="blossom"), None
    if method == "linucb-notrust":
        return Matchmaker(seed=seed, trust_features=False), None
    if method == "linucb-robust":
        return Matchmaker(seed=seed, reward_normaliser="robust"), None
    if method == "mabwiser-linucb":
        return _MabwiserPolicy(seed), None
    if method == "random":
        return RandomMatchmaker(seed=seed), None
    if method == "hetero-greedy":
        return HeteroGreedyMatchmaker(), None
    if method == "oracle":
        truth = _TrueRewards(env)
        return OracleMatchmaker(truth), truth
    raise ValueError(f"unknown method {method!r}")


def run_one(spec: RunSpec) -> RunResult:
    """Run one method on its own federation; returns traces against the true rewards."""
    start = time.perf_counter()
    env = SyntheticFederation(spec.n, spec.heterogeneity, spec.seed)
    policy, truth = make_policy(spec.method, spec.seed, env)
    js = env.js_matrix()
    result = RunResult(spec, [env.mean_pass_at_1()], [], [])
    regret = 0.0
    for _ in range(spec.rounds):
        profiles = env.profiles()
        expected = env.expected_reward_matrix()
        if truth is not None:
            truth.matrix = expected
        t0 = time.perf_counter()
        pairings = policy.select(profiles)
        result.select_s += time.perf_counter() - t0
        result.select_calls += 1
        idx = [(env.index(p.sender), env.index(p.receiver)) for p in pairings]
        chosen = float(sum(expected[s, r] for s, r in idx))
        regret += env.optimal_value(expected) - chosen
        result.regret_curve.append(regret)
        result.reward_curve.append(chosen)
        result.js_sum += float(sum(js[s, r] for s, r in idx))
        result.js_count += len(idx)
        rewards = env.step([(p.sender, p.receiver) for p in pairings])
        t0 = time.perf_counter()
        for pairing, reward in zip(pairings, rewards, strict=True):
            policy.observe(pairing, reward)
        result.observe_s += time.perf_counter() - t0
        result.observe_calls += len(pairings)
        result.pass_curve.append(env.mean_pass_at_1())
    result.wall_s = time.perf_counter() - start
    return result


def _specs(params: BenchParams, with_mabwiser: bool) -> list[RunSpec]:
    specs = [
        RunSpec(n, het, seed, method, params.rounds)
        for n in params.sizes
        for het in params.heterogeneities
        for seed in range(params.seeds)
        for method in params.methods
    ]
    if with_mabwiser and params.mabwiser_n in params.sizes and "high" in params.heterogeneities:
        needed = ["random", "oracle", *EXTRA_METHODS]
        have = {(s.n, s.heterogeneity, s.method) for s in specs}
        specs += [
            RunSpec(params.mabwiser_n, "high", seed, method, params.rounds)
            for seed in range(params.seeds)
            for method in needed
            if (params.mabwiser_n, "high", method) not in have
        ]
    return specs


def _ci95(values: Sequence[float]) -> float:
    n = len(values)
    if n < 2:
        return 0.0
    sd = float(np.std(values, ddof=1))
    t = _T975[n - 2] if n - 1 <= len(_T975) else 1.96
    return t * sd / math.sqrt(n)


def _ratio_ci(num: FloatArray, den: FloatArray, seed: int = 0) -> list[float] | None:
    """Paired bootstrap 95% CI of ``100 * (mean num / mean den - 1)`` over seeds."""
    n = len(num)
    if n < 2:
        return None
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(2000, n))
    d = den[idx].mean(axis=1)
    if np.any(d <= 0):
        return None
    ratios = 100.0 * (num[idx].mean(axis=1) / d - 1.0)
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    return [float(lo), float(hi)]


def _pct(num: float, den: float) -> float | None:
    return 100.0 * (num / den - 1.0) if den > 0 else None


def summarise(results: Sequence[RunResult], final_window: int) -> dict[str, Any]:
    """Aggregate run results into metric rows (``METRIC_KEYS``) and mean curves."""
    groups: dict[tuple[int, str, str], list[RunResult]] = {}
    for res in results:
        groups.setdefault((res.spec.n, res.spec.heterogeneity, res.spec.method), []).append(res)
    for runs in groups.values():
        runs.sort(key=lambda r: r.spec.seed)

    def stats(runs: list[RunResult]) -> tuple[FloatArray, FloatArray, FloatArray]:
        p0 = np.array([r.pass_curve[0] for r in runs])
        pf = np.array([float(np.mean(r.pass_curve[-final_window:])) for r in runs])
        return p0, pf, pf - p0

    rows: list[dict[str, Any]] = []
    curves: dict[str, dict[str, list[float]]] = {}
    order = {m: i for i, m in enumerate((*METHODS, *EXTRA_METHODS))}
    for key in sorted(groups, key=lambda k: (k[0], k[1], order.get(k[2], 99))):
        n, het, method = key
        runs = groups[key]
        p0, pf, dp = stats(runs)
        base = groups.get((n, het, "random"))
        orc = groups.get((n, het, "oracle"))
        gain = ratio = frac = None
        gain_ci = None
        if base is not None and len(base) == len(runs):
            _, bpf, bdp = stats(base)
            gain = _pct(float(dp.mean()), float(bdp.mean()))
            gain_ci = _ratio_ci(dp, bdp)
            ratio = _pct(float(pf.mean()), float(bpf.mean()))
        if orc is not None:
            _, _, odp = stats(orc)
            frac = float(dp.mean() / odp.mean()) if odp.mean() > 0 else None
        t = runs[0].spec.rounds
        reg = np.array([r.regret_curve for r in runs])
        q1, half = max(1, t // 4), max(1, t // 2)
        r_half = float(reg[:, half - 1].mean())
        r_final = float(reg[:, -1].mean())
        obs_calls = sum(r.observe_calls for r in runs)
        obs_s = sum(r.observe_s for r in runs)
        js_count = sum(r.js_count for r in runs)
        rows.append(
            {
                "n": n,
                "heterogeneity": het,
                "method": method,
                "seeds": len(runs),
                "initial_pass_at_1": float(p0.mean()),
                "final_pass_at_1": float(pf.mean()),
                "final_pass_at_1_ci": _ci95(pf.tolist()),
                "gain_vs_random_pct": gain,
                "gain_vs_random_ci": gain_ci,
                "pass_ratio_vs_random_pct": ratio,
                "fraction_of_oracle": frac,
                "cum_expected_reward": float(np.mean([sum(r.reward_curve) for r in runs])),
                "regret_q1": float(reg[:, q1 - 1].mean()),
                "regret_half": r_half,
                "regret_final": r_final,
                "regret_ratio": r_final / r_half if r_half > 1e-9 else None,
                "regret_rate_final": float(
                    (reg[:, -1] - reg[:, -1 - final_window]).mean() / final_window
                    if t > final_window
                    else reg[:, -1].mean() / t
                ),
                "js_mean": sum(r.js_sum for r in runs) / js_count if js_count else None,
                "rewards_per_s": (obs_calls / obs_s if method in _LEARNING and obs_s > 0 else None),
                "select_ms": 1e3
                * sum(r.select_s for r in runs)
                / max(1, sum(r.select_calls for r in runs)),
            }
        )
        pass_arr = np.array([r.pass_curve for r in runs])
        curves[f"{n}/{het}/{method}"] = {
            "pass_mean": pass_arr.mean(axis=0).tolist(),
            "pass_ci": [_ci95(col.tolist()) for col in pass_arr.T],
            "regret_mean": reg.mean(axis=0).tolist(),
            "regret_ci": [_ci95(col.tolist()) for col in reg.T],
        }
    return {"results": rows, "curves": curves}


# ---------------------------------------------------------------------------- speed


def _random_profiles(n: int, rng: np.random.Generator) -> dict[str, FloatArray]:
    prof = np.zeros((n, PROFILE_DIM))
    prof[np.arange(n), rng.integers(0, N_FAMILIES, size=n)] = 1.0
    prof[:, N_FAMILIES : PROFILE_DIM - N_CATEGORIES] = rng.uniform(
        0.0, 1.0, size=(n, PROFILE_DIM - N_FAMILIES - N_CATEGORIES)
    )
    prof[:, PROFILE_DIM - N_CATEGORIES :] = rng.dirichlet(np.full(N_CATEGORIES, 0.5), size=n)
    width = len(str(n - 1))
    return {f"a{i:0{width}d}": prof[i] for i in range(n)}


def _warm(mm: Matchmaker, n: int, rng: np.random.Generator, rounds: int = 2) -> None:
    for _ in range(rounds):
        for p in mm.select(_random_profiles(n, rng)):
            mm.observe(p, float(rng.normal()))


def _top_functions(prof: cProfile.Profile, limit: int = 8) -> list[str]:
    stream = io.StringIO()
    stats = pstats.Stats(prof, stream=stream)
    rows = []
    for func, (_cc, _nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        filename, line, name = func
        rows.append((ct, tt, f"{Path(filename).name}:{line}({name})"))
    rows.sort(reverse=True)
    return [
        f"{label}: cum {1e3 * ct:.1f} ms, self {1e3 * tt:.1f} ms" for ct, tt, label in rows[:limit]
    ]


def _select_latency(n: int, prefilter: bool, calls: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    mm = Matchmaker(seed=seed, prefilter_min_agents=64 if prefilter else 10**9)
    _warm(mm, n, rng)
    times = []
    candidates = 0
    for _ in range(calls):
        profiles = _random_profiles(n, rng)
        t0 = time.perf_counter()
        mm.select(profiles)
        times.append(time.perf_counter() - t0)
        candidates = mm.last_candidates
    ms = 1e3 * np.array(times)
    out: dict[str, Any] = {
        "n": n,
        "prefilter": prefilter,
        "calls": calls,
        "median_ms": float(np.median(ms)),
        "p95_ms": float(np.percentile(ms, 95)),
        "candidates": candidates,
    }
    if prefilter and out["median_ms"] >= 50.0:
        prof = cProfile.Profile()
        profiles = _random_profiles(n, rng)
        prof.enable()
        mm.select(profiles)
        prof.disable()
        out["profile"] = _top_functions(prof)
    return out


def _select_scaling(sizes: Sequence[int], calls: int, seed: int) -> dict[str, Any]:
    """Median select() wall and CPU time per N, one thread, and the fitted growth exponent.

    The machine may be shared, so process CPU time (``time.process_time``) is the honest
    figure; wall time is reported beside it. BLAS and OpenMP pools are limited to one
    thread (threadpoolctl) so the CPU time is that of one core. The exponent is the
    least-squares slope of log(CPU ms) on log(N) (N log N over 1e3..1e4 gives ~1.13).
    The C allocator is set as the CPM process sets it (:func:`retain_freed_memory`), for
    the rest of this process: without it the same calls spend a quarter of their CPU at
    N = 1,000 in page faults (docs/matchmaker.md, "Third step").
    """
    # threadpoolctl comes with scikit-learn, a core dependency.
    from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

    limiter = threadpool_limits(limits=1)
    # As the CPM process does at start (services/cpm/allocator.py); stays set afterwards.
    retained = retain_freed_memory()
    rows: list[dict[str, Any]] = []
    try:
        for n in sizes:
            rng = np.random.default_rng(seed + n)
            mm = Matchmaker(seed=seed)
            _warm(mm, n, rng)
            wall, cpu = [], []
            for _ in range(calls):
                profiles = _random_profiles(n, rng)
                t0, c0 = time.perf_counter(), time.process_time()
                mm.select(profiles)
                cpu.append(time.process_time() - c0)
                wall.append(time.perf_counter() - t0)
            rows.append(
                {
                    "n": n,
                    "calls": calls,
                    "wall_median_ms": 1e3 * float(np.median(wall)),
                    "cpu_median_ms": 1e3 * float(np.median(cpu)),
                    "cpu_min_ms": 1e3 * float(np.min(cpu)),
                    "candidates": mm.last_candidates,
                    **_top_k_recall(mm, profiles, seed),
                }
            )
    finally:
        limiter.unregister()
    exponent = None
    if len(rows) >= 2:
        x = np.log([r["n"] for r in rows])
        y = np.log([max(r["cpu_median_ms"], 1e-6) for r in rows])
        exponent = float(np.polyfit(x, y, 1)[0])
    return {
        "threads": 1,
        "allocator_retains_freed_memory": retained,
        "rows": rows,
        "cpu_growth_exponent": exponent,
    }


def _top_k_recall(mm: Matchmaker, profiles: Mapping[str, ArrayLike], seed: int) -> dict[str, Any]:
    """Recall of the exact cheap-score top-k by the prefilter's search at this N (1.0 on the
    exact path by construction; the clustered search from ``prefilter_cluster_min_agents``)."""
    cfg = mm.config()
    ids = sorted(profiles)
    prof = mm.features.bound_profiles(np.array([profiles[a] for a in ids], dtype=np.float64))
    trust = np.array([mm.trust(a) for a in ids]) if cfg["trust_features"] else None
    a_inv_diag = np.diagonal(mm.snapshot().a_inv).copy()
    inputs = CheapScore(prof, trust, mm.features.layout, mm.theta, a_inv_diag, cfg["beta"])
    k = cfg["prefilter_k"]
    exact = exact_top_k(inputs, k)
    found = top_k_partners(
        inputs,
        k,
        np.random.default_rng(seed),
        cluster_min_agents=cfg["prefilter_cluster_min_agents"],
    )
    hits = [len(set(e) & set(f)) for e, f in zip(exact.tolist(), found.tolist(), strict=True)]
    return {
        "top_k_search": "clustered" if len(ids) >= cfg["prefilter_cluster_min_agents"] else "exact",
        "top_k_recall": float(np.sum(hits)) / exact.size,
    }


def _observe_throughput(updates: int, seed: int, **kwargs: Any) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    mm = Matchmaker(seed=seed, **kwargs)
    pairings = mm.select(_random_profiles(64, rng))
    rewards = rng.normal(size=updates).tolist()
    k = len(pairings)
    elapsed = math.inf
    for _ in range(_REPEATS):  # best of a few: other load on the machine only slows it
        t0 = time.perf_counter()
        for i, r in enumerate(rewards):
            mm.observe(pairings[i % k], r)
        elapsed = min(elapsed, time.perf_counter() - t0)
    out: dict[str, Any] = {
        "updates": updates,
        "context_dim": mm.context_dim,
        "seconds": elapsed,
        "updates_per_s": updates / elapsed,
    }
    if out["updates_per_s"] < 50_000:
        prof = cProfile.Profile()
        prof.enable()
        for i, r in enumerate(rewards[: min(updates, 5_000)]):
            mm.observe(pairings[i % k], r)
        prof.disable()
        out["profile"] = _top_functions(prof)
    return out


def _mabwiser_speed(params: BenchParams, seed: int = 0) -> dict[str, Any]:
    from mabwiser.mab import MAB, LearningPolicy

    rng = np.random.default_rng(seed)
    features = ContextFeatures(PROFILE_DIM, interaction=True, trust=False)

    def candidates(n: int) -> FloatArray:
        profiles = _random_profiles(n, rng)
        mat = np.stack(list(profiles.values()))
        ss, rr = np.nonzero(~np.eye(n, dtype=bool))
        z = np.zeros(len(ss), dtype=np.intp)
        return features.build(mat, None, ss.astype(np.intp), rr.astype(np.intp), z, z)

    def new_mab() -> Any:
        mab = MAB(
            arms=[DEFAULT_PROTOCOL],
            learning_policy=LearningPolicy.LinUCB(alpha=_BETA, l2_lambda=1.0),
            seed=seed,
        )
        x0 = candidates(8)[:4]
        mab.fit([DEFAULT_PROTOCOL] * 4, rng.normal(size=4).tolist(), x0)
        return mab

    xs = candidates(params.mabwiser_n)
    m = params.mabwiser_updates
    rows = xs[rng.integers(0, len(xs), size=m)]
    rewards = rng.normal(size=m)
    batch = max(1, params.mabwiser_n // 2)
    single = batched = ours_update = 0.0
    for _ in range(_REPEATS):  # best of a few, as for observe()
        mab = new_mab()
        t0 = time.perf_counter()
        for i in range(m):
            mab.partial_fit([DEFAULT_PROTOCOL], [float(rewards[i])], rows[i : i + 1])
        single = max(single, m / (time.perf_counter() - t0))
        mab = new_mab()
        t0 = time.perf_counter()
        for lo in range(0, m, batch):
            hi = min(m, lo + batch)
            mab.partial_fit([DEFAULT_PROTOCOL] * (hi - lo), rewards[lo:hi].tolist(), rows[lo:hi])
        batched = max(batched, m / (time.perf_counter() - t0))
        bandit = LinUCB(features.dim)
        t0 = time.perf_counter()
        for i in range(m):
            bandit.update(rows[i], float(rewards[i]))
        ours_update = max(ours_update, m / (time.perf_counter() - t0))

    latency: list[dict[str, Any]] = []
    for n in sorted({params.mabwiser_n, params.speed_n_exact}):
        x = candidates(n)
        calls = max(3, min(params.speed_calls, 10))
        t_mab, t_ours = [], []
        for _ in range(calls):
            t0 = time.perf_counter()
            mab.predict_expectations(x)
            t_mab.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            bandit.score(x, _BETA)
            t_ours.append(time.perf_counter() - t0)
        latency.append(
            {
                "n": n,
                "candidates": len(x),
                "mabwiser_predict_ms": 1e3 * float(np.median(t_mab)),
                "ours_score_ms": 1e3 * float(np.median(t_ours)),
            }
        )
    return {
        "context_dim": features.dim,
        "updates": m,
        "mabwiser_partial_fit_single_per_s": single,
        "mabwiser_partial_fit_batch": batch,
        "mabwiser_partial_fit_batched_per_s": batched,
        "ours_linucb_update_per_s": ours_update,
        "latency": latency,
    }


def speed_report(params: BenchParams, with_mabwiser: bool) -> dict[str, Any]:
    """select() latency with and without pre-filtering, observe() throughput, mabwiser."""
    out: dict[str, Any] = {
        "load_average_before": list(os.getloadavg()),
        "select_prefilter": _select_latency(params.speed_n_prefilter, True, params.speed_calls, 0),
        "select_exact": _select_latency(params.speed_n_exact, False, params.speed_calls, 1),
        "select_scaling": _select_scaling(
            params.speed_scaling_sizes, params.speed_scaling_calls, 4
        ),
        "observe": _observe_throughput(params.observe_updates, 2),
        "observe_paper_context": _observe_throughput(
            params.observe_updates, 3, interaction_features=False, trust_features=False
        ),
    }
    if with_mabwiser:
        out["mabwiser"] = _mabwiser_speed(params)
    else:
        out["mabwiser"] = {"skipped": "mabwiser is not importable (install the 'bench' extra)"}
    out["load_average_after"] = list(os.getloadavg())
    return out


# ---------------------------------------------------------------------------- driver

ProgressFn = Callable[[str, int, int], None]


def run_benchmark(params: BenchParams, progress: ProgressFn | None = None) -> dict[str, Any]:
    """Run every (setting, seed, method) and the speed section; returns the JSON report.

    ``progress(label, done, total)`` is called after each run (and each speed step).
    With ``params.jobs > 1`` runs go to a process pool; results do not depend on ``jobs``
    (only the measured timings do).
    """
    start = time.perf_counter()
    with_mabwiser = params.mabwiser and mabwiser_available()
    specs = _specs(params, with_mabwiser)
    total = len(specs) + (1 if params.speed else 0)
    done = 0
    results: list[RunResult] = []

    def tick(label: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(label, done, total)

    def label(s: RunSpec) -> str:
        return f"N={s.n} {s.heterogeneity} seed={s.seed} {s.method}"

    jobs = max(1, min(params.jobs, len(specs)))
    if jobs == 1:
        for spec in specs:
            results.append(run_one(spec))
            tick(label(spec))
    else:
        # Biggest federations first, so the pool is not left waiting on one long run.
        ordered = sorted(specs, key=lambda s: -s.n)
        with ProcessPoolExecutor(max_workers=jobs, initializer=_single_blas_thread) as pool:
            futures = {pool.submit(run_one, s): s for s in ordered}
            for fut in as_completed(futures):
                results.append(fut.result())
                tick(label(futures[fut]))
    report: dict[str, Any] = {
        "params": _params_dict(params),
        **summarise(results, params.final_window),
    }
    report["mabwiser_compared"] = with_mabwiser
    if params.speed:
        report["speed"] = speed_report(params, with_mabwiser)
        tick("speed")
    report["elapsed_s"] = time.perf_counter() - start
    report["cpu_count"] = os.cpu_count()
    return report


def _single_blas_thread() -> None:
    """Pool workers use one BLAS thread each: with several workers on few cores, OpenBLAS
    threads spin against each other and small inversions (mabwiser) get 20x slower."""
    try:
        from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]
    except ImportError:  # pragma: no cover - threadpoolctl comes with the bench extra
        return
    threadpool_limits(limits=1)


def _params_dict(params: BenchParams) -> dict[str, Any]:
    d = asdict(params)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def params_with(params: BenchParams, **changes: Any) -> BenchParams:
    """``params`` with the given fields replaced (``None`` values are ignored)."""
    return replace(params, **{k: v for k, v in changes.items() if v is not None})


# ---------------------------------------------------------------------------- output


def _fmt(value: Any, spec: str = ".3f", suffix: str = "") -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and abs(value) < 5e-9:
        value = 0.0  # float noise of two exact solvers agreeing; never print "-0.0"
    return f"{value:{spec}}{suffix}"


def render_report(report: Mapping[str, Any], console: Any) -> None:
    """Print the report as rich tables on ``console`` (a ``rich.console.Console``)."""
    from rich.table import Table

    settings: dict[tuple[int, str], list[Mapping[str, Any]]] = {}
    for row in report["results"]:
        settings.setdefault((row["n"], row["heterogeneity"]), []).append(row)
    params = report["params"]
    for (n, het), rows in settings.items():
        table = Table(
            title=f"N = {n}, {het} heterogeneity — {params['rounds']} rounds, "
            f"{rows[0]['seeds']} seeds",
            title_justify="left",
        )
        for col in (
            "method",
            "pass@1 final (±95%)",
            "gain vs rand",
            "pass@1 vs rand",
            "frac. oracle",
            "cum E[r]",
            "regret T/4 / T/2 / T",
            "R(T)/R(T/2)",
            "regret/round (end)",
            "JS",
            "rewards/s",
            "select ms",
        ):
            table.add_column(col, justify="left" if col == "method" else "right")
        for r in rows:
            table.add_row(
                METHOD_LABELS.get(r["method"], r["method"]),
                f"{r['final_pass_at_1']:.3f} ±{r['final_pass_at_1_ci']:.3f}",
                _fmt(r["gain_vs_random_pct"], "+.1f", "%"),
                _fmt(r["pass_ratio_vs_random_pct"], "+.1f", "%"),
                _fmt(r["fraction_of_oracle"], ".2f"),
                f"{r['cum_expected_reward']:.1f}",
                " / ".join(_fmt(r[k], ".1f") for k in ("regret_q1", "regret_half", "regret_final")),
                _fmt(r["regret_ratio"], ".2f"),
                _fmt(r["regret_rate_final"], ".2f"),
                _fmt(r["js_mean"], ".3f"),
                _fmt(r["rewards_per_s"], ",.0f"),
                f"{r['select_ms']:.2f}",
            )
        console.print(table)
    speed = report.get("speed")
    if speed:
        table = Table(title="Speed", title_justify="left")
        table.add_column("measurement")
        table.add_column("value", justify="right")
        for key in ("select_prefilter", "select_exact"):
            s = speed[key]
            mode = "pre-filtered" if s["prefilter"] else "exact (no pre-filter)"
            table.add_row(
                f"select() N={s['n']} {mode}, {s['candidates']:,} candidates",
                f"median {s['median_ms']:.1f} ms, p95 {s['p95_ms']:.1f} ms",
            )
        scaling = speed["select_scaling"]
        for row in scaling["rows"]:
            table.add_row(
                f"select() N={row['n']:,}, 1 thread, {row['candidates']:,} candidates",
                f"CPU median {row['cpu_median_ms']:.1f} ms (min {row['cpu_min_ms']:.1f}), "
                f"wall {row['wall_median_ms']:.1f} ms",
            )
            table.add_row(
                f"prefilter top-k recall N={row['n']:,} ({row['top_k_search']} search)",
                f"{row['top_k_recall']:.4f}",
            )
        table.add_row(
            "select() CPU growth exponent (log-log fit)",
            _fmt(scaling["cpu_growth_exponent"], ".2f"),
        )
        table.add_row(
            "select() scaling: allocator keeps freed memory (as in the CPM)",
            "yes" if scaling.get("allocator_retains_freed_memory") else "no",
        )
        for key, name in (("observe", "default context"), ("observe_paper_context", "paper")):
            o = speed[key]
            table.add_row(
                f"observe() {name} (d={o['context_dim']}), {o['updates']:,} updates",
                f"{o['updates_per_s']:,.0f} /s",
            )
        mab = speed.get("mabwiser", {})
        if "skipped" in mab:
            table.add_row("mabwiser comparison", f"skipped: {mab['skipped']}")
        else:
            table.add_row(
                f"mabwiser LinUCB partial_fit, 1 reward/call (d={mab['context_dim']})",
                f"{mab['mabwiser_partial_fit_single_per_s']:,.0f} /s",
            )
            table.add_row(
                f"mabwiser LinUCB partial_fit, {mab['mabwiser_partial_fit_batch']} rewards/call",
                f"{mab['mabwiser_partial_fit_batched_per_s']:,.0f} /s",
            )
            table.add_row(
                "our LinUCB.update (Sherman–Morrison), same contexts",
                f"{mab['ours_linucb_update_per_s']:,.0f} /s",
            )
            for lat in mab["latency"]:
                table.add_row(
                    f"score {lat['candidates']:,} candidates (N={lat['n']}): mabwiser / ours",
                    f"{lat['mabwiser_predict_ms']:.1f} ms / {lat['ours_score_ms']:.1f} ms",
                )
        console.print(table)
        for key in ("select_prefilter", "observe"):
            for line in speed[key].get("profile", []):
                console.print(f"  [{key} profile] {line}")
    if speed:
        before = ", ".join(f"{x:.2f}" for x in speed["load_average_before"])
        after = ", ".join(f"{x:.2f}" for x in speed["load_average_after"])
        console.print(
            f"load average (1/5/15 min) before / after the speed section: {before} / {after} "
            f"on {report['cpu_count']} CPUs"
        )
    console.print(f"elapsed {report['elapsed_s']:.1f} s")


def write_plots(report: Mapping[str, Any], directory: str | os.PathLike[str]) -> list[Path]:
    """PNG learning curves (pass@1, 95% CI) and cumulative regret per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    by_setting: dict[str, list[tuple[str, Mapping[str, list[float]]]]] = {}
    for key, curve in report["curves"].items():
        n, het, method = key.split("/")
        by_setting.setdefault(f"{n}-{het}", []).append((method, curve))
    written: list[Path] = []
    for setting, items in sorted(by_setting.items()):
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
        for method, curve in items:
            label = METHOD_LABELS.get(method, method)
            style = "--" if method in ("random", "oracle") else "-"
            pm, pc = np.array(curve["pass_mean"]), np.array(curve["pass_ci"])
            x = np.arange(len(pm))
            (line,) = ax1.plot(x, pm, style, label=label)
            ax1.fill_between(x, pm - pc, pm + pc, alpha=0.15, color=line.get_color())
            rm, rc = np.array(curve["regret_mean"]), np.array(curve["regret_ci"])
            xr = np.arange(1, len(rm) + 1)
            ax2.plot(xr, rm, style, label=label, color=line.get_color())
            ax2.fill_between(xr, rm - rc, rm + rc, alpha=0.15, color=line.get_color())
        n, het = setting.split("-")
        ax1.set(title=f"Network pass@1 (N={n}, {het})", xlabel="round", ylabel="pass@1")
        ax2.set(title="Cumulative regret vs oracle", xlabel="round", ylabel="regret")
        ax1.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"cpm-{setting}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


if __name__ == "__main__":
    # `python bench/cpm.py ...` is the same as `peerlm bench cpm ...`.
    import sys

    from peerlm.bench.cli import app

    sys.exit(app(["cpm", *sys.argv[1:]], standalone_mode=True))
