"""FedProxy on the tiny models: H-TIES against plain FedAvg of proxies (and TIES, and H-TIES
with PCR) under heterogeneous skills.

One run: the shipped tiny model ``M`` of one architecture is compressed to a proxy by Block
Influence on the federation's public transfer prompts (Eq. 4); ``K`` clients of the default
world (each the only holder of one private skill, public skills shared) train the global
proxy on their own data for a few full-parameter steps per round; the owner merges with each
method; after ``T`` rounds the global proxy is fused into ``M`` (Section 4.3). Every method
starts from the same proxy and the same client data and batches (one seed per run).

Measured: the reference NLL (nats per UTF-8 byte of the reference solution, given the
prompt) of the global proxy and of the fused model on the test problems of the private
skills (each held by one client: where merging heterogeneous updates matters) and of the
public ones, and the paired difference of each method against FedAvg of proxies per test
problem, with a normal 95 % interval over problems x seeds. Reference NLL, not Pass@1: on
these models Pass@1 barely moves (docs/models.md), the NLL of the right answer does.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from peerlm.agent import (
    PROXY_MERGES,
    ConflictRegulariser,
    Problem,
    WorldSpec,
    build_federation_data,
    build_models,
    compress_by_influence,
    fuse_into,
    merge_proxies,
    read_jsonl,
    uses_pcr,
)
from rich.console import Console
from rich.table import Table

__all__ = ["METHODS", "FedProxyBenchConfig", "render_report", "run_benchmark"]

#: The merges compared (:data:`peerlm.agent.PROXY_MERGES`); ``fedavg`` is the reference of
#: the paired differences.
METHODS = PROXY_MERGES


@dataclass(frozen=True)
class FedProxyBenchConfig:
    """What one benchmark run does (defaults: a few minutes on two shared cores)."""

    arch: str = "gpt2"
    ratio: float = 0.5
    clients: int = 4
    rounds: int = 3
    local_steps: int = 12
    batch_size: int = 8
    lr: float = 1e-3
    lambda_reg: float = 1e-5
    max_length: int = 160
    seeds: tuple[int, ...] = (0,)
    methods: tuple[str, ...] = METHODS
    threads: int = 1


def _encode(tokenizer: Any, problem: Problem, max_length: int) -> tuple[list[int], int]:
    """Token ids of prompt + reference + EOS and the number of prompt tokens."""
    prompt = tokenizer(problem.prompt)["input_ids"]
    answer = tokenizer(problem.reference)["input_ids"] + [tokenizer.eos_token_id]
    ids = (prompt + answer)[:max_length]
    return ids, min(len(prompt), len(ids))


def _batch(rows: Sequence[tuple[list[int], int]], pad: int) -> tuple[torch.Tensor, ...]:
    width = max(len(ids) for ids, _ in rows)
    ids_t = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids_t)
    labels = torch.full_like(ids_t, -100)
    for i, (ids, start) in enumerate(rows):
        ids_t[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
        labels[i, start : len(ids)] = torch.tensor(ids[start:])
    return ids_t, mask, labels


def reference_nll(
    model: Any, tokenizer: Any, problems: Sequence[Problem], max_length: int
) -> list[float]:
    """Per problem: ``−log p(reference + EOS | prompt)`` per UTF-8 byte of the reference."""
    out: list[float] = []
    model.eval()
    with torch.no_grad():
        for start in range(0, len(problems), 16):
            chunk = problems[start : start + 16]
            ids, mask, labels = _batch([_encode(tokenizer, p, max_length) for p in chunk], 0)
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
            target = labels[:, 1:]
            logp = torch.log_softmax(logits.float(), dim=-1)
            picked = logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            nll = -(picked * (target != -100)).sum(dim=1)
            for p, v in zip(chunk, nll.tolist(), strict=True):
                out.append(v / max(1, len(p.reference.encode("utf-8"))))
    return out


def _train(
    model: Any,
    tokenizer: Any,
    data: Sequence[Problem],
    cfg: FedProxyBenchConfig,
    seed: int,
    regulariser: ConflictRegulariser | None,
) -> None:
    """Full-parameter AdamW on the client's problems (the whole text is the loss)."""
    gen = torch.Generator().manual_seed(seed)
    optimiser = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    model.train()
    for _ in range(cfg.local_steps):
        pick = torch.randint(0, len(data), (cfg.batch_size,), generator=gen).tolist()
        rows = [_encode(tokenizer, data[i], cfg.max_length) for i in pick]
        rows = [(ids, 0) for ids, _ in rows]  # loss on prompt and body: private data
        ids, mask, labels = _batch(rows, 0)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
        if regulariser is not None:
            loss = loss + regulariser.penalty(model)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
    model.eval()


def _interval(diffs: Sequence[float]) -> dict[str, float]:
    n = len(diffs)
    mean = math.fsum(diffs) / n
    var = math.fsum((d - mean) ** 2 for d in diffs) / max(1, n - 1)
    half = 1.96 * math.sqrt(var / n)
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": n}


def run_benchmark(
    cfg: FedProxyBenchConfig, progress: Callable[[str, int, int], None] | None = None
) -> dict[str, Any]:
    """Every method on every seed; per-problem NLLs, means and paired differences."""
    previous = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="peerlm-fedproxy-") as tmp:
            return _run(cfg, Path(tmp), progress, started)
    finally:
        torch.set_num_threads(previous)


