"""The cohort pieces the bench and the experiment share: the owner's merge by method and the
compression by Block Influence."""

from __future__ import annotations

import pytest
import torch
from peerlm.agent.fedproxy.cohort import (
    PROXY_MERGES,
    compress_by_influence,
    merge_proxies,
    uses_pcr,
)
from peerlm.agent.fedproxy.compress import block_influence, blocks_to_keep, token_batches
from peerlm.agent.fedproxy.hties import fedavg_proxies, h_ties, ties_merge
from peerlm.agent.fedproxy.proxy import proxy_info


@pytest.fixture(autouse=True)
def _offline(offline_hub: None) -> None:
    """Every load here is from a local directory (tests/conftest.py)."""


def _cohort() -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(6, 5, generator=gen), "b": torch.randn(5, generator=gen)}
    clients = [
        {k: v + torch.randn(v.shape, generator=gen) for k, v in base.items()} for _ in range(3)
    ]
    return base, clients


def test_each_method_is_its_merge_and_only_h_ties_publishes_scores() -> None:
    base, clients = _cohort()
    expected = {
        "fedavg": fedavg_proxies(base, clients),
        "ties": ties_merge(base, clients),
        "h_ties": h_ties(base, clients).state,
        "h_ties_pcr": h_ties(base, clients).state,
    }
    for method in PROXY_MERGES:
        merged = merge_proxies(method, base, clients)
        assert all(torch.equal(merged.state[k], expected[method][k]) for k in base), method
        assert (merged.conflict is not None) == method.startswith("h_ties"), method
    scores = merge_proxies("h_ties", base, clients).conflict
    assert scores is not None
    assert all(torch.equal(scores[k], h_ties(base, clients).analysis.conflict[k]) for k in base)
    assert [m for m in PROXY_MERGES if uses_pcr(m)] == ["h_ties_pcr"]
    with pytest.raises(ValueError, match="unknown proxy merge"):
        merge_proxies("median", base, clients)


def test_compression_keeps_the_blocks_of_highest_influence_on_the_texts() -> None:
    from peerlm.agent import SHIPPED_DIR
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = SHIPPED_DIR / "tiny" / "gpt2"
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    texts = ["def add(a, b):\n    return a + b\n", "x = [i * i for i in range(10)]\n"] * 3
    got = compress_by_influence(model, tokenizer, texts, 0.5)
    rows = [tokenizer(t)["input_ids"] for t in texts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    influence = block_influence(model, token_batches(rows, batch_size=8, pad_id=pad))
    assert got.influence == pytest.approx(influence)
    assert got.kept == tuple(blocks_to_keep(influence, 0.5))
    info = proxy_info(got.proxy)
    assert info is not None and info.kept_blocks == got.kept
    assert got.proxy.config.num_hidden_layers == len(got.kept) == 2
