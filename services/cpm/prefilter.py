"""Candidate pre-filtering for large federations (the paper's O(N k d_p) matchmaking).

Scoring every ordered pair exactly costs O(N^2 d^2) (a d x d quadratic form per
candidate, d ~ 4 d_p). For ``N >= prefilter_min_agents`` the matchmaker first ranks all
pairs with a *cheap* score built from O(N^2 d_p) matrix products — never materialising
an N^2 x d context tensor — keeps each agent's ``k`` best partners plus a few seeded
random ones, and scores only the surviving pairs exactly.

The cheap score of ``i -> j`` decomposes ``theta`` over the context blocks
(:class:`~.features.FeatureLayout`)::

    mean ~ theta_s.p_i + theta_r.p_j + theta_a.(p_i - p_j)^2 + p_i^T diag(theta_p) p_j
           + theta_ts t_i + theta_tr t_j + max(theta_onehot) + theta_bias

which is ``a_i + c_j + p_i^T diag(theta_p - 2 theta_a) p_j``: separable terms plus one
symmetric bilinear form, i.e. one ``(N, d_p) @ (d_p, N)`` product. The ``|p_i - p_j|``
block is approximated by the squared difference (which is bilinear; ``|d|`` is not).

Choice beyond the issue: the exploration bonus is approximated the same way, with the
diagonal of ``A^-1`` (``v``) standing in for the full matrix::

    x^T A^-1 x ~ sum_k v_k x_k^2
              = alpha_i + gamma_j - 2 p_i^T diag(v_a) p_j + (p_i^2)^T diag(v_p) (p_j^2)

(for the ``|d|`` block ``x^2 = d^2`` is exact, and the product block squares to a
bilinear form of the squared profiles), so the prefilter ranks by an optimistic score
``mean + beta * sqrt(var)`` like the exact pass, not by the mean alone: otherwise an
untried region of profile space would only be reached through the random partners.

The pair score is ``max(mean(i->j), mean(j->i)) + beta * sqrt(var_avg)`` with
``var_avg`` the variance approximation averaged over the two directions. Both parts are
symmetric: the bilinear part of the mean is the same in both directions, so the better
direction is ``B_ij + s_i + s_j + |d_i - d_j|`` (``s``, ``d`` the half sum and half
difference of the separable sender and receiver terms). Each part is one GEMM, the
separable terms riding along as extra columns (``[L, s, 1] @ [R; 1; s] = L R + s_i +
s_j``): two ``(N, ~2 d_p) @ (~2 d_p, N)`` products, one outer difference and a handful
of elementwise passes. Rows are processed in blocks to bound memory (at N = 10^4 a full
matrix would be 400 MB), in float32, which is plenty for a ranking and halves memory traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from .features import FeatureLayout

__all__ = [
    "CheapScore",
    "PrefilterScratch",
    "cheap_pair_scores",
    "clustered_top_k",
    "exact_top_k",
    "prefilter_pairs",
    "top_k_partners",
]

# Elements per row block of the N x N score matrix (~8 MB per float32 temporary).
_BLOCK_ELEMENTS = 1 << 21
#: From this many agents on, the top-k search is clustered (sub-quadratic) instead of exact.
DEFAULT_CLUSTER_MIN_AGENTS = 2048
#: Target agents per k-means cell of the clustered search.
DEFAULT_CLUSTER_SIZE = 128
#: Partners scored per cell: the agents that score best against the cell's centre.
DEFAULT_SHORTLIST = 512
# k-means is fitted on at most this many agents per cell, then every agent is assigned.
_FIT_PER_CELL = 8


def _block(vec: NDArray[np.float64], sl: slice | None) -> NDArray[np.float64] | None:
    return None if sl is None else vec[sl]


@dataclass(frozen=True)
class CheapScore:
    """What the cheap pair score is computed from.

    ``profiles`` (N, d_p) are the bounded profiles and ``trust`` (N,) the agents' trust
    (``None``: 0.5 for everyone where trust features are on); ``theta`` and
    ``a_inv_diag`` are the bandit's weights and the diagonal of ``A^-1``, laid out as
    ``layout`` says; ``beta`` weighs the exploration bonus as in the exact UCB.
    """

    profiles: NDArray[np.float64]
    trust: NDArray[np.float64] | None
    layout: FeatureLayout
    theta: NDArray[np.float64]
    a_inv_diag: NDArray[np.float64]
    beta: float

    def model(self) -> _CheapModel:
        """The per-agent factors of the score (O(N d_p))."""
        return _CheapModel(self.profiles, self.trust, self.layout, self.theta, self.a_inv_diag)


class PrefilterScratch:
    """Float32 buffers reused by the exact top-k search from one call to the next.

    The exact search writes each row block of the N x N score matrix (up to
    ``_BLOCK_ELEMENTS`` values) into two buffers. Fresh multi-megabyte temporaries cost
    more than the arithmetic: the allocator returns them to the kernel when freed, so
    every call page-faults and zeroes them again (~40% of the exact search's CPU time at
    N = 1,000). The owner (a :class:`~.matchmaker.Matchmaker`) keeps one scratch, so it
    holds at most ``2 * _BLOCK_ELEMENTS`` floats (16 MB); it must not be shared between
    threads.
    """

    __slots__ = ("_bufs",)

    def __init__(self) -> None:
        self._bufs: list[NDArray[np.float32]] = [np.empty(0, np.float32) for _ in range(2)]

    def take(self, slot: int, rows: int, cols: int) -> NDArray[np.float32]:
        """A C-contiguous ``(rows, cols)`` view of buffer ``slot`` (0 or 1); grows it."""
        size = rows * cols
        if self._bufs[slot].size < size:
            self._bufs[slot] = np.empty(size, dtype=np.float32)
        return self._bufs[slot][:size].reshape(rows, cols)


_Factors = tuple[NDArray[np.float32], NDArray[np.float32], NDArray[np.float32]]


class _CheapModel:
    """The per-agent vectors and bilinear weights of the cheap score."""

    def __init__(
        self,
        profiles: NDArray[np.float64],
        trust: NDArray[np.float64] | None,
        layout: FeatureLayout,
        theta: NDArray[np.float64],
        a_inv_diag: NDArray[np.float64],
    ) -> None:
        p = profiles
        p2 = p * p
        n, dp = p.shape
        zeros = np.zeros(layout.profile_dim)
        th_a = _block(theta, layout.absdiff)
        th_p = _block(theta, layout.product)
        v_a = _block(a_inv_diag, layout.absdiff)
        v_p = _block(a_inv_diag, layout.product)
        th_a = zeros if th_a is None else th_a
        th_p = zeros if th_p is None else th_p
        v_a = zeros if v_a is None else v_a
        v_p = zeros if v_p is None else v_p
        # Mean: a_i (as sender) + c_j (as receiver) + p_i^T diag(w) p_j.
        a = p @ theta[layout.sender] + p2 @ th_a
        c = p @ theta[layout.receiver] + p2 @ th_a
        const_mean = float(np.max(theta[layout.onehot])) + float(theta[layout.bias])
        # Variance (diagonal approximation): alpha_i + gamma_j + [p, p^2]_i^T diag(q) [p, p^2]_j.
        alpha = p2 @ (a_inv_diag[layout.sender] + v_a)
        gamma = p2 @ (a_inv_diag[layout.receiver] + v_a)
        const_var = float(np.max(a_inv_diag[layout.onehot])) + float(a_inv_diag[layout.bias])
        if layout.trust_sender is not None and layout.trust_receiver is not None:
            t = np.full(n, 0.5) if trust is None else trust
            a = a + theta[layout.trust_sender] * t
            c = c + theta[layout.trust_receiver] * t
            alpha = alpha + a_inv_diag[layout.trust_sender] * t * t
            gamma = gamma + a_inv_diag[layout.trust_receiver] * t * t
        a = a + const_mean
        # The bonus uses the direction-averaged variance q + h_i + h_j (h = (alpha + gamma)/2),
        # which is symmetric: one GEMM serves both directions.
        h = 0.5 * (alpha + gamma) + 0.5 * const_var
        # The mean of i -> j is B_ij + a_i + c_j with B_ij = p_i^T diag(w) p_j symmetric, so
        # the better direction is B_ij + max(a_i + c_j, a_j + c_i)
        #   = B_ij + s_i + s_j + |d_i - d_j|,   s = (a + c) / 2, d = (a - c) / 2:
        # one GEMM (the separable s_i + s_j ride along as extra columns: [L, s, 1] @ [R; 1; s])
        # and one outer difference, where both directions took a GEMM each.
        # The float32 factors are filled column by column from the float64 pieces (the same
        # rounding as building them in float64 and casting, without the float64 copies).
        f32 = np.float32
        s, d = 0.5 * (a + c), 0.5 * (a - c)
        self.mean_left = _columns(n, f32, p * (th_p - 2.0 * th_a), s, 1.0)
        self.var_left = _columns(n, f32, p * (-2.0 * v_a), p2 * v_p, h, 1.0)
        self.mean_right = _columns(n, f32, p, 1.0, s).T.copy()
        self.var_right = _columns(n, f32, p, p2, 1.0, h).T.copy()
        self.spread = d.astype(f32)
        self._dims = (dp + 2, 2 * dp + 2)
        self._rows: NDArray[np.float32] | None = None
        self._pieces = (p, p2, s, h)

    @property
    def right_rows(self) -> NDArray[np.float32]:
        """``[mean_right; var_right]`` transposed: one contiguous row per agent, so a
        shortlist of columns is one row gather (built on first use)."""
        if self._rows is None:
            p, p2, s, h = self._pieces
            self._rows = _columns(p.shape[0], np.float32, p, 1.0, s, p, p2, 1.0, h)
        return self._rows

    def left(self, rows: slice | NDArray[np.intp]) -> _Factors:
        """The row factors ``(mean, spread, variance)`` of agents ``rows``."""
        if isinstance(rows, slice):
            return self.mean_left[rows], self.spread[rows], self.var_left[rows]
        return self.mean_left.take(rows, 0), self.spread.take(rows), self.var_left.take(rows, 0)

    def right(self, cols: slice | NDArray[np.intp] = slice(None)) -> _Factors:
        """The column factors ``(mean, spread, variance)`` of agents ``cols``."""
        if isinstance(cols, slice):
            return self.mean_right[:, cols], self.spread[cols], self.var_right[:, cols]
        # One gather of whole rows of the (N, d) copy is far cheaper than gathers of
        # columns of the (d, N) factors.
        picked = self.right_rows.take(cols, axis=0).T
        width = self._dims[0]
        return picked[:width], self.spread.take(cols), picked[width:]

    def rows(
        self, lo: int, hi: int, beta: float, scratch: PrefilterScratch | None = None
    ) -> NDArray[np.float32]:
        """Cheap ``max`` over directions of ``mean + beta * sqrt(var)``, rows ``[lo, hi)``;
        written into ``scratch``'s first buffer when given."""
        left, right = self.left(slice(lo, hi)), self.right()
        if scratch is None:
            return _cheap_score(left, right, beta)
        width = self.mean_right.shape[1]
        out, tmp = scratch.take(0, hi - lo, width), scratch.take(1, hi - lo, width)
        return _cheap_score(left, right, beta, out, tmp)

    def block(
        self, rows: slice | NDArray[np.intp], cols: slice | NDArray[np.intp], beta: float
    ) -> NDArray[np.float32]:
        """The cheap score of the sub-matrix ``rows x cols``."""
        return _cheap_score(self.left(rows), self.right(cols), beta)


