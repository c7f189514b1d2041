"""FedProxy's cohort round core (sans-IO) and payload codec: the failure paths."""

from __future__ import annotations

import pytest
import torch
from peerlm.agent.fedproxy.codec import (
    decode_proxy,
    decode_update,
    encode_proxy,
    encode_update,
    parse_round,
    payload_content_type,
)
from peerlm.agent.fedproxy.proxy import PROXY_CONFIG_KEY, ProxyError, ProxyInfo
from peerlm.agent.fedproxy.rounds import CohortRound, RoundAnswer, RoundError, round_answer

COHORT = ("a", "b", "c")
INFO = ProxyInfo("gpt2", 4, (0, 3), "transformer.h", 0.5)


def _round() -> CohortRound:
    return CohortRound(2, COHORT, opened_at=100.0, deadline_s=10.0)


def test_a_round_ends_when_everyone_answered_and_says_who() -> None:
    core = _round()
    assert core.pending() == COHORT and not core.done(101.0)
    core.deliver("b", 2, 101.0)
    core.refuse("a", 2, 102.0, "non_finite")
    assert core.pending() == ("c",) and not core.done(103.0)
    with pytest.raises(RoundError) as err:
        core.close(103.0)
    assert err.value.reason == "open"
    core.deliver("c", 2, 104.0)
    assert core.done(104.0)
    outcome = core.close(104.0)
    assert outcome.arrived == ("b", "c") and outcome.missing == ()
    assert outcome.refused == {"a": "non_finite"}
    assert not outcome.deadline_passed and not outcome.complete
    assert core.close(200.0) is outcome  # idempotent


def test_the_deadline_ends_a_round_with_the_missing_named() -> None:
    core = _round()
    core.deliver("a", 2, 105.0)
    assert not core.done(109.9) and core.done(110.0)
    assert core.remaining(108.0) == pytest.approx(2.0) and core.remaining(111.0) == 0.0
    outcome = core.close(110.0)
    assert outcome.arrived == ("a",) and outcome.missing == ("b", "c")
    assert outcome.deadline_passed and not outcome.complete


@pytest.mark.parametrize(
    ("member", "round_", "now", "reason"),
    [
        ("mallory", 2, 101.0, "not_in_cohort"),
        ("a", 1, 101.0, "round"),
        ("a", 3, 101.0, "round"),
        ("a", 2, 110.0, "late"),
    ],
)
def test_events_the_round_cannot_take_are_refused_and_change_nothing(
    member: str, round_: int, now: float, reason: str
) -> None:
    core = _round()
    with pytest.raises(RoundError) as err:
        core.deliver(member, round_, now)
    assert err.value.reason == reason
    with pytest.raises(RoundError):
        core.refuse(member, round_, now, "shape")
    assert core.pending() == COHORT


def test_a_second_answer_and_an_answer_after_the_close_are_refused() -> None:
    core = _round()
    core.deliver("a", 2, 101.0)
    for event in (core.deliver, lambda m, r, n: core.refuse(m, r, n, "shape")):
        with pytest.raises(RoundError) as err:
            event("a", 2, 102.0)
        assert err.value.reason == "duplicate"
    core.close(111.0)
    with pytest.raises(RoundError) as err:
        core.deliver("b", 2, 105.0)
    assert err.value.reason == "closed"


def test_bad_rounds_are_refused_at_construction() -> None:
    with pytest.raises(ValueError):
        CohortRound(0, COHORT, opened_at=0, deadline_s=1)
    with pytest.raises(ValueError):
        CohortRound(1, (), opened_at=0, deadline_s=1)
    with pytest.raises(ValueError):
        CohortRound(1, COHORT, opened_at=0, deadline_s=0)


def test_round_answer_serves_the_current_waits_for_the_next_and_knows_no_other() -> None:
    assert round_answer(3, 3) is RoundAnswer.SERVE
    assert round_answer(4, 3) is RoundAnswer.WAIT
    assert round_answer(5, 3) is RoundAnswer.NOT_FOUND
    assert round_answer(2, 3) is RoundAnswer.NOT_FOUND
    assert round_answer(1, 0) is RoundAnswer.WAIT
    assert round_answer(9, 3, horizon=None) is RoundAnswer.WAIT
    with pytest.raises(ValueError):
        round_answer(0, 3)


