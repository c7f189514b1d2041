"""A FedWave expert killed mid-run (SIGKILL) and restarted: it resumes from its checkpoint
of the last round it concluded (adapter, adopted router, VCLayer, neighbours' VCLayers),
rejoins the workflow at the round the others are in, and every agent ends the run with the
same router. Real ``peerlm agent`` processes on loopback mTLS."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from peerlm.agent.checkpoint import CheckpointStore
from peerlm.agent.fedwave.workflow import Workflow
from peerlm.agent.models.tiny import build_models

from peerlm.forkserver import ChildProcess, ForkServer
from tests.agent_harness import start_agent
from tests.cpm_harness import CpmProcess, Pki
from tests.integration.test_fedwave_agents import _events, _wait_for
from tests.integration.test_fedwave_hostile_member import (
    agent_config,
    write_stage_data,
)
from tests.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WORKFLOW = {
    "stages": [
        {"name": "specify", "agents": ["a0"]},
        {"name": "implement", "agents": ["a1"]},
        {"name": "test", "agents": ["a2"]},
    ]
}
AGENTS = ("a0", "a1", "a2")
VICTIM = "a1"
KILLED_AFTER = 2  # the kill comes once this round's checkpoint is saved (or a later one's)
ROUNDS = 8
DEADLINE_S = 60.0


def _saved(log: Path, round_: int) -> bool:
    return any(
        e.get("event") == "checkpoint_saved" and e.get("round") == round_ for e in _events(log)
    )


def _stop_all(procs: dict[str, ChildProcess], cpm: CpmProcess) -> None:
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()
    cpm.terminate()


@dataclass
class Federation:
    cpm: CpmProcess
    configs: dict[str, Path]


def _federation(tmp_path: Path, deadline_s: float = DEADLINE_S) -> Federation:
    """Three micro gpt2 experts of a three-stage workflow and a CPM; not started."""
    models = tmp_path / "models"
    build_models(models, ("gpt2",), size="micro")
    pki = Pki.create(tmp_path, agents=3)
    workflow = Workflow.model_validate(WORKFLOW)
    cpm = CpmProcess(pki, tmp_path / "cpm.db", tmp_path, {"PEERLM_CPM_ROUND_INTERVAL_S": "3600"})
    data = tmp_path / "data"
    transfer = write_stage_data(data, workflow, AGENTS)
    peers = {a: f"127.0.0.1:{free_port()}" for a in AGENTS}
    # Metrics on a port the kernel picks (0): nothing here scrapes them, and a port chosen
    # in advance was taken by another test worker's process before one agent bound it.
    configs = {
        a: agent_config(
            tmp_path,
            pki,
            cpm,
            a,
            peers,
            0,
            models,
            data,
            transfer,
            rounds=ROUNDS,
            deadline_s=deadline_s,
            workflow=WORKFLOW,
        )
        for a in AGENTS
    }
    return Federation(cpm, configs)


def test_a_killed_expert_resumes_rejoins_and_ends_with_the_same_router(
    tmp_path: Path, agent_forks: ForkServer
) -> None:
    fed = _federation(tmp_path)
    cpm, configs = fed.cpm, fed.configs
    cpm.start()
    logs = {a: tmp_path / f"{a}.log" for a in AGENTS}
    procs = {a: start_agent(agent_forks, configs[a], logs[a]) for a in AGENTS}
    restarted_log = tmp_path / f"{VICTIM}-restarted.log"
    try:
        _wait_for(
            lambda: _saved(logs[VICTIM], KILLED_AFTER) or procs[VICTIM].poll() is not None,
            300,
            f"{VICTIM}'s checkpoint of round {KILLED_AFTER}",
        )
        assert procs[VICTIM].poll() is None, logs[VICTIM].read_text()[-3000:]
        procs[VICTIM].send_signal(signal.SIGKILL)
        procs[VICTIM].wait(30)
        assert procs[VICTIM].returncode == -signal.SIGKILL
        # Micro rounds are short: the victim may have concluded a round or two more before
        # the signal landed. The newest checkpoint it logged is the one to resume from.
        killed_after = max(
            e["round"] for e in _events(logs[VICTIM]) if e.get("event") == "checkpoint_saved"
        )
        assert KILLED_AFTER <= killed_after < ROUNDS, killed_after
        procs[VICTIM] = start_agent(agent_forks, configs[VICTIM], restarted_log)
        outs = {a: p.communicate(timeout=400)[0] for a, p in procs.items()}
    finally:
        _stop_all(procs, cpm)
    victim_log = restarted_log
    summaries = {}
    for name, out in outs.items():
        log = victim_log if name == VICTIM else logs[name]
        assert procs[name].returncode == 0, log.read_text()[-3000:]
        summaries[name] = json.loads(out.strip().splitlines()[-1])
        assert not summaries[name]["errors"], summaries[name]["errors"]
    reports = {name: s["fedwave"] for name, s in summaries.items()}
    events = _events(victim_log)
    restored = [e for e in events if e.get("event") == "fedwave_checkpoint_restored"]
    rejoined = [e for e in events if e.get("event") == "fedwave_rejoined"]
    assert len(rejoined) == 1, rejoined
    # Killed once it had saved round t but before the others concluded t, the victim is
    # ahead of the running workflow: it rolls back to their round and replays t with them
    # (docs/fedwave.md section 5). Otherwise it joins the round they play, past t.
    back = rejoined[0]["rolled_back_to"]
    resumed = killed_after if back is None else back
    assert [e["round"] for e in restored] == sorted({killed_after, resumed}, reverse=True)
    if back is None:
        assert rejoined[0]["next_round"] > killed_after, rejoined
    else:
        assert back < killed_after and rejoined[0]["next_round"] == back + 1, rejoined
    played = [e["round"] for e in events if e.get("event") == "fedwave_round_done"]
    # The restarted process plays from the workflow's round to the last, never round 1.
    assert played == list(range(rejoined[0]["next_round"], ROUNDS + 1)), played
    victim = reports[VICTIM]
    assert victim["resumed_from"] == resumed and victim["rounds"] == ROUNDS, victim
    # The report goes on from the checkpoint: its rounds before the kill are in it.
    assert len(victim["router_sha256"]) == ROUNDS - victim["rounds_skipped"], victim
    for name in AGENTS:
        assert reports[name]["rounds"] == ROUNDS, reports[name]
        assert summaries[name]["bytes_sent"] > 0 and summaries[name]["bytes_received"] > 0
    # The restarted process's byte counts go on from the checkpoint's: routers are all of
    # about one size, so the victim's router bytes per router it averaged in (its report's
    # ``members`` less itself, rounds before the kill included) match a0's. Counting only
    # the second process's bytes would give well under half of that per router. (Totals
    # are not comparable: the victim pulled nothing in the rounds it skipped, the others
    # one router fewer there.)
    per_router = {
        a: reports[a]["bytes_received"]["router"] / sum(m - 1 for m in reports[a]["members"])
        for a in AGENTS
    }
    assert per_router[VICTIM] >= 0.85 * per_router["a0"], (per_router, reports)
    # Every agent ends with the same router bits: in the last round all three averaged all
    # three routers (a 60 s deadline is not passed here) and adopted the aggregate. An
    # expert whose routing check refuses the aggregate keeps the router it held before
    # (routing_check.py): then it alone differs, holding its previous round's router, and
    # the other two still agree.
    final = {a: _last_round(victim_log if a == VICTIM else logs[a]) for a in AGENTS}
    assert all(f.members == len(AGENTS) for f in final.values()), (final, reports)
    adopted = {a: f.digest for a, f in final.items() if not f.refused}
    assert len(adopted) >= 2 and len(set(adopted.values())) == 1, (final, reports)
    for a, f in final.items():
        if f.refused:
            assert f.digest == reports[a]["router_sha256"][-2], (final, reports)
    # And up to the round resumed from, in every round all three averaged all three
    # routers. A round in which one agent's part came too late for another (the kill can
    # land between a part's publication and its pull; a loaded machine can pass the
    # deadline) is averaged over fewer members there, and that agent's digest differs.
    full = [
        i for i in range(resumed) if all(r["members"][i] == len(AGENTS) for r in reports.values())
    ]
    assert full, reports
    early = {tuple(r["router_sha256"][i] for i in full) for r in reports.values()}
    assert len(early) == 1, reports


@dataclass
class FinalRound:
    """An agent's last round as its log says it: the agents averaged, the router it holds,
    whether its routing check refused the aggregate."""

    members: int
    digest: str
    refused: bool


def _last_round(log: Path) -> FinalRound:
    events = _events(log)
    (done,) = [e for e in events if e.get("event") == "fedwave_round_done" and e["round"] == ROUNDS]
    refused = any(
        e.get("event") == "fedwave_aggregate_rejected" and e["round"] == ROUNDS for e in events
    )
    return FinalRound(len(done["members"]), done["router_sha256"], refused)


def _newest_checkpoint(tmp_path: Path, agent: str) -> int:
    return max(CheckpointStore(_checkpoints(tmp_path, agent)).rounds(), default=0)


def _checkpoints(tmp_path: Path, agent: str) -> Path:
    return tmp_path / "state" / agent / "fedwave" / "checkpoints"


def _kill_all_after(procs: dict[str, ChildProcess], logs: dict[str, Path]) -> None:
    """Wait until every agent saved its checkpoint of round ``KILLED_AFTER``, then SIGKILL
    them all at once."""
    _wait_for(
        lambda: (
            all(_saved(logs[a], KILLED_AFTER) for a in AGENTS)
            or any(p.poll() is not None for p in procs.values())
        ),
        300,
        f"every agent's checkpoint of round {KILLED_AFTER}",
    )
    for a, p in procs.items():
        assert p.poll() is None, logs[a].read_text()[-3000:]
        p.send_signal(signal.SIGKILL)
    for p in procs.values():
        p.wait(30)


def _fedwave_reports(
    procs: dict[str, ChildProcess], outs: dict[str, str], logs: dict[str, Path]
) -> dict[str, dict[str, Any]]:
    """Each agent's FedWave report from its summary line, after checking that it exited 0
    without errors."""
    reports = {}
    for a, out in outs.items():
        assert procs[a].returncode == 0, logs[a].read_text()[-3000:]
        summary = json.loads(out.strip().splitlines()[-1])
        assert not summary["errors"], summary["errors"]
        reports[a] = summary["fedwave"]
    return reports


@dataclass
class Restart:
    """What :func:`_restart_together` leaves: each agent's newest checkpoint at the restart
    (the smallest newest at the kill, for all), the round the agents in ``behind_agents``
    were rolled back to, the restarted processes' logs and reports."""

    newest: dict[str, int]
    behind: int
    relogs: dict[str, Path]
    reports: dict[str, dict[str, Any]]


