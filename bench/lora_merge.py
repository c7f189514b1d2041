"""OnePeFT's SVD aggregation (:func:`peerlm.agent.merging.lora_merge.aggregate_svd`) beside peft's.

peft merges LoRA adapters with ``PeftModel.add_weighted_adapter(adapters, weights, name,
combination_type="svd", svd_rank=r)``: per module ``Σ w_i · get_delta_weight(i)`` (the
client's scaling ``alpha_i / r_i`` included), a full SVD in the adapters' dtype, ``B = U_r
Σ_r``, ``A = V_rᵀ`` and an output adapter with ``lora_alpha = r``. This benchmark builds one
module stack of ``Linear(dim_in, dim_out)`` layers, wraps it with peft, gives it K client
adapters (ranks and alphas as asked, A and B random: B non-zero as after training), and
aggregates them both ways with the same normalised data-share weights. It reports, per
module, the largest absolute difference between the two reconstructed updates
``(alpha / r) B A`` (and of each against the exact float64 ``Σ λ_i ΔW_i`` when the target
rank covers it), and the median wall time of each (peft's includes injecting the new
adapter into the model, which its API does not separate).

Timings vary with load on the machine; the differences are what this is for.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from peerlm.agent import ClientAdapter, aggregate_svd, delta_weights, normalise_weights
from peft import LoraConfig, PeftModel, get_peft_model
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from rich.console import Console
from rich.table import Table

__all__ = [
    "MergeBenchConfig",
    "peft_quirks",
    "peft_svd_merge",
    "render_report",
    "run_benchmark",
]


@dataclass(frozen=True)
class MergeBenchConfig:
    """What to merge: ``modules`` layers of ``dim_out x dim_in``, one client per rank."""

    modules: int = 8
    dim_in: int = 1024
    dim_out: int = 1024
    ranks: tuple[int, ...] = (8, 8, 16, 4)
    alphas: tuple[float, ...] = (16.0, 16.0, 32.0, 8.0)
    examples: tuple[int, ...] = (100, 300, 50, 550)
    target_rank: int = 16
    repeats: int = 3
    seed: int = 0
    #: torch intra-op threads for both (1: on a shared, loaded machine more threads than
    #: free cores made a 1024 x 36 QR 40x slower than one thread).
    threads: int = 1


class _Stack(torch.nn.Module):
    def __init__(self, modules: int, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(dim_in, dim_out, bias=False) for _ in range(modules)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([layer(x) for layer in self.layers]).sum(0)


def _client_model(cfg: MergeBenchConfig) -> tuple[PeftModel, list[ClientAdapter]]:
    gen = torch.Generator().manual_seed(cfg.seed)
    base = _Stack(cfg.modules, cfg.dim_in, cfg.dim_out)
    model: PeftModel | None = None
    clients: list[ClientAdapter] = []
    for i, (r, alpha, n) in enumerate(zip(cfg.ranks, cfg.alphas, cfg.examples, strict=True)):
        lora = LoraConfig(r=r, lora_alpha=alpha, target_modules=r"layers\.\d+", lora_dropout=0.0)  # type: ignore[arg-type]
        name = f"c{i}"
        if model is None:
            model = get_peft_model(base, lora, adapter_name=name)  # type: ignore[assignment]
        else:
            model.add_adapter(name, lora)
        assert model is not None
        shapes = get_peft_model_state_dict(model, adapter_name=name)
        state = {
            k: torch.randn(v.shape, generator=gen) / v.shape[-1] ** 0.5 for k, v in shapes.items()
        }
        set_peft_model_state_dict(model, state, adapter_name=name)
        clients.append(ClientAdapter(state, r, alpha, n, name))
    assert model is not None
    return model, clients


def peft_svd_merge(
    model: PeftModel, names: Sequence[str], weights: Sequence[float], rank: int, merged: str
) -> dict[str, torch.Tensor]:
    """peft's SVD merge of the named adapters into ``merged`` (its ``lora_alpha`` is
    ``rank``); the merged adapter's LoRA tensors, which it then deletes from ``model``."""
    model.add_weighted_adapter(
        list(names), list(weights), merged, combination_type="svd", svd_rank=rank
    )
    state = get_peft_model_state_dict(model, adapter_name=merged)
    out = {k: v.detach().clone() for k, v in state.items()}
    model.delete_adapter(merged)
    return out