# ----------------------------------------------------------------------------- codec


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4, 3, generator=gen)
    return {"w": w, "tied": w, "b": torch.randn(3, generator=gen)}  # "tied" shares storage


CONFIG = {"model_type": "gpt2", "n_layer": 2, PROXY_CONFIG_KEY: INFO.to_dict()}


def _shapes() -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in _state().items()}


def test_a_proxy_round_trips_with_its_conflict_scores() -> None:
    state = _state()
    conflict = {"w": torch.full((4, 3), 0.5)}
    data = encode_proxy(state, CONFIG, 3, conflict)
    got = decode_proxy(data, _shapes(), max_bytes=1 << 20, round_=3, expected_info=INFO)
    assert got.round == 3 and got.info == INFO and got.config == CONFIG
    assert set(got.state) == set(state)
    assert all(torch.equal(got.state[k], state[k]) for k in state)
    assert torch.equal(got.conflict["w"], conflict["w"])
    assert parse_round(payload_content_type("x/y", 7), "x/y") == 7


def test_an_update_round_trips() -> None:
    state = _state()
    got = decode_update(encode_update(state, INFO, 2), state, INFO, max_bytes=1 << 20, round_=2)
    assert all(torch.equal(got.state[k], state[k]) for k in state)


def _refusal(call: object) -> str:
    with pytest.raises(ProxyError) as err:
        assert callable(call)
        call()
    return err.value.reason


def test_bad_updates_are_refused_with_their_reason() -> None:
    state = _state()
    dec = lambda data, **kw: (  # noqa: E731
        lambda: decode_update(
            data,
            state,
            kw.get("info", INFO),
            max_bytes=kw.get("mb", 1 << 20),
            round_=kw.get("round_", 2),
        )
    )
    good = encode_update(state, INFO, 2)
    assert _refusal(dec(good, round_=3)) == "round"
    assert _refusal(dec(good, mb=100)) == "too_large"
    other = ProxyInfo("gpt2", 4, (0, 2), "transformer.h", 0.5)
    assert _refusal(dec(encode_update(state, other, 2))) == "mismatch"
    nan = dict(state, b=torch.tensor([0.0, float("nan"), 1.0]))
    assert _refusal(dec(encode_update(nan, INFO, 2))) == "non_finite"
    wide = dict(state, b=torch.zeros(5))
    assert _refusal(dec(encode_update(wide, INFO, 2))) == "shape"
    extra = dict(state, more=torch.zeros(1))
    assert _refusal(dec(encode_update(extra, INFO, 2))) == "keys"
    half = {k: v.half() for k, v in state.items()}
    assert _refusal(dec(encode_update(half, INFO, 2))) == "dtype"
    assert _refusal(dec(encode_proxy(state, CONFIG, 2))) == "format"
    assert _refusal(dec(b"\x00" * 16)) == "decode"


