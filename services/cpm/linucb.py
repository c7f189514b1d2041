"""LinUCB state (Li et al. 2010) as used by KNEXA-FL's CPM (Algorithm 2, Algorithm 3 l.12).

The model keeps ``A^-1`` and ``b`` for a ridge regression of reward on context:
``A = ridge * I + sum x x^T``, ``b = sum r x``, ``theta = A^-1 b``. A candidate's
upper confidence bound is ``theta^T x + beta * sqrt(x^T A^-1 x)``.

``A`` itself is never stored or inverted: each observation updates ``A^-1`` in O(d^2) by
Sherman–Morrison,

    A^-1 <- A^-1 - (A^-1 x)(A^-1 x)^T / (1 + x^T A^-1 x),

written as ``A^-1 -= s s^T`` with ``s = A^-1 x / sqrt(1 + x^T A^-1 x)`` (``A^-1`` is
symmetric, so ``A^-1 x x^T A^-1 = u u^T`` with ``u = A^-1 x``). In that form every update
keeps ``A^-1`` *bitwise* symmetric — ``s_i * s_j == s_j * s_i`` in IEEE arithmetic — so no
symmetrising pass is needed per update; :meth:`LinUCB.from_arrays` symmetrises whatever it
is handed, which makes symmetry an invariant of the object.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

from .features import FeatureLayout

__all__ = ["LinUCB"]

# Unordered pairs scored per block in score_pairs (bounds the O(block * d) temporaries).
_PAIR_BLOCK = 8192


class LinUCB:
    """Ridge-regression bandit state with Sherman–Morrison updates and batch UCB scoring."""

    __slots__ = ("_a_inv", "_b", "_buf", "_dim", "_n_updates", "_theta")

    def __init__(self, dim: int, ridge: float = 1.0) -> None:
        if dim < 1:
            raise ValueError("dim must be >= 1")
        if not (math.isfinite(ridge) and ridge > 0):
            raise ValueError("ridge must be a positive finite number")
        self._dim = int(dim)
        self._a_inv: NDArray[np.float64] = np.eye(dim, dtype=np.float64) / ridge
        self._b: NDArray[np.float64] = np.zeros(dim, dtype=np.float64)
        # Scratch for the rank-one term, so an update allocates only O(d).
        self._buf: NDArray[np.float64] = np.empty((dim, dim), dtype=np.float64)
        self._n_updates = 0
        self._theta: NDArray[np.float64] | None = None

    @classmethod
    def from_arrays(
        cls, a_inv: NDArray[np.float64], b: NDArray[np.float64], n_updates: int
    ) -> LinUCB:
        """Rebuild a state from stored ``A^-1``, ``b`` and update count (copies them)."""
        a = np.array(a_inv, dtype=np.float64)
        vec = np.array(b, dtype=np.float64)
        if a.ndim != 2 or a.shape[0] != a.shape[1] or a.shape[0] < 1:
            raise ValueError(f"a_inv must be a square matrix, got shape {a.shape}")
        if vec.shape != (a.shape[0],):
            raise ValueError(f"b must have shape ({a.shape[0]},), got {vec.shape}")
        if not (np.all(np.isfinite(a)) and np.all(np.isfinite(vec))):
            raise ValueError("a_inv and b must be finite")
        if n_updates < 0:
            raise ValueError("n_updates must be >= 0")
        scale = max(float(np.max(np.abs(a))), 1.0)
        if not np.allclose(a, a.T, rtol=0.0, atol=1e-9 * scale):
            raise ValueError("a_inv must be symmetric")
        if np.any(np.diag(a) <= 0):
            raise ValueError("a_inv must be positive definite (non-positive diagonal)")
        state = cls(a.shape[0])
        # Exact for a bitwise-symmetric input (x + x) / 2 == x; otherwise removes the drift.
        state._a_inv = (a + a.T) * 0.5
        state._b = vec
        state._n_updates = int(n_updates)
        return state

    @property
    def dim(self) -> int:
        """Context dimension d."""
        return self._dim

    @property
    def a_inv(self) -> NDArray[np.float64]:
        """Read-only view of ``A^-1`` (d, d)."""
        view = self._a_inv.view()
        view.flags.writeable = False
        return view

    @property
    def b(self) -> NDArray[np.float64]:
        """Read-only view of ``b`` (d,)."""
        view = self._b.view()
        view.flags.writeable = False
        return view

    @property
    def n_updates(self) -> int:
        """Number of observations folded in."""
        return self._n_updates

    @property
    def theta(self) -> NDArray[np.float64]:
        """``A^-1 b`` (read-only; computed once per change of state, not per call)."""
        if self._theta is None:
            theta = self._a_inv @ self._b
            theta.flags.writeable = False
            self._theta = theta
        return self._theta

    def prepare(self, x: NDArray[np.float64]) -> NDArray[np.float64]:
        """Validate ``x`` and return the Sherman–Morrison factor ``s``; changes nothing.

        Split from :meth:`commit` so a caller can validate everything it will change
        before changing any of it. Raises ``ValueError`` for a wrong shape or a
        non-finite ``x`` (caught through ``x^T A^-1 x``, which is NaN or Inf then: one
        scalar check instead of an O(d) scan).
        """
        if x.shape != (self._dim,):
            raise ValueError(f"context must have shape ({self._dim},), got {x.shape}")
        u = self._a_inv @ x
        denom = 1.0 + float(np.dot(x, u))
        if not (math.isfinite(denom) and denom > 0.0):
            raise ValueError("context is not finite (or A^-1 lost positive definiteness)")
        u *= 1.0 / math.sqrt(denom)
        return u

    def commit(self, x: NDArray[np.float64], s: NDArray[np.float64], reward: float) -> None:
        """Apply ``A^-1 -= s s^T`` and ``b += reward * x`` (``s`` from :meth:`prepare`)."""
        # np.dot of a column and a row is a k = 1 GEMM (BLAS, ~1.5x faster than np.outer);
        # each entry is still the single product s_i * s_j, so the result stays symmetric.
        np.dot(s[:, None], s[None, :], out=self._buf)
        np.subtract(self._a_inv, self._buf, out=self._a_inv)
        self._b += reward * x
        self._n_updates += 1
        self._theta = None

    def update(self, x: NDArray[np.float64], reward: float) -> None:
        """Fold one observation ``(x, reward)`` in: O(d^2), no matrix inverse."""
        ctx = np.asarray(x, dtype=np.float64)
        if not math.isfinite(reward):
            raise ValueError("reward must be finite")
        self.commit(ctx, self.prepare(ctx), reward)

    def score(
        self, contexts: NDArray[np.float64], beta: float
    ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """UCB and mean for each row of ``contexts`` (M, d), vectorised.

        ``mean = X theta``; ``ucb = mean + beta * sqrt(rowsum((X A^-1) * X))``. The
        quadratic form is clipped at 0 before the square root: it is non-negative in exact
        arithmetic, but rounding can leave ``-1e-17`` for a near-null direction.
        """
        if contexts.ndim != 2 or contexts.shape[1] != self._dim:
            raise ValueError(f"contexts must have shape (M, {self._dim}), got {contexts.shape}")
        mean = contexts @ self.theta
        quad = np.einsum("ij,ij->i", contexts @ self._a_inv, contexts)
        np.maximum(quad, 0.0, out=quad)
        np.sqrt(quad, out=quad)
        quad *= beta
        quad += mean
        return quad, mean

    def score_pairs(
        self,
        layout: FeatureLayout,
        profiles: NDArray[np.float64],
        trust: NDArray[np.float64] | None,
        left: NDArray[np.intp],
        right: NDArray[np.intp],
        beta: float,
    ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """Exact UCB and mean of every candidate tuple of the pairs ``(left[p], right[p])``.

        Returns two ``(n_pairs, 2 * C)`` arrays (``C`` = protocols x roles): columns
        ``[0, C)`` are ``left -> right`` with one-hot combo ``c``, columns ``[C, 2C)`` are
        ``right -> left``. Equal (to rounding) to :meth:`score` on the contexts built by
        :class:`~.features.ContextFeatures` — but without building them. The context is
        ``x = E_s u_s + E_r u_r + E_z z + k_c`` with ``u_a = [p_a, t_a]`` per agent,
        ``z = [|p_i - p_j|, p_i * p_j]`` per unordered pair (the same for both
        directions) and ``k_c`` the one-hot plus bias, so ``x^T A^-1 x`` splits into
        per-agent terms (computed once per agent), one ``z^T M_zz z`` per pair, and dot
        products of length ``d_p``. That is ~``(2 d_p)^2`` work per pair instead of
        ``2 C d^2`` with ``d ~ 4 d_p``, and no ``(M, d)`` context matrix.
        """
        lay = layout
        m = self._a_inv
        th = self.theta
        n, dp = profiles.shape
        if dp != lay.profile_dim or lay.dim != self._dim:
            raise ValueError("layout does not match the profiles or this bandit")
        s_idx = np.arange(lay.sender.start, lay.sender.stop)
        r_idx = np.arange(lay.receiver.start, lay.receiver.stop)
        if lay.trust_sender is not None and lay.trust_receiver is not None:
            if trust is None or trust.shape != (n,):
                raise ValueError("trust features are on: trust must have shape (N,)")
            u = np.hstack([profiles, trust[:, None]])
            s_idx = np.append(s_idx, lay.trust_sender)
            r_idx = np.append(r_idx, lay.trust_receiver)
        else:
            u = profiles
        oh_idx = np.arange(lay.onehot.start, lay.onehot.stop)
        # Per agent: quadratic self-terms, the sender-receiver cross map, combo terms, means.
        q_s = np.einsum("ij,ij->i", u @ m[np.ix_(s_idx, s_idx)], u)
        q_r = np.einsum("ij,ij->i", u @ m[np.ix_(r_idx, r_idx)], u)
        cross = 2.0 * (u @ m[np.ix_(s_idx, r_idx)])
        k_rows = m[oh_idx] + m[lay.bias]  # (C, d): row c is M k_c
        h_s = 2.0 * (u @ k_rows[:, s_idx].T)
        h_r = 2.0 * (u @ k_rows[:, r_idx].T)
        kk = k_rows[np.arange(len(oh_idx)), oh_idx] + k_rows[:, lay.bias]
        mean_s = u @ th[s_idx]
        mean_r = u @ th[r_idx]
        mean_c = th[oh_idx] + th[lay.bias]
        inter = lay.absdiff is not None and lay.product is not None
        if lay.absdiff is not None and lay.product is not None:
            z_idx = np.r_[
                np.arange(lay.absdiff.start, lay.absdiff.stop),
                np.arange(lay.product.start, lay.product.stop),
            ]
            m_zz = m[np.ix_(z_idx, z_idx)]
            g_s = 2.0 * (u @ m[np.ix_(s_idx, z_idx)])
            g_r = 2.0 * (u @ m[np.ix_(r_idx, z_idx)])
            k_z = 2.0 * k_rows[:, z_idx]
            th_z = th[z_idx]

        n_pairs, n_c = len(left), len(oh_idx)
        ucb = np.empty((n_pairs, 2 * n_c), dtype=np.float64)
        mean = np.empty((n_pairs, 2 * n_c), dtype=np.float64)
        for lo in range(0, n_pairs, _PAIR_BLOCK):
            i = left[lo : lo + _PAIR_BLOCK]
            j = right[lo : lo + _PAIR_BLOCK]
            fwd = q_s[i] + q_r[j] + np.einsum("ij,ij->i", cross[i], u[j])
            rev = q_s[j] + q_r[i] + np.einsum("ij,ij->i", cross[j], u[i])
            m_fwd = mean_s[i] + mean_r[j]
            m_rev = mean_s[j] + mean_r[i]
            combo = h_s[i] + h_r[j], h_s[j] + h_r[i]
            if inter:
                pi, pj = profiles[i], profiles[j]
                z = np.hstack([np.abs(pi - pj), pi * pj])
                q_z = np.einsum("ij,ij->i", z @ m_zz, z)
                fwd += q_z + np.einsum("ij,ij->i", z, g_s[i] + g_r[j])
                rev += q_z + np.einsum("ij,ij->i", z, g_s[j] + g_r[i])
                z_c = z @ k_z.T + kk
                m_z = z @ th_z
                m_fwd += m_z
                m_rev += m_z
            else:
                z_c = np.broadcast_to(kk, (len(i), n_c))
            for col, (quad, mu, per_combo) in enumerate(
                ((fwd, m_fwd, combo[0]), (rev, m_rev, combo[1]))
            ):
                block = quad[:, None] + per_combo + z_c
                np.maximum(block, 0.0, out=block)
                np.sqrt(block, out=block)
                block *= beta
                mu_block = mu[:, None] + mean_c
                cols = slice(col * n_c, (col + 1) * n_c)
                mean[lo : lo + len(i), cols] = mu_block
                ucb[lo : lo + len(i), cols] = block + mu_block
        return ucb, mean
