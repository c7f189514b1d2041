"""``peerlm run-experiment``: the KNEXA-FL comparison (Table 4) with real tiny models.

Five pairing strategies run the same rounds on the same data, models and seeds, in one
process over :class:`~peerlm.agent.modelhost.ModelHost` instances. Every model operation
is the agent daemon's own (:mod:`peerlm.agent.rounds`: local update, teacher predictions,
guardrailed packages encoded and decoded as on the wire, AKD per Eq. 2 with the Table 6
schedule, the reward of Eq. 3); only the transport is missing. Strategies:

=============  ==========================================================================
local          LocalOnly: local training only, no exchange.
random         Random-P2P: disjoint random pairs, random direction (``RandomMatchmaker``).
heuristic      Heuristic-P2P: Algorithm 4, greedy max JS divergence of the category
               histograms, the higher validation pass@1 teaches (``HeteroGreedyMatchmaker``).
central_kd     Central-KD: a server averages all clients' predictions into one ensemble
               teacher and every client distils from it (see below).
cpm            KNEXA-FL: the CPM's LinUCB ``Matchmaker`` (the service's defaults), fed the
               students' real Eq. 3 rewards after each exchange.
=============  ==========================================================================

Round t (Algorithm 3): every client trains locally, measures validation loss and pass@1
and forms its profile p_i (as the daemon does); the strategy pairs clients; each student
integrates its teacher's package and its reward goes back to the strategy; then every
client's greedy pass@1 on the global test set is recorded. After the last round each
client draws ``samples`` completions per test problem at ``sample_temperature`` for the
unbiased pass@1/5/10 estimator (Chen et al. 2021), the numbers of Table 4.

Central-KD with heterogeneous tokenizers. FedMD's server averages the clients' logits,
which is undefined across vocabularies. The probability of a *string* is not: here the
ensemble teacher is the mixture ``p_bar(y | x) = (1/N) sum_i p_i(y | x)`` of the clients'
sequence distributions, each client scoring a string under its own canonical tokenisation
(EOS included). Every client sends its guardrailed greedy completion of each transfer
prompt; every client scores every candidate (the scores are what is averaged, as FedMD
averages logits); the server broadcasts, per prompt, the candidate with the highest
ensemble log-likelihood per UTF-8 byte, ``log p_bar(y | x) / max(1, bytes(y))`` (per byte,
or the shortest candidate would always win). Each client then runs AKD on this one
consensus package, with the same alpha schedule as the P2P strategies.

Everything is seeded: the data partition, the initial adapters (client i: ``seed + i``),
the batches of round t, the random pairing and the samples, so strategies differ only in
who teaches whom.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    from peerlm.agent import Guardrail, ModelHost, Problem
    from peerlm.services.cpm import Pairing

__all__ = [
    "ARCHS",
    "LABELS",
    "STRATEGIES",
    "ExperimentPlan",
    "consensus_texts",
    "render_table",
    "run_experiment",
    "write_outputs",
]

STRATEGIES: tuple[str, ...] = ("local", "random", "heuristic", "central_kd", "cpm")
LABELS: Mapping[str, str] = {
    "local": "LocalOnly",
    "random": "Random-P2P",
    "heuristic": "Heuristic-P2P",
    "central_kd": "Central-KD",
    "cpm": "KNEXA-FL (CPM)",
}
#: Client i hosts ARCHS[i % 4] (as ``peerlm up``).
ARCHS: tuple[str, ...] = ("gpt2", "gpt_neox", "bloom", "qwen2")

Event = Callable[[str, Mapping[str, Any]], None]


@dataclass(frozen=True)
class ExperimentPlan:
    """Everything that defines a run; part of ``results.json``."""

    agents: int = 4
    rounds: int = 5
    strategies: tuple[str, ...] = STRATEGIES
    seed: int = 0
    size: Literal["tiny", "micro"] = "tiny"
    alpha: float = 0.1  # Dirichlet concentration of the client split
    local_steps: int = 8
    grad_accumulation: int = 4  # x batch 8: Table 6's effective batch of 32
    learning_rate: float = 1e-3
    lora_rank: int = 8
    transfer_limit: int = 32
    val_limit: int | None = 12
    test_limit: int = 48
    samples: int = 10
    sample_temperature: float = 0.8
    max_new_tokens: int = 64
    reward_delta: float = 0.001

    def __post_init__(self) -> None:
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown:
            raise ValueError(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")
        if not self.strategies or len(set(self.strategies)) != len(self.strategies):
            raise ValueError("strategies must be a non-empty list without repeats")
        if self.agents < 2 or self.rounds < 1:
            raise ValueError("need at least 2 agents and 1 round")
        if self.samples < 1 or self.test_limit < 1 or self.transfer_limit < 1:
            raise ValueError("samples, test_limit and transfer_limit must be positive")
        if not self.sample_temperature > 0:
            raise ValueError("sample_temperature must be > 0")

    @property
    def ks(self) -> tuple[int, ...]:
        """The k of pass@k reported: 1, 5, 10 where ``samples`` allows."""
        return tuple(k for k in (1, 5, 10) if k <= self.samples)


@dataclass
class _Client:
    name: str
    arch: str
    host: ModelHost
    train: list[Problem]
    val: list[Problem]
    guardrail: Guardrail
    history: list[dict[str, float]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    exchanges: int = 0

    @property
    def train_examples(self) -> list[tuple[str, str]]:
        return [(p.prompt, p.reference) for p in self.train]

    @property
    def val_examples(self) -> list[tuple[str, str]]:
        return [(p.prompt, p.reference) for p in self.val]


@dataclass
class _World:
    plan: ExperimentPlan
    models: Path
    clients_data: list[tuple[list[Problem], list[Problem]]]
    transfer: list[str]
    transfer_sha256: str
    test: list[Problem]


# ------------------------------------------------------------------------ the ensemble


def consensus_texts(
    hosts: Sequence[ModelHost], prompts: Sequence[str], candidates: Sequence[Sequence[str]]
) -> list[str]:
    """Central-KD's ensemble teacher (module docstring): per prompt, the candidate with the
    highest mixture log-likelihood per UTF-8 byte under all ``hosts``.

    ``candidates[i]`` are client i's completions of ``prompts``; empty ones are not
    candidates (a prompt nobody answered gets ``""``).
    """
    out: list[str] = []
    for j, prompt in enumerate(prompts):
        options = list(dict.fromkeys(c[j] for c in candidates if c[j].strip()))
        if not options:
            out.append("")
            continue
        pairs = [(prompt, option) for option in options]
        scores = np.array([h.sequence_logprobs(pairs) for h in hosts])  # [clients, options]
        mixture = np.logaddexp.reduce(scores, axis=0) - math.log(len(hosts))
        per_byte = mixture / np.array([max(1, len(o.encode())) for o in options])
        out.append(options[int(np.argmax(per_byte))])
    return out


# ------------------------------------------------------------------------- set-up


def _prepare(plan: ExperimentPlan, models: Path, data: Path, event: Event) -> _World:
    from peerlm.agent import build_federation_data, build_models, read_jsonl, transfer_set_sha256

    archs = tuple(dict.fromkeys(ARCHS[i % len(ARCHS)] for i in range(plan.agents)))

    def on_build(e: Any) -> None:
        if e.phase in ("pretrain", "done", "cached"):
            event("build", {"arch": e.arch, "phase": e.phase, "step": e.step, "total": e.total})

    build_models(models, archs, size=plan.size, seed=plan.seed, progress=on_build)
    build_federation_data(data, plan.agents, alpha=plan.alpha, seed=plan.seed, overwrite=True)
    clients = [
        (
            read_jsonl(data / "clients" / str(i) / "train.jsonl"),
            read_jsonl(data / "clients" / str(i) / "val.jsonl"),
        )
        for i in range(plan.agents)
    ]
    transfer = [p.prompt for p in read_jsonl(data / "transfer.jsonl")][: plan.transfer_limit]
    test = read_jsonl(data / "test.jsonl")[: plan.test_limit]
    return _World(plan, models, clients, transfer, transfer_set_sha256(transfer), test)


def _clients(world: _World) -> list[_Client]:
    from peerlm.agent import Guardrail, LoraSettings, ModelHost

    plan = world.plan
    out = []
    for i, (train, val) in enumerate(world.clients_data):
        arch = ARCHS[i % len(ARCHS)]
        host = ModelHost.load(
            world.models / arch, LoraSettings(r=plan.lora_rank), device="cpu", seed=plan.seed + i
        )
        guard = Guardrail([p.prompt + p.reference for p in train], public_texts=world.transfer)
        out.append(_Client(f"agent-{i}", arch, host, train, val, guard))
    return out


def _round_config(plan: ExperimentPlan, i: int) -> Any:
    from peerlm.agent import RoundConfig, TrainSettings

    return RoundConfig(
        total_rounds=plan.rounds,
        train=TrainSettings(
            learning_rate=plan.learning_rate,
            grad_accumulation=plan.grad_accumulation,
            seed=plan.seed + i,
        ),
        local_steps=plan.local_steps,
        reward_delta=plan.reward_delta,
        max_new_tokens=plan.max_new_tokens,
    )


def _pairing_policy(strategy: str, plan: ExperimentPlan) -> Any:
    from peerlm.config import CpmSettings
    from peerlm.services.cpm import HeteroGreedyMatchmaker, Matchmaker, RandomMatchmaker

    if strategy == "random":
        return RandomMatchmaker(seed=plan.seed)
    if strategy == "heuristic":
        return HeteroGreedyMatchmaker()
    if strategy == "cpm":
        s = CpmSettings(seed=plan.seed)
        return Matchmaker(
            profile_dim=s.profile_dim,
            beta=s.beta,
            pair_budget=s.pair_budget,
            protocols=s.protocols,
            seed=s.seed,
            roles=s.roles,
            interaction_features=s.interaction_features,
            trust_features=s.trust_features,
            matching=s.matching,
            ridge=s.ridge,
        )
    return None


# ------------------------------------------------------------------------ evaluation


def _test_pass1(world: _World, client: _Client) -> tuple[float, list[float]]:
    from peerlm.agent import evaluate_pass

    report = evaluate_pass(
        client.host, world.test, max_new_tokens=world.plan.max_new_tokens, ks=(1,)
    )
    return report.mean.get(1, 0.0), [r.pass_at[1] for r in report.problems]


def _final_eval(world: _World, client: _Client, seed: int) -> dict[str, Any]:
    from peerlm.agent import evaluate_pass

    plan = world.plan
    greedy, _ = _test_pass1(world, client)
    report = evaluate_pass(
        client.host,
        world.test,
        max_new_tokens=plan.max_new_tokens,
        n=plan.samples,
        temperature=plan.sample_temperature,
        ks=plan.ks,
        seed=seed,
    )
    return {
        "greedy_pass@1": greedy,
        **{f"pass@{k}": report.mean.get(k, 0.0) for k in plan.ks},
        "per_category": {c: v.get(1, 0.0) for c, v in report.per_category.items()},
        "status_counts": dict(report.status_counts),
    }


# ------------------------------------------------------------------------ one round


def _exchange(
    world: _World,
    strategy: str,
    policy: Any,
    clients: list[_Client],
    profiles: Mapping[str, np.ndarray],
    t: int,
) -> list[dict[str, Any]]:
    from peerlm.agent import build_package, decode_package, integrate_package, teacher_completions

    plan = world.plan
    by_name = {c.name: c for c in clients}
    records: list[dict[str, Any]] = []
    if strategy == "local":
        return records
    if strategy == "central_kd":
        completions = [
            [
                r.text
                for r in c.guardrail.filter_many(
                    teacher_completions(c.host, world.transfer, plan.max_new_tokens)
                )
            ]
            for c in clients
        ]
        consensus = consensus_texts([c.host for c in clients], world.transfer, completions)
        from peerlm.agent import Guardrail, build_text_package

        data = build_text_package(
            prompts=world.transfer,
            completions=consensus,
            teacher="central",
            directive_id=f"central-{t}",
            transfer_sha256=world.transfer_sha256,
            family="other",
            guardrail=Guardrail([]),  # the clients vetted their texts before sending
        )
        package = decode_package(data, expect_transfer_sha256=world.transfer_sha256)
        for i, student in enumerate(clients):
            result = integrate_package(
                student.host,
                package,
                kilobytes=len(data) / 1024,
                local_examples=student.train_examples,
                val_examples=student.val_examples,
                transfer_prompts=world.transfer,
                config=_round_config(plan, i),
                t=t,
            )
            student.rewards.append(result.reward)
            student.exchanges += 1
            records.append(_record("central", student.name, result, None))
        return records
    pairings: list[Pairing] = policy.select(profiles)
    for pairing in pairings:
        teacher, student = by_name[pairing.sender], by_name[pairing.receiver]
        directive = f"{strategy}-{t}-{teacher.name}-{student.name}"
        data = build_package(
            teacher.host,
            mode="text",
            prompts=world.transfer,
            completions=teacher_completions(teacher.host, world.transfer, plan.max_new_tokens),
            teacher=teacher.name,
            directive_id=directive,
            transfer_sha256=world.transfer_sha256,
            guardrail=teacher.guardrail,
        )
        package = decode_package(
            data,
            expect_transfer_sha256=world.transfer_sha256,
            expect_directive_id=directive,
            expect_teacher=teacher.name,
        )
        i = clients.index(student)
        result = integrate_package(
            student.host,
            package,
            kilobytes=len(data) / 1024,
            local_examples=student.train_examples,
            val_examples=student.val_examples,
            transfer_prompts=world.transfer,
            config=_round_config(plan, i),
            t=t,
        )
        normalised = policy.observe(pairing, result.reward)
        student.rewards.append(result.reward)
        student.exchanges += 1
        records.append(_record(teacher.name, student.name, result, float(normalised)))
    return records


def _record(teacher: str, student: str, result: Any, normalised: float | None) -> dict[str, Any]:
    return {
        "teacher": teacher,
        "student": student,
        "mode": result.mode,
        "alpha_kd": round(result.alpha_kd, 4),
        "loss_pre": round(result.loss_pre, 5),
        "loss_post": round(result.loss_post, 5),
        "kilobytes": round(result.kilobytes, 2),
        "reward": round(result.reward, 6),
        "normalised_reward": None if normalised is None else round(normalised, 5),
    }


@dataclass(frozen=True)
class _LocalPhase:
    """One client's local phase of a round: adapter after it, and what it measured."""

    adapter: dict[str, Any]
    train_loss: float
    val_loss: float
    val_pass1: float