def _restart_together(
    agent_forks: ForkServer,
    tmp_path: Path,
    behind_agents: tuple[str, ...],
    *,
    deadline_s: float = DEADLINE_S,
    timeout_s: float = 400,
    tamper: Callable[[dict[str, int], int], None] | None = None,
) -> Restart:
    """Run the workflow, SIGKILL every agent at once after round ``KILLED_AFTER``'s
    checkpoints, roll every agent back to the smallest newest round among them and
    ``behind_agents`` to the round before it, let ``tamper(newest, behind)`` change the
    disk, restart all three together and run them to the end."""
    fed = _federation(tmp_path, deadline_s=deadline_s)
    fed.cpm.start()
    logs = {a: tmp_path / f"{a}.log" for a in AGENTS}
    procs = {a: start_agent(agent_forks, fed.configs[a], logs[a]) for a in AGENTS}
    relogs = {a: tmp_path / f"{a}-restarted.log" for a in AGENTS}
    try:
        _kill_all_after(procs, logs)
        at_kill = {a: _newest_checkpoint(tmp_path, a) for a in AGENTS}
        assert min(at_kill.values()) >= 2 and max(at_kill.values()) < ROUNDS, at_kill
        # The kill lands at a different point of each agent's round, so one may have
        # concluded a round more than another. Even them out first: rolling an agent that
        # was already a round behind back once more would put it two rounds behind, an
        # outlier the agreement rightly leaves out (it skips to the others' round instead).
        even = min(at_kill.values())
        for a in AGENTS:
            if at_kill[a] > even:
                CheckpointStore(_checkpoints(tmp_path, a)).roll_back(even)
        newest = dict.fromkeys(AGENTS, even)
        behind = even - 1
        for a in behind_agents:
            CheckpointStore(_checkpoints(tmp_path, a)).roll_back(behind)
        if tamper is not None:
            tamper(newest, behind)
        procs = {a: start_agent(agent_forks, fed.configs[a], relogs[a]) for a in AGENTS}
        outs = {a: p.communicate(timeout=timeout_s)[0] for a, p in procs.items()}
    finally:
        _stop_all(procs, fed.cpm)
    return Restart(newest, behind, relogs, _fedwave_reports(procs, outs, relogs))