def _run(
    cfg: FedProxyBenchConfig,
    tmp: Path,
    progress: Callable[[str, int, int], None] | None,
    started: float,
) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def tick(label: str, done: int, total: int) -> None:
        if progress is not None:
            progress(label, done, total)

    info = build_models(tmp / "models", (cfg.arch,), size="tiny")[0]
    tokenizer = AutoTokenizer.from_pretrained(info.path)
    spec = WorldSpec()
    private = set(spec.private_categories)
    per_seed: dict[str, dict[str, list[float]]] = {}
    total = len(cfg.seeds) * len(cfg.methods) * cfg.rounds * cfg.clients
    done = 0
    compress_info: dict[str, Any] = {}
    for seed in cfg.seeds:
        data_dir = tmp / f"data-{seed}"
        build_federation_data(data_dir, cfg.clients, seed=seed, world=spec)
        train = [
            read_jsonl(data_dir / "clients" / str(k) / "train.jsonl") for k in range(cfg.clients)
        ]
        test = read_jsonl(data_dir / "test.jsonl")
        full = AutoModelForCausalLM.from_pretrained(info.path)
        prompts = [p.prompt for p in read_jsonl(data_dir / "transfer.jsonl")]
        compressed = compress_by_influence(full, tokenizer, prompts, cfg.ratio)
        proxy0 = compressed.proxy
        compress_info = {
            "block_influence": compressed.influence,
            "kept_blocks": list(compressed.kept),
        }
        start_state = {k: v.detach().clone() for k, v in proxy0.state_dict().items()}
        nll = {"base_full": reference_nll(full, tokenizer, test, cfg.max_length)}
        nll["base_proxy"] = reference_nll(proxy0, tokenizer, test, cfg.max_length)
        for method in cfg.methods:
            global_state = {k: v.clone() for k, v in start_state.items()}
            conflict: dict[str, torch.Tensor] | None = None
            for rnd in range(cfg.rounds):
                client_states = []
                for k in range(cfg.clients):
                    proxy0.load_state_dict(global_state)
                    reg = None
                    if uses_pcr(method) and conflict is not None:
                        reg = ConflictRegulariser(global_state, conflict, cfg.lambda_reg)
                    _train(proxy0, tokenizer, train[k], cfg, seed * 1000 + rnd * 10 + k, reg)
                    client_states.append(
                        {n: t.detach().clone() for n, t in proxy0.state_dict().items()}
                    )
                    done += 1
                    tick(f"seed {seed} {method} round {rnd + 1} client {k}", done, total)
                merged = merge_proxies(method, global_state, client_states)
                global_state, conflict = merged.state, merged.conflict
            proxy0.load_state_dict(global_state)
            nll[f"{method}_proxy"] = reference_nll(proxy0, tokenizer, test, cfg.max_length)
            fused = AutoModelForCausalLM.from_pretrained(info.path)
            fuse_into(fused, proxy0)
            nll[f"{method}_fused"] = reference_nll(fused, tokenizer, test, cfg.max_length)
        per_seed[str(seed)] = nll
    report = _summarise(cfg, per_seed, [p.category in private for p in test])
    report["compress"] = compress_info
    report["seconds"] = round(time.perf_counter() - started, 1)
    return report


def _summarise(
    cfg: FedProxyBenchConfig, per_seed: dict[str, dict[str, list[float]]], is_private: list[bool]
) -> dict[str, Any]:
    slices = {"private": [i for i, p in enumerate(is_private) if p]}
    slices["public"] = [i for i, p in enumerate(is_private) if not p]
    names = list(next(iter(per_seed.values())))
    means: dict[str, dict[str, float]] = {}
    diffs: dict[str, dict[str, dict[str, float]]] = {}
    for name in names:
        means[name] = {}
        for label, idx in slices.items():
            values = [per_seed[s][name][i] for s in per_seed for i in idx]
            means[name][label] = math.fsum(values) / len(values)
    for method in cfg.methods:
        if method == "fedavg":
            continue
        for kind in ("proxy", "fused"):
            key = f"{method}_{kind}"
            ref = f"fedavg_{kind}"
            diffs[key] = {}
            for label, idx in slices.items():
                paired = [per_seed[s][key][i] - per_seed[s][ref][i] for s in per_seed for i in idx]
                diffs[key][label] = _interval(paired)
    return {"config": asdict(cfg), "mean_nll": means, "vs_fedavg": diffs, "per_seed": per_seed}


def render_report(report: dict[str, Any], console: Console) -> None:
    """Mean reference NLL per model and slice, and the paired differences against FedAvg."""
    cfg = report["config"]
    title = (
        f"FedProxy on tiny {cfg['arch']}: ratio {cfg['ratio']}, {cfg['clients']} clients, "
        f"{cfg['rounds']} rounds x {cfg['local_steps']} steps, seeds {cfg['seeds']} "
        f"({report['seconds']} s)"
    )
    table = Table(title=title)
    for col in ("model", "private NLL", "public NLL", "Δ private vs FedAvg [95 %]", "Δ public"):
        table.add_column(col, justify="right" if col != "model" else "left")
    for name, m in report["mean_nll"].items():
        d = report["vs_fedavg"].get(name)
        cells = ["", ""]
        if d is not None:
            cells = [
                f"{d[s]['mean']:+.4f} [{d[s]['low']:+.4f}, {d[s]['high']:+.4f}]"
                for s in ("private", "public")
            ]
        table.add_row(name, f"{m['private']:.4f}", f"{m['public']:.4f}", *cells)
    console.print(table)
    console.print(f"kept blocks {report['compress']['kept_blocks']}; lower NLL is better")
