"""Can a tiny model learn each stage of the code value chain? (FedWave foundations check.)

For each stage of the three-stage code chain, one expert (a shipped tiny model with a fresh
LoRA adapter and VCLayer) trains on its stage's private examples with the local loss of
Eq. 2 (no router, no neighbours: this checks the data and the model path, not FedWave's
collaboration), and is scored on the held-out test chains with reference inputs before and
after: Table 1's lexical metrics, plus the implementation pass@1 (``implement``) and the
generated-test share (``test``) in the sandbox. Not an experiment of the paper's tables.

    python -m peerlm.bench.fedwave_chain [--arch gpt2] [--steps 150] [--per-stage 240]
        [--test 24] [--seed 0] [--threads 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Sequence
from typing import Any

import torch
from peerlm.agent import (
    CODE_CHAIN_STAGES,
    SHIPPED_DIR,
    LoraSettings,
    VCCausalLM,
    VCLayer,
    Workflow,
    apply_lora,
    build_code_chain,
    corpus_scores,
    encode_stage_examples,
    expert_loss,
    greedy_generate,
    score_chain_tasks,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

__all__ = ["main", "run"]


def _scores(
    stage: int, outputs: list[str], items: Sequence[Any], references: list[str]
) -> dict[str, float]:
    row = {k: round(v, 2) for k, v in corpus_scores(outputs, references).as_dict().items()}
    if stage == 1:
        tasks = score_chain_tasks(items, outputs, [""] * len(items))
        row["pass@1"] = round(100 * tasks.pass_at_1, 1)
    if stage == 2:
        bodies = [item.artefacts[2] for item in items]
        tasks = score_chain_tasks(items, bodies, outputs)
        row["test_share"] = round(100 * tasks.test_share, 1)
    return row


def run(
    arch: str, steps: int, per_stage: int, n_test: int, seed: int, batch: int = 8
) -> list[dict[str, Any]]:
    """One row per stage: metrics before and after training, with the wall time."""
    workflow = Workflow.model_validate(
        {"stages": [{"name": n, "agents": [n]} for n in CODE_CHAIN_STAGES]}
    )
    split = build_code_chain(workflow, per_stage=per_stage, n_test=n_test, n_public=0, seed=seed)
    path = SHIPPED_DIR / "tiny" / arch
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows: list[dict[str, Any]] = []
    for index, stage in enumerate(CODE_CHAIN_STAGES):
        started = time.perf_counter()
        torch.manual_seed(seed + index)
        base = AutoModelForCausalLM.from_pretrained(path)
        lm = apply_lora(base, LoraSettings(dropout=0.0))
        layer = VCLayer(int(base.config.hidden_size),
                        generator=torch.Generator().manual_seed(seed + 1 + index))  # fmt: skip
        model = VCCausalLM(lm, layer)
        tests = [item.example(index) for item in split.test]
        sources, references = [e.source for e in tests], [e.target for e in tests]
        before = _scores(index, greedy_generate(model, tokenizer, sources), split.test, references)
        data = list(split.private[stage][stage])
        rng = random.Random(seed)
        params = [p for p in model.parameters() if p.requires_grad]
        optimiser = torch.optim.AdamW(params, lr=2e-3)
        model.train()
        for _ in range(steps):
            encoded = encode_stage_examples(tokenizer, rng.sample(data, batch), 256)
            loss = expert_loss(
                model, encoded, stage_index=index, predecessor=None, successor=None, router=None
            )
            optimiser.zero_grad()
            loss.total.backward()  # type: ignore[no-untyped-call]
            optimiser.step()
        after = _scores(index, greedy_generate(model, tokenizer, sources), split.test, references)
        rows.append(
            {
                "stage": stage,
                "before": before,
                "after": after,
                "final_loss": round(float(loss.sft), 3),
                "seconds": round(time.perf_counter() - started, 1),
            }
        )
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    """Print the per-stage table (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="gpt2")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--per-stage", type=int, default=240)
    parser.add_argument("--test", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    # One thread: steps this small use more threads poorly, and spinning OpenMP threads on
    # a shared machine made a 5-step run take 15 minutes instead of about one.
    torch.set_num_threads(args.threads)
    rows = run(args.arch, args.steps, args.per_stage, args.test, args.seed)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"arch {args.arch}, {args.steps} steps of 8, seed {args.seed}, {args.test} test chains")
    print("| stage | metric | before | after |")
    print("|---|---|---|---|")
    for row in rows:
        for metric, value in row["after"].items():
            print(f"| {row['stage']} | {metric} | {row['before'][metric]} | {value} |")
        tail = f"{row['final_loss']} / {row['seconds']}"
        print(f"| {row['stage']} | final SFT loss / seconds | | {tail} |")


if __name__ == "__main__":
    main()
