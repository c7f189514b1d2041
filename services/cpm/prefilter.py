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

Each score matrix is a single GEMM, the separable terms riding along as extra columns
(``[L, a, 1] @ [R; 1; c] = L R + a_i + c_j``). The pair score is
``max(mean(i->j), mean(j->i)) + beta * sqrt(var_avg)`` with ``var_avg`` the variance
approximation averaged over the two directions (symmetric, so one GEMM serves both):
three ``(N, ~2 d_p) @ (~2 d_p, N)`` products and a handful of elementwise passes. Rows
are processed in blocks to bound memory (at N = 10^4 a full matrix would be 400 MB),
in float32, which is plenty for a ranking and halves memory traffic.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from .features import FeatureLayout

__all__ = ["cheap_pair_scores", "prefilter_pairs"]

# Elements per row block of the N x N score matrix (~8 MB per float32 temporary).
_BLOCK_ELEMENTS = 1 << 21


def _block(vec: NDArray[np.float64], sl: slice | None) -> NDArray[np.float64] | None:
    return None if sl is None else vec[sl]


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
        n = p.shape[0]
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
        # Each score matrix is one GEMM: the separable terms ride along as extra columns
        # ([L, a, 1] @ [R; 1; c] = L R + a_i + c_j), so no N x N broadcast pass is needed.
        f32 = np.float32
        ones = np.ones((n, 1))
        a = (a + const_mean)[:, None]
        c = c[:, None]
        mean_left = p * (th_p - 2.0 * th_a)
        self.fwd_left = np.hstack([mean_left, a, ones]).astype(f32)
        self.fwd_right = np.hstack([p, ones, c]).T.astype(f32).copy()
        self.rev_left = np.hstack([mean_left, ones, c]).astype(f32)
        self.rev_right = np.hstack([p, a, ones]).T.astype(f32).copy()
        # The bonus uses the direction-averaged variance q + h_i + h_j (h = (alpha + gamma)/2),
        # which is symmetric: one GEMM serves both directions.
        h = (0.5 * (alpha + gamma) + 0.5 * const_var)[:, None]
        self.var_left = np.hstack([p * (-2.0 * v_a), p2 * v_p, h, ones]).astype(f32)
        self.var_right = np.hstack([p, p2, ones, h]).T.astype(f32).copy()

    def rows(self, lo: int, hi: int, beta: float) -> NDArray[np.float32]:
        """Cheap ``max`` over directions of ``mean + beta * sqrt(var)``, rows ``[lo, hi)``."""
        out: NDArray[np.float32] = self.fwd_left[lo:hi] @ self.fwd_right
        np.maximum(out, self.rev_left[lo:hi] @ self.rev_right, out=out)
        if beta > 0:
            var = self.var_left[lo:hi] @ self.var_right
            np.maximum(var, 0.0, out=var)
            np.sqrt(var, out=var)
            var *= np.float32(beta)
            out += var
        return out


def cheap_pair_scores(
    profiles: NDArray[np.float64],
    trust: NDArray[np.float64] | None,
    layout: FeatureLayout,
    theta: NDArray[np.float64],
    a_inv_diag: NDArray[np.float64],
    beta: float,
) -> NDArray[np.float32]:
    """The full ``(N, N)`` symmetric cheap score matrix (diagonal: -inf). For tests/tools."""
    model = _CheapModel(profiles, trust, layout, theta, a_inv_diag)
    n = profiles.shape[0]
    out = model.rows(0, n, beta)
    np.fill_diagonal(out, -np.inf)
    return out


def prefilter_pairs(
    profiles: NDArray[np.float64],
    trust: NDArray[np.float64] | None,
    layout: FeatureLayout,
    theta: NDArray[np.float64],
    a_inv_diag: NDArray[np.float64],
    beta: float,
    k: int,
    n_random: int,
    rng: np.random.Generator,
) -> tuple[NDArray[np.intp], NDArray[np.intp]]:
    """Unordered candidate pairs ``(I, J)`` with ``I < J``, unique, sorted.

    Each agent contributes its ``k`` best partners by the cheap score and ``n_random``
    partners drawn uniformly (seeded) from the others, so at most ``N (k + n_random)``
    pairs survive. Ties in the cheap score fall to the lower index (agents are indexed
    by sorted id); the exact pass that follows breaks its own ties with the seeded
    generator.
    """
    n = profiles.shape[0]
    if n < 2:
        empty = np.empty(0, dtype=np.intp)
        return empty, empty
    k = max(0, min(k, n - 1))
    model = _CheapModel(profiles, trust, layout, theta, a_inv_diag)
    best = np.empty((n, k), dtype=np.intp)
    if k:
        step = max(1, _BLOCK_ELEMENTS // n)
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            block = model.rows(lo, hi, beta)
            block[np.arange(hi - lo), np.arange(lo, hi)] = -np.inf
            if k < n - 1:
                best[lo:hi] = np.argpartition(block, n - 1 - k, axis=1)[:, n - k :]
            else:
                # Every other agent survives: skip the partition.
                best[lo:hi] = np.argsort(block, axis=1)[:, 1:]
    n_random = max(0, n_random)
    offsets = rng.integers(1, n, size=(n, n_random)) if n_random else np.empty((n, 0), np.intp)
    rand = (np.arange(n)[:, None] + offsets) % n
    rows = np.repeat(np.arange(n, dtype=np.intp), k + n_random)
    cols = np.hstack([best, rand]).astype(np.intp).ravel()
    lo_idx = np.minimum(rows, cols)
    hi_idx = np.maximum(rows, cols)
    keys = np.unique(lo_idx * n + hi_idx)
    return (keys // n).astype(np.intp), (keys % n).astype(np.intp)
