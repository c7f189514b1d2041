"""Can an expert form? Train one client on its private data and measure Pass@1 on its skill.

``python -m peerlm.app.expert_probe --arch gpt2 --steps 200`` builds (or reuses) a tiny
model whose pre-training left the world's private categories out, lays out the default
world with a larger test set, fine-tunes client ``--client``'s LoRA adapter on its private
training data (its own private category plus public ones) and reports greedy Pass@1 on the
test problems of its own category and of the public categories, each with a 95 % Wilson
interval over problems, before and after, plus the share of failures whose body is right up
to literals (the "wrong constants" failure). This is the measurement behind the figures in
``docs/models.md``; it is a diagnostic, not part of the federation.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import re
import sys
import time
import tokenize
from pathlib import Path
from typing import Any

__all__ = ["copy_rate", "main", "normalise_literals", "wilson"]


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a binomial proportion."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def normalise_literals(code: str) -> str:
    """Code with every number and string literal replaced by a placeholder (whitespace too)."""
    out: list[str] = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            if tok.type == tokenize.NUMBER:
                out.append("<N>")
            elif tok.type == tokenize.STRING:
                out.append("<S>")
            elif tok.type in (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT):
                out.append((tok.type == tokenize.NEWLINE and ";") or "")
            elif tok.type != tokenize.ENDMARKER:
                out.append(tok.string)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return re.sub(r"\s+", " ", code.strip())
    return " ".join(t for t in out if t)


def _measure(host: Any, problems: list[Any], max_new_tokens: int) -> dict[str, Any]:
    from peerlm.agent import evaluate

    completions = host.generate(
        [p.prompt for p in problems], max_new_tokens=max_new_tokens, temperature=0.0
    )
    report = evaluate(
        problems, {p.task_id: c[:1] for p, c in zip(problems, completions, strict=True)}, ks=(1,)
    )
    passed = [r.c > 0 for r in report.problems]
    structure = [
        normalise_literals(c[0]) == normalise_literals(p.reference)
        for p, c in zip(problems, completions, strict=True)
    ]
    wrong_literals = sum(s and not ok for s, ok in zip(structure, passed, strict=True))
    n = len(problems)
    k = sum(passed)
    low, high = wilson(k, n)
    return {
        "n": n,
        "pass1": round(k / n, 4) if n else 0.0,
        "ci95": [round(low, 4), round(high, 4)],
        "structure_match": round(sum(structure) / n, 4) if n else 0.0,
        "right_body_wrong_literals": round(wrong_literals / n, 4) if n else 0.0,
        "examples": [
            {"reference": p.reference, "completion": c[0]}
            for p, c, ok in list(zip(problems, completions, passed, strict=True))[:3]
        ],
    }


def copy_rate(model_dir: str, corpus_size: int, n: int = 60) -> dict[str, Any]:
    """Share of ``n`` held-out copy drills (none is in the corpus) whose whole body the
    pre-trained model predicts token by token (greedy, teacher-forced).

    Teacher forcing on the complete function keeps the measurement free of prompt-boundary
    effects: where a prompt ends inside what the tokenizer would merge (GPT-2's regex
    merges ``"\n   "``, Qwen2's ``\"\"\"\n``), free generation measures the boundary,
    not copying.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from peerlm.agent import held_out_drills

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()  # type: ignore[no-untyped-call]
    exact = 0
    examples: list[dict[str, str]] = []
    for text in held_out_drills(n, corpus_size):
        body_at = text.rindex('"""') + len('"""\n    ')
        encoding = tokenizer(text, return_offsets_mapping=True)
        ids = torch.tensor([encoding["input_ids"]])
        first = next(i for i, (lo, hi) in enumerate(encoding["offset_mapping"]) if hi > body_at)
        with torch.no_grad():
            predicted = model(input_ids=ids).logits[0, first - 1 : -1].argmax(-1)
        right = bool(torch.equal(predicted, ids[0, first:]))
        exact += right
        if len(examples) < 3:
            examples.append(
                {"body": text[body_at:].strip(), "predicted": str(tokenizer.decode(predicted))}
            )
    low, high = wilson(exact, n)
    return {
        "n": n,
        "exact": round(exact / n, 4),
        "ci95": [round(low, 4), round(high, 4)],
        "examples": examples,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the probe; prints one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="gpt2")
    parser.add_argument("--models-dir", type=Path, default=Path("state/models-cache/tiny"))
    parser.add_argument("--work-dir", type=Path, default=Path("state/expert-probe"))
    parser.add_argument("--pretrain-steps", type=int, default=None)
    parser.add_argument("--steps", type=int, default=200, help="LoRA optimiser steps.")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--lora-r", type=int, default=8)
    parser.add_argument("--client", type=int, default=0)
    parser.add_argument("--test-per-category", type=int, default=60)
    parser.add_argument("--own-only", action="store_true", help="Train on own category only.")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from peerlm.agent import (
        LoraSettings,
        ModelHost,
        TrainSettings,
        WorldSpec,
        build_federation_data,
        build_models,
        read_jsonl,
    )

    started = time.perf_counter()
    [info] = build_models(
        args.models_dir, (args.arch,), pretrain_steps=args.pretrain_steps, threads=args.threads
    )
    built = time.perf_counter() - started
    spec = WorldSpec(test_per_category=args.test_per_category, per_private_category=240)
    data = args.work_dir / "data"
    manifest = build_federation_data(data, 4, world=spec, overwrite=True)
    world = manifest.world
    own = set(world.own(args.client))
    client = data / "clients" / str(args.client)
    train = read_jsonl(client / "train.jsonl")
    if args.own_only:
        train = [p for p in train if p.category in own]
    test = read_jsonl(data / "test.jsonl")
    own_test = [p for p in test if p.category in own]
    public_test = [p for p in test if p.category in world.public_categories][: len(own_test)]

    host = ModelHost.load(info.path, LoraSettings(r=args.lora_r), device="cpu", seed=0)
    result: dict[str, Any] = {
        "arch": args.arch,
        "model": info.to_dict(),
        "build_s": round(built, 1),
        "own": sorted(own),
        "train_problems": len(train),
        "copy_drills_before": copy_rate(info.path, int(info.extra.get("copy_drills") or 0)),
        "before": {"own": _measure(host, own_test, args.max_new_tokens)},
    }
    settings = TrainSettings(learning_rate=args.lr)
    t0 = time.perf_counter()
    stats = host.train_local([(p.prompt, p.reference) for p in train], settings, steps=args.steps)
    result["train_s"] = round(time.perf_counter() - t0, 1)
    result["train_loss"] = stats.mean_loss
    result["after"] = {
        "own": _measure(host, own_test, args.max_new_tokens),
        "public": _measure(host, public_test, args.max_new_tokens),
    }
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
