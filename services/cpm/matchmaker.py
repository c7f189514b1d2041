"""The CPM matchmaker: LinUCB over (sender, receiver, protocol, role) tuples (Algorithm 2).

Pure state machine: :meth:`Matchmaker.select` turns the round's profiles into disjoint
pairing directives; :meth:`Matchmaker.observe` folds one receiver-reported reward (Eq. 3)
into the bandit (Algorithm 3, l.12); :meth:`~Matchmaker.snapshot` /
:meth:`~Matchmaker.restore` move the whole learnt state in and out as plain arrays.

Choices the paper leaves open (see also ``docs/matchmaker.md``):

* **Direction is learnt.** Algorithm 2 enumerates unordered pairs; here both directions
  of every pair (i teaches j, j teaches i) are separate candidates, because the context
  of ``i -> j`` differs from that of ``j -> i`` and who should teach whom is exactly what
  the bandit is meant to learn.
* **Agents are indexed by sorted id**, so results never depend on the iteration order of
  the ``profiles`` mapping; exact UCB ties are broken by a seeded random permutation.
* **Per-round randomness is derived, not streamed**: round randomness comes from
  ``default_rng([seed, n_updates, selects since the last update])``. Two matchmakers with
  the same seed and state therefore select identically — including one freshly
  :meth:`~Matchmaker.restore`-d from a snapshot taken after the last reward — while
  consecutive rounds without new rewards still draw fresh tie-breaks and random partners.
* **The reward is normalised before the update** (running z-score, :mod:`.normalise`), and
  ``observe`` updates with exactly ``pairing.context``, the vector scored at selection.
* **Trust** is counted for the sender only; see :mod:`.trust`.
* **Exact scores without building contexts**: every candidate's UCB is computed exactly
  by :meth:`.LinUCB.score_pairs` from per-agent and per-pair pieces of ``x^T A^-1 x``
  (the per-pair part in float32 by default, ``score_precision``: within ~1e-6 of float64);
  only the chosen pairings' contexts are materialised (see :mod:`.linucb`).
* **Admissibility is a mask, not a feature.** With ``capabilities`` (what each agent's
  profile declares: parameter-space fingerprint, protocols it executes; :mod:`.menu`),
  tuples the menu's rules forbid are removed before the walk: pairs with no admissible
  tuple are not scored at all, the others' forbidden tuples score ``-inf`` and are never
  walked. When every tuple is admissible (the default ``("akd",)`` menu) no mask is built
  and selection is exactly what it was without one.
* **Large federations** (``N >= prefilter_min_agents``) score only prefiltered pairs
  (:mod:`.prefilter`). The sparse candidate graph can strand agents, so leftovers get
  further passes among themselves until ``K_p`` is met or nobody is left, as Algorithm 2
  would; pairings are best-first within a pass. ``last_candidates`` counts all passes.
* **Several senders per merge** (``merge_senders`` > 1): after the walk, each merge
  pairing's receiver gets co-senders, its admissible candidate partners ranked by the UCB
  of (co-sender, receiver, protocol, role); the walk and the primary pairings are those of
  ``merge_senders=1``, and :meth:`observe` still updates once, on the primary's context.
  With ``co_sender_scoring="group"`` the group is one arm instead: co-senders are added
  greedily by the UCB of the group's context (the members' mean profile as one sender,
  :meth:`.ContextFeatures.build_groups`), and the pairing's context, ``ucb`` and
  ``mean`` are the group's, so :meth:`observe` learns the group (docs/matchmaker.md,
  "Group scoring"). Trust is still credited to the teacher only.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import Any, Literal, Protocol

import numpy as np
from numpy.typing import ArrayLike, NDArray

from peerlm.protocols import DEFAULT_PROTOCOL

from .features import ContextFeatures
from .linucb import LinUCB, PairTables
from .matching import greedy_disjoint, greedy_students, max_weight_disjoint
from .menu import MERGE_PROTOCOLS, AdmissibilityMask, Capabilities
from .normalise import DEFAULT_REWARD_CLIP_SIGMAS, Normaliser, RewardNormaliser, check_reward
from .prefilter import (
    DEFAULT_CLUSTER_MIN_AGENTS,
    DEFAULT_SHORTLIST,
    CheapScore,
    PrefilterScratch,
    prefilter_pairs,
)
from .profile import check_context_columns, validate_profiles
from .robust_normalise import DEFAULT_REWARD_WINDOW, RobustRewardNormaliser
from .trust import TrustLedger

__all__ = [
    "MAX_MERGE_SENDERS",
    "MAX_TEACHERS_PER_STUDENT",
    "Matchmaker",
    "MatchmakerState",
    "Pairing",
    "PairingPolicy",
]

#: Most senders one merge directive may name (the primary and its co-senders): the
#: student pulls each adapter, so this bounds one directive's fan-out.
MAX_MERGE_SENDERS = 16
#: Most teachers one student may learn from a round under ``pairing="per_student"``: each
#: is a package to fetch and an integration to run, so this bounds a student's round.
MAX_TEACHERS_PER_STUDENT = 16
#: Seeded random partners per agent added by the prefilter (exploration beyond top-k).
DEFAULT_PREFILTER_RANDOM = 2
# Refill passes per select (each pairs leftovers of the previous; two or three suffice).
_MAX_PASSES = 8
# In a round that uses the clustered top-k search, refill passes use it from this many
# leftovers on (2 x the shortlist: below that the exact search scores fewer pairs).
_REFILL_CLUSTER_MIN_AGENTS = 2 * DEFAULT_SHORTLIST + 1
# Group co-sender scoring builds contexts for at most about this many (pairing, candidate)
# rows at once (~8 MiB at d = 132), whatever the number of merge pairings.
_GROUP_BLOCK_ROWS = 8192


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Disable the cyclic garbage collector for the block (restored as it was after)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass(frozen=True)
class Pairing:
    """One directive of a round: ``sender`` teaches ``receiver`` with ``protocol``.

    ``context`` is the x that was scored (stored read-only: :meth:`Matchmaker.observe`
    updates with exactly this vector); ``ucb`` and ``mean`` are ``theta^T x + beta *
    sqrt(x^T A^-1 x)`` and ``theta^T x`` at selection time. Baselines fill ``context``
    and the scores as their docstrings say. ``co_senders``: further senders of a merge
    protocol whose adapters the receiver merges with the sender's (``merge_senders``,
    best UCB first; ``()`` for every other pairing). Under ``co_sender_scoring="pair"``
    ``context`` and the reward stay the primary ``sender``'s (docs/matchmaker.md,
    "Several senders per merge directive"); under ``"group"`` co-senders are in the order
    the greedy added them and ``context``, ``ucb`` and ``mean`` are the group's.
    """

    sender: str
    receiver: str
    protocol: str
    role: str
    context: NDArray[np.float64] = field(repr=False)
    ucb: float
    mean: float
    co_senders: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        arr = np.asarray(self.context, dtype=np.float64)
        if arr.flags.writeable:
            # A private read-only copy: nobody can change the x a reward will be tied to.
            arr = arr.copy()
            arr.flags.writeable = False
        object.__setattr__(self, "context", arr)

    @classmethod
    def _trusted_batch(
        cls, rows: Iterable[tuple[str, str, str, str, NDArray[np.float64], float, float]]
    ) -> list[Pairing]:
        """Pairings from values the matchmaker produced itself, one per ``(sender, receiver,
        protocol, role, context, ucb, mean)`` row, ``context`` already a read-only float64
        row. Skips the frozen-dataclass ``__init__`` (seven guarded ``setattr`` calls and
        the copy check), and pauses the cyclic garbage collector meanwhile: 5,000 pairings
        are 10,000 new containers, enough to trigger collections that walk the caller's
        whole heap (about half the cost of building them at N = 10,000)."""
        new, set_attr = object.__new__, object.__setattr__
        out: list[Pairing] = []
        append = out.append
        with _gc_paused():
            for sender, receiver, protocol, role, context, ucb, mean in rows:
                obj = new(cls)
                set_attr(
                    obj,
                    "__dict__",
                    {
                        "sender": sender,
                        "receiver": receiver,
                        "protocol": protocol,
                        "role": role,
                        "context": context,
                        "ucb": ucb,
                        "mean": mean,
                        "co_senders": (),
                    },
                )
                append(obj)
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Pairing):
            return NotImplemented
        return (
            (self.sender, self.receiver, self.protocol, self.role, self.ucb, self.mean)
            == (other.sender, other.receiver, other.protocol, other.role, other.ucb, other.mean)
            and self.co_senders == other.co_senders
            and self.context.shape == other.context.shape
            and bool(np.array_equal(self.context, other.context))
        )

    def __hash__(self) -> int:
        return hash((self.sender, self.receiver, self.protocol, self.role, self.ucb, self.mean))


@dataclass(eq=False)
class MatchmakerState:
    """Everything :class:`Matchmaker` learns, as plain arrays, ints and floats.

    Nothing here needs pickle: the arrays are float64 (store as raw bytes plus shape).
    The seed and hyper-parameters are configuration, not state, and are not included.
    """

    context_dim: int
    a_inv: NDArray[np.float64]
    b: NDArray[np.float64]
    n_updates: int
    reward_count: int
    reward_mean: float
    reward_m2: float
    trust: dict[str, tuple[int, int]]
    #: ``A`` itself (d, d); ``None`` in a state stored before ``A`` was kept.
    a: NDArray[np.float64] | None = None
    #: The robust normaliser's window (raw rewards, oldest first; ``reward_count`` is then
    #: its count and ``reward_mean``/``reward_m2`` are 0); ``None`` for the running z-score.
    reward_window: NDArray[np.float64] | None = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MatchmakerState):
            return NotImplemented
        return (
            (self.context_dim, self.n_updates, self.reward_count)
            == (other.context_dim, other.n_updates, other.reward_count)
            and (self.reward_mean, self.reward_m2) == (other.reward_mean, other.reward_m2)
            and self.trust == other.trust
            and bool(np.array_equal(self.a_inv, other.a_inv))
            and bool(np.array_equal(self.b, other.b))
            and _same_window(self.reward_window, other.reward_window)
        )

    __hash__ = None  # type: ignore[assignment]  # mutable


def _same_window(a: NDArray[np.float64] | None, b: NDArray[np.float64] | None) -> bool:
    if a is None or b is None:
        return a is b
    return bool(np.array_equal(a, b))


@dataclass(frozen=True)
class _Picked:
    """The pairings one selection pass kept, best first (agent indices into the round)."""

    senders: NDArray[np.intp]
    receivers: NDArray[np.intp]
    combos: NDArray[np.intp]
    ucb: NDArray[np.float64]
    mean: NDArray[np.float64]


def _descending(values: NDArray[np.float64]) -> NDArray[np.intp]:
    """``np.argsort(-values, kind="stable")``, ~2x faster when no two values are equal.

    The default (unstable, SIMD) sort is tried first: without equal values the order is
    unique, so it is the stable one; if the sorted keys hold an equal neighbour or a NaN
    (``NaN != NaN`` would hide a tie), the stable sort is run after all."""
    neg = -values
    order: NDArray[np.intp] = np.argsort(neg)
    keys = neg[order]
    if len(keys) > 1 and (bool(np.any(keys[1:] == keys[:-1])) or bool(np.isnan(keys[-1]))):
        order = np.argsort(neg, kind="stable")
    return order


def _pair_best_mask(ucb2: NDArray[np.float64], perm: NDArray[np.intp]) -> NDArray[np.bool_]:
    """Flat mask of each row's best tuple of ``ucb2`` (pairs x tuples): the highest UCB,
    ties to the earliest position in ``perm`` — the tuple the full tie-broken order
    (``perm`` stably sorted by descending UCB) would reach first. O(tuples), no sort."""
    n_pairs, combos = ucb2.shape
    pos = np.empty(perm.size, dtype=np.intp)
    pos[perm] = np.arange(perm.size)
    pos2 = pos.reshape(n_pairs, combos)
    if combos == 2:
        # One protocol and role (the default): the reverse direction wins when its UCB is
        # higher, or equal and earlier in perm; a NaN never wins, as in the general path.
        u, p = ucb2.T, pos2.T
        second = (u[1] > u[0]) | ((u[1] == u[0]) & (p[1] < p[0]))
        pair_mask = np.empty((n_pairs, 2), dtype=bool)
        pair_mask[:, 1] = second
        np.logical_not(second, out=pair_mask[:, 0])
        return pair_mask.ravel()
    top = ucb2 == ucb2.max(axis=1, keepdims=True)
    best = np.where(top, pos2, perm.size).argmin(axis=1) + np.arange(n_pairs) * combos
    mask = np.zeros(perm.size, dtype=bool)
    mask[best] = True
    return mask


class PairingPolicy(Protocol):
    """What a benchmark or the service needs from a matchmaker (learnt or baseline)."""

    def select(self, profiles: Mapping[str, ArrayLike]) -> list[Pairing]:
        """Pairing directives for this round's profiles: disjoint pairs (the paper's), or
        one teacher per student (``pairing="per_student"``)."""
        ...

    def observe(self, pairing: Pairing, reward: float) -> float:
        """Feed back the reward reported for ``pairing``; returns the value learnt from."""
        ...


class Matchmaker:
    """LinUCB matchmaker over (sender, receiver, protocol, role) tuples (Algorithm 2).

    Args:
        profile_dim: ``d_p``, the length of every profile vector.
        beta: exploration weight of the UCB bonus (>= 0).
        pair_budget: ``K_p``; ``None`` means ``floor(N / 2)`` (every agent may be paired).
        protocols: the admissible knowledge-exchange protocols ``K_rec``.
        seed: seeds every random choice (tie-breaks, random prefilter partners).
        roles: admissible role assignments ``R_ij``; ``"one_way"`` means the sender
            teaches the receiver (the only role AKD has). Every (protocol, role)
            combination is admissible.
        interaction_features: add ``|p_s - p_r|`` and ``p_s * p_r`` to the context.
        trust_features: add the CPM-maintained trust of sender and receiver.
        matching: ``"greedy"`` (Algorithm 2) or ``"blossom"`` (exact max-weight).
        prefilter_k: partners kept per agent by the cheap prefilter score.
        prefilter_min_agents: prefilter only from this many agents on (exact below).
        ridge: ``A`` starts as ``ridge * I``.
        prefilter_random: seeded random partners added per agent by the prefilter.
        prefilter_cluster_min_agents: from this many agents on the prefilter's top-k
            search is clustered (sub-quadratic, approximate; see :mod:`.prefilter`); such
            a round's refill passes keep it while more than ``2 * DEFAULT_SHORTLIST``
            agents are left.
        score_precision: arithmetic of the per-pair part of the exact UCB
            (:meth:`.LinUCB.score_pairs`): ``"float32"`` (default; ~2x faster, UCBs within
            ~1e-6 of float64) or ``"float64"``.
        context_columns: the profile entries the context map sees (indices into a
            ``profile_dim`` profile, in this order); ``None``: all of them. Profiles are
            still validated whole. A context of few columns suits a federation that gives
            the bandit few rewards (docs/matchmaker.md, "Context columns").
        merge_senders: most senders one merge directive (``pmix``, ``svd_hka``) names:
            after the walk, a receiver of a merge pairing gets up to ``merge_senders - 1``
            co-senders, its admissible candidate partners of the round with the best UCB
            for (co-sender, receiver, protocol, role); 1 (default): none, selection
            exactly as without the setting.
        reward_clip_sigmas: rewards are winsorised to this many running standard
            deviations before the z-score (our guard against a hostile student's report;
            :mod:`.normalise`); None: the paper's plain running z-score. Under
            ``reward_normaliser="robust"`` the bound on each z-score.
        co_sender_scoring: ``"pair"`` (default): co-senders ranked by their own pair UCB,
            the reward learnt on the teacher's context, exactly as without the setting;
            ``"group"``: the group is grown greedily by its group UCB and its context is
            the one learnt (:meth:`_group_co_senders`). No effect with one sender.
        reward_normaliser: ``"zscore"`` (default): the paper's running z-score,
            winsorised (:mod:`.normalise`); ``"robust"``: median/MAD over the last
            ``reward_window`` rewards (:mod:`.robust_normalise`), which a hostile member
            filing fewer than half of them cannot flatten.
        reward_window: rewards the robust normaliser keeps (unused under ``"zscore"``).
        pairing: ``"disjoint"`` (default, Algorithm 2): at most ``floor(N / 2)`` pairs, no
            agent in two; ``"per_student"`` (ours; docs/matchmaker.md, "A student every
            round"): every agent may be the student of one pairing a round, the walk
            keeping, best UCB first, a tuple whose receiver has no teacher yet and whose
            sender teaches fewer than ``teacher_capacity`` students; an agent may teach
            and learn in the same round. ``K_p`` then bounds the pairings up to ``N``.
            Greedy matching only.
        teacher_capacity: students one sender may teach a round under ``"per_student"``;
            ``None``: any number.
        teachers_per_student: teachers one receiver may learn from a round under
            ``"per_student"`` (ours; docs/matchmaker.md, "Several teachers a student"): the
            walk keeps a receiver's best ``teachers_per_student`` distinct senders, so a
            student is taught by its second-best teacher too instead of by its best one
            alone. ``K_p`` then bounds the pairings up to ``N * teachers_per_student``.
            1 (default): one teacher, exactly as without the setting.
    """

    def __init__(
        self,
        profile_dim: int = 32,
        beta: float = 1.0,
        pair_budget: int | None = None,
        protocols: Sequence[str] = (DEFAULT_PROTOCOL,),
        seed: int = 0,
        *,
        roles: Sequence[str] = ("one_way",),
        interaction_features: bool = True,
        trust_features: bool = True,
        matching: Literal["greedy", "blossom"] = "greedy",
        prefilter_k: int = 8,
        prefilter_min_agents: int = 64,
        ridge: float = 1.0,
        prefilter_random: int = DEFAULT_PREFILTER_RANDOM,
        prefilter_cluster_min_agents: int = DEFAULT_CLUSTER_MIN_AGENTS,
        score_precision: Literal["float32", "float64"] = "float32",
        context_columns: Sequence[int] | None = None,
        merge_senders: int = 1,
        reward_clip_sigmas: float | None = DEFAULT_REWARD_CLIP_SIGMAS,
        co_sender_scoring: Literal["pair", "group"] = "pair",
        reward_normaliser: Literal["zscore", "robust"] = "zscore",
        reward_window: int = DEFAULT_REWARD_WINDOW,
        pairing: Literal["disjoint", "per_student"] = "disjoint",
        teacher_capacity: int | None = None,
        teachers_per_student: int = 1,
    ) -> None:
        if not (math.isfinite(beta) and beta >= 0):
            raise ValueError("beta must be a finite number >= 0")
        if pair_budget is not None and pair_budget < 0:
            raise ValueError("pair_budget must be >= 0 or None")
        if seed < 0:
            raise ValueError("seed must be >= 0")
        if matching not in ("greedy", "blossom"):
            raise ValueError(f"matching must be 'greedy' or 'blossom', got {matching!r}")
        if pairing not in ("disjoint", "per_student"):
            raise ValueError(f"pairing must be 'disjoint' or 'per_student', got {pairing!r}")
        if pairing == "per_student" and matching != "greedy":
            raise ValueError("pairing 'per_student' is walked greedily: matching must be 'greedy'")
        if teacher_capacity is not None and (
            not isinstance(teacher_capacity, int) or teacher_capacity < 1
        ):
            raise ValueError(f"teacher_capacity must be an integer >= 1, got {teacher_capacity!r}")
        if (
            isinstance(teachers_per_student, bool)
            or not isinstance(teachers_per_student, int)
            or not 1 <= teachers_per_student <= MAX_TEACHERS_PER_STUDENT
        ):
            raise ValueError(
                f"teachers_per_student must be an integer in [1, {MAX_TEACHERS_PER_STUDENT}], "
                f"got {teachers_per_student!r}"
            )
        if teachers_per_student > 1 and pairing != "per_student":
            raise ValueError("teachers_per_student > 1 needs pairing 'per_student'")
        if prefilter_k < 1 or prefilter_random < 0:
            raise ValueError("prefilter_k must be >= 1 and prefilter_random >= 0")
        if prefilter_min_agents < 2:
            raise ValueError("prefilter_min_agents must be >= 2")
        if score_precision not in ("float32", "float64"):
            raise ValueError(
                f"score_precision must be 'float32' or 'float64', got {score_precision!r}"
            )
        if not isinstance(merge_senders, int) or not 1 <= merge_senders <= MAX_MERGE_SENDERS:
            raise ValueError(
                f"merge_senders must be an integer in [1, {MAX_MERGE_SENDERS}], "
                f"got {merge_senders!r}"
            )
        if co_sender_scoring not in ("pair", "group"):
            raise ValueError(
                f"co_sender_scoring must be 'pair' or 'group', got {co_sender_scoring!r}"
            )
        if reward_normaliser not in ("zscore", "robust"):
            raise ValueError(
                f"reward_normaliser must be 'zscore' or 'robust', got {reward_normaliser!r}"
            )
        self._merge_senders = merge_senders
        self._co_sender_scoring = co_sender_scoring
        self._profile_dim = int(profile_dim)
        self._columns = check_context_columns(context_columns, self._profile_dim)
        self._features = ContextFeatures(
            profile_dim if self._columns is None else len(self._columns),
            protocols,
            roles,
            interaction=interaction_features,
            trust=trust_features,
        )
        self._bandit = LinUCB(self._features.dim, ridge)
        self._reward_clip_sigmas = reward_clip_sigmas
        self._reward_normaliser = reward_normaliser
        self._reward_window = reward_window
        # Validates reward_clip_sigmas and reward_window.
        self._normaliser: Normaliser = self._new_normaliser()
        self._trust = TrustLedger()
        self._beta = float(beta)
        self._ridge = float(ridge)
        self._pair_budget = pair_budget
        self._seed = int(seed)
        self._matching = matching
        self._pairing = pairing
        self._teacher_capacity = teacher_capacity
        self._teachers_per_student = teachers_per_student
        self._prefilter_k = int(prefilter_k)
        self._prefilter_min_agents = int(prefilter_min_agents)
        self._prefilter_random = int(prefilter_random)
        self._prefilter_cluster_min_agents = int(prefilter_cluster_min_agents)
        self._score_precision = score_precision
        self._score_dtype = np.float32 if score_precision == "float32" else np.float64
        self._selects_since_update = 0
        self._last_candidates = 0
        # Buffers the exact prefilter reuses across selects (see PrefilterScratch).
        self._scratch = PrefilterScratch()
        # Column layout of LinUCB.score_pairs per pair: C forward combos, then C reverse.
        n_p, n_r = len(self._features.protocols), len(self._features.roles)
        self._combo_forward = np.arange(2 * n_p * n_r) < n_p * n_r

    def _new_normaliser(self, state: MatchmakerState | None = None) -> Normaliser:
        """A fresh normaliser of the configured kind, or one rebuilt from ``state``;
        ``ValueError`` when ``state`` holds the other kind's statistics."""
        clip = self._reward_clip_sigmas
        if self._reward_normaliser == "robust":
            if state is None:
                return RobustRewardNormaliser(self._reward_window, clip_sigmas=clip)
            if state.reward_window is None:
                raise ValueError(
                    "the stored state holds running z-score statistics (no reward window); "
                    "this matchmaker uses reward_normaliser='robust'"
                )
            window = np.asarray(state.reward_window, dtype=np.float64)
            if window.ndim != 1:
                raise ValueError("the stored reward window must be one-dimensional")
            return RobustRewardNormaliser(
                self._reward_window,
                (float(v) for v in window),
                state.reward_count,
                clip_sigmas=clip,
            )
        if state is None:
            return RewardNormaliser(clip_sigmas=clip)
        if state.reward_window is not None:
            raise ValueError(
                "the stored state holds a robust normaliser's reward window; this matchmaker "
                "uses reward_normaliser='zscore'"
            )
        return RewardNormaliser(
            state.reward_count, state.reward_mean, state.reward_m2, clip_sigmas=clip
        )

    # -- read-only views -------------------------------------------------------------

    @property
    def reward_statistics(self) -> tuple[float, float]:
        """The centre and spread the reward normaliser z-scores by: the running mean and
        standard deviation (``"zscore"``), the window's median and 1.4826 * MAD
        (``"robust"``)."""
        return self._normaliser.statistics()

    @property
    def context_dim(self) -> int:
        """Dimension d of the context vectors (132 with every default)."""
        return self._features.dim

    @property
    def features(self) -> ContextFeatures:
        """The context map phi in use."""
        return self._features

    @property
    def theta(self) -> NDArray[np.float64]:
        """Current reward-model weights ``A^-1 b`` (read-only)."""
        return self._bandit.theta

    @property
    def n_updates(self) -> int:
        """Number of rewards learnt from."""
        return self._bandit.n_updates

    @property
    def last_candidates(self) -> int:
        """Number of (sender, receiver, protocol, role) tuples the last select scored."""
        return self._last_candidates

    def trust(self, agent: str) -> float:
        """The smoothed success rate of ``agent`` as a teacher (0.5 if never seen)."""
        return self._trust.score(agent)

    # -- Algorithm 2 -------------------------------------------------------------------

    def select(
        self,
        profiles: Mapping[str, ArrayLike],
        capabilities: Mapping[str, Capabilities] | None = None,
    ) -> list[Pairing]:
        """Pick up to ``K_p`` pairings for the agents in ``profiles``: disjoint ones, or
        under ``pairing="per_student"`` up to ``teachers_per_student`` distinct teachers
        per student.

        ``capabilities``: what each agent declared (:class:`.menu.Capabilities`; an agent
        missing from it counts as undeclared); only admissible (pair, protocol) tuples are
        then selected (:class:`.menu.AdmissibilityMask`). ``None``: every tuple is
        admissible (benchmarks, baselines and tests of the bandit alone). Raises
        ``ValueError`` for an invalid profile (wrong shape, NaN/Inf, absurd magnitude).
        Returns ``[]`` for fewer than two agents. Pairings come best first (within a
        refill pass, see :meth:`_select_pass`).
        """
        if any(not isinstance(a, str) for a in profiles):
            raise ValueError("agent ids must be strings")
        ids = sorted(profiles)
        mat = validate_profiles(ids, [profiles[a] for a in ids], self._profile_dim)
        if self._columns is not None:
            mat = np.ascontiguousarray(mat[:, self._columns])
        # Contexts are built from bounded profiles only (see .features: the norm cap).
        mat = self._features.bound_profiles(mat)
        n = len(ids)
        per_student = self._pairing == "per_student"
        most = n * self._teachers_per_student if per_student else n // 2
        budget = most if self._pair_budget is None else min(self._pair_budget, most)
        self._last_candidates = 0
        if n < 2 or budget == 0:
            return []
        rng = np.random.default_rng(
            [self._seed, self._bandit.n_updates, self._selects_since_update]
        )
        self._selects_since_update += 1
        trust = self._trust.scores(ids) if self._features.trust else None
        admissible: AdmissibilityMask | None = None
        if capabilities is not None:
            admissible = AdmissibilityMask(
                ids, capabilities, self._features.protocols, self._features.roles
            )
            if admissible.trivial:
                admissible = None

        # Refill passes: a prefiltered candidate graph is sparse, so greedy can strand
        # agents whose few candidate partners were taken. Algorithm 2 would still pair
        # them (it stops only at K_p or when nobody is left), so the leftovers get another
        # pass among themselves. With all pairs scored the first pass already fills K_p.
        passes: list[_Picked] = []
        n_chosen = 0
        # A round large enough for the clustered top-k search keeps it for refill passes
        # with more than 2 x the shortlist leftovers (~1,500 of 10,000 after the first
        # pass): there the exact search would cost as much as the first pass's clustered
        # one. Smaller leftovers, and every pass of a smaller round, are searched exactly.
        cluster_min = self._prefilter_cluster_min_agents
        if n >= cluster_min:
            cluster_min = min(cluster_min, _REFILL_CLUSTER_MIN_AGENTS)
        free = np.arange(n, dtype=np.intp)
        taken = np.zeros(n, dtype=bool)
        # per_student: how many teachers each agent has this round, how many students each
        # sender teaches, and the (sender, receiver) pairs kept.
        served = np.zeros(n, dtype=np.intp)
        load = np.zeros(n, dtype=np.intp)
        capacity = n if self._teacher_capacity is None else self._teacher_capacity
        teachers = self._teachers_per_student
        kept: set[tuple[int, int]] = set()
        students = (served, load, capacity, teachers, kept) if per_student else None
        # The per-agent pieces of the exact UCB, once for all passes.
        tables = self._bandit.pair_tables(
            self._features.layout, mat, trust, dtype=self._score_dtype
        )
        # The candidate pairs every pass scored: a merge student's co-senders are chosen
        # among its candidate partners (all agents below the prefilter's threshold).
        seen: list[tuple[NDArray[np.intp], NDArray[np.intp]]] | None = (
            [] if self._merge_senders > 1 else None
        )
        for _ in range(_MAX_PASSES):
            picked = self._select_pass(
                free,
                mat,
                trust,
                tables,
                budget - n_chosen,
                rng,
                cluster_min,
                admissible,
                seen,
                students,
            )
            if not len(picked.senders):
                break
            passes.append(picked)
            n_chosen += len(picked.senders)
            if n_chosen >= budget:
                break
            if per_student:
                # Refill among the students still without a teacher and the senders with
                # room; the walk keeps the rest of its rules.
                if bool((served >= teachers).all()):
                    break
                free = np.flatnonzero((served < teachers) | (load < capacity)).astype(np.intp)
                if len(free) < 2:
                    break
                continue
            taken[picked.senders] = True
            taken[picked.receivers] = True
            free = free[~taken[free]]
            if len(free) < 2:
                break
        if not passes:
            return []

        senders = np.concatenate([p.senders for p in passes])
        receivers = np.concatenate([p.receivers for p in passes])
        combo = np.concatenate([p.combos for p in passes])
        ucb = np.concatenate([p.ucb for p in passes]).tolist()
        mean = np.concatenate([p.mean for p in passes]).tolist()
        n_roles = len(self._features.roles)
        contexts = self._features.build(
            mat, trust, senders, receivers, combo // n_roles, combo % n_roles
        )
        # Read-only, so each Pairing can hold a row view instead of a copy.
        contexts.flags.writeable = False
        names = [(p, r) for p in self._features.protocols for r in self._features.roles]
        pairings = Pairing._trusted_batch(
            (ids[s], ids[r], *names[c], row, u, mu)
            for s, r, c, row, u, mu in zip(
                senders.tolist(),
                receivers.tolist(),
                combo.tolist(),
                contexts,
                ucb,
                mean,
                strict=True,
            )
        )
        if seen is not None and self._co_sender_scoring == "group":
            groups = self._group_co_senders(
                ids, mat, trust, senders, receivers, combo, admissible, seen
            )
            pairings = [
                p if g is None else replace(p, co_senders=g[0], context=g[1], ucb=g[2], mean=g[3])
                for p, g in zip(pairings, groups, strict=True)
            ]
        elif seen is not None:
            co = self._co_senders(ids, tables, senders, receivers, combo, admissible, seen)
            pairings = [
                replace(p, co_senders=c) if c else p for p, c in zip(pairings, co, strict=True)
            ]
        return pairings

    def _co_sender_candidates(
        self,
        n: int,
        senders: NDArray[np.intp],
        receivers: NDArray[np.intp],
        combo: NDArray[np.intp],
        admissible: AdmissibilityMask | None,
        seen: Sequence[tuple[NDArray[np.intp], NDArray[np.intp]]],
    ) -> tuple[list[int], list[NDArray[np.intp]], list[NDArray[np.bool_]]]:
        """The merge pairings (positions into ``senders``) and, for each, the receiver's
        candidate partners of the round's passes but the pairing's sender (ascending
        index) with a flag per candidate: admissible for (candidate -> receiver, the
        pairing's protocol and role) under the walk's mask. See :meth:`_co_senders`."""
        n_roles = len(self._features.roles)
        merge = [
            k
            for k, c in enumerate(combo.tolist())
            if self._features.protocols[c // n_roles] in MERGE_PROTOCOLS
        ]
        if not merge or n < 3:
            return [], [], []
        # Both directions of every candidate pair: partner -> agent.
        src = np.concatenate([a for pair in seen for a in (pair[0], pair[1])])
        dst = np.concatenate([a for pair in seen for a in (pair[1], pair[0])])
        # Sorted by receiver, then partner: one slice per receiver, partners ascending
        # (exact UCB ties then fall to the lower index), duplicates of passes dropped.
        key = np.unique(dst.astype(np.int64) * n + src)
        dst, src = (key // n).astype(np.intp), (key % n).astype(np.intp)
        cands: list[NDArray[np.intp]] = []
        for k in merge:
            s, r = int(senders[k]), int(receivers[k])
            lo, hi = np.searchsorted(dst, [r, r + 1])
            cand = src[lo:hi]
            cands.append(cand[cand != s])
        if admissible is None:
            return merge, cands, [np.ones(len(c), dtype=bool) for c in cands]
        left = np.concatenate(cands)
        right = np.repeat(receivers[merge], [len(c) for c in cands])
        # Forward columns (left -> right: the candidate sends to the receiver).
        cols = np.repeat(combo[merge], [len(c) for c in cands])
        ok = admissible.pairs(left, right)[np.arange(len(left)), cols]
        bounds = np.cumsum([0, *(len(c) for c in cands)]).tolist()
        return merge, cands, [ok[a:b] for a, b in pairwise(bounds)]

    def _co_senders(
        self,
        ids: Sequence[str],
        tables: PairTables,
        senders: NDArray[np.intp],
        receivers: NDArray[np.intp],
        combo: NDArray[np.intp],
        admissible: AdmissibilityMask | None,
        seen: Sequence[tuple[NDArray[np.intp], NDArray[np.intp]]],
    ) -> list[tuple[str, ...]]:
        """Up to ``merge_senders - 1`` co-senders for each merge pairing (``()`` for the
        others): the receiver's candidate partners of this round's passes (``seen``: every
        other agent below the prefilter's threshold; its prefiltered top-k and random
        partners above, so a round costs O(N (k + r)) more scores, not O(N^2)) but the
        pairing's sender, admissible for
        (co-sender -> receiver, the pairing's protocol and role) under the same mask as
        the walk (same parameter space, executes the protocol, on the receiver's overlay
        list when it reported one), ranked by that tuple's UCB, best first; exact ties to
        the lower index (sorted name). Co-senders need not be otherwise unmatched: they
        only serve their adapter (an open ``PullAdapter``), so serving one more student
        costs them no round and takes no pairing from anyone."""
        out: list[tuple[str, ...]] = [()] * len(senders)
        merge, cands, oks = self._co_sender_candidates(
            len(ids), senders, receivers, combo, admissible, seen
        )
        if not merge:
            return out
        spans = [len(c) for c in cands]
        left = np.concatenate(cands)
        right = np.repeat(receivers[merge], spans)
        ucb2, _ = self._bandit.score_pair_tables(tables, left, right, self._beta)
        # Forward columns (left -> right: the candidate sends to the receiver).
        ucb = ucb2[np.arange(len(left)), np.repeat(combo[merge], spans)]
        if admissible is not None:
            ucb = np.where(np.concatenate(oks), ucb, -np.inf)
        start = 0
        for k, span in zip(merge, spans, strict=True):
            cand, u = left[start : start + span], ucb[start : start + span]
            start += span
            order = np.argsort(-u, kind="stable")
            order = order[np.isfinite(u[order])][: self._merge_senders - 1]
            out[k] = tuple(ids[int(i)] for i in cand[order])
        return out

    def _group_co_senders(
        self,
        ids: Sequence[str],
        mat: NDArray[np.float64],
        trust: NDArray[np.float64] | None,
        senders: NDArray[np.intp],
        receivers: NDArray[np.intp],
        combo: NDArray[np.intp],
        admissible: AdmissibilityMask | None,
        seen: Sequence[tuple[NDArray[np.intp], NDArray[np.intp]]],
    ) -> list[tuple[tuple[str, ...], NDArray[np.float64], float, float] | None]:
        """``co_sender_scoring="group"``: for each merge pairing with an admissible
        candidate, ``(co_senders, group context, group UCB, group mean)``; ``None`` for
        the others (their pairing is left as the walk made it).

        Greedy over the same candidates as :meth:`_co_senders` (the receiver's candidate
        partners of the round, admissible, not the student or the sender): starting from
        the primary ``{sender}``, each step adds the candidate whose addition gives the
        group context (:meth:`.ContextFeatures.build_groups`: the members' mean profile
        and trust) the highest UCB, exact ties to the lower index, until
        ``merge_senders - 1`` co-senders or no candidate is left. It does not stop when
        the best addition lowers the group's UCB (docs/matchmaker.md, "Group scoring":
        averaging shortens the context, so a fresh bandit's bonus would never let a group
        form). Co-senders are listed in the order they were added. The returned context
        is the row that was scored, read-only; ``observe`` learns exactly it. Scored in
        float64 on built contexts (:meth:`.LinUCB.score`), in blocks of pairings so that
        no step builds more than ~``_GROUP_BLOCK_ROWS`` contexts at once.
        """
        out: list[tuple[tuple[str, ...], NDArray[np.float64], float, float] | None]
        out = [None] * len(senders)
        merge, cands, oks = self._co_sender_candidates(
            len(ids), senders, receivers, combo, admissible, seen
        )
        n_roles = len(self._features.roles)
        todo = [(k, c[ok]) for k, c, ok in zip(merge, cands, oks, strict=True) if ok.any()]
        block: list[tuple[int, NDArray[np.intp]]] = []
        rows = 0
        for item in [*todo, None]:
            if item is not None and (not block or rows + len(item[1]) <= _GROUP_BLOCK_ROWS):
                block.append(item)
                rows += len(item[1])
                continue
            if block:
                for k, members, x, u, mu in self._grow_groups(
                    mat, trust, senders, receivers, combo // n_roles, combo % n_roles, block
                ):
                    co = tuple(ids[int(i)] for i in members[1:])
                    out[k] = (co, x, u, mu)
            block = [] if item is None else [item]
            rows = 0 if item is None else len(item[1])
        return out

    def _grow_groups(
        self,
        mat: NDArray[np.float64],
        trust: NDArray[np.float64] | None,
        senders: NDArray[np.intp],
        receivers: NDArray[np.intp],
        protocol_idx: NDArray[np.intp],
        role_idx: NDArray[np.intp],
        block: Sequence[tuple[int, NDArray[np.intp]]],
    ) -> Iterator[tuple[int, list[int], NDArray[np.float64], float, float]]:
        """The greedy of :meth:`_group_co_senders` for a block of merge pairings, given
        as ``(position, admissible candidates ascending)``; yields ``(position, members
        in order of addition, context, ucb, mean)``. All groups of a step have the same
        size, so each step is one :meth:`.ContextFeatures.build_groups` and one
        :meth:`.LinUCB.score` call over every (pairing, candidate) of the block."""
        members = [[int(senders[k])] for k, _ in block]
        pools = [c for _, c in block]
        best: list[tuple[NDArray[np.float64], float, float] | None] = [None] * len(block)
        for _ in range(self._merge_senders - 1):
            active = [j for j, pool in enumerate(pools) if len(pool)]
            if not active:
                break
            spans = [len(pools[j]) for j in active]
            size = len(members[active[0]]) + 1
            grid = np.empty((sum(spans), size), dtype=np.intp)
            grid[:, : size - 1] = np.repeat([members[j] for j in active], spans, axis=0)
            grid[:, size - 1] = np.concatenate([pools[j] for j in active])
            pos = np.repeat([block[j][0] for j in active], spans)
            x = self._features.build_groups(
                mat, trust, grid, receivers[pos], protocol_idx[pos], role_idx[pos]
            )
            ucb, mean = self._bandit.score(x, self._beta)
            start = 0
            for j, span in zip(active, spans, strict=True):
                # argmax: the first of equal UCBs, i.e. the lowest index (pools ascend).
                pick = start + int(np.argmax(ucb[start : start + span]))
                start += span
                members[j].append(int(grid[pick, size - 1]))
                pools[j] = pools[j][pools[j] != members[j][-1]]
                row = x[pick].copy()
                row.flags.writeable = False
                best[j] = (row, float(ucb[pick]), float(mean[pick]))
        for j, (k, _) in enumerate(block):
            found = best[j]
            if found is not None:
                yield k, members[j], found[0], found[1], found[2]

    def _select_pass(
        self,
        agents: NDArray[np.intp],
        mat: NDArray[np.float64],
        trust: NDArray[np.float64] | None,
        tables: PairTables,
        budget: int,
        rng: np.random.Generator,
        cluster_min: int,
        admissible: AdmissibilityMask | None = None,
        seen: list[tuple[NDArray[np.intp], NDArray[np.intp]]] | None = None,
        students: tuple[NDArray[np.intp], NDArray[np.intp], int, int, set[tuple[int, int]]]
        | None = None,
    ) -> _Picked:
        """One Algorithm-2 pass over ``agents``, best first; indices are into ``mat`` and
        ``tables`` (the bandit's pair tables of all of ``mat``). The prefilter's top-k
        search is clustered from ``cluster_min`` agents on. With ``admissible``, only its
        admissible tuples can be picked. ``seen`` collects the pass's candidate pairs.
        ``students``: ``(served, load, capacity, teachers, kept)`` of
        ``pairing="per_student"``, indexed like ``mat`` and updated by the walk
        (:func:`.matching.greedy_students`)."""
        sub = mat[agents]
        sub_trust = None if trust is None else trust[agents]
        n = len(agents)
        left, right = self._candidate_pairs(sub, sub_trust, rng, cluster_min)
        if seen is not None:
            seen.append((agents[left], agents[right]))
        ok2: NDArray[np.bool_] | None = None
        if admissible is not None:
            ok2 = admissible.pairs(agents[left], agents[right])
            # Pairs with no admissible tuple are not scored at all.
            keep = ok2.any(axis=1)
            if not bool(keep.all()):
                left, right, ok2 = left[keep], right[keep], ok2[keep]
            if not len(left):
                none = np.empty(0, dtype=np.intp)
                return _Picked(none, none, none, np.empty(0), np.empty(0))
        ucb2, mean2 = self._bandit.score_pair_tables(
            tables, agents[left], agents[right], self._beta
        )
        if ok2 is not None:
            # A forbidden tuple of an admissible pair ranks below every admissible one, so
            # neither the per-pair best (greedy) nor the rank argmin (blossom) can take it.
            ucb2 = np.where(ok2, ucb2, -np.inf)
            self._last_candidates += int(np.count_nonzero(ok2))
        else:
            self._last_candidates += ucb2.size
        n_pairs, combos = ucb2.shape
        ucb, mean = ucb2.ravel(), mean2.ravel()

        def ends(tuples: NDArray[np.intp]) -> tuple[NDArray[np.intp], NDArray[np.intp]]:
            # Sender and receiver of the given flat tuple indices (only those: the walk
            # needs each pair's best tuple, not all 2C of them).
            pair, fwd = tuples // combos, self._combo_forward[tuples % combos]
            return np.where(fwd, left[pair], right[pair]), np.where(fwd, right[pair], left[pair])

        # Descending UCB; exact ties fall to a seeded random permutation (never to input order).
        perm = rng.permutation(len(ucb))
        if students is not None:
            # Every direction of every pair is a candidate of its own (a and b may teach
            # each other); forbidden tuples (-inf) are never kept.
            order = perm[_descending(ucb[perm])]
            order = order[np.isfinite(ucb[order])]
            s_order, r_order = ends(order)
            served, load, capacity, teachers, kept = students
            walked = greedy_students(
                agents[s_order], agents[r_order], budget, served, load, capacity, teachers, kept
            )
            picked = order[np.asarray(walked, dtype=np.intp)]
        elif self._matching == "greedy":
            # Only each pair's best tuple can be kept by the greedy walk (its other tuples
            # come later, with the same two agents), so only those are ranked and walked:
            # the walk over all tuples in the full order keeps the same candidates.
            order = perm[_pair_best_mask(ucb2, perm)[perm]]
            order = order[_descending(ucb[order])]
            s_order, r_order = ends(order)
            walk = np.arange(len(order), dtype=np.intp)
            picked = order[np.asarray(greedy_disjoint(s_order, r_order, walk, budget, n), np.intp)]
        else:
            order = perm[_descending(ucb[perm])]
            rank = np.empty(len(ucb), dtype=np.intp)
            rank[order] = np.arange(len(ucb))
            # Each pair's best tuple (over directions, protocols, roles) under the same order.
            best = rank.reshape(n_pairs, combos).argmin(axis=1) + np.arange(n_pairs) * combos
            edges = max_weight_disjoint(left, right, ucb[best], budget, n)
            picked = best[np.asarray(edges, dtype=np.intp)]
            picked = picked[np.argsort(rank[picked], kind="stable")]
        senders, receivers = ends(picked)
        return _Picked(
            senders=agents[senders],
            receivers=agents[receivers],
            combos=picked % (combos // 2),
            ucb=ucb[picked],
            mean=mean[picked],
        )

    def _candidate_pairs(
        self,
        mat: NDArray[np.float64],
        trust: NDArray[np.float64] | None,
        rng: np.random.Generator,
        cluster_min: int,
    ) -> tuple[NDArray[np.intp], NDArray[np.intp]]:
        """Unordered candidate pairs: all of them, or the prefiltered ones for large N."""
        n = mat.shape[0]
        survivors = self._prefilter_k + self._prefilter_random
        if n >= self._prefilter_min_agents and survivors < n - 1:
            inputs = CheapScore(
                mat,
                trust,
                self._features.layout,
                self._bandit.theta,
                np.diagonal(self._bandit.a_inv),
                self._beta,
            )
            return prefilter_pairs(
                inputs,
                self._prefilter_k,
                self._prefilter_random,
                rng,
                cluster_min_agents=cluster_min,
                scratch=self._scratch,
            )
        left, right = np.triu_indices(n, 1)
        return left.astype(np.intp), right.astype(np.intp)

    # -- feedback (Algorithm 3, phase 4) -----------------------------------------------

    def observe(self, pairing: Pairing, reward: float) -> float:
        """Learn from ``reward`` (Eq. 3, raw) for ``pairing``; returns the z-scored reward.

        Updates the running normaliser, then ``A^-1`` (Sherman–Morrison) and ``b`` with
        exactly ``pairing.context``, then the sender's trust (success: raw reward > 0).
        Raises ``ValueError`` — with no state changed — for a non-finite or absurd reward
        or a context of the wrong shape or with non-finite entries.
        """
        value = check_reward(reward)
        x = self._features.bound_context(np.asarray(pairing.context, dtype=np.float64))
        s = self._bandit.prepare(x)  # validates x before anything changes
        r_norm = self._normaliser.update(value)
        self._bandit.commit(x, s, r_norm)
        self._trust.record(pairing.sender, value > 0.0)
        self._selects_since_update = 0
        return r_norm

    def observe_many(self, pairings: Sequence[Pairing], rewards: Sequence[float]) -> list[float]:
        """:meth:`observe` for many pairings at once: one block update of the bandit.

        Rewards are normalised in order (each z-scored after folding it in, as
        :meth:`observe` would); the bandit update is one Woodbury step
        (:meth:`.LinUCB.update_block`), equal to the sequential updates to rounding.
        Raises ``ValueError`` with no state changed if any reward or context is invalid.
        """
        values = [check_reward(r) for r in rewards]
        if len(values) != len(pairings):
            raise ValueError("one reward per pairing")
        if not pairings:
            return []
        xs = np.stack(
            [
                self._features.bound_context(np.asarray(p.context, dtype=np.float64))
                for p in pairings
            ]
        )
        if xs.shape[1] != self.context_dim or not np.all(np.isfinite(xs)):
            raise ValueError("contexts must be finite and of the bandit's dimension")
        saved = self._normaliser.copy()
        r_norm = [self._normaliser.update(v) for v in values]
        try:
            self._bandit.update_block(xs, np.asarray(r_norm, dtype=np.float64))
        except BaseException:
            self._normaliser = saved
            raise
        for pairing, value in zip(pairings, values, strict=True):
            self._trust.record(pairing.sender, value > 0.0)
        self._selects_since_update = 0
        return r_norm

    # -- persistence -------------------------------------------------------------------

    def snapshot(self) -> MatchmakerState:
        """A copy of the learnt state (A^-1, b, normaliser, trust)."""
        normaliser = self._normaliser
        window: NDArray[np.float64] | None = None
        if isinstance(normaliser, RobustRewardNormaliser):
            count, rewards = normaliser.state()
            mean, m2 = 0.0, 0.0
            window = np.array(rewards, dtype=np.float64)
        else:
            assert isinstance(normaliser, RewardNormaliser)
            count, mean, m2 = normaliser.state()
        return MatchmakerState(
            context_dim=self.context_dim,
            a_inv=np.array(self._bandit.a_inv, dtype=np.float64),
            a=np.array(self._bandit.a, dtype=np.float64),
            b=np.array(self._bandit.b, dtype=np.float64),
            n_updates=self._bandit.n_updates,
            reward_count=count,
            reward_mean=mean,
            reward_m2=m2,
            trust=self._trust.state(),
            reward_window=window,
        )

    def restore(self, state: MatchmakerState) -> None:
        """Replace the learnt state with ``state`` exactly; all-or-nothing.

        Raises ``ValueError`` (leaving this matchmaker unchanged) if ``state`` does not
        fit this configuration or is inconsistent (shapes, non-finite values, asymmetric
        ``A^-1``, negative counts, successes > exchanges) or holds the other reward
        normaliser's statistics (a z-score state under ``"robust"``, a window under
        ``"zscore"``).
        """
        if state.context_dim != self.context_dim:
            raise ValueError(
                f"state has context_dim {state.context_dim}, this matchmaker {self.context_dim}"
            )
        bandit = LinUCB.from_arrays(
            state.a_inv, state.b, state.n_updates, state.a, ridge=self._ridge
        )
        if bandit.dim != self.context_dim:
            raise ValueError(f"a_inv is {bandit.dim}-dimensional, expected {self.context_dim}")
        normaliser = self._new_normaliser(state)
        trust = TrustLedger(state.trust)
        self._bandit, self._normaliser, self._trust = bandit, normaliser, trust
        self._selects_since_update = 0

    def check(self) -> bool:
        """Full O(d^3) validation of the bandit; on failure, re-derive ``A^-1`` and re-check.

        True when ``A^-1`` is symmetric positive definite and inverts ``A``: the state may
        then be persisted. Run before every snapshot, never per reward.
        """
        if self._bandit.check():
            return True
        try:
            self._bandit.refactor()
        except ValueError:
            return False
        return self._bandit.check()

    @property
    def refactors(self) -> int:
        """Re-derivations of ``A^-1`` from ``A`` by the current bandit object."""
        return self._bandit.refactors

    def config(self) -> dict[str, Any]:
        """The hyper-parameters (for logs and for checking a stored state belongs here)."""
        return {
            "profile_dim": self._profile_dim,
            "context_columns": None if self._columns is None else self._columns.tolist(),
            "beta": self._beta,
            "ridge": self._ridge,
            "pair_budget": self._pair_budget,
            "protocols": self._features.protocols,
            "roles": self._features.roles,
            "seed": self._seed,
            "interaction_features": self._features.interaction,
            "trust_features": self._features.trust,
            "matching": self._matching,
            "prefilter_k": self._prefilter_k,
            "prefilter_min_agents": self._prefilter_min_agents,
            "prefilter_random": self._prefilter_random,
            "prefilter_cluster_min_agents": self._prefilter_cluster_min_agents,
            "score_precision": self._score_precision,
            "context_dim": self.context_dim,
            "merge_senders": self._merge_senders,
            "reward_clip_sigmas": self._reward_clip_sigmas,
            "co_sender_scoring": self._co_sender_scoring,
            "reward_normaliser": self._reward_normaliser,
            "reward_window": self._reward_window,
        }
