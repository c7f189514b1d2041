"""``peerlm up --workflow``: a local FedWave value-chain federation on loopback.

One expert agent per stage of the bundled code chain (requirement → signature and
docstring → implementation → tests; docs/fedwave.md, section 1), each a real ``peerlm
agent`` process with its own certificate, its stage's private examples as its training
file and the held-out chains' stage examples as its validation file. Every agent's
configuration holds the ``fedwave:`` section: the workflow, its stage and every agent's
endpoint (``fedwave.peers``; the ports are chosen here, before the agents start, so each
configuration can name the others). The agents run ``rounds`` FedWave rounds (train, publish,
pull the routers and adjacent VCLayers over mTLS, aggregate the router by n_i), then each
pulls the other stages' experts, assembles π_SFT behind the aggregated router, runs the DPO
phase on the public requirements and scores every model on its held-out examples
(``fedwave.assembly``); :func:`workflow_rows` turns the reports into the final table, one
row per stage, and :func:`stage_scores` gives the scores for ``--json``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, Literal

from rich.console import Console

from peerlm.app.agent_launch import agent_argv
from peerlm.app.report_rows import print_rows

__all__ = [
    "WORKFLOW_AGENTS",
    "LogRounds",
    "prepare_workflow",
    "print_workflow_report",
    "router_agreement",
    "stage_scores",
    "workflow_rows",
]

#: Agents of the workflow, one per code-chain stage (certificate names).
WORKFLOW_AGENTS: tuple[str, ...] = ("specify-0", "implement-0", "test-0")
#: Per stage private examples and held-out chains, by model size (micro: smoke tests).
_DATA = {"tiny": (64, 12), "micro": (16, 4)}
#: A round's pulls wait this long for the slowest agent's training (and, in round 1, for
#: every agent to have loaded its model and started serving).
ROUND_DEADLINE_S = 180.0


class LogRounds:
    """An agent's last round from its JSON log (``<logs>/<agent>.log``): the highest
    ``round`` of the lines of ``events`` (one event name or several) read so far; each call
    reads only the new lines. ``from_end``: lines already in the logs (a resumed run's
    predecessor's) are not read."""

    def __init__(
        self, logs: Path, events: str | Collection[str], *, from_end: bool = False
    ) -> None:
        self._logs = logs
        self._events = frozenset({events} if isinstance(events, str) else events)
        self._offsets: dict[str, int] = {}
        if from_end and logs.is_dir():
            self._offsets = {p.stem: p.stat().st_size for p in logs.glob("*.log")}
        self._rounds: dict[str, int] = {}

    def __call__(self, agent: str) -> int:
        path = self._logs / f"{agent}.log"
        try:
            with path.open("rb") as handle:
                handle.seek(self._offsets.get(agent, 0))
                chunk = handle.read()
        except OSError:
            return self._rounds.get(agent, 0)
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a partly written line waits
        self._offsets[agent] = self._offsets.get(agent, 0) + len(complete)
        for line in complete.splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and entry.get("event") in self._events:
                found = entry.get("round")
                if isinstance(found, int):
                    self._rounds[agent] = max(self._rounds.get(agent, 0), found)
        return self._rounds.get(agent, 0)


def _stage_problems(examples: Any, stage: str) -> list[Any]:
    """Stage examples as the agent's training/validation records (prompt = the stage's
    input, reference = its reference output; no tests: the stage loss is what is scored)."""
    from peerlm.agent import Problem

    return [
        Problem(
            task_id=f"{e.task_id}/{stage}",
            category=stage,
            prompt=e.source,
            reference=e.target,
            tests="",
            entry_point="stage_output",
        )
        for e in examples
    ]


def prepare_workflow(
    fed: Any,
    rounds: int,
    seed: int,
    *,
    size: str,
    family: str,
    console: Console | None,
    free_ports: Callable[[int], list[int]],
    stop_grace_s: float,
) -> Callable[[int, str, str], list[str]]:
    """Build (or reuse) the models and the chain's data; write one configuration per
    workflow agent (``fedwave:`` with the endpoints); the agents' command lines."""
    from peerlm.agent import (
        CODE_CHAIN_STAGES,
        Problem,
        Workflow,
        build_code_chain,
        transfer_set_sha256,
        write_jsonl,
    )
    from peerlm.app.cli_models import build_with_progress, models_cache_dir

    model_size: Literal["tiny", "micro"] = "micro" if size == "micro" else "tiny"
    models_dir = models_cache_dir(model_size)
    if console:
        console.print(f"building or reusing {size} models in {models_dir} ...")
    build_with_progress(models_dir, (family,), model_size, console or Console(quiet=True))
    workflow = Workflow.model_validate(
        {
            "stages": [
                {"name": stage, "agents": [agent]}
                for stage, agent in zip(CODE_CHAIN_STAGES, WORKFLOW_AGENTS, strict=True)
            ]
        }
    )
    per_stage, n_test = _DATA[model_size]
    chain = build_code_chain(workflow, per_stage=per_stage, n_test=n_test, n_public=4, seed=seed)
    data = fed.root / "workflow-data"
    data.mkdir(parents=True, exist_ok=True)
    # X_u (every agent's configuration needs one): the public requirements, nobody's data.
    transfer = [
        Problem(f"public/{k}", "public", text, "", "", "stage_output")
        for k, text in enumerate(chain.public)
    ]
    write_jsonl(data / "transfer.jsonl", transfer)
    ports = dict(zip(WORKFLOW_AGENTS, free_ports(len(WORKFLOW_AGENTS)), strict=True))
    peers = {agent: f"127.0.0.1:{port}" for agent, port in ports.items()}
    configs = fed.root / "agents"
    configs.mkdir(parents=True, exist_ok=True)
    for index, (stage, agent) in enumerate(zip(CODE_CHAIN_STAGES, WORKFLOW_AGENTS, strict=True)):
        t = fed.tls(agent)
        own = data / agent
        own.mkdir(parents=True, exist_ok=True)
        write_jsonl(own / "train.jsonl", _stage_problems(chain.of_agent(agent), stage))
        held_out = [item.example(index, stage) for item in chain.test]
        write_jsonl(own / "val.jsonl", _stage_problems(held_out, stage))
        config: dict[str, Any] = {
            "federation": "dev",
            "listen": peers[agent],
            "state_dir": str(fed.root / "agents" / agent),
            "model": str(models_dir / family),
            "device": "cpu",
            "train_file": str(own / "train.jsonl"),
            "val_file": str(own / "val.jsonl"),
            "transfer_file": str(data / "transfer.jsonl"),
            "transfer_sha256": transfer_set_sha256([p.prompt for p in transfer]),
            "rounds": rounds,
            "local_steps": 8,
            "learning_rate": 2e-3,
            "batch_size": 8,
            "max_length": 192,
            "stop_grace_s": stop_grace_s,
            "seed": seed + index,
            "log_format": "json",
            "tls": {"ca_cert": str(t.ca_cert), "cert": str(t.cert), "key": str(t.key)},
            "fedwave": {
                "workflow": workflow.model_dump(),
                "stage": stage,
                "peers": peers,
                "round_deadline_s": ROUND_DEADLINE_S,
                "seed": seed,
                # After the last round: pull the other stages' experts, assemble π_SFT, DPO.
                "assembly": {"enabled": True},
            },
        }
        (configs / f"{agent}.yaml").write_text(json.dumps(config, indent=2))

    return agent_argv(configs)


def router_agreement(reports: list[Mapping[str, Any]]) -> tuple[int, int]:
    """(rounds in which every agent ended with the same router, rounds every agent played)."""
    digests = [list(r.get("fedwave", {}).get("router_sha256", [])) for r in reports]
    played = min((len(d) for d in digests), default=0)
    agreed = sum(1 for k in range(played) if len({d[k] for d in digests}) == 1)
    return agreed, played


def _loss(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, int | float) else "-"


#: The metric the final table shows (all of them are in ``--json``).
TABLE_METRIC = "meteor"
#: The models scored per stage, in the table's order.
SCORED = ("expert_before", "expert_after", "pi_sft", "pi_sft_dpo")


def stage_scores(reports: list[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per stage: the mean held-out scores (metric → 0-100) of the expert before and after
    the rounds, of π_SFT and of π_SFT after DPO, and the stages π_SFT was assembled
    without (for ``--json``)."""
    out: dict[str, dict[str, Any]] = {}
    for r in reports:
        fw = r.get("fedwave", {})
        scores = fw.get("scores", {})
        assembly = fw.get("assembly", {})
        out[str(fw.get("stage", r.get("name", "?")))] = {
            **{model: scores.get(model) for model in SCORED},
            "missing_stages": assembly.get("missing_stages"),
            "dpo_pairs": assembly.get("dpo_informative"),
        }
    return out


def _score(scores: Mapping[str, Any], model: str) -> str:
    value = (scores.get(model) or {}).get(TABLE_METRIC)
    return f"{value:.1f}" if isinstance(value, int | float) else "-"


def workflow_rows(result: Mapping[str, Any]) -> list[dict[str, str]]:
    """One row per stage: agent, rounds, router agreement, parts pulled / missing /
    rejected, part KiB served / pulled, the held-out SFT loss before → after, METEOR of
    the expert before → after the rounds, of π_SFT and of π_SFT after DPO, the stages
    π_SFT lacked, errors."""
    reports = list(result.get("agents", []))
    agreed, played = router_agreement(reports)
    rows = []
    for r in reports:
        fw = r.get("fedwave", {})
        pulled = fw.get("parts_pulled", {})
        scores = fw.get("scores", {})
        rows.append(
            {
                "stage": str(fw.get("stage", "?")),
                "agent": str(r.get("name", "?")),
                "rounds": str(fw.get("rounds", 0)),
                "same router": f"{agreed}/{played} rounds",
                "pulled r/vc/a": f"{pulled.get('router', 0)}/{pulled.get('vclayer', 0)}/"
                f"{pulled.get('adapter', 0)}",
                "missing": str(sum(fw.get("parts_missing", {}).values())),
                "refused": str(sum(fw.get("parts_rejected", {}).values())),
                "KiB out/in": f"{sum(fw.get('bytes_sent', {}).values()) / 1024:.0f}/"
                f"{sum(fw.get('bytes_received', {}).values()) / 1024:.0f}",
                "held-out loss": f"{_loss(fw.get('heldout_before'))}→"
                f"{_loss(fw.get('heldout_after'))}",
                "METEOR expert": f"{_score(scores, 'expert_before')}→"
                f"{_score(scores, 'expert_after')}",
                "METEOR π_SFT": _score(scores, "pi_sft"),
                "METEOR +DPO": _score(scores, "pi_sft_dpo"),
                "no expert": ",".join(fw.get("assembly", {}).get("missing_stages") or []) or "-",
                "errors": "; ".join(r.get("errors", [])) or "-",
            }
        )
    return rows


def print_workflow_report(console: Console, result: Mapping[str, Any], logs: Path) -> None:
    """The final per-stage table (a vertical block per stage on narrow consoles)."""
    rows = workflow_rows(result)
    title = f"peerlm FedWave workflow: {result.get('rounds')} rounds in {result.get('seconds')} s"
    print_rows(console, title, rows, "stage", left=("agent",))
    agreed, played = router_agreement(list(result.get("agents", [])))
    console.print(
        f"router: every agent ended {agreed} of {played} rounds with the same bits; "
        f"METEOR (0-100) of the greedy outputs on each stage's held-out examples "
        f"(all metrics in --json); logs in {logs}",
        highlight=False,
    )
