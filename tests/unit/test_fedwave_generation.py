"""Greedy decoding through the VCLayer wrapper (peerlm.agent.fedwave.generation)."""

from __future__ import annotations

import pytest
import torch
from peerlm.agent.fedwave.generation import greedy_generate
from peerlm.agent.fedwave.vclayer import VCCausalLM, VCLayer, VCLayerSettings
from peerlm.agent.models.tiny import SHIPPED_DIR
from peerlm.agent.training import split_prompt, token_ids
from transformers import AutoModelForCausalLM, AutoTokenizer


@pytest.fixture(autouse=True)
def _offline(offline_hub: None) -> None:
    """Every load here is from the shipped tiny models (tests/conftest.py)."""


def test_with_a_zero_branch_it_is_the_lms_own_greedy_decoding() -> None:
    path = SHIPPED_DIR / "tiny" / "qwen2"
    tokenizer = AutoTokenizer.from_pretrained(path)
    lm = AutoModelForCausalLM.from_pretrained(path).eval()
    layer = VCLayer(int(lm.config.hidden_size), VCLayerSettings(d_vc=16, heads=2))
    with torch.no_grad():
        layer.w_o.zero_()
    model = VCCausalLM(lm, layer)
    source = "def add(a: int, b: int) -> int:\n"
    [ours] = greedy_generate(model, tokenizer, [source], max_new_tokens=12)
    head, tail = split_prompt(tokenizer, source)
    ids = torch.tensor([token_ids(tokenizer, head, special=True)])
    theirs = lm.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=12,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )[0, ids.shape[1] :]
    text = tokenizer.decode(
        [t for t in theirs.tolist() if t != tokenizer.eos_token_id], skip_special_tokens=True
    )
    assert ours == text.removeprefix(tail)
    assert model.training  # the mode it had before is restored
    # A non-zero branch changes what is generated (the VCLayer is in the path).
    with torch.no_grad():
        layer.w_v.normal_(0, 1.0)
        layer.w_o.normal_(0, 1.0)
    assert greedy_generate(model, tokenizer, [source], max_new_tokens=12) != [ours]


def test_generation_refuses_bad_budgets() -> None:
    path = SHIPPED_DIR / "tiny" / "gpt2"
    lm = AutoModelForCausalLM.from_pretrained(path)
    model = VCCausalLM(lm, VCLayer(int(lm.config.hidden_size)))
    tokenizer = AutoTokenizer.from_pretrained(path)
    with pytest.raises(ValueError, match="max_new_tokens"):
        greedy_generate(model, tokenizer, ["x"], max_new_tokens=0)
    with pytest.raises(ValueError, match="max_length"):
        greedy_generate(model, tokenizer, ["x"], max_new_tokens=8, max_length=8)
