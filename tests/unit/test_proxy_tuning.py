"""ProxyTuning's logit arithmetic (FedProxy Table 9): M + (expert − anti-expert), in scoring
and in generation, against hand computations on a micro model and its proxy."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from peerlm.agent.fedproxy.proxy import build_proxy
from peerlm.agent.fedproxy.tuning import ProxyTunedHost
from peerlm.agent.modelhost import ModelHost
from peerlm.agent.models.lora import LoraSettings
from peerlm.agent.training import TrainSettings, encode_example
from transformers import AutoModelForCausalLM

PROMPT = "def add(a, b):\n    "
PAIRS = [(PROMPT, "return a + b\n"), ("def neg(x):\n    ", "return -x\n")]


@pytest.fixture(autouse=True, scope="module")
def _offline(offline_hub: None) -> None:
    """Every load here is from a local directory (tests/conftest.py)."""


@pytest.fixture(scope="module")
def path(micro_gpt2: Path) -> Path:
    return micro_gpt2


def _host(path: Path) -> ModelHost:
    return ModelHost.load(str(path), LoraSettings(r=4, alpha=8.0), device="cpu", seed=0)


def _proxies(path: Path) -> tuple[Any, Any]:
    """The anti-expert (the proxy as compressed) and an expert whose weights moved."""
    full = AutoModelForCausalLM.from_pretrained(path)
    blocks = full.config.n_layer
    anti = build_proxy(full, list(range(blocks)), ratio=0.0).eval()
    expert = copy.deepcopy(anti)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in expert.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return expert, anti


def _hand_logprob(
    host: ModelHost, expert: Any, anti: Any, prompt: str, completion: str, beta: float = 1.0
) -> float:
    """log p(completion + EOS | prompt) from softmax(s_M + β (s_E − s_A)) on the host's own
    encoding of the pair (one sequence, no padding), from the three models' logits."""
    encoded = encode_example(host.tokenizer, (prompt, completion), 256)
    assert encoded is not None
    ids = torch.tensor([encoded.input_ids])
    labels = torch.tensor(encoded.labels[1:])
    with torch.no_grad():
        logits = host.model(input_ids=ids).logits.float() + beta * (
            expert(input_ids=ids).logits.float() - anti(input_ids=ids).logits.float()
        )
    logp = torch.log_softmax(logits[0, :-1], -1)
    scored = labels >= 0
    return float(logp[torch.arange(len(labels)), labels.clamp(min=0)][scored].sum())


def test_scoring_is_the_softmax_of_the_summed_logits(path: Path) -> None:
    base = _host(path)
    expert, anti = _proxies(path)
    tuned = ProxyTunedHost(base, expert, anti)
    # A single pair: no padding, so the hand computation needs no mask.
    prompt, completion = PAIRS[0]
    [got] = tuned.sequence_logprobs([(prompt, completion)])
    want = _hand_logprob(base, expert, anti, prompt, completion)
    assert got == pytest.approx(want, rel=1e-4, abs=1e-3)
    # The offset moved it: M alone scores differently.
    [plain] = _host(path).sequence_logprobs([(prompt, completion)])
    assert abs(plain - got) > 1e-3


def test_beta_scales_the_offset_and_zero_leaves_m_as_it_is(path: Path) -> None:
    expert, anti = _proxies(path)
    prompt, completion = PAIRS[0]
    base = _host(path)
    half = ProxyTunedHost(base, expert, anti, beta=0.5)
    [got] = half.sequence_logprobs([(prompt, completion)])
    assert got == pytest.approx(
        _hand_logprob(base, expert, anti, prompt, completion, beta=0.5), rel=1e-4, abs=1e-3
    )
    [full] = ProxyTunedHost(base, expert, anti).sequence_logprobs([(prompt, completion)])
    assert abs(full - got) > 1e-3
    off = ProxyTunedHost(_host(path), expert, anti, beta=0.0)
    # β = 0 is M alone, without running the proxies at all.
    calls: list[str] = []
    for name, proxy in (("expert", expert), ("anti-expert", anti)):
        proxy.register_forward_hook(lambda *_a, _n=name: calls.append(_n))
    assert off.sequence_logprobs(PAIRS) == pytest.approx(
        _host(path).sequence_logprobs(PAIRS), abs=1e-4
    )
    prompts = [p for p, _ in PAIRS]
    assert off.generate(prompts, max_new_tokens=12) == _host(path).generate(
        prompts, max_new_tokens=12
    )
    assert calls == []
    half.sequence_logprobs(PAIRS[:1])
    assert sorted(set(calls)) == ["anti-expert", "expert"]  # the hooks do see a forward


