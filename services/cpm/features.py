"""The context map ``phi(p_s, p_r, K_rec, R_sr)`` of Algorithm 2, vectorised over candidates.

Layout of one context ``x`` (blocks in this order; ``d_p`` = profile dimension)::

    [ p_s | p_r | |p_s - p_r| | p_s * p_r | onehot(protocol, role) | trust_s, trust_r | 1 ]
      d_p   d_p     d_p          d_p        n_protocols * n_roles        2             1
                 \\_ interaction_features _/                          \\ trust_features /

With the defaults (d_p = 32, one protocol, one role) ``d = 4*32 + 1 + 2 + 1 = 132``.

Why more than the paper's ``[p_s, p_r]``: under a linear model, ``theta^T [p_s, p_r]`` is
``f(p_s) + g(p_r)`` — every agent ranks every partner the same way, so it cannot express
that *this* sender suits *that* receiver. The elementwise product and absolute difference
make the score a (diagonal) bilinear function of the pair, which can. With
``interaction_features=False`` the context is the paper's plain concatenation (plus the
one-hot, trust and bias blocks), kept for comparison.

Other choices:

* The (protocol, role) one-hot lets the bandit learn a per-protocol, per-role offset; a
  context that did not depend on ``K_rec`` would score every protocol alike.
* The bias entry gives the ridge regression an intercept (rewards are z-scored, so it
  mostly absorbs drift of the running mean).
* The paper's ``S_net`` (global network state) is left out: it is the same for every
  candidate of a round, so under a linear model it shifts all scores alike and cannot
  change a ranking; the per-agent part of the network state that does matter is the
  CPM-maintained trust, which is included (see :mod:`.trust`).
* Trust enters as the Beta(1, 1)-smoothed success rate, in [0, 1].
* **Groups of senders** (a merge directive with co-senders, ``co_sender_scoring="group"``)
  use the same layout: :meth:`ContextFeatures.build_groups` puts the members' mean
  profile and mean trust where one sender's would be, so singles and groups share one
  bandit (docs/matchmaker.md, "Group scoring", says what the mean cannot express).

**Bounded contexts.** Every entry of an agent profile is in [-1, 1] by design (one-hot,
rates, deltas of rates, squashed losses, a histogram; see
:mod:`peerlm.services.cpm.profile`), so an honest profile has ``||p|| <= sqrt(d_p)``. The
validator accepts entries up to 1e6 (it only rejects what is absurd), which is what let
two colluding agents feed contexts of norm ~1e12 into the bandit. Before any context is
built a profile is therefore scaled onto the ball of radius :attr:`max_profile_norm` =
``sqrt(d_p)`` (direction kept, honest profiles untouched). That bounds each block, hence
``||x||`` by :attr:`max_context_norm` (~35 with the defaults):
``||p_s||, ||p_r|| <= R``, ``|| |p_s - p_r| || <= 2R``, ``||p_s * p_r|| <= R^2``, and
the one-hot, trust and bias entries are each at most 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from peerlm.protocols import DEFAULT_PROTOCOL

__all__ = ["ContextFeatures", "FeatureLayout"]


@dataclass(frozen=True)
class FeatureLayout:
    """Where each block lives in a context vector; ``None`` for a disabled block."""

    profile_dim: int
    sender: slice
    receiver: slice
    absdiff: slice | None
    product: slice | None
    onehot: slice
    trust_sender: int | None
    trust_receiver: int | None
    bias: int
    dim: int


def _layout(profile_dim: int, n_combos: int, interaction: bool, trust: bool) -> FeatureLayout:
    d = profile_dim
    pos = 2 * d
    absdiff = product = None
    if interaction:
        absdiff, product = slice(pos, pos + d), slice(pos + d, pos + 2 * d)
        pos += 2 * d
    onehot = slice(pos, pos + n_combos)
    pos += n_combos
    trust_s = trust_r = None
    if trust:
        trust_s, trust_r = pos, pos + 1
        pos += 2
    return FeatureLayout(
        profile_dim=d,
        sender=slice(0, d),
        receiver=slice(d, 2 * d),
        absdiff=absdiff,
        product=product,
        onehot=onehot,
        trust_sender=trust_s,
        trust_receiver=trust_r,
        bias=pos,
        dim=pos + 1,
    )


def _names(values: Sequence[str], what: str) -> tuple[str, ...]:
    names = tuple(values)
    if not names:
        raise ValueError(f"at least one {what} is required")
    if any(not isinstance(n, str) or not n for n in names):
        raise ValueError(f"{what} names must be non-empty strings")
    if len(set(names)) != len(names):
        raise ValueError(f"{what} names must be unique, got {names}")
    return names


class ContextFeatures:
    """Builds contexts ``phi`` for batches of (sender, receiver, protocol, role) tuples."""

    def __init__(
        self,
        profile_dim: int,
        protocols: Sequence[str] = (DEFAULT_PROTOCOL,),
        roles: Sequence[str] = ("one_way",),
        *,
        interaction: bool = True,
        trust: bool = True,
    ) -> None:
        if profile_dim < 1:
            raise ValueError("profile_dim must be >= 1")
        self.protocols = _names(protocols, "protocol")
        self.roles = _names(roles, "role")
        self.interaction = interaction
        self.trust = trust
        self.layout = _layout(
            profile_dim, len(self.protocols) * len(self.roles), interaction, trust
        )

    @property
    def dim(self) -> int:
        """Context dimension d."""
        return self.layout.dim

    @property
    def max_profile_norm(self) -> float:
        """``R = sqrt(d_p)``: the L2 norm a profile is scaled down to, if above."""
        return math.sqrt(self.layout.profile_dim)

    @property
    def max_context_norm(self) -> float:
        """An upper bound on ``||x||`` for contexts built from bounded profiles."""
        r2 = float(self.layout.profile_dim)
        sq = 2.0 * r2 + 1.0 + 1.0  # sender, receiver, one-hot entry, bias
        if self.interaction:
            sq += 4.0 * r2 + r2 * r2
        if self.trust:
            sq += 2.0
        return math.sqrt(sq)

    def bound_profiles(self, profiles: NDArray[np.float64]) -> NDArray[np.float64]:
        """Rows of ``profiles`` (N, d_p) scaled onto the ball of :attr:`max_profile_norm`.

        Returns ``profiles`` itself when no row exceeds the cap (the honest case), else a
        scaled copy.
        """
        norms = np.sqrt(np.einsum("ij,ij->i", profiles, profiles))
        cap = self.max_profile_norm
        over = norms > cap
        if not np.any(over):
            return profiles
        out = profiles.copy()
        out[over] *= (cap / norms[over])[:, None]
        return out

    def bound_context(self, x: NDArray[np.float64]) -> NDArray[np.float64]:
        """``x`` scaled onto the ball of :attr:`max_context_norm` if above (else ``x``).

        For contexts that were stored before profiles were bounded (directives issued by
        an older CPM, replayed from the ledger): they are brought inside the same bound.
        """
        norm = float(np.linalg.norm(x))
        cap = self.max_context_norm
        if not norm > cap:  # also passes NaN through, for the caller's finiteness check
            return x
        scaled: NDArray[np.float64] = x * (cap / norm)
        return scaled

    @property
    def profile_dim(self) -> int:
        """Profile dimension d_p."""
        return self.layout.profile_dim

    def combo_index(self, protocol: str, role: str) -> int:
        """Offset of (protocol, role) inside the one-hot block."""
        try:
            p, r = self.protocols.index(protocol), self.roles.index(role)
        except ValueError:
            raise ValueError(f"unknown protocol/role {protocol!r}/{role!r}") from None
        return p * len(self.roles) + r

    def names(self) -> list[str]:
        """A human-readable name for every context entry (for logs and docs)."""
        lay, d = self.layout, self.profile_dim
        out = [f"s[{k}]" for k in range(d)] + [f"r[{k}]" for k in range(d)]
        if lay.absdiff is not None:
            out += [f"|s-r|[{k}]" for k in range(d)] + [f"s*r[{k}]" for k in range(d)]
        out += [f"{p}/{r}" for p in self.protocols for r in self.roles]
        if lay.trust_sender is not None:
            out += ["trust_s", "trust_r"]
        return [*out, "bias"]

    def build(
        self,
        profiles: NDArray[np.float64],
        trust: NDArray[np.float64] | None,
        senders: NDArray[np.intp],
        receivers: NDArray[np.intp],
        protocol_idx: NDArray[np.intp],
        role_idx: NDArray[np.intp],
    ) -> NDArray[np.float64]:
        """Contexts for M tuples at once: an ``(M, dim)`` float64 matrix.

        ``profiles`` is ``(N, d_p)``; ``trust`` is ``(N,)`` (ignored, and may be ``None``,
        when trust features are off); the four index arrays have length M and index into
        ``profiles`` / :attr:`protocols` / :attr:`roles`.
        """
        self._check_inputs(profiles, trust)
        ps = profiles[senders]
        ts = None if trust is None or self.layout.trust_sender is None else trust[senders]
        return self._assemble(profiles, trust, ps, ts, receivers, protocol_idx, role_idx)

    def build_groups(
        self,
        profiles: NDArray[np.float64],
        trust: NDArray[np.float64] | None,
        members: NDArray[np.intp],
        receivers: NDArray[np.intp],
        protocol_idx: NDArray[np.intp],
        role_idx: NDArray[np.intp],
    ) -> NDArray[np.float64]:
        """Contexts of M *groups* of senders: an ``(M, dim)`` float64 matrix.

        ``members`` is ``(M, g)``: row ``m`` names the g senders (indices into
        ``profiles``) whose adapters ``receivers[m]`` merges. The group is scored as one
        virtual sender whose profile is the members' mean profile and whose trust is their
        mean trust: the sender block, ``|p_G - p_r|``, ``p_G * p_r`` and ``trust_s`` are
        those of ``p_G = mean(p_s for s in G)`` (docs/matchmaker.md, "Group scoring").
        The context has :attr:`dim` entries like a pair's, so singles and groups share
        one bandit. Each row's members are summed in ascending index order, so a context
        depends on the set of members only (bitwise), never on their order; a group of
        one is exactly :meth:`build`'s pair context. The mean of bounded profiles is
        inside the same ball (convexity), so :attr:`max_context_norm` still holds.
        """
        self._check_inputs(profiles, trust)
        if members.ndim != 2 or members.shape[0] != len(receivers) or members.shape[1] < 1:
            raise ValueError(f"members must be (M, g >= 1) with M = {len(receivers)}")
        ordered = np.sort(members, axis=1)
        g = ordered.shape[1]
        ps = profiles[ordered[:, 0]]  # a fresh copy (fancy indexing): summed into in place
        for j in range(1, g):
            ps += profiles[ordered[:, j]]
        ts: NDArray[np.float64] | None = None
        if trust is not None and self.layout.trust_sender is not None:
            ts = trust[ordered[:, 0]]
            for j in range(1, g):
                ts += trust[ordered[:, j]]
        if g > 1:
            ps /= g
            if ts is not None:
                ts /= g
        return self._assemble(profiles, trust, ps, ts, receivers, protocol_idx, role_idx)

    def _check_inputs(
        self, profiles: NDArray[np.float64], trust: NDArray[np.float64] | None
    ) -> None:
        lay = self.layout
        if profiles.ndim != 2 or profiles.shape[1] != lay.profile_dim:
            raise ValueError(f"profiles must be (N, {lay.profile_dim}), got {profiles.shape}")
        if lay.trust_sender is not None and (trust is None or trust.shape != (len(profiles),)):
            raise ValueError("trust features are on: trust must have shape (N,)")

    def _assemble(
        self,
        profiles: NDArray[np.float64],
        trust: NDArray[np.float64] | None,
        ps: NDArray[np.float64],
        ts: NDArray[np.float64] | None,
        receivers: NDArray[np.intp],
        protocol_idx: NDArray[np.intp],
        role_idx: NDArray[np.intp],
    ) -> NDArray[np.float64]:
        """Contexts from the sender side given as values (``ps``: (M, d_p) profiles,
        ``ts``: (M,) trust) and the receivers as indices."""
        lay = self.layout
        m = len(receivers)
        out = np.empty((m, lay.dim), dtype=np.float64)
        pr = profiles[receivers]
        out[:, lay.sender] = ps
        out[:, lay.receiver] = pr
        if lay.absdiff is not None and lay.product is not None:
            diff = out[:, lay.absdiff]
            np.subtract(ps, pr, out=diff)
            np.abs(diff, out=diff)
            np.multiply(ps, pr, out=out[:, lay.product])
        onehot = out[:, lay.onehot]
        onehot.fill(0.0)
        onehot[np.arange(m), protocol_idx * len(self.roles) + role_idx] = 1.0
        if lay.trust_sender is not None and lay.trust_receiver is not None:
            if trust is None or ts is None:  # _check_inputs has refused this already
                raise ValueError("trust features are on: trust must have shape (N,)")
            out[:, lay.trust_sender] = ts
            out[:, lay.trust_receiver] = trust[receivers]
        out[:, lay.bias] = 1.0
        return out

    def single(
        self,
        p_s: NDArray[np.float64],
        p_r: NDArray[np.float64],
        protocol: str,
        role: str,
        trust_s: float = 0.5,
        trust_r: float = 0.5,
    ) -> NDArray[np.float64]:
        """One context vector ``phi(p_s, p_r, protocol, role)`` (the reference path)."""
        combo = self.combo_index(protocol, role)
        one = np.array([0], dtype=np.intp)
        rows = self.build(
            np.stack([np.asarray(p_s, np.float64), np.asarray(p_r, np.float64)]),
            np.array([trust_s, trust_r], dtype=np.float64),
            one,
            one + 1,
            np.array([combo // len(self.roles)], dtype=np.intp),
            np.array([combo % len(self.roles)], dtype=np.intp),
        )
        row: NDArray[np.float64] = rows[0].copy()
        return row