def _local_phase(world: _World, c: _Client, i: int, t: int) -> _LocalPhase:
    from peerlm.agent import local_update, sample_completions, score_completions

    plan = world.plan
    stats = local_update(c.host, c.train_examples, _round_config(plan, i), t)
    loss, _ = c.host.eval_loss(c.val_examples)
    val = c.val[: plan.val_limit] if plan.val_limit else c.val
    completions = sample_completions(c.host, val, max_new_tokens=plan.max_new_tokens)
    pass1 = score_completions(val, completions).mean.get(1, 0.0)
    return _LocalPhase(c.host.adapter_state(), stats.mean_loss, loss, pass1)


def _first_local_phase(world: _World) -> dict[str, _LocalPhase]:
    """Round 1's local phase, the same for every strategy (same adapters, data and seeds):
    computed once and handed to each strategy."""
    return {c.name: _local_phase(world, c, i, 1) for i, c in enumerate(_clients(world))}


def _run_strategy(
    world: _World,
    strategy: str,
    initial: Mapping[str, float],
    first: Mapping[str, _LocalPhase],
    event: Event,
) -> dict[str, Any]:
    from peerlm.agent import ProfileInputs, category_counts, round_profile

    plan = world.plan
    clients = _clients(world)
    policy = _pairing_policy(strategy, plan)
    rounds: list[dict[str, Any]] = []
    curve = [sum(initial.values()) / len(initial)]
    per_client_curve = {c.name: [initial[c.name]] for c in clients}
    started = time.perf_counter()
    for t in range(1, plan.rounds + 1):
        profiles: dict[str, np.ndarray] = {}
        trained: dict[str, float] = {}
        for i, c in enumerate(clients):
            if t == 1:
                phase = first[c.name]
                c.host.load_adapter_state(phase.adapter)
            else:
                phase = _local_phase(world, c, i, t)
            trained[c.name] = phase.train_loss
            profile, pass1 = round_profile(
                c.host,
                ProfileInputs(
                    t=t,
                    total_rounds=plan.rounds,
                    val_loss=phase.val_loss,
                    pass_at_1=phase.val_pass1,
                    last_reward=c.rewards[-1] if c.rewards else 0.0,
                    exchanges=c.exchanges,
                ),
                c.history,
                category_counts(c.train),
                seed=plan.seed + i,
            )
            c.history.append({"round": t, "loss": phase.val_loss, "pass1": pass1})
            profiles[c.name] = profile
        exchanges = _exchange(world, strategy, policy, clients, profiles, t)
        test = {c.name: _test_pass1(world, c)[0] for c in clients}
        for name, value in test.items():
            per_client_curve[name].append(value)
        curve.append(sum(test.values()) / len(test))
        rounds.append(
            {
                "round": t,
                "train_loss": {k: round(v, 5) for k, v in trained.items()},
                "val_loss": {c.name: round(c.history[-1]["loss"], 5) for c in clients},
                "val_pass@1": {c.name: c.history[-1]["pass1"] for c in clients},
                "test_pass@1": test,
                "exchanges": exchanges,
            }
        )
        event("round", {"strategy": strategy, "round": t, "test_pass@1": curve[-1]})
    final = {
        c.name: {"arch": c.arch, **_final_eval(world, c, plan.seed * 1_000 + i)}
        for i, c in enumerate(clients)
    }
    event("final", {"strategy": strategy})
    mean = {
        key: sum(v[key] for v in final.values()) / len(final)
        for key in ("greedy_pass@1", *(f"pass@{k}" for k in plan.ks))
    }
    rewards = [x["reward"] for r in rounds for x in r["exchanges"]]
    return {
        "strategy": strategy,
        "label": LABELS[strategy],
        "mean": mean,
        "clients": final,
        "curve": curve,
        "client_curves": per_client_curve,
        "peak_greedy_pass@1": max(curve),
        "mean_reward": sum(rewards) / len(rewards) if rewards else None,
        "kilobytes": sum(x["kilobytes"] for r in rounds for x in r["exchanges"]),
        "rounds": rounds,
        "seconds": round(time.perf_counter() - started, 1),
    }


