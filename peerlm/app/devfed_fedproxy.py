"""``peerlm up --fedproxy``: a local FedProxy cohort on loopback (docs/fedproxy.md, section 8).

One owner agent holds the full model (the family's tiny model, or its micro one with
``--micro``) and compresses it at start by Block Influence on the public transfer set at
``κ`` (``fedproxy.compress_ratio``); the other agents are its cohort members: same family,
each with its client partition of the default world as private training and validation
data. Every agent is a real ``peerlm agent`` process with its own certificate, playing only
the cohort's rounds (``fedproxy.cohort_only``): the owner publishes the proxy, pulls the
members' trained proxies over mTLS, merges them (analysis + H-TIES) and publishes the next;
after the last round it fuses the final proxy into its full model.

What each party measures is what it may see: a member, every proxy it pulled, on its own
validation data; the owner, its full model before and the fused one after (and its proxy),
on held-out problems of the world's *public* categories, nobody's private data.
:func:`cohort_summary` turns the agents' reports into the run's ``fedproxy`` result and
:func:`print_cohort_report` into the final table.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from rich.console import Console

from peerlm.app.agent_launch import agent_argv
from peerlm.app.report_rows import print_rows

__all__ = [
    "OWNER",
    "ROUND_DEADLINE_S",
    "cohort_names",
    "cohort_summary",
    "prepare_cohort",
    "print_cohort_report",
]

#: The owner's certificate name; members are ``member-1`` … ``member-N``.
OWNER = "owner"
#: How long the owner collects a round; round 1 also waits for the members to load.
ROUND_DEADLINE_S = 180.0
#: Per model size: members' optimiser steps per round, validation texts measured.
_PLAN = {"tiny": (8, 16), "micro": (4, 8)}


def cohort_names(agents: int) -> list[str]:
    """The owner and ``agents - 1`` members."""
    return [OWNER] + [f"member-{i}" for i in range(1, agents)]


def prepare_cohort(
    fed: Any,
    names: list[str],
    rounds: int,
    seed: int,
    *,
    size: str,
    family: str,
    ratio: float,
    round_deadline_s: float | None = None,
    console: Console | None,
    free_ports: Callable[[int], list[int]],
    stop_grace_s: float,
) -> Callable[[int, str, str], list[str]]:
    """Build (or reuse) the family's model and the default world's data (one client per
    member); write every agent's configuration with its ``fedproxy:`` section (the owner's
    cohort: the members' names and endpoints); the agents' command lines."""
    from peerlm.agent import build_federation_data, read_jsonl, write_jsonl
    from peerlm.app.cli_models import build_with_progress, models_cache_dir

    model_size: Literal["tiny", "micro"] = "micro" if size == "micro" else "tiny"
    models_dir = models_cache_dir(model_size)
    if console:
        console.print(f"building or reusing the {size} {family} model in {models_dir} ...")
    build_with_progress(models_dir, (family,), model_size, console or Console(quiet=True))
    members = names[1:]
    data = fed.root / "data"
    manifest = build_federation_data(data, len(members), seed=seed)
    public = set(manifest.world.public_categories)
    # The owner's own data: public problems only. Training file (unused: an owner trains
    # nothing itself) the public transfer pairs; validation, the public held-out tests.
    owner_dir = data / OWNER
    owner_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(
        owner_dir / "train.jsonl",
        [p for p in read_jsonl(data / "transfer.jsonl") if p.category in public],
    )
    write_jsonl(
        owner_dir / "val.jsonl",
        [p for p in read_jsonl(data / "test.jsonl") if p.category in public],
    )
    steps, texts = _PLAN[model_size]
    # Each agent's gRPC port, then its Prometheus endpoint (the peerlm_agent_fedproxy_* series).
    ports = free_ports(2 * len(names))
    grpc_ports, metric_ports = ports[: len(names)], ports[len(names) :]
    at = {name: f"127.0.0.1:{port}" for name, port in zip(names, grpc_ports, strict=True)}
    metrics = dict(zip(names, metric_ports, strict=True))
    configs = fed.root / "agents"
    configs.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        t = fed.tls(name)
        state = fed.root / "agents" / name
        own = owner_dir if name == OWNER else data / "clients" / str(i - 1)
        cohort: dict[str, Any] = {
            "enabled": True,
            "cohort_only": True,
            "rounds": rounds,
            "round_deadline_s": round_deadline_s or ROUND_DEADLINE_S,
            "gate_examples": texts,
            "proxy_path": str(state / "proxy"),
        }
        if name == OWNER:
            cohort |= {
                "owner": True,
                "cohort": {m: at[m] for m in members},
                "compress_ratio": ratio,
                "fused_path": str(state / "fused"),
            }
        else:
            cohort |= {"owner_name": OWNER, "owner_address": at[OWNER], "local_steps": steps}
        config: dict[str, Any] = {
            "federation": "dev",
            "listen": at[name],
            "state_dir": str(state),
            "model": str(models_dir / family),
            "device": "cpu",
            "train_file": str(own / "train.jsonl"),
            "val_file": str(own / "val.jsonl"),
            "transfer_file": str(data / "transfer.jsonl"),
            "transfer_sha256": manifest.transfer_sha256,
            "rounds": rounds,
            "batch_size": 8,
            "max_length": 128,
            "stop_grace_s": stop_grace_s,
            "seed": seed + i,
            "log_format": "json",
            "metrics_port": metrics[name],
            "tls": {"ca_cert": str(t.ca_cert), "cert": str(t.cert), "key": str(t.key)},
            "fedproxy": cohort,
        }
        (configs / f"{name}.yaml").write_text(json.dumps(config, indent=2))
    if console:
        console.print(
            "metrics (peerlm_agent_fedproxy_*): "
            + ", ".join(f"{n} http://127.0.0.1:{port}/metrics" for n, port in metrics.items()),
            highlight=False,
        )

    return agent_argv(configs)


def _absences(merges: list[Mapping[str, Any]], member: str) -> list[str]:
    """``round: reason`` for every round the owner merged without ``member``."""
    out = []
    for m in merges:
        if member in m.get("missing", []):
            out.append(f"{m.get('round')}: deadline")
        elif member in m.get("refused", {}):
            out.append(f"{m.get('round')}: {m['refused'][member]}")
    return out


def cohort_summary(reports: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The run's cohort result from the agents' reports: the owner's merges and losses, and
    per member its rounds, bytes, losses, the rounds merged without it, and how many of the
    proxies it pulled are bit for bit what the owner published for that round."""
    by_name = {str(r.get("name")): r for r in reports}
    owner = dict(by_name.get(OWNER, {}).get("fedproxy", {}))
    published = owner.get("proxy_sha256", {})
    merges = list(owner.get("merges", []))
    members = []
    for name, r in by_name.items():
        if name == OWNER:
            continue
        fp = r.get("fedproxy", {})
        pulled = fp.get("proxy_sha256", {})
        members.append(
            {
                "name": name,
                "rounds": fp.get("rounds", 0),
                "merged_rounds": [m["round"] for m in merges if name in m.get("merged", [])],
                "absent": _absences(merges, name),
                "bytes_down": fp.get("bytes_received", 0),
                "bytes_up": fp.get("bytes_sent", 0),
                "heldout_before": fp.get("heldout_before"),
                "heldout_after": fp.get("heldout_after"),
                "proxies_pulled": len(pulled),
                "proxies_as_published": sum(
                    1 for t, digest in pulled.items() if published.get(t) == digest
                ),
                "errors": list(r.get("errors", [])),
            }
        )
    return {
        "owner": OWNER,
        "kept_blocks": owner.get("kept_blocks", []),
        "source_layers": owner.get("source_layers", 0),
        "rounds": owner.get("rounds", 0),
        "merges": merges,
        "owner_heldout_texts": owner.get("heldout_texts", 0),
        "owner_heldout_before": owner.get("heldout_before"),
        "owner_heldout_after": owner.get("heldout_after"),
        "proxy_heldout_before": owner.get("proxy_before"),
        "proxy_heldout_after": owner.get("proxy_after"),
        "owner_bytes_sent": owner.get("bytes_sent", 0),
        "owner_bytes_received": owner.get("bytes_received", 0),
        "members": members,
    }


