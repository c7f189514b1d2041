"""The agent's FedProxy helpers: the owner's proxy made at start, the cohort byte counts."""

from __future__ import annotations

from pathlib import Path

from peerlm.agent.fedproxy.agent import fedproxy_bytes, make_owner_proxy
from peerlm.agent.fedproxy.compress import block_influence, blocks_to_keep, token_batches
from peerlm.agent.fedproxy.proxy import proxy_info
from peerlm.agent.models.tiny import SHIPPED_DIR
from prometheus_client import CollectorRegistry, Counter
from transformers import AutoModelForCausalLM, AutoTokenizer

TEXTS = [f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(12)]


def test_the_owner_proxy_keeps_the_blocks_block_influence_picks(tmp_path: Path) -> None:
    """What `fedproxy.compress_ratio` makes is `peerlm models compress`'s proxy: the blocks
    of highest BI on the texts, saved with the tokenizer, loadable as a proxy."""
    model = SHIPPED_DIR / "tiny" / "gpt2"
    kept, influence = make_owner_proxy(model, TEXTS, tmp_path / "proxy", 0.5, max_length=64)
    full = AutoModelForCausalLM.from_pretrained(model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = [tokenizer(t, truncation=True, max_length=64)["input_ids"] for t in TEXTS]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    expected = block_influence(full, token_batches(rows, batch_size=8, pad_id=int(pad)))
    assert influence == expected
    assert kept == list(blocks_to_keep(expected, 0.5)) and len(kept) == 2
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "proxy")
    info = proxy_info(saved)
    assert info is not None and list(info.kept_blocks) == kept and info.source_layers == 4
    assert (tmp_path / "proxy" / "tokenizer_config.json").is_file()


def test_fedproxy_bytes_adds_both_rpcs_and_reads_zero_when_nothing_moved() -> None:
    registry = CollectorRegistry()
    assert fedproxy_bytes(registry) == (0, 0)
    sent = Counter("peerlm_agent_fedproxy_bytes_sent", "", ("rpc",), registry=registry)
    received = Counter("peerlm_agent_fedproxy_bytes_received", "", ("rpc",), registry=registry)
    sent.labels("PullUpdate").inc(30)
    received.labels("PullProxy").inc(40)
    received.labels("PullUpdate").inc(2)
    assert fedproxy_bytes(registry) == (30, 42)