def _strategy_job(
    world: _World,
    strategy: str,
    initial: Mapping[str, float],
    first: Mapping[str, _LocalPhase],
    events: Any,
    threads: int,
) -> dict[str, Any]:
    """One strategy in a worker process; events go back through a queue."""
    import torch

    torch.set_num_threads(threads)
    return _run_strategy(world, strategy, initial, first, lambda k, d: events.put((k, dict(d))))


def _run_parallel(
    world: _World,
    initial: Mapping[str, float],
    first: Mapping[str, _LocalPhase],
    jobs: int,
    emit: Event,
) -> dict[str, dict[str, Any]]:
    """Strategies in ``jobs`` worker processes (spawned: no forked torch state)."""
    import multiprocessing
    import queue
    from concurrent.futures import ProcessPoolExecutor

    import torch

    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager, ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        events = manager.Queue()
        futures = {
            name: pool.submit(
                _strategy_job, world, name, initial, first, events, torch.get_num_threads()
            )
            for name in world.plan.strategies
        }
        while not all(f.done() for f in futures.values()):
            try:
                kind, data = events.get(timeout=0.5)
            except queue.Empty:
                continue
            emit(kind, data)
        while True:
            try:
                kind, data = events.get_nowait()
            except queue.Empty:
                break
            emit(kind, data)
        return {name: f.result() for name, f in futures.items()}