def _loss(before: Any, after: Any) -> str:
    def one(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, int | float) else "-"

    return f"{one(before)}→{one(after)}"


def _member_rows(cohort: Mapping[str, Any]) -> list[dict[str, str]]:
    rows = []
    for m in cohort["members"]:
        rows.append(
            {
                "member": m["name"],
                "rounds": str(m["rounds"]),
                "merged": f"{len(m['merged_rounds'])}/{cohort['rounds']}",
                "missing": "; ".join(m["absent"]) or "-",
                "KiB down/up": f"{m['bytes_down'] / 1024:.0f}/{m['bytes_up'] / 1024:.0f}",
                "own val loss": _loss(m["heldout_before"], m["heldout_after"]),
                "proxy = owner's": f"{m['proxies_as_published']}/{m['proxies_pulled']}",
                "errors": "; ".join(m["errors"]) or "-",
            }
        )
    return rows


def _merge_line(m: Mapping[str, Any]) -> str:
    merged = ", ".join(m.get("merged", [])) or "-"
    line = f"round {m.get('round')}: {m.get('outcome')}, merged {merged}"
    absent = [f"{n} (deadline)" for n in m.get("missing", [])]
    absent += [f"{n} ({reason})" for n, reason in m.get("refused", {}).items()]
    if absent:
        line += "; without " + ", ".join(absent)
    return line


def print_cohort_report(console: Console, result: Mapping[str, Any], logs: Path) -> None:
    """The final report: one row per member (a block per member on narrow consoles), then
    the owner's losses and merges."""
    cohort = result["fedproxy"]
    rows = _member_rows(cohort)
    title = (
        f"peerlm FedProxy cohort: {cohort['rounds']} of {result.get('rounds')} rounds in "
        f"{result.get('seconds')} s; proxy = blocks {cohort['kept_blocks']} of "
        f"{cohort['source_layers']}"
    )
    print_rows(console, title, rows, "member", left=("errors",), label_width=16)
    n = cohort["owner_heldout_texts"]
    console.print(
        f"owner: on {n} public held-out texts, full model "
        f"{_loss(cohort['owner_heldout_before'], cohort['owner_heldout_after'])} (fused), "
        f"proxy {_loss(cohort['proxy_heldout_before'], cohort['proxy_heldout_after'])}; "
        f"KiB sent/received {cohort['owner_bytes_sent'] / 1024:.0f}/"
        f"{cohort['owner_bytes_received'] / 1024:.0f}",
        highlight=False,
        soft_wrap=True,
    )
    for m in cohort["merges"]:
        console.print("  " + _merge_line(m), highlight=False, soft_wrap=True)
    console.print(f"logs in {logs}", highlight=False)