def test_bad_proxies_are_refused_with_their_reason() -> None:
    state = _state()
    shapes = _shapes()
    bad_scores = encode_proxy(state, CONFIG, 2, {"w": torch.full((4, 3), 1.5)})
    assert _refusal(lambda: decode_proxy(bad_scores, shapes, max_bytes=1 << 20)) == "non_finite"
    other = ProxyInfo("gpt2", 4, (1, 3), "transformer.h", 0.5)
    data = encode_proxy(state, CONFIG, 2)
    assert (
        _refusal(lambda: decode_proxy(data, shapes, max_bytes=1 << 20, expected_info=other))
        == "mismatch"
    )
    assert _refusal(lambda: decode_proxy(data, {"w": (4, 3)}, max_bytes=1 << 20)) == "keys"
    assert _refusal(lambda: encode_proxy(state, CONFIG, 2, {"nope": torch.zeros(1)})) == "keys"
    update = encode_update(state, INFO, 2)
    assert _refusal(lambda: decode_proxy(update, shapes, max_bytes=1 << 20)) == "format"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"owner": True}, "needs fedproxy.cohort"),
        ({"owner": True, "cohort": {"m1": "nohost"}}, "fedproxy.cohort.m1"),
        ({"owner": True, "cohort": {"bad name": "127.0.0.1:1"}}, "not an agent name"),
        ({"owner": True, "cohort": {"m1": "127.0.0.1:1"}, "owner_name": "o"}, "member's"),
        ({}, "needs fedproxy.owner_name"),
        ({"owner_name": "o", "owner_address": "127.0.0.1:1", "fused_path": "x"}, "owner's"),
        ({"owner_name": "o", "owner_address": "127.0.0.1:1", "compress_ratio": 0.5}, "owner's"),
        ({"owner": True, "cohort": {"m1": "127.0.0.1:1"}, "compress_ratio": 1.0}, "less than 1"),
        ({"owner": True, "cohort": {"m1": "127.0.0.1:1"}, "compress_ratio": -0.1}, "greater"),
        ({"rho": 0.9}, "greater than or equal to 1"),
        ({"round_deadline_s": 0}, "greater than 0"),
        ({"max_update_norm_ratio": 0}, "greater than 0"),
        ({"acceptance_margin": -0.1}, "greater than or equal to 0"),
        ({"gate_examples": 0}, "greater than or equal to 1"),
    ],
)
def test_fedproxy_settings_are_refused_with_a_clear_error(
    settings: dict[str, object], message: str
) -> None:
    from peerlm.agent.settings import FedProxySettings
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as err:
        FedProxySettings(enabled=True, **settings)  # type: ignore[arg-type]
    assert message in str(err.value)


def test_fedproxy_settings_defaults_are_the_papers() -> None:
    from peerlm.agent.settings import AgentSettings

    fp = AgentSettings().fedproxy
    assert not fp.enabled and (fp.r0, fp.delta, fp.rho, fp.lambda_reg) == (1.0, 0.2, 1.1, 1e-5)
    # Admission (docs/fedproxy.md, "Hostile members"): on by default, loose.
    assert (fp.max_update_norm_ratio, fp.acceptance_margin, fp.gate_examples) == (1.0, 0.1, 32)
    # Hostile members inside the bounds: robust merge, group bounds, rollback, pull limit.
    assert (fp.robust_merge, fp.max_group_norm_ratio, fp.harm_margin) == (True, 0.5, 0.5)
    assert fp.max_pulls_per_round == 4


def _weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(8, 8, generator=gen),
        "b": torch.randn(8, generator=gen),
        "steps": torch.tensor([3]),  # not floating: no part of any norm
    }


def test_update_norms_are_float64_and_ignore_non_floating_tensors() -> None:
    from peerlm.agent.fedproxy.admission import state_norm, update_norm

    base = _weights()
    flat = torch.cat([base["w"].reshape(-1), base["b"]]).double()
    assert state_norm(base) == pytest.approx(float(flat.norm()))
    # 1e30 entries square to 1e60: inf in float32, finite in float64.
    huge = {k: (v + 1e30 if v.is_floating_point() else v) for k, v in base.items()}
    assert update_norm(base, huge) == pytest.approx(1e30 * (72**0.5), rel=1e-6)
    assert update_norm(base, base) == 0.0


def test_the_norm_bound_refuses_huge_and_nan_updates_and_admits_the_rest() -> None:
    from peerlm.agent.fedproxy.admission import norm_refusal

    base = _weights()
    small = {k: (v * 1.05 if v.is_floating_point() else v) for k, v in base.items()}
    assert norm_refusal(base, small, max_ratio=1.0) is None
    huge = {k: (v + 1e30 if v.is_floating_point() else v) for k, v in base.items()}
    message = norm_refusal(base, huge, max_ratio=1.0)
    assert message is not None and "max_update_norm_ratio" in message
    # Just over and just under the bound, against a given reference norm.
    double = {k: (v * 2 if v.is_floating_point() else v) for k, v in base.items()}
    assert norm_refusal(base, double, max_ratio=0.99, base_norm=None) is not None
    assert norm_refusal(base, double, max_ratio=1.01) is None
    nan = {
        k: (torch.full_like(v, float("nan")) if v.is_floating_point() else v)
        for k, v in base.items()
    }
    assert norm_refusal(base, nan, max_ratio=1e9) is not None
    # No bound configured: nothing is refused.
    assert norm_refusal(base, huge, max_ratio=None) is None
