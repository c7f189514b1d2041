"""The daemon's peer slot: integrations write to it, the own adapter is never touched, the
router is fitted from the agent's data, the slot survives a checkpoint or is set aside."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from peerlm.agent import AgentSettings, LoraSettings, ModelHost, TrainSettings
from peerlm.agent.checkpoint import CheckpointStore
from peerlm.agent.exchange.package import TextItem, TextPackage, prompt_sha256
from peerlm.agent.exchange.peer_knowledge import (
    REHEARSAL_LESSONS,
    REHEARSAL_PAIR_CHARS,
    REHEARSAL_PAIRS_PER_LESSON,
    PeerSlot,
)
from peerlm.agent.exchange.rounds import RoundConfig, integrate_package
from peerlm.agent.merging.pull_aggregate import PullSettings, integrate_adapters
from peerlm.agent.peer_integration import (
    SLOT_EXTRA,
    fit_agent_router,
    in_slot,
    restore_slot,
    slot_extra,
    slot_learns,
    slot_record,
    slot_runner,
)

from peerlm.app.devfed_report import _peer_slot

OWN = [f'def add_{k}(x: int) -> int:\n    """Return x plus {k}."""\n    ' for k in range(20)]
VAL = [f'def add_{k}(y: int) -> int:\n    """Return y plus {k}."""\n    ' for k in range(20, 26)]
OTHER = [
    f'def is_pal_{k}(s: str) -> bool:\n    """Whether the word {k} is a palindrome."""\n    '
    for k in range(20)
]
LOCAL = [(p, f"return x + {k}\n") for k, p in enumerate(OWN[:4])]
FAST = TrainSettings(learning_rate=5e-2, batch_size=4, grad_accumulation=1, seed=0)


@pytest.fixture(scope="module")
def host(micro_gpt2: Path) -> ModelHost:
    return ModelHost.load(micro_gpt2, LoraSettings(r=4), device="cpu", seed=0)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _package() -> TextPackage:
    return TextPackage(
        teacher="teacher",
        directive_id="d" * 32,
        transfer_sha256="ab" * 32,
        model_family="gpt2",
        items=tuple(
            TextItem(str(i), prompt_sha256(p), "return s == s[::-1]\n")
            for i, p in enumerate(OTHER[:4])
        ),
        created_at=1.0,
    )


def _akd_args(steps: int = 3) -> dict[str, Any]:
    """integrate_package's arguments after the host and package: own data LOCAL."""
    return {
        "kilobytes": 1.0,
        "local_examples": LOCAL,
        "val_examples": LOCAL,
        "transfer_prompts": OTHER[:4],
        "config": RoundConfig(total_rounds=2, train=FAST, local_steps=steps),
        "t": 1,
    }


def _akd(host: ModelHost) -> Any:
    return integrate_package(host, _package(), **_akd_args())


def test_an_akd_exchange_changes_the_slot_and_never_the_own_adapter(host: ModelHost) -> None:
    own = host.adapter_state()
    slot = PeerSlot()
    result = in_slot(slot, host, "akd", integrate_package, host, _package(), **_akd_args())
    assert result.stats.steps == 3
    assert _same(host.adapter_state(), own)
    assert slot.integrations == 1 and slot.history == ["akd"]
    assert slot.state is not None and not _same(slot.state, own)
    # Only the listed integration functions count: _akd is a test wrapper, so a call of it
    # through in_slot is a measurement whose writes are dropped: nothing changes at all.
    before = dict(slot.state)
    in_slot(slot, host, "akd", _akd, host)
    assert _same(slot.state, before) and slot.integrations == 1
    assert _same(host.adapter_state(), own)


async def inline(fn: Any, /, *args: Any, **kw: Any) -> Any:
    """The daemon's model-thread runner, run on the caller's thread."""
    return fn(*args, **kw)


def test_a_direct_akd_integration_through_the_runner_counts_and_stays_in_the_slot(
    host: ModelHost,
) -> None:
    own = host.adapter_state()
    slot = PeerSlot()

    run = slot_runner(inline, slot, host, "akd")
    result = asyncio.run(run(integrate_package, host, _package(), **_akd_args(2)))
    assert result.mode == "text"
    assert _same(host.adapter_state(), own)
    assert slot.integrations == 1 and slot.state is not None and not _same(slot.state, own)


