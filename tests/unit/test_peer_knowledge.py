"""The peer slot and the input router: peers' knowledge beside the own adapter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peerlm.agent import LoraSettings, ModelHost, TrainSettings
from peerlm.agent.exchange.package import TextItem, TextPackage, prompt_sha256
from peerlm.agent.exchange.peer_knowledge import (
    InputRouter,
    PeerSlot,
    learnt_items,
    route_map,
    routed_share,
)

OWN = [f'def add_{k}(x: int) -> int:\n    """Return x plus {k}."""\n    ' for k in range(30)]
VAL = [f'def add_{k}(y: int) -> int:\n    """Return y plus {k}."""\n    ' for k in range(30, 40)]
OTHER = [
    f'def is_even_{k}(s: str) -> bool:\n    """Whether the word {k} is a palindrome."""\n    '
    for k in range(30)
]


def test_the_router_never_sends_an_own_validation_prompt_to_the_peer_slot() -> None:
    router = InputRouter.fit(OWN, OTHER, VAL)
    assert router.to_peer(VAL) == [False] * len(VAL)
    # Unlike anything of the participant's: the peers' knowledge answers.
    fresh = [p.replace("is_even", "check_word") for p in OTHER[:5]]
    assert all(router.to_peer(fresh))
    assert routed_share(router, fresh) == 1.0
    assert routed_share(None, fresh) == 0.0


def test_the_slot_learns_the_items_its_router_sends_it_and_keeps_a_foreign_one() -> None:
    router = InputRouter.fit(OWN, OTHER, VAL)
    transfer = [*OWN[:3], *OTHER[:3]]
    foreign = TextItem("x", prompt_sha256("not in X_u"), "return 0\n")
    package = TextPackage(
        teacher="t",
        directive_id="d" * 32,
        transfer_sha256="ab" * 32,
        model_family="gpt2",
        items=(
            *(TextItem(str(i), prompt_sha256(p), "pass\n") for i, p in enumerate(transfer)),
            foreign,
        ),
        created_at=1.0,
    )
    kept = learnt_items(package, transfer, router.to_peer)
    # The own category's items go; the others' stay, and so does the item answering a
    # prompt outside X_u, so that the integration still refuses the package for it.
    assert [i.prompt_id for i in kept.items] == ["3", "4", "5", "x"]
    assert kept.teacher == package.teacher and kept.created_at == package.created_at
    assert learnt_items(package, transfer, lambda ps: [False] * len(ps)).items == (foreign,)
    with pytest.raises(ValueError, match="answers for 6 prompts"):
        learnt_items(package, transfer, lambda ps: [True])


def test_a_router_needs_every_set() -> None:
    with pytest.raises(ValueError, match="own, other and validation"):
        InputRouter.fit(OWN, OTHER, [])
    with pytest.raises(ValueError):
        InputRouter.fit([], OTHER, VAL)


@pytest.fixture(scope="module")
def host(micro_gpt2: Path) -> ModelHost:
    return ModelHost.load(micro_gpt2, LoraSettings(r=4), device="cpu", seed=0)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_what_an_integration_does_stays_in_the_slot_and_the_own_adapter_is_untouched(
    host: ModelHost,
) -> None:
    own = host.adapter_state()
    slot = PeerSlot()
    assert not slot.ready
    pairs = [(p, "return x\n") for p in OTHER[:8]]
    with slot.active(host, "akd"):
        host.train_local(pairs, TrainSettings(learning_rate=5e-2, seed=1), steps=3)
    assert _same(host.adapter_state(), own)
    assert slot.ready and slot.integrations == 1 and slot.history == ["akd"]
    assert slot.state is not None and not _same(slot.state, own)
    # The next integration starts from the slot, not from the own adapter.
    first = dict(slot.state)
    with slot.active(host):
        assert _same(host.adapter_state(), first)


def test_a_block_that_learnt_nothing_leaves_the_slot_as_it_was(host: ModelHost) -> None:
    own = host.adapter_state()
    slot = PeerSlot()
    pairs = [(p, "return x\n") for p in OTHER[:8]]
    with slot.active(host, "akd") as write:
        host.train_local(pairs, TrainSettings(learning_rate=5e-2, seed=1), steps=1)
        write.kept = False
    assert slot.state is None and slot.integrations == 0 and slot.history == []
    assert _same(host.adapter_state(), own)


def test_a_failed_integration_keeps_the_slot_and_restores_the_own_adapter(
    host: ModelHost,
) -> None:
    own = host.adapter_state()
    slot = PeerSlot()
    with pytest.raises(RuntimeError, match="peer went away"), slot.active(host):
        host.train_local(
            [(OTHER[0], "return 1\n")], TrainSettings(learning_rate=5e-2, seed=2), steps=1
        )
        raise RuntimeError("peer went away")
    assert slot.state is None and slot.integrations == 0
    assert _same(host.adapter_state(), own)


def test_route_map_answers_each_input_with_its_adapter_and_keeps_the_order(
    host: ModelHost,
) -> None:
    router = InputRouter.fit(OWN, OTHER, VAL)
    slot = PeerSlot()
    items = [OWN[0], OTHER[0].replace("is_even", "check_word"), OWN[1]]

    def which(prompts: list[str]) -> list[tuple[str, bool]]:
        # Whether the adapter in place now is the slot's (its B factors are non-zero).
        state = host.adapter_state()
        peer = any(float(v.abs().sum()) > 0 for k, v in state.items() if "lora_B" in k)
        return [(p, peer) for p in prompts]

    # Empty slot: everything is the own adapter's, whatever the router says.
    assert [x[1] for x in route_map(host, slot, router, items, str, which)] == [False] * 3
    with slot.active(host):
        host.train_local(
            [(OTHER[0], "return 2\n")], TrainSettings(learning_rate=5e-2, seed=3), steps=2
        )
    got = route_map(host, slot, router, items, str, which)
    assert [p for p, _ in got] == items
    assert [peer for _, peer in got] == [False, True, False]
    # No router: the own adapter answers everything.
    assert [x[1] for x in route_map(host, slot, None, items, str, which)] == [False] * 3


def test_runs_that_replay_local_plus_own_track_wait_for_it() -> None:
    from peerlm.app.experiment import ExperimentPlan
    from peerlm.app.experiment_run import shares_track
    from peerlm.app.experiment_workers import schedule

    plan = ExperimentPlan(strategies=("local_plus", "random", "cpm"), seeds=(0, 1))
    todo = [(s, seed) for seed in (0, 1) for s in ("random", "local_plus", "cpm")]
    ready, waits = schedule(plan, todo)
    assert ready == [("local_plus", 0), ("local_plus", 1)]
    assert waits == {
        ("random", 0): ("local_plus", 0),
        ("cpm", 0): ("local_plus", 0),
        ("random", 1): ("local_plus", 1),
        ("cpm", 1): ("local_plus", 1),
    }
    # LocalOnly+ of seed 1 was reused from a stored result: its track is not at hand, so
    # seed 1's runs train their own adapters themselves and start at once.
    ready, waits = schedule(plan, [k for k in todo if k != ("local_plus", 1)])
    assert ("random", 1) in ready and ("cpm", 1) in ready
    assert set(waits) == {("random", 0), ("cpm", 0)}
    # One adapter for everything (the papers' integration): nothing is shared.
    shared = ExperimentPlan(strategies=("local_plus", "random"), integration="shared")
    assert not shares_track(shared, "random")
    assert schedule(shared, [("random", 0), ("local_plus", 0)])[1] == {}
    # FFA-LoRA starts from its own warm-up, and LocalOnly trains no extra steps.
    assert not shares_track(plan, "ffa_lora") and not shares_track(plan, "local")


def test_an_unknown_integration_or_a_zero_period_is_refused() -> None:
    from peerlm.app.experiment import ExperimentPlan

    with pytest.raises(ValueError, match="integration"):
        ExperimentPlan(integration="both")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="val_every"):
        ExperimentPlan(val_every=0)
    with pytest.raises(ValueError, match="teach_limit"):
        ExperimentPlan(teach_limit=0)


def test_with_categories_a_transfer_prompt_of_a_held_category_counts_as_own() -> None:
    # X_u holds prompts of the participant's own category ("add") and of another one.
    other = [p.replace("add_", "plus_") for p in OWN[:10]] + OTHER
    categories = ["add"] * 10 + ["word"] * len(OTHER)
    router = InputRouter.fit(
        OWN, other, VAL, own_categories=["add"] * len(OWN), other_categories=categories
    )
    assert router.to_peer(VAL) == [False] * len(VAL)
    assert not any(router.to_peer([p.replace("add_", "plus_") for p in OWN[10:20]]))
    assert all(router.to_peer([p.replace("is_even", "check_word") for p in OTHER[:5]]))
    with pytest.raises(ValueError, match="one category per prompt"):
        InputRouter.fit(OWN, other, VAL, own_categories=["add"], other_categories=categories)
    with pytest.raises(ValueError, match="does not hold"):
        InputRouter.fit(
            OWN, other, VAL, own_categories=["add"] * len(OWN), other_categories=["add"] * 40
        )


def test_with_own_runs_all_the_own_adapter_answers_everything_in_one_call(
    host: ModelHost,
) -> None:
    router = InputRouter.fit(OWN, OTHER, VAL)
    slot = PeerSlot()
    with slot.active(host):
        host.train_local(
            [(OTHER[0], "return 2\n")], TrainSettings(learning_rate=5e-2, seed=4), steps=2
        )
    items = [OWN[0], OTHER[0].replace("is_even", "check_word"), OWN[1]]
    calls: list[list[str]] = []

    def record(prompts: list[str]) -> list[str]:
        calls.append(list(prompts))
        return [p[:5] for p in prompts]

    got = route_map(host, slot, router, items, str, record, own_runs_all=True)
    assert got == [p[:5] for p in items]
    # One call with every item (the own adapter's), then the peer slot's items.
    assert calls == [items, [items[1]]]


def test_with_own_results_the_own_adapter_runs_nothing_and_the_slot_its_items(
    host: ModelHost,
) -> None:
    router = InputRouter.fit(OWN, OTHER, VAL)
    slot = PeerSlot()
    items = [OWN[0], OTHER[0].replace("is_even", "check_word"), OWN[1]]
    calls: list[list[str]] = []

    def record(prompts: list[str]) -> list[str]:
        calls.append(list(prompts))
        return ["computed"] * len(prompts)

    known = ["own-0", "own-1", "own-2"]
    # Empty slot: the known results are the answer, nothing runs.
    assert route_map(host, slot, router, items, str, record, own_results=known) == known
    assert calls == []
    with slot.active(host):
        host.train_local(
            [(OTHER[0], "return 2\n")], TrainSettings(learning_rate=5e-2, seed=4), steps=2
        )
    got = route_map(host, slot, router, items, str, record, own_results=known)
    assert got == ["own-0", "computed", "own-2"]
    assert calls == [[items[1]]]
    with pytest.raises(ValueError, match="2 results for 3 items"):
        route_map(host, slot, router, items, str, record, own_results=known[:2])


def test_choose_gets_the_slots_items_with_both_adapters_results_and_decides_them(
    host: ModelHost,
) -> None:
    """``choose`` (the answer check's hook): the own adapter answers every item, the slot
    its items, and what ``choose`` returns for those is what they keep."""
    router = InputRouter.fit(OWN, OTHER, VAL)
    slot = PeerSlot()
    with slot.active(host):
        host.train_local(
            [(OTHER[0], "return 2\n")], TrainSettings(learning_rate=5e-2, seed=4), steps=2
        )
    items = [OWN[0], OTHER[0].replace("is_even", "check_word"), OWN[1]]
    calls: list[list[str]] = []
    seen: list[tuple[list[str], list[str], list[str]]] = []

    def record(prompts: list[str]) -> list[str]:
        calls.append(list(prompts))
        return [f"{len(calls)}:{p[:4]}" for p in prompts]

    def choose(peer_items: list[str], own: list[str], peer: list[str]) -> list[str]:
        seen.append((list(peer_items), list(own), list(peer)))
        return [f"chosen {o}" for o in own]

    got = route_map(host, slot, router, items, str, record, choose=choose)  # type: ignore[arg-type]
    assert calls == [items, [items[1]]]
    assert seen == [([items[1]], [f"1:{items[1][:4]}"], [f"2:{items[1][:4]}"])]
    assert got == [f"1:{items[0][:4]}", f"chosen 1:{items[1][:4]}", f"1:{items[2][:4]}"]
    # A choose that loses an answer is refused, not zipped short.
    with pytest.raises(ValueError, match="choose gave 0 results for 1"):
        route_map(host, slot, router, items, str, record, choose=lambda i, o, p: [])


def test_a_saved_slot_undoes_a_trial_and_keeps_it_when_restored(host: ModelHost) -> None:
    """The Oracle's trials: every teacher is tried from the same slot, the best kept."""
    slot = PeerSlot()
    empty = slot.saved()
    with slot.active(host, "akd"):
        host.train_local(
            [(OTHER[0], "return 2\n")], TrainSettings(learning_rate=5e-2, seed=4), steps=1
        )
    tried = slot.saved()
    assert tried.integrations == 1 and tried.history == ("akd",) and tried.state is not None
    slot.restore(empty)
    assert slot.state is None and slot.integrations == 0 and slot.history == []
    assert not slot.ready
    slot.restore(tried)
    assert slot.integrations == 1 and slot.history == ["akd"]
    assert slot.state is tried.state
    # The saved history is the slot's at that moment, not a view of the live list.
    slot.history.append("later")
    assert tried.history == ("akd",)


def _category(prompts: list[str] | tuple[str, ...]) -> list[str]:
    """A stand-in for the router's unheld category: the function name's stem."""
    return ["pal" if "is_even" in p else "sum" if "add_" in p else "other" for p in prompts]


def test_a_lesson_goes_to_the_bank_of_most_of_its_prompts_and_ties_to_the_first() -> None:
    one = PeerSlot()
    assert one.bank_for(OTHER[:3]) == ""  # one bank: always the shared one
    slot = PeerSlot(classify=_category)
    assert slot.bank_for([]) == ""
    assert slot.bank_for([*OTHER[:2], OWN[0]]) == "pal"
    assert slot.bank_for([OTHER[0], OWN[0]]) == "pal"  # a tie: sort order
    with pytest.raises(ValueError, match="answers nothing"):
        slot.bank_of(OTHER[:1])


def test_each_routed_input_is_answered_by_its_categorys_bank(host: ModelHost) -> None:
    own = host.adapter_state()
    slot = PeerSlot(classify=_category)
    with slot.active(host, "akd", "pal"):
        host.train_local([(OTHER[0], "return 1\n")], TrainSettings(learning_rate=5e-2), steps=1)
    with slot.active(host, "akd", "other"):
        host.train_local([(OTHER[1], "return 2\n")], TrainSettings(learning_rate=5e-2), steps=2)
    with slot.active(host, "akd", "other"):
        host.train_local([(OTHER[2], "return 3\n")], TrainSettings(learning_rate=5e-2), steps=1)
    assert _same(host.adapter_state(), own)
    assert slot.writes == {"pal": 1, "other": 2} and slot.last == "other"
    assert slot.integrations == 3 and slot.state is slot.banks["other"]
    # A category without a bank goes to the most written one.
    assert slot.bank_of([OTHER[0], "def g():", OWN[0]]) == ["pal", "other", "other"]

    def which(prompts: list[str]) -> list[str]:
        state = host.adapter_state()
        bank = next((b for b, s in slot.banks.items() if _same(s, state)), "own")
        return [bank] * len(prompts)

    router = InputRouter.fit(OWN, OTHER, VAL)
    fresh = OTHER[0].replace("is_even", "is_even_word")
    items = [OWN[0], fresh, "def check_word(s: str) -> bool:\n    ", OWN[1]]
    got = route_map(host, slot, router, items, str, which)
    assert got == ["own", "pal", "other", "own"]
    assert _same(host.adapter_state(), own)
    # Saved and restored with its banks: a trial in a new bank is undone.
    saved = slot.saved()
    assert saved.state is slot.banks["other"]
    with slot.active(host, "trial", "sum"):
        host.train_local([(OWN[0], "return 4\n")], TrainSettings(learning_rate=5e-2), steps=1)
    assert set(slot.banks) == {"pal", "other", "sum"} and slot.last == "sum"
    slot.restore(saved)
    assert set(slot.banks) == {"pal", "other"} and slot.writes == {"pal": 1, "other": 2}
    assert slot.last == "other" and slot.integrations == 3
    # One bank set as the slot's state: everything answered by it.
    slot.state = dict(own)
    assert slot.banks.keys() == {""} and slot.bank_of(items) == [""] * 4


def test_the_routers_unheld_category_is_one_the_participant_holds_no_data_of() -> None:
    sums = [
        f'def total_{k}(xs: list[int]) -> int:\n    """Sum of xs, {k}."""\n    ' for k in range(20)
    ]
    router = InputRouter.fit(
        OWN,
        [*OTHER[:20], *sums, *OWN[:5]],
        VAL,
        own_categories=["add"] * len(OWN),
        other_categories=["pal"] * 20 + ["sum"] * 20 + ["add"] * 5,
    )
    assert router.unheld_category([]) == []
    assert router.unheld_category([OTHER[21], sums[3]]) == ["pal", "sum"]
    assert set(router.unheld_category(OWN[:5])) <= {"pal", "sum"}