@pytest.mark.parametrize("beta", [-0.5, float("nan"), float("inf")])
def test_a_beta_that_is_not_a_finite_non_negative_number_is_refused(
    path: Path, beta: float
) -> None:
    with pytest.raises(ValueError, match="beta"):
        ProxyTunedHost(_host(path), *_proxies(path), beta=beta)


def test_an_expert_equal_to_the_anti_expert_changes_nothing(path: Path) -> None:
    base = _host(path)
    _expert, anti = _proxies(path)
    tuned = ProxyTunedHost(base, copy.deepcopy(anti), anti)
    assert tuned.sequence_logprobs(PAIRS) == pytest.approx(
        _host(path).sequence_logprobs(PAIRS), abs=1e-4
    )
    prompts = [p for p, _ in PAIRS]
    assert tuned.generate(prompts, max_new_tokens=12) == _host(path).generate(
        prompts, max_new_tokens=12
    )


def test_greedy_generation_takes_the_argmax_of_the_summed_logits(path: Path) -> None:
    base = _host(path)
    expert, anti = _proxies(path)
    tuned = ProxyTunedHost(base, expert, anti)
    prompt = "def add(a, b):\n"
    ids = torch.tensor([base.tokenizer(prompt)["input_ids"]])
    with torch.no_grad():
        summed = (
            base.model(input_ids=ids).logits[0, -1]
            + expert(input_ids=ids).logits[0, -1]
            - anti(input_ids=ids).logits[0, -1]
        )
    first = base.tokenizer.decode([int(summed.argmax())])
    [[completion]] = tuned.generate([prompt], max_new_tokens=1, dedent=False, stop=())
    assert completion == first


def test_left_padded_batches_generate_what_each_prompt_generates_alone(path: Path) -> None:
    """The offset follows the attention mask and positions of a left-padded batch."""
    tuned = ProxyTunedHost(_host(path), *_proxies(path))
    prompts = ["def f(x):\n    ", "def a_much_longer_name(values, index, other):\n    "]
    batch = tuned.generate(prompts, max_new_tokens=10)
    alone = [tuned.generate([p], max_new_tokens=10)[0] for p in prompts]
    assert batch == alone


def test_sampling_is_seeded_and_returns_n_per_prompt(path: Path) -> None:
    tuned = ProxyTunedHost(_host(path), *_proxies(path))
    prompts = [p for p, _ in PAIRS]
    one = tuned.generate(prompts, max_new_tokens=8, temperature=0.8, n=3, seed=5)
    again = tuned.generate(prompts, max_new_tokens=8, temperature=0.8, n=3, seed=5)
    assert one == again and [len(g) for g in one] == [3, 3]


def test_a_proxy_of_another_vocabulary_is_refused(path: Path) -> None:
    expert, anti = _proxies(path)
    expert.resize_token_embeddings(expert.get_output_embeddings().weight.shape[0] + 8)
    with pytest.raises(ValueError, match="one vocabulary"):
        ProxyTunedHost(_host(path), expert, anti)


def test_a_proxy_tuned_host_cannot_be_trained(path: Path) -> None:
    base = _host(path)
    before = {k: v.clone() for k, v in base.adapter_state().items()}
    tuned = ProxyTunedHost(base, *_proxies(path))
    with pytest.raises(TypeError, match="decodes"):
        tuned.train_local(["def f():\n    return 1\n"], TrainSettings(), steps=1)
    with pytest.raises(TypeError, match="decodes"):
        tuned.train_hka([PAIRS[0]], [], TrainSettings(), steps=1)
    assert all(torch.equal(before[k], v) for k, v in base.adapter_state().items())