def peft_quirks(seed: int = 0) -> dict[str, Any]:
    """Where peft's SVD merge is not Eq. 3 as used here, measured on a 5 x 6 module with two
    clients (ranks 2 and 3, data sizes 1 and 3, target rank 4):

    * ``raw_weight_ratio``: peft's update with the raw data sizes as weights over ours (peft
      does not normalise: 4.0 means the update is scaled by Σ |D_j|);
    * ``one_adapter_shapes``: one adapter with ``svd_rank=2`` (peft falls back to ``linear``
      and keeps the client's rank 3);
    * ``rank_above_min_shapes``: ``svd_rank=6 > min(5, 6)`` (the adapter is configured for
      rank 6; are A and B of rank 6?).
    """
    cfg = MergeBenchConfig(
        modules=1, dim_in=6, dim_out=5, ranks=(2, 3), alphas=(4.0, 3.0), examples=(1, 3),
        target_rank=4, seed=seed,
    )  # fmt: skip
    model, clients = _client_model(cfg)
    ours = delta_weights(aggregate_svd(clients, r=4).state, r=4, alpha=4.0)
    raw = delta_weights(peft_svd_merge(model, ["c0", "c1"], [1.0, 3.0], 4, "raw"), r=4, alpha=4.0)
    ratios = torch.cat([(raw[m] / ours[m]).flatten() for m in ours])
    one = peft_svd_merge(model, ["c1"], [1.0], 2, "one")
    big = peft_svd_merge(model, ["c0", "c1"], [0.25, 0.75], 6, "big")

    def shapes(state: dict[str, torch.Tensor]) -> dict[str, list[int]]:
        return {k.rsplit(".", 2)[-2]: list(v.shape) for k, v in state.items()}

    return {
        "raw_weight_ratio": [float(ratios.min()), float(ratios.max())],
        "one_adapter_shapes": shapes(one),
        "rank_above_min_shapes": shapes(big),
    }


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_benchmark(
    cfg: MergeBenchConfig, progress: Callable[[str, int, int], None] | None = None
) -> dict[str, Any]:
    """Both merges on the same clients: differences per module and median times."""
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return _run(cfg, progress)
    finally:
        torch.set_num_threads(previous_threads)


def _run(cfg: MergeBenchConfig, progress: Callable[[str, int, int], None] | None) -> dict[str, Any]:
    model, clients = _client_model(cfg)
    lam = normalise_weights(cfg.examples)
    names = [c.name for c in clients]
    r = cfg.target_rank
    if progress:
        progress("merging", 0, 2)
    ours = aggregate_svd(clients, r=r)
    theirs = peft_svd_merge(model, names, lam, r, "merged")
    ours_dw = delta_weights(ours.state, r=ours.r, alpha=ours.alpha)
    peft_dw = delta_weights(theirs, r=r, alpha=float(r))
    exact_possible = sum(cfg.ranks) <= r
    modules: list[dict[str, Any]] = []
    for m, dw in ours_dw.items():
        ideal = sum(
            (w * c.scaling)
            * (c.state[m + ".lora_B.weight"].double() @ c.state[m + ".lora_A.weight"].double())
            for w, c in zip(lam, clients, strict=True)
        )
        assert isinstance(ideal, torch.Tensor)
        modules.append(
            {
                "module": m,
                "max_abs_diff_ours_peft": float((dw - peft_dw[m]).abs().max()),
                "max_abs_delta": float(dw.abs().max()),
                "ours_tail_norm": ours.error[m],
                "peft_error_fro": float(torch.linalg.matrix_norm(peft_dw[m] - ideal)),
                "ours_error_fro": float(torch.linalg.matrix_norm(dw - ideal)),
            }
        )
    if progress:
        progress("timing", 1, 2)
    ours_s = _median_s(lambda: aggregate_svd(clients, r=r), cfg.repeats)
    peft_s = _median_s(lambda: peft_svd_merge(model, names, lam, r, "timed"), cfg.repeats)
    if progress:
        progress("done", 2, 2)
    return {
        "config": asdict(cfg),
        "weights": list(lam),
        "exact_possible": exact_possible,
        "max_abs_diff_ours_peft": max(row["max_abs_diff_ours_peft"] for row in modules),
        "ours_median_s": ours_s,
        "peft_median_s": peft_s,
        "torch_threads": cfg.threads,
        "modules": modules,
        "peft_quirks": peft_quirks(cfg.seed),
    }


def render_report(report: dict[str, Any], console: Console) -> None:
    """The per-module table and the two timings."""
    cfg = report["config"]
    table = Table(
        title=(
            f"SVD merge, K={len(cfg['ranks'])} ranks {cfg['ranks']} -> r={cfg['target_rank']}, "
            f"{cfg['modules']} x ({cfg['dim_out']}x{cfg['dim_in']})"
        )
    )
    for col in (
        "module",
        "max |ΔW_ours − ΔW_peft|",
        "max |ΔW|",
        "‖ours − ideal‖_F",
        "‖peft − ideal‖_F",
    ):
        table.add_column(col, justify="right")
    for row in report["modules"]:
        table.add_row(
            row["module"],
            f"{row['max_abs_diff_ours_peft']:.3g}",
            f"{row['max_abs_delta']:.3g}",
            f"{row['ours_error_fro']:.3g}",
            f"{row['peft_error_fro']:.3g}",
        )
    console.print(table)
    console.print(
        f"median time: ours {report['ours_median_s'] * 1e3:.1f} ms, "
        f"peft {report['peft_median_s'] * 1e3:.1f} ms "
        f"({cfg['repeats']} repeats, {report['torch_threads']} torch threads)"
    )
    quirks = report["peft_quirks"]
    console.print(
        "peft, 5x6 module, ranks 2 and 3: raw data sizes (1, 3) as weights give "
        f"{quirks['raw_weight_ratio'][0]:.3g}-{quirks['raw_weight_ratio'][1]:.3g} x our update; "
        f"one adapter at svd_rank=2 gives {quirks['one_adapter_shapes']}; "
        f"svd_rank=6 gives {quirks['rank_above_min_shapes']}"
    )