def test_an_akd_package_the_slot_learns_nothing_of_leaves_it_as_it_was(host: ModelHost) -> None:
    own = host.adapter_state()
    slot = PeerSlot()
    run = slot_runner(inline, slot, host, "akd")
    nothing = asyncio.run(
        run(
            integrate_package, host, _package(), **_akd_args(2), learns=lambda ps: [False] * len(ps)
        )
    )
    assert nothing.stats.steps == 0 and nothing.loss_pre == nothing.loss_post
    assert slot.state is None and slot.integrations == 0 and slot.history == []
    assert _same(host.adapter_state(), own)
    # One item learnt: the slot takes it and counts it.
    learnt = asyncio.run(
        run(
            integrate_package,
            host,
            _package(),
            **_akd_args(2),
            learns=lambda ps: [p == OTHER[0] for p in ps],
        )
    )
    assert learnt.stats.steps == 2 and slot.integrations == 1 and slot.state is not None
    assert _same(host.adapter_state(), own)


def test_the_slot_scope_is_the_routers_peer_side_and_nothing_without_a_router() -> None:
    router, _how = fit_agent_router(OWN, ["add"] * len(OWN), OTHER, ["pal"] * len(OTHER), VAL)
    assert router is not None
    # "all": every item, with or without a router (never None: the slot takes no own-data
    # step for a package it learns nothing of).
    for r in (router, None):
        everything = slot_learns(r, "all")
        assert everything is not None and list(everything([OTHER[0], VAL[0]])) == [True, True]
    learns = slot_learns(router, "routed")
    assert learns is not None and list(learns([OTHER[0], VAL[0]])) == [True, False]
    # No router: no input ever reaches the slot, so it learns nothing either.
    nothing = slot_learns(None, "routed")
    assert nothing is not None and list(nothing([OTHER[0], VAL[0]])) == [False, False]
    with pytest.raises(ValueError):
        AgentSettings(slot_scope="everything")  # type: ignore[arg-type]


def test_a_merge_through_the_runner_writes_the_slot_and_measurements_leave_it(
    host: ModelHost,
) -> None:
    own = host.adapter_state()
    slot = PeerSlot()

    run = slot_runner(inline, slot, host, "pmix")

    async def exchange() -> None:
        # A measurement before anything was integrated leaves the slot empty.
        await run(host.eval_loss, LOCAL)
        assert slot.state is None
        # A write that is not an integration (training) is dropped, never kept anywhere.
        await run(host.train_local, LOCAL, FAST, steps=1)
        assert slot.state is None and _same(host.adapter_state(), own)
        peer = {k: v + 0.01 for k, v in own.items()}
        report, _verdict, _pre = await run(
            integrate_adapters, host, {"peer": peer}, {"peer": 1.0}, PullSettings(), "me"
        )
        assert report.accepted

    asyncio.run(exchange())
    assert _same(host.adapter_state(), own)
    assert slot.integrations == 1 and slot.history == ["pmix"]
    assert slot.state is not None and not _same(slot.state, own)


def test_the_agent_router_by_category_falls_back_and_may_be_absent() -> None:
    router, how = fit_agent_router(OWN, ["add"] * len(OWN), OTHER, ["word"] * len(OTHER), VAL)
    assert how == "categories" and router is not None
    assert not any(router.to_peer(VAL))
    # X_u of the agent's own category only: own against X_u.
    router, how = fit_agent_router(OWN, ["add"] * len(OWN), OTHER, ["add"] * len(OTHER), [])
    assert how == "own_vs_transfer" and router is not None
    assert not any(router.to_peer(OWN))  # no validation: calibrated on the training prompts
    router, how = fit_agent_router(OWN, ["add"] * len(OWN), [], [], VAL)
    assert router is None and how.startswith("none")