def run_experiment(
    plan: ExperimentPlan,
    *,
    models: Path,
    work: Path,
    event: Event | None = None,
    jobs: int = 1,
) -> dict[str, Any]:
    """Run every strategy of ``plan``; the results as a JSON-ready dictionary.

    ``jobs > 1`` runs strategies in that many worker processes; results are the same (every
    strategy is seeded on its own), only the wall time changes.
    """
    emit = event or (lambda _kind, _data: None)
    started = time.perf_counter()
    world = _prepare(plan, models, work / "data", emit)
    # Round 0: the pre-trained models with fresh adapters (LoRA B = 0), the same for every
    # strategy; measured once. So is round 1's local phase.
    initial = {c.name: _test_pass1(world, c)[0] for c in _clients(world)}
    emit("initial", {"test_pass@1": sum(initial.values()) / len(initial)})
    first = _first_local_phase(world)
    if jobs > 1 and len(plan.strategies) > 1:
        results = _run_parallel(world, initial, first, jobs, emit)
    else:
        results = {s: _run_strategy(world, s, initial, first, emit) for s in plan.strategies}
    return {
        "plan": {**asdict(plan), "strategies": list(plan.strategies)},
        "models": str(models),
        "clients": [
            {
                "name": f"agent-{i}",
                "arch": ARCHS[i % len(ARCHS)],
                "train": len(train),
                "val": len(val),
            }
            for i, (train, val) in enumerate(world.clients_data)
        ],
        "transfer_prompts": len(world.transfer),
        "test_problems": len(world.test),
        "initial_test_pass@1": initial,
        "strategies": results,
        "seconds": round(time.perf_counter() - started, 1),
    }


