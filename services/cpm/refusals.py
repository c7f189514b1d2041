"""Refused exchanges: the closed list of reasons a student may report instead of a reward.

A student that cannot execute a directive (it does not run the protocol, the teacher's
adapter is of another parameter space, the pull failed, the sender proof was wrong, the
payload did not check) reports the failure on the same call a reward takes
(``ReportRewardRequest.failure``), so that the bandit learns the tuple was bad instead of
seeing the directive expire unrewarded. The codes are the wire enum's
(``peerlm.v1.ExchangeFailure``); this module holds them without importing the wire, so the
core stays free of gRPC (``tests/unit/test_cpm_refusals.py`` checks the two agree).

The bandit rule (our choice; the paper has no refused exchanges): a refusal is a reward of
``CpmSettings.refusal_reward``, default 0.0, applied exactly like a reported reward
(z-scored by the same normaliser, one Sherman-Morrison step on the directive's stored
context, the teacher's trust counting a non-success). 0.0 is what Eq. 3 gives an exchange
that changed nothing and moved nothing (``L_pre = L_post``, ``KB = 0``): the directive was
worth no more than staying at home, which is what a refused exchange amounts to. It is not
lower by default because the student reports it and could otherwise push a teacher down
harder than a (bounded) reward already lets it; an operator who wants refusals to weigh
more sets a negative value (``|refusal_reward| <= max_reward_magnitude``).
"""

from __future__ import annotations

from types import MappingProxyType

__all__ = ["FAILURE_REASONS", "failure_name"]

#: Wire code (``peerlm.v1.ExchangeFailure``) -> ledger and metric name. 0 is "no failure".
FAILURE_REASONS = MappingProxyType(
    {
        1: "unsupported_protocol",
        2: "parameter_space",
        3: "pull_failed",
        4: "sender_proof",
        5: "invalid_payload",
    }
)


def failure_name(code: int) -> str:
    """The name of refusal ``code`` ("" for 0, a reward); ValueError outside the list."""
    if code == 0:
        return ""
    name = FAILURE_REASONS.get(code)
    if name is None:
        known = ", ".join(f"{k} ({v})" for k, v in FAILURE_REASONS.items())
        raise ValueError(f"failure {code} is not one of {known}")
    return name