def test_a_workflow_restarted_together_agrees_on_one_round_and_stays_in_phase(
    tmp_path: Path, agent_forks: ForkServer
) -> None:
    # Every expert is killed at once, then a0 loses its newest checkpoint (a crash before
    # its save landed): it is a round behind the others. Restarted together, all three
    # wait for each other's checkpoints, agree on a0's round + 1 (the others roll back),
    # and every round after the restart is complete: nobody waits out a deadline.
    run = _restart_together(agent_forks, tmp_path, ("a0",))
    newest, behind, relogs, reports = run.newest, run.behind, run.relogs, run.reports
    modes = []
    for a in AGENTS:
        events = _events(relogs[a])
        (rejoined,) = [e for e in events if e.get("event") == "fedwave_rejoined"]
        # The agents restart "together" within a second or so: one that comes up after
        # the others have already agreed finds them running the agreed round and joins it
        # ("running"); the round is the same either way.
        assert rejoined["mode"] in ("together", "running"), rejoined
        assert rejoined["next_round"] == behind + 1, rejoined
        modes.append(rejoined["mode"])
        own = behind if a == "a0" else newest[a]
        assert rejoined["checkpoint_round"] == own, rejoined
        assert rejoined["rolled_back_to"] == (behind if own > behind else None), rejoined
        played = [e["round"] for e in events if e.get("event") == "fedwave_round_done"]
        assert played == list(range(behind + 1, ROUNDS + 1)), (a, played)
        report = reports[a]
        assert report["rounds"] == ROUNDS and report["resumed_from"] == behind, report
        assert report["rolled_back_from"] == (own if own > behind else None), report
        # One entry per round: the rolled-back rounds are not counted twice.
        assert len(report["router_sha256"]) == ROUNDS, report
        assert report["members"][behind:] == [len(AGENTS)] * (ROUNDS - behind), report
        assert _newest_checkpoint(tmp_path, a) == ROUNDS
    # At least the first ones up agreed among themselves (nobody was running yet).
    assert "together" in modes, modes
    last = {a: r["router_sha256"][-1] for a, r in reports.items()}
    assert len(set(last.values())) == 1, last