# ------------------------------------------------------------------------ reporting


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


def render_table(result: Mapping[str, Any]) -> str:
    """Table 4 (mean over clients) and the per-client pass@1, as Markdown."""
    plan = result["plan"]
    ks = [k for k in (1, 5, 10) if k <= plan["samples"]]
    head = ["Method", *(f"Pass@{k} (%)" for k in ks), "greedy Pass@1 (%)", "peak greedy (%)"]
    head += ["mean reward", "KB exchanged"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["strategies"].values():
        mean = r["mean"]
        reward = "-" if r["mean_reward"] is None else f"{r['mean_reward']:.4f}"
        cells = [r["label"], *(_pct(mean.get(f"pass@{k}")) for k in ks)]
        cells += [_pct(mean["greedy_pass@1"]), _pct(r["peak_greedy_pass@1"]), reward]
        cells += [f"{r['kilobytes']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    clients = result["clients"]
    lines += ["", "Per client, Pass@1 (%) from samples (greedy in brackets):", ""]
    head = ["Method", *(f"{c['name']} ({c['arch']})" for c in clients)]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["strategies"].values():
        cells = [r["label"]]
        for c in clients:
            v = r["clients"][c["name"]]
            cells.append(f"{_pct(v.get('pass@1'))} ({_pct(v['greedy_pass@1'])})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_outputs(result: Mapping[str, Any], out: Path) -> list[Path]:
    """``results.json``, ``table.md`` and (with matplotlib) two PNG plots under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json", out / "table.md"]
    written[0].write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    written[1].write_text(render_table(result))
    try:
        import matplotlib
    except ImportError:  # the plots need the bench extra; the numbers do not
        return written
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    strategies = list(result["strategies"].values())
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in strategies:
        ax.plot(range(len(r["curve"])), [100 * v for v in r["curve"]], marker="o", label=r["label"])
    ax.set_xlabel("round")
    ax.set_ylabel("mean greedy Pass@1 on the test set (%)")
    ax.set_title("Pass@1 per round")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "pass1_by_round.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    clients = result["clients"]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.8 / max(1, len(strategies))
    x = np.arange(len(clients))
    for j, r in enumerate(strategies):
        values = [100 * r["clients"][c["name"]].get("pass@1", 0.0) for c in clients]
        ax.bar(x + (j - (len(strategies) - 1) / 2) * width, values, width, label=r["label"])
    ax.set_xticks(x, [f"{c['name']}\n{c['arch']}" for c in clients])
    ax.set_ylabel(f"Pass@1 (%), {result['plan']['samples']} samples")
    ax.set_title("Final Pass@1 per client")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "per_client.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written