def test_the_slot_survives_a_checkpoint(host: ModelHost, tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ck")
    slot = PeerSlot()
    slot.state = {k: v + 0.5 for k, v in host.adapter_state().items()}
    slot.integrations, slot.history = 3, ["akd", "pmix", "overlay"]
    store.save(1, host.adapter_state(), {SLOT_EXTRA: slot_record(slot)}, extra=slot_extra(slot))
    restored = store.load_latest()
    assert restored is not None
    again = PeerSlot()
    assert restore_slot(again, host, restored, store)
    assert again.state is not None and _same(again.state, slot.state)
    assert again.integrations == 3 and again.history == ["akd", "pmix", "overlay"]
    assert slot_extra(PeerSlot()) is None and slot_extra(None) is None


def test_the_slots_lessons_survive_a_checkpoint_and_a_malformed_record_loses_only_itself(
    host: ModelHost, tmp_path: Path
) -> None:
    store = CheckpointStore(tmp_path / "ck")
    slot = PeerSlot(rehearsal=4)
    slot.state = host.adapter_state()
    slot.remember([("p1", "c1"), ("p2", "c2")])
    slot.remember([("p3", "c3")])
    record = slot_record(slot)
    store.save(1, host.adapter_state(), {SLOT_EXTRA: record}, extra=slot_extra(slot))
    restored = store.load_latest()
    assert restored is not None
    again = PeerSlot(rehearsal=4)
    assert restore_slot(again, host, restored, store)
    assert again.lessons == slot.lessons
    # What a damaged or hostile record holds that is not a lesson of string pairs is
    # dropped, the rest kept.
    record["lessons"] = [[["p", "c"], ["only one"], [1, "c"]], "text", [], [["q", "d"]]]
    store.save(2, host.adapter_state(), {SLOT_EXTRA: record}, extra=slot_extra(slot))
    restored = store.load_latest()
    assert restored is not None and restore_slot(again, host, restored, store)
    assert again.lessons == [(("p", "c"),), (("q", "d"),)]
    # Without rehearsal the peers' text is not taken back (nor saved again).
    off = PeerSlot()
    assert restore_slot(off, host, restored, store) and off.lessons == []
    assert slot_record(off)["lessons"] == []


def test_rehearsal_draws_from_remembered_lessons_within_its_bounds() -> None:
    off = PeerSlot()
    off.remember([("p", "c")])
    assert off.lessons == [] and off.rehearse() == []
    slot = PeerSlot(rehearsal=3, seed=7)
    assert slot.rehearse() == []
    many = [(f"p{k}", f"c{k}") for k in range(REHEARSAL_PAIRS_PER_LESSON + 10)]
    slot.remember([("p" * REHEARSAL_PAIR_CHARS, "c"), *many])
    # A pair longer than the limit is not kept; of the rest, the first of the lesson.
    assert slot.lessons == [tuple(many[:REHEARSAL_PAIRS_PER_LESSON])]
    drawn = slot.rehearse()
    assert len(drawn) == 3 == len(set(drawn)) and set(drawn) <= set(many)
    # The same draws for the same slot (seed and integration count): a replay repeats it.
    assert slot.rehearse() == drawn
    slot.integrations += 1
    for k in range(REHEARSAL_LESSONS + 5):
        slot.remember([(f"lesson{k}", "c")])
    assert len(slot.lessons) == REHEARSAL_LESSONS
    assert slot.lessons[-1] == (("lesson20", "c"),) and slot.lessons[0] == (("lesson5", "c"),)
    saved = slot.saved()
    slot.remember([("later", "c")])
    slot.restore(saved)
    assert slot.lessons[-1] == (("lesson20", "c"),)


def test_a_lesson_is_distilled_with_earlier_ones_and_remembered_only_when_kept(
    host: ModelHost,
) -> None:
    seen: list[list[tuple[str, str]]] = []
    train_akd = host.train_akd

    def spy(local: Any, teacher: Any, *args: Any, **kw: Any) -> Any:
        seen.append(list(teacher))
        return train_akd(local, teacher, *args, **kw)

    own = host.adapter_state()
    slot = PeerSlot(rehearsal=2, seed=1)
    host.train_akd = spy  # type: ignore[method-assign]
    try:
        in_slot(slot, host, "akd", integrate_package, host, _package(), **_akd_args(1))
        first = [(p, "return s == s[::-1]\n") for p in OTHER[:4]]
        assert seen[-1] == first and slot.lessons == [tuple(first)]
        in_slot(slot, host, "akd", integrate_package, host, _package(), **_akd_args(1))
        # The new lesson's four pairs and two of the remembered one's.
        assert seen[-1][:4] == first and len(seen[-1]) == 6 and set(seen[-1][4:]) <= set(first)
        assert len(slot.lessons) == 2
        # A lesson its gate rolled back is not remembered: a margin below any change.
        gated = _akd_args(1)
        gated["config"] = RoundConfig(
            total_rounds=2, train=FAST, local_steps=1, acceptance_margin=-1.0
        )
        out = in_slot(slot, host, "akd", integrate_package, host, _package(), **gated)
        assert out.rolled_back and len(slot.lessons) == 2
    finally:
        del host.train_akd
        host.load_adapter_state(own)


def test_a_damaged_slot_file_is_set_aside_and_the_slot_starts_empty(
    host: ModelHost, tmp_path: Path
) -> None:
    store = CheckpointStore(tmp_path / "ck")
    state = {k: v + 0.5 for k, v in host.adapter_state().items()}
    path = store.save(1, host.adapter_state(), {}, extra={SLOT_EXTRA: state})
    slot_file = path / f"{SLOT_EXTRA}.safetensors"
    data = bytearray(slot_file.read_bytes())
    data[-1] ^= 0xFF
    slot_file.write_bytes(bytes(data))
    restored = store.load_latest()
    assert restored is not None and restored.round == 1  # the adapter still loads
    assert restored.damaged == (SLOT_EXTRA,) and SLOT_EXTRA not in restored.extras
    assert not slot_file.exists() and list(path.glob(f"{SLOT_EXTRA}.safetensors.corrupt-*"))
    reasons: list[str] = []
    slot = PeerSlot()
    assert not restore_slot(slot, host, restored, store, reasons.append)
    assert slot.state is None and reasons == ["damaged"]


def test_a_slot_that_does_not_fit_the_model_is_set_aside(host: ModelHost, tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ck")
    state = host.adapter_state()
    name = sorted(state)[0]
    wrong = {**state, name: torch.full_like(state[name], float("nan"))}
    path = store.save(1, state, {}, extra={SLOT_EXTRA: wrong})
    restored = store.load_latest()
    assert restored is not None and SLOT_EXTRA in restored.extras  # the bytes are intact
    reasons: list[str] = []
    slot = PeerSlot()
    assert not restore_slot(slot, host, restored, store, reasons.append)
    assert slot.state is None and reasons == ["non_finite"]
    assert list(path.glob(f"{SLOT_EXTRA}.safetensors.corrupt-*"))
    with pytest.raises(ValueError, match="not allowed"):
        store.save(2, state, {}, extra={"adapter": state})


def test_integration_setting_and_report_row() -> None:
    assert AgentSettings.model_fields["integration"].default == "separate"
    assert _peer_slot({}) == "-"
    row = _peer_slot(
        {
            "peer_slot_integrations": 2,
            "slices_after": {"lacked": {"peer_share": 0.75}, "own": {"peer_share": 0.0}},
        }
    )
    assert row == "2 (routed lacked 0.75, own 0.00)"
    # answer_check: the routed answers the own adapter kept, where there are any.
    checked = {"lacked": {"peer_share": 0.75, "own_answers": 2.0}, "own": {"peer_share": 0.0}}
    row = _peer_slot({"peer_slot_integrations": 2, "slices_after": checked})
    assert row == "2 (routed lacked 0.75 [2 kept by own adapter], own 0.00)"


def test_slot_only_settings_are_refused_without_a_slot() -> None:
    from peerlm.app.experiment_plan import ExperimentPlan

    with pytest.raises(ValueError, match=r"slot_rehearsal .* integration 'separate'"):
        AgentSettings(slot_rehearsal=4, integration="shared")
    assert AgentSettings(slot_rehearsal=4).slot_rehearsal == 4
    for fields in ({"slot_rehearsal": 8}, {"slot_learning_rate": 1e-2}):
        with pytest.raises(ValueError, match="needs a peer slot"):
            ExperimentPlan(integration="shared", **fields)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="slot_banks divides a peer slot"):
        AgentSettings(slot_banks="category", integration="shared")
    with pytest.raises(ValueError, match="slot_banks needs a peer slot"):
        ExperimentPlan(integration="shared", slot_banks="category")
    with pytest.raises(ValueError, match="slot_banks must be"):
        ExperimentPlan(slot_banks="teacher")  # type: ignore[arg-type]
    assert AgentSettings(slot_banks="category").slot_banks == "category"
    # The default: banks by category with a slot, one adapter (nothing refused) without.
    assert AgentSettings(integration="shared").slot_banks is None
    assert ExperimentPlan().slot_banks == "category"
    assert ExperimentPlan(integration="shared").slot_banks == "one"
    with pytest.raises(ValueError, match="slot_rehearsal and slot_learning_rate need"):
        ExperimentPlan(integration="shared", slot_rehearsal=8, slot_learning_rate=1e-2)
    for bad in (0.0, 1.5, float("nan"), True):
        with pytest.raises(ValueError, match="slot_learning_rate"):
            ExperimentPlan(slot_learning_rate=bad)
    assert ExperimentPlan(slot_learning_rate=1).slot_learning_rate == 1.0


def test_the_slot_learning_rate_reaches_integrations_only() -> None:
    from peerlm.app.experiment_plan import ExperimentPlan
    from peerlm.app.experiment_world import round_config

    plan = ExperimentPlan(learning_rate=5e-3, slot_learning_rate=2e-2)
    lesson = round_config(plan, 0, 1, integration=True)
    assert lesson.integrating().train.learning_rate == 2e-2
    assert round_config(plan, 0, 1).train.learning_rate == 5e-3  # own-data steps
    default = ExperimentPlan(learning_rate=5e-3)
    assert round_config(default, 0, 1, integration=True).integrating().train.learning_rate == 5e-3
    shared = ExperimentPlan(learning_rate=5e-3, integration="shared")
    assert round_config(shared, 0, 1, integration=True).slot_learning_rate is None


def test_the_daemon_narrows_a_routed_reward_scope_to_what_its_router_sends_the_slot() -> None:
    """The agent's ``_fit_router`` under ``reward_scope: routed``: the answered scope is
    narrowed to the probe problems its fitted router sends to the peer slot (the lacked
    category's, not the own one's); when none reaches the slot the agent warns once that
    every AKD reward will be the KB penalty alone. ``answered`` stays unnarrowed."""
    from types import SimpleNamespace

    import structlog
    from peerlm.agent.daemon import AgentDaemon
    from peerlm.agent.exchange.reward_probe import AnsweredProbe

    # Both labelled with X_u's category, so both are "answered"; the router keeps the
    # own-looking one on the own adapter and sends the other to the slot.
    own_looking = (VAL[0], "return y + 20\n", "word")
    lacked_probe = (OTHER[5], "return w\n", "word")

    def daemon(scope: str, probe: list[tuple[str, str, str]], banks: str | None = "one") -> Any:
        problem = SimpleNamespace
        return SimpleNamespace(
            s=SimpleNamespace(
                integration="separate",
                reward_scope=scope,
                slot_rehearsal=0,
                seed=0,
                slot_banks=banks,
            ),
            train=[problem(prompt=p, category="add") for p in OWN],
            val=[problem(prompt=p, category="add") for p in VAL],
            transfer_prompts=OTHER[:4],
            transfer_categories=["word"] * 4,
            reward_scope=AnsweredProbe.of(probe, OTHER[:4], ["word"] * 4),
            log=structlog.get_logger("test"),
        )

    agent = daemon("routed", [own_looking, lacked_probe])
    with structlog.testing.capture_logs() as logs:
        asyncio.run(AgentDaemon._fit_router(agent))
    assert agent.router is not None and agent.slot is not None
    assert agent.slot.classify is None  # slot_banks: one
    assert agent.reward_scope(OTHER[:4]) == [lacked_probe[:2]]
    assert not [e for e in logs if e["event"] == "reward_scope_measures_nothing"]

    answered = daemon("answered", [own_looking, lacked_probe], banks=None)
    asyncio.run(AgentDaemon._fit_router(answered))
    # slot_banks: category (the default, None): the banks are the router's lacked categories.
    assert answered.slot.classify is not None
    assert answered.slot.bank_for(OTHER[:4]) == "word"
    assert answered.reward_scope(OTHER[:4]) == [own_looking[:2], lacked_probe[:2]]
    # Only the own-looking problem: nothing reaches the slot, said once at start.
    only_own = daemon("routed", [own_looking])
    with structlog.testing.capture_logs() as logs:
        asyncio.run(AgentDaemon._fit_router(only_own))
    assert only_own.reward_scope(OTHER[:4]) == []
    assert [e["event"] for e in logs].count("reward_scope_measures_nothing") == 1


def _stem(prompts: Any) -> list[str]:
    """A stand-in for the router's unheld category: palindromes by even index, else odd."""
    return ["even" if int(p.split("_")[2].split("(")[0]) % 2 == 0 else "odd" for p in prompts]


def test_with_banks_a_lesson_writes_its_categorys_bank_and_a_merge_the_shared_one(
    host: ModelHost,
) -> None:
    own = host.adapter_state()
    slot = PeerSlot(classify=_stem)
    args = _akd_args(1)
    # Three of the package's four prompts are learnt (the scope drops OTHER[1]): 0, 2
    # even, 3 odd, so the lesson is the "even" bank's.
    learns = lambda ps: [p != OTHER[1] for p in ps]  # noqa: E731
    in_slot(slot, host, "akd", integrate_package, host, _package(), **args, learns=learns)
    assert slot.writes == {"even": 1} and slot.last == "even"
    odd_only = lambda ps: [p in (OTHER[1], OTHER[3]) for p in ps]  # noqa: E731
    in_slot(slot, host, "akd", integrate_package, host, _package(), **args, learns=odd_only)
    assert slot.writes == {"even": 1, "odd": 1} and slot.last == "odd"
    even = slot.banks["even"]
    peer = {k: v + 0.01 for k, v in own.items()}
    in_slot(
        slot, host, "pmix", integrate_adapters, host, {"p": peer}, {"p": 1.0}, PullSettings(), "me"
    )
    assert slot.writes == {"even": 1, "odd": 1, "": 1} and slot.last == ""
    # Each write started from its own bank: the "even" bank is untouched by the others.
    assert slot.banks["even"] is even and not _same(slot.banks["even"], slot.banks["odd"])
    # A measurement sees the bank written last and leaves every bank as it was.
    before = {b: dict(s) for b, s in slot.banks.items()}
    in_slot(slot, host, "probe", host.train_local, LOCAL, FAST, steps=1)
    assert all(_same(slot.banks[b], before[b]) for b in before)
    assert _same(host.adapter_state(), own) and slot.integrations == 3


def test_every_bank_survives_a_checkpoint_and_a_damaged_one_loses_only_itself(
    host: ModelHost, tmp_path: Path
) -> None:
    store = CheckpointStore(tmp_path / "ck")
    own = host.adapter_state()
    slot = PeerSlot(classify=_stem)
    slot.banks = {b: {k: v + d for k, v in own.items()} for b, d in (("even", 0.1), ("", 0.2))}
    slot.writes, slot.last, slot.integrations = {"even": 2, "": 1}, "even", 3
    record = slot_record(slot)
    assert record["banks"] == [["even", 2], ["", 1]] and record["last"] == "even"
    extra = slot_extra(slot)
    assert extra is not None and sorted(extra) == [SLOT_EXTRA, f"{SLOT_EXTRA}_1"]
    path = store.save(1, own, {SLOT_EXTRA: record}, extra=extra)
    restored = store.load_latest()
    assert restored is not None
    again = PeerSlot(classify=_stem)
    assert restore_slot(again, host, restored, store)
    assert again.writes == slot.writes and again.last == "even" and again.integrations == 3
    assert all(_same(again.banks[b], slot.banks[b]) for b in slot.banks)
    # The second bank's file damaged: the first comes back alone, the reason reported.
    second = path / f"{SLOT_EXTRA}_1.safetensors"
    data = bytearray(second.read_bytes())
    data[-1] ^= 0xFF
    second.write_bytes(bytes(data))
    restored = store.load_latest()
    assert restored is not None
    reasons: list[str] = []
    alone = PeerSlot(classify=_stem)
    assert restore_slot(alone, host, restored, store, reasons.append)
    assert list(alone.banks) == ["even"] and reasons == ["damaged"] and alone.last == "even"
    # A record that lists its banks wrongly (or none: before banks) reads as one shared bank.
    for listed in ("x", [["a", -1]], [["a", 1], ["a", 2]], [[1, 2]], None):
        bad = {**record, "banks": listed}
        store.save(2, own, {SLOT_EXTRA: bad}, extra={SLOT_EXTRA: slot.banks["even"]})
        restored = store.load_latest()
        assert restored is not None
        shared = PeerSlot()
        assert restore_slot(shared, host, restored, store)
        assert list(shared.banks) == [""] and shared.last == ""
    # Restored under one bank (``slot_banks: one`` after ``category``): the slot is the
    # bank that answered every input, the shared one, and lessons go on from it.
    store.save(3, own, {SLOT_EXTRA: record}, extra=extra)
    restored = store.load_latest()
    assert restored is not None
    one = PeerSlot()
    assert restore_slot(one, host, restored, store)
    assert list(one.banks) == [""] and one.last == "" and one.writes == {"": 3}
    assert _same(one.banks[""], slot.banks[""])
    # Without a shared bank, the most written one is kept.
    only = PeerSlot(integrations=4)
    only.banks = {b: {k: v + d for k, v in own.items()} for b, d in (("a", 0.1), ("b", 0.2))}
    only.writes = {"a": 1, "b": 3}
    b_state = only.banks["b"]
    only.as_one_bank()
    assert only.banks == {"": b_state} and only.writes == {"": 4} and only.last == ""
    # With classify set the banks stay.
    kept = PeerSlot(classify=_stem)
    kept.banks, kept.writes = dict(slot.banks), dict(slot.writes)
    kept.as_one_bank()
    assert list(kept.banks) == list(slot.banks)


def test_with_banks_a_merge_measures_the_bank_it_writes_and_a_new_bank_starts_from_it(
    host: ModelHost,
) -> None:
    own = host.adapter_state()
    slot = PeerSlot(classify=_stem)
    in_slot(slot, host, "akd", integrate_package, host, _package(), **_akd_args(1))
    assert list(slot.banks) == ["even"] and slot.last == "even"
    # A measurement through the runner (a merge's probe) sees the shared bank, which a
    # merge writes: here none yet, so the own adapter, not the "even" bank written last.
    seen = in_slot(slot, host, "pmix", host.adapter_state)
    assert _same(seen, own)
    peer = {k: v + 0.01 for k, v in own.items()}
    in_slot(
        slot, host, "pmix", integrate_adapters, host, {"p": peer}, {"p": 1.0}, PullSettings(), "me"
    )
    shared = slot.banks[""]
    assert _same(in_slot(slot, host, "pmix", host.adapter_state), shared)
    # A new category bank starts as the shared bank (what the slot held before banks).
    with slot.active(host, "trial", "odd"):
        assert _same(host.adapter_state(), shared)
    assert _same(host.adapter_state(), own)


def test_a_rolled_back_lesson_counts_but_creates_no_bank(host: ModelHost) -> None:
    own = host.adapter_state()
    slot = PeerSlot(classify=_stem)
    gated = _akd_args(1)
    gated["config"] = RoundConfig(total_rounds=2, train=FAST, local_steps=1, acceptance_margin=-1.0)
    out = in_slot(slot, host, "akd", integrate_package, host, _package(), **gated)
    assert out.rolled_back and out.stats.steps == 1
    assert slot.banks == {} and slot.integrations == 1 and slot.history == ["akd"]
    # Into an existing bank a rolled-back lesson is kept as the gate left it.
    in_slot(slot, host, "akd", integrate_package, host, _package(), **_akd_args(1))
    even = slot.banks["even"]
    out = in_slot(slot, host, "akd", integrate_package, host, _package(), **gated)
    assert out.rolled_back and _same(slot.banks["even"], even) and slot.writes == {"even": 2}
    assert _same(host.adapter_state(), own)


def test_a_record_listing_too_many_banks_is_read_up_to_the_bound(
    host: ModelHost, tmp_path: Path
) -> None:
    store = CheckpointStore(tmp_path / "ck")
    own = host.adapter_state()
    record = {"integrations": 1, "banks": [[f"c{k}", 1] for k in range(100_000)], "last": "c0"}
    store.save(1, own, {SLOT_EXTRA: record}, extra={SLOT_EXTRA: own, f"{SLOT_EXTRA}_1": own})
    restored = store.load_latest()
    assert restored is not None
    slot = PeerSlot(classify=_stem)
    assert restore_slot(slot, host, restored, store)
    assert list(slot.banks) == ["c0", "c1"] and slot.last == "c0"