def _columns(
    n: int, dtype: type[np.float32], *parts: NDArray[np.float64] | float
) -> NDArray[np.float32]:
    """``np.hstack`` of ``parts`` (``(n, w)`` blocks, ``(n,)`` columns or constants) cast to
    ``dtype``, written straight into one ``(n, sum w)`` array."""
    widths = [1 if np.ndim(x) < 2 else np.shape(x)[1] for x in parts]
    out = np.empty((n, sum(widths)), dtype=dtype)
    col = 0
    for x, w in zip(parts, widths, strict=True):
        out[:, col : col + w] = x if np.ndim(x) != 1 else np.asarray(x)[:, None]
        col += w
    return out


def cheap_pair_scores(inputs: CheapScore) -> NDArray[np.float32]:
    """The full ``(N, N)`` symmetric cheap score matrix (diagonal: -inf). For tests/tools."""
    model = inputs.model()
    n = inputs.profiles.shape[0]
    out = model.rows(0, n, inputs.beta)
    np.fill_diagonal(out, -np.inf)
    return out


def _top_k_exact(
    model: _CheapModel, n: int, k: int, beta: float, scratch: PrefilterScratch | None = None
) -> NDArray[np.intp]:
    """Each row's ``k`` best columns of the full cheap score matrix (O(N^2 d_p))."""
    best = np.empty((n, k), dtype=np.intp)
    step = max(1, _BLOCK_ELEMENTS // n)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        block = model.rows(lo, hi, beta, scratch)
        block[np.arange(hi - lo), np.arange(lo, hi)] = -np.inf
        if k < n - 1:
            # The second buffer is free once the block is scored: partition a copy there.
            work = None if scratch is None else scratch.take(1, hi - lo, n)
            best[lo:hi] = _top_columns(block, k, work)
        else:
            # Every other agent survives: skip the partition.
            best[lo:hi] = np.argsort(block, axis=1)[:, 1:]
    return best


def _top_columns(
    block: NDArray[np.float32], k: int, work: NDArray[np.float32] | None = None
) -> NDArray[np.intp]:
    """The columns of each row's ``k`` largest values, ``(rows, k)`` in ascending column
    order; ties at the k-th value go to the lowest columns; NaN is never preferred.

    The same sets as ``np.argpartition(block, w - k, axis=1)[:, w - k:]`` whenever the k-th
    value is not tied (argpartition's pick among ties is unspecified). Wide rows take the
    bounded search (:func:`_top_columns_bounded`); narrow ones partition the values.
    ``work`` (the block's shape) receives the partitioned copy instead of a fresh array.
    """
    rows, width = block.shape
    groups = _BOUND_GROUPS_PER_K * k
    if width >= 2 * groups:
        return _top_columns_bounded(block, k, groups)
    if work is None:
        kth = np.partition(block, width - k, axis=1)[:, width - k, None]
    else:
        np.copyto(work, block)
        work.partition(width - k, axis=1)
        kth = work[:, width - k, None]
    ge = block >= kth
    flat = np.flatnonzero(ge)
    if len(flat) == rows * k:
        cols: NDArray[np.intp] = (flat % width).reshape(rows, k).astype(np.intp, copy=False)
        return cols
    out = np.empty((rows, k), dtype=np.intp)
    counts = np.count_nonzero(ge, axis=1)
    ok = counts == k
    if ok.any():
        out[ok] = np.nonzero(ge[ok])[1].reshape(-1, k)
    _top_rows_by_sort(block, np.flatnonzero(~ok), k, out)
    return out


#: Column groups per wanted partner in the bounded top-k search (measured at N = 1,000,
#: k = 8: 16 leaves ~2% more candidates than k per row, and a smaller partition).
_BOUND_GROUPS_PER_K = 16


def _top_columns_bounded(block: NDArray[np.float32], k: int, groups: int) -> NDArray[np.intp]:
    """:func:`_top_columns` for rows much wider than ``k``, without partitioning them.

    Columns are dealt into ``groups`` classes (column mod ``groups``); each row's class
    maxima take a few elementwise passes. The k-th largest class maximum of a row is at
    most the row's k-th largest value (the k largest maxima are k distinct entries), so
    every top-k column is among the entries ``>=`` it: one compare pass finds a handful of
    candidates per row (about ``k``), and only rows with more than ``k`` candidates are
    ranked (descending value, ties to the lower column). ``fmax`` keeps NaN out of the
    maxima; a row whose bound still leaves fewer than ``k`` candidates (NaN entries) is
    sorted whole. ~2x faster than partitioning 1,000-wide rows.
    """
    rows, width = block.shape
    maxima = block[:, :groups].copy()
    for lo in range(groups, width, groups):
        hi = min(width, lo + groups)
        np.fmax(maxima[:, : hi - lo], block[:, lo:hi], out=maxima[:, : hi - lo])
    maxima.partition(groups - k, axis=1)
    flat = np.flatnonzero(block >= maxima[:, groups - k, None])
    if len(flat) == rows * k:
        cols: NDArray[np.intp] = (flat % width).reshape(rows, k).astype(np.intp, copy=False)
        return cols
    row, col = np.divmod(flat, width)
    counts = np.bincount(row, minlength=rows)
    out = np.empty((rows, k), dtype=np.intp)
    exact = counts == k
    out[exact] = col[exact[row]].reshape(-1, k)
    over = counts > k
    if over.any():
        sel = over[row]
        r, c = row[sel], col[sel]
        # Row, then descending value, then ascending column (NaN is never a candidate).
        order = np.lexsort((c, -block[r, c], r))
        starts = np.cumsum(counts[over]) - counts[over]
        first = np.repeat(starts, counts[over])
        rank = np.arange(len(order)) - first
        out[over] = np.sort(c[order[rank < k]].reshape(-1, k), axis=1)
    _top_rows_by_sort(block, np.flatnonzero(counts < k), k, out)
    return out


def _top_rows_by_sort(
    block: NDArray[np.float32], rows: NDArray[np.intp], k: int, out: NDArray[np.intp]
) -> None:
    """Rows ``rows`` of :func:`_top_columns` by a stable sort of the whole row (the rare
    rows with ties or NaN at the k-th value)."""
    for r in rows:
        # Descending value, ties to the lower column; NaN sorts last (never preferred).
        top = np.argsort(-block[r].astype(np.float64), kind="stable")[:k]
        out[r] = np.sort(top)


def _cheap_score(
    left: _Factors,
    right: _Factors,
    beta: float,
    out: NDArray[np.float32] | None = None,
    tmp: NDArray[np.float32] | None = None,
) -> NDArray[np.float32]:
    """``max`` over the two directions of the mean, plus ``beta * sqrt(var)``: the cheap score
    of left (mean, spread, variance factors; rows) against right (columns). ``out`` and
    ``tmp`` (the result's shape, C-contiguous) take the result and the temporaries.

    The variance approximation is a sum of non-negative terms, negative only by float32
    cancellation; ``sqrt(|var|)`` treats that noise as the clamp at 0 would, to rounding,
    and ``abs`` is a third of the cost of a clamp against a scalar here.
    """
    shape = (left[0].shape[0], right[0].shape[1])
    if out is None or tmp is None:
        out, tmp = np.empty(shape, np.float32), np.empty(shape, np.float32)
    np.matmul(left[0], right[0], out=out)
    np.subtract(left[1][:, None], right[1][None, :], out=tmp)
    np.abs(tmp, out=tmp)
    out += tmp
    if beta > 0:
        np.matmul(left[2], right[2], out=tmp)
        np.abs(tmp, out=tmp)
        np.sqrt(tmp, out=tmp)
        if beta != 1.0:  # x * 1 == x: the default beta skips a pass
            tmp *= np.float32(beta)
        out += tmp
    return out


def _cross_block(left: _CheapModel, right: _CheapModel, beta: float) -> NDArray[np.float32]:
    """Cheap scores of ``left``'s agents (rows) against ``right``'s agents (columns)."""
    return _cheap_score(left.left(slice(None)), right.right(), beta)


def clustered_top_k(
    inputs: CheapScore,
    k: int,
    rng: np.random.Generator,
    *,
    cell_size: int = DEFAULT_CLUSTER_SIZE,
    shortlist: int = DEFAULT_SHORTLIST,
) -> NDArray[np.intp]:
    """Approximate per-agent top-``k`` partners by the cheap score, in ~O(N (C + S) d_p).

    Agents are grouped into ``C ~ N / cell_size`` cells by k-means on ``[profile, trust]``
    (scikit-learn, random init, fitted on a seeded sample of at most 8 agents per cell,
    then every agent assigned). Each cell centre, treated as a pseudo-agent, is scored
    against all agents (one ``(C, N)`` pass) and keeps its ``S = shortlist`` best; the
    cell's members are then scored exactly against that shortlist only. Members of a
    cell have similar profiles, so their best partners are mostly the centre's best.
    Returns ``(N, k)`` partner indices (never the agent itself); deterministic for a
    given ``rng`` state.
    """
    profiles, trust, beta = inputs.profiles, inputs.trust, inputs.beta
    n = profiles.shape[0]
    k = max(1, min(k, n - 1))
    feats = profiles if trust is None else np.hstack([profiles, trust[:, None]])
    n_cells = max(1, min(n // 2, round(n / max(1, cell_size))))
    seed = int(rng.integers(0, 2**31 - 1))
    fit_n = min(n, _FIT_PER_CELL * n_cells)
    sample = rng.choice(n, size=fit_n, replace=False) if fit_n < n else np.arange(n)
    # Imported here: scikit-learn is 1.3 of the 2.6 CPU seconds a `peerlm cpm` start
    # costs, and only rounds of thousands of agents take the clustered search.
    from sklearn.cluster import KMeans

    km = KMeans(n_clusters=n_cells, init="random", n_init=1, max_iter=10, random_state=seed)
    km.fit(feats[sample])
    labels = km.predict(feats).astype(np.intp)
    # Cells present (k-means may leave one empty) as contiguous runs of a stable sort.
    order = np.argsort(labels, kind="stable").astype(np.intp)
    counts = np.bincount(labels, minlength=n_cells)
    starts = np.concatenate([[0], np.cumsum(counts)])
    centres = km.cluster_centers_
    c_prof = centres[:, : profiles.shape[1]]
    c_trust = None if trust is None else centres[:, -1]
    model = inputs.model()
    # Each centre's shortlist: the `shortlist` agents scoring best against the centre (a
    # pseudo-agent), one (C, N) pass. Members of a cell are then scored exactly against
    # their centre's shortlist only, so an agent is compared with `shortlist` others.
    centre_model = _CheapModel(c_prof, c_trust, inputs.layout, inputs.theta, inputs.a_inv_diag)
    centre_scores = _cross_block(centre_model, model, beta)
    width = min(n, max(shortlist, k + 1))
    if width < n:
        lists = _top_columns(centre_scores, width)
    else:
        lists = np.broadcast_to(np.arange(n), (len(centres), n))
    best = np.empty((n, k), dtype=np.intp)
    for cell in np.flatnonzero(counts):
        members = order[starts[cell] : starts[cell + 1]]
        cols = lists[cell]
        block = model.block(members, cols, beta)
        # A member on its own shortlist is not its own partner. Shortlists are in
        # ascending order, so a binary search finds each member's column (if any) instead
        # of a members x shortlist comparison.
        at = np.minimum(np.searchsorted(cols, members), len(cols) - 1)
        own = np.flatnonzero(cols[at] == members)
        block[own, at[own]] = -np.inf
        top = _top_columns(block, k)
        best[members] = cols[top]
    return best


def top_k_partners(
    inputs: CheapScore,
    k: int,
    rng: np.random.Generator,
    *,
    cluster_min_agents: int = DEFAULT_CLUSTER_MIN_AGENTS,
    cell_size: int = DEFAULT_CLUSTER_SIZE,
    shortlist: int = DEFAULT_SHORTLIST,
    scratch: PrefilterScratch | None = None,
) -> NDArray[np.intp]:
    """Each agent's ``k`` best partners by the cheap score, ``(N, k)``: the exact search
    below ``cluster_min_agents`` agents, :func:`clustered_top_k` from there on.
    ``scratch`` lends the exact search reusable buffers (results do not depend on it)."""
    n = inputs.profiles.shape[0]
    k = max(0, min(k, n - 1))
    if not k:
        return np.empty((n, 0), dtype=np.intp)
    if n >= cluster_min_agents:
        return clustered_top_k(inputs, k, rng, cell_size=cell_size, shortlist=shortlist)
    return exact_top_k(inputs, k, scratch=scratch)


def exact_top_k(
    inputs: CheapScore, k: int, *, scratch: PrefilterScratch | None = None
) -> NDArray[np.intp]:
    """Each agent's ``k`` best partners by the cheap score over all ``N^2`` pairs (the
    reference the clustered search's recall is measured against)."""
    n = inputs.profiles.shape[0]
    k = max(1, min(k, n - 1))
    return _top_k_exact(inputs.model(), n, k, inputs.beta, scratch)


def prefilter_pairs(
    inputs: CheapScore,
    k: int,
    n_random: int,
    rng: np.random.Generator,
    *,
    cluster_min_agents: int = DEFAULT_CLUSTER_MIN_AGENTS,
    cell_size: int = DEFAULT_CLUSTER_SIZE,
    shortlist: int = DEFAULT_SHORTLIST,
    scratch: PrefilterScratch | None = None,
) -> tuple[NDArray[np.intp], NDArray[np.intp]]:
    """Unordered candidate pairs ``(I, J)`` with ``I < J``, unique, sorted.

    Each agent contributes its ``k`` best partners by the cheap score and ``n_random``
    partners drawn uniformly (seeded) from the others, so at most ``N (k + n_random)``
    pairs survive. Ties in the cheap score fall to the lower index (agents are indexed
    by sorted id); the exact pass that follows breaks its own ties with the seeded
    generator. From ``cluster_min_agents`` on, the top-``k`` search is
    :func:`clustered_top_k` (approximate, sub-quadratic) instead of the exact O(N^2) one.
    """
    n = inputs.profiles.shape[0]
    if n < 2:
        empty = np.empty(0, dtype=np.intp)
        return empty, empty
    k = max(0, min(k, n - 1))
    best = top_k_partners(
        inputs,
        k,
        rng,
        cluster_min_agents=cluster_min_agents,
        cell_size=cell_size,
        shortlist=shortlist,
        scratch=scratch,
    )
    n_random = max(0, n_random)
    offsets = rng.integers(1, n, size=(n, n_random)) if n_random else np.empty((n, 0), np.intp)
    rand = (np.arange(n)[:, None] + offsets) % n
    rows = np.repeat(np.arange(n, dtype=np.intp), k + n_random)
    cols = np.hstack([best, rand]).astype(np.intp).ravel()
    lo_idx = np.minimum(rows, cols)
    hi_idx = np.maximum(rows, cols)
    keys = _sorted_unique(lo_idx * n + hi_idx)
    return (keys // n).astype(np.intp), (keys % n).astype(np.intp)


def _sorted_unique(keys: NDArray[np.intp]) -> NDArray[np.intp]:
    """``np.unique(keys)`` for integers by sort and compare: numpy 2.3+'s hash-based
    ``unique`` was ~15x slower than this on 10^5 keys (measured with numpy 2.4)."""
    keys = np.sort(keys)
    if len(keys) < 2:
        return keys
    keep = np.empty(len(keys), dtype=bool)
    keep[0] = True
    np.not_equal(keys[1:], keys[:-1], out=keep[1:])
    return keys[keep]
