"""`peerlm up` checks every flag before it touches the previous run's state."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from peerlm.app.cli import app


@pytest.mark.parametrize(
    "flags",
    [
        ["--family", "gtp2"],
        ["--simulated", "--overlay"],
        ["--simulated", "--family", "gpt2"],
        ["--overlay", "--aggregation", "fedavg"],
        ["--aggregation", "svd_hka"],  # aggregation is of overlay pulls
        ["--aggregation", "svd_hka", "--one-shot"],  # the one shot is an overlay pull's
        ["--fedproxy", "--one-shot"],
        ["--overlay-startup", "30"],  # the overlay's first build: needs --overlay
        ["--overlay", "--overlay-startup", "0"],
        ["--overlay", "--overlay-startup", "nan"],
        ["--protocols", "akd,h_ties"],  # not on the CPM's menu
        ["--protocols", "pmix,pmix"],
        ["--protocols", ","],
        ["--simulated", "--protocols", "pmix"],  # simulated agents execute akd only
        ["--merge-senders", "3"],  # co-senders are for merge protocols: akd has none
        ["--protocols", "pmix", "--merge-senders", "0"],
        ["--protocols", "pmix", "--merge-senders", "17"],
        ["--protocols", "pmix", "--co-sender-scoring", "group"],  # needs --merge-senders > 1
        ["--protocols", "pmix", "--merge-senders", "3", "--co-sender-scoring", "best"],
        ["--reward-normaliser", "median"],
        ["--workflow", "--simulated"],  # FedWave experts host models
        ["--workflow", "--overlay"],
        ["--workflow", "--protocols", "pmix"],
        ["--workflow", "-n", "4"],  # one agent per stage of the code chain: 3
        ["--workflow", "--family", "gtp2"],
        ["--reward", "oracle"],
        ["--simulated", "--reward", "lacked"],  # simulated agents measure no reward
        ["--workflow", "--reward", "val"],
    ],
)
def test_a_bad_flag_leaves_the_last_run_untouched(tmp_path: Path, flags: list[str]) -> None:
    state = tmp_path / "fed"
    (state / "agents" / "agent-0" / "checkpoints").mkdir(parents=True)
    checkpoint = state / "agents" / "agent-0" / "checkpoints" / "round-3.safetensors"
    checkpoint.write_bytes(b"weights")
    db = state / "cpm.db"
    db.write_bytes(b"bandit")
    result = CliRunner().invoke(app, ["up", "--state-dir", str(state), *flags])
    assert result.exit_code == 2, result.output
    assert db.read_bytes() == b"bandit"
    assert checkpoint.read_bytes() == b"weights"
    assert not (state / "pki").exists()  # nothing provisioned either


@pytest.mark.parametrize("reward", ["val", "probe", "lacked"])
def test_the_reward_files_hold_what_each_agent_measures_on(tmp_path: Path, reward: str) -> None:
    """`--reward probe` gives every agent a whole probe (2 per category, fresh functions,
    drawn for that agent), `lacked` only its lacked categories' problems, `val` no file."""
    from peerlm.agent import (
        CATEGORIES,
        build_federation_data,
        function_key,
        public_problems,
        read_jsonl,
    )

    from peerlm.app.devfed import RealPlan, _write_reward_files

    data = tmp_path / "data"
    manifest = build_federation_data(data, 4, alpha=0.1, seed=0)
    agents = [f"agent-{i}" for i in range(4)]
    plan = RealPlan(reward=reward)
    files = _write_reward_files(tmp_path / "eval", data, manifest.world, agents, plan, 0)
    if reward == "val":
        assert files == [None] * 4
        return
    taken = {function_key(p) for p in public_problems()}
    taken |= {function_key(p) for f in data.rglob("*.jsonl") for p in read_jsonl(f)}
    # Each agent's probe is its own draw: no teacher can tune its answers to it.
    drawn = [{function_key(p) for p in read_jsonl(path)} for path in files if path]
    assert all(a != b for k, a in enumerate(drawn) for b in drawn[k + 1 :])
    again = _write_reward_files(tmp_path / "again", data, manifest.world, agents, plan, 0)
    assert [p.read_bytes() for p in again if p] == [p.read_bytes() for p in files if p]
    for i, path in enumerate(files):
        assert path is not None
        probe = read_jsonl(path)
        assert not {function_key(p) for p in probe} & taken  # never seen anywhere
        categories = sorted({p.category for p in probe})
        if reward == "probe":
            assert len(probe) == 2 * len(CATEGORIES) and categories == sorted(CATEGORIES)
        else:
            lacked = sorted(c for c in CATEGORIES if manifest.world.slice_of(i, c) == "lacked")
            assert lacked and categories == lacked and len(probe) == 2 * len(lacked)


def test_a_protocol_off_by_default_on_the_menu_is_executed_by_the_agents() -> None:
    """`--protocols` naming a catalogue baseline (off by default) makes every agent execute
    it besides the default ones; otherwise the agents keep their own default."""
    from peerlm.app.devfed import RealPlan, agent_protocols
    from peerlm.protocols import names

    assert agent_protocols(RealPlan()) is None
    for extra in names(on_by_default=False):
        executed = agent_protocols(RealPlan(extra_protocols=(extra,)))
        assert executed == [*names(on_by_default=True), extra]


def test_a_micro_plan_does_a_smoke_runs_work_and_a_tiny_one_the_defaults() -> None:
    """`--micro` agents train, answer and are evaluated on MICRO_BUDGET's smaller amounts;
    tiny ones keep RealPlan's defaults; an explicit option wins over either."""
    from peerlm.app.devfed import MICRO_BUDGET, RealPlan

    micro, tiny = RealPlan.of_size("micro"), RealPlan.of_size("tiny")
    assert micro.size == "micro" and tiny == RealPlan(size="tiny")
    for field, value in MICRO_BUDGET.items():
        assert getattr(micro, field) == value < getattr(tiny, field), field
    assert RealPlan.of_size("micro", max_new_tokens=64, overlay=True).max_new_tokens == 64
    assert RealPlan.of_size("micro", overlay=True).overlay