def test_an_agent_whose_older_checkpoint_is_damaged_keeps_its_state_and_plays_on(
    tmp_path: Path, agent_forks: ForkServer
) -> None:
    # As above, but a0 and a2 both restart a round behind a1, so a1 must roll back whoever
    # of them it hears (a restart skew past the positions' wait leaves out at most one);
    # and every older checkpoint a1 keeps is damaged (an adapter byte changed on disk), so
    # its roll-back fails whichever round is agreed. It must lose nothing: it keeps the
    # state it restored, discards nothing, says so (fedwave_rollback_failed,
    # rollback_unavailable), plays its own next round, and the workflow runs to the end
    # out of phase (a deadline lost a round: a short one here) with every agent exiting 0.
    kept: list[int] = []

    def damage_older(newest: dict[str, int], behind: int) -> None:
        kept.extend(CheckpointStore(_checkpoints(tmp_path, VICTIM)).rounds())
        assert behind in kept, kept
        for r in kept:
            if r < newest[VICTIM]:
                damaged = _checkpoints(tmp_path, VICTIM) / f"round-{r:06d}" / "adapter.safetensors"
                blob = bytearray(damaged.read_bytes())
                blob[-1] ^= 0xFF
                damaged.write_bytes(bytes(blob))

    run = _restart_together(
        agent_forks, tmp_path, ("a0", "a2"), deadline_s=20.0, timeout_s=600, tamper=damage_older
    )
    newest, behind, relogs, reports = run.newest, run.behind, run.relogs, run.reports
    for a in AGENTS:
        assert reports[a]["rounds"] == ROUNDS, reports[a]
    own = newest[VICTIM]
    events = _events(relogs[VICTIM])
    (failed,) = [e for e in events if e.get("event") == "fedwave_rollback_failed"]
    assert failed["round"] in kept and failed["round"] < own, failed
    assert "SHA-256" in failed["error"], failed
    (rejoined,) = [e for e in events if e.get("event") == "fedwave_rejoined"]
    assert rejoined["checkpoint_round"] == own and rejoined["next_round"] == own + 1, rejoined
    assert rejoined["rollback_unavailable"] is True, rejoined
    played = [e["round"] for e in events if e.get("event") == "fedwave_round_done"]
    assert played == list(range(own + 1, ROUNDS + 1)), played
    victim = reports[VICTIM]
    assert victim["resumed_from"] == own and victim["rolled_back_from"] is None, victim
    # Nothing of its own was discarded by the failed roll-back (the store logs each
    # roll-back it makes; a failed one changes nothing: test_checkpoint.py).
    assert not [e for e in events if e.get("event") == "checkpoint_rolled_back"], events
    # The others agreed on a0's round + 1, or, if they asked again after the victim had
    # decided, joined the round it plays (it says so as a running agent).
    for a in ("a0", "a2"):
        (other,) = [e for e in _events(relogs[a]) if e.get("event") == "fedwave_rejoined"]
        assert other["next_round"] in (behind + 1, own + 1), other
