"""The agent profile layout the CPM relies on, and the AKD schedules."""

from __future__ import annotations

import numpy as np
import pytest
from peerlm.agent.cpm.profile import FAMILIES, AgentMetrics, build_profile, family_index
from peerlm.agent.daemon import linear_schedule
from peerlm.services.cpm.profile import PERFORMANCE_INDEX, validate_profile


def _metrics(**kw: float) -> AgentMetrics:
    base = dict(
        pass_at_1=0.25, pass_at_5=0.5, val_loss=2.0, prev_pass_at_1=0.1, prev_val_loss=2.5,
        trainable_share=0.02, trainable_parameters=40_000, last_reward=0.3, exchanges=3,
        round=2, total_rounds=10,
    )  # fmt: skip
    base.update(kw)
    return AgentMetrics(**base)  # type: ignore[arg-type]


def test_layout_and_validity() -> None:
    counts = np.arange(12, dtype=np.float64)
    p = build_profile("bloom", _metrics(), counts)
    validate_profile(p, 32)
    assert p[:8].sum() == 1.0 and p[FAMILIES.index("bloom")] == 1.0
    assert p[PERFORMANCE_INDEX] == 0.25  # the Hetero-Greedy baseline reads pass@1 here
    np.testing.assert_allclose(p[20:32], counts / counts.sum())
    assert p[12] == pytest.approx(0.15) and p[13] == pytest.approx(-0.05)


def test_families() -> None:
    assert family_index("qwen3") == family_index("qwen2")
    assert family_index("some_new_arch") == FAMILIES.index("other")


def test_laplace_noise_keeps_a_distribution() -> None:
    counts = np.array([10.0] + [0.0] * 11)
    noisy = build_profile("gpt2", _metrics(), counts, dp_epsilon=0.5, rng=np.random.default_rng(0))[
        20:32
    ]
    assert noisy.min() >= 0 and noisy.sum() == pytest.approx(1.0)
    assert not np.allclose(noisy, counts / counts.sum())
    with pytest.raises(ValueError):
        build_profile("gpt2", _metrics(), counts, dp_epsilon=0.0)


def test_diverged_loss_stays_finite() -> None:
    p = build_profile("gpt2", _metrics(val_loss=1e9, prev_val_loss=float("inf")), np.ones(12))
    assert np.isfinite(p).all()


def test_linear_schedules_match_table_6() -> None:
    assert linear_schedule(0.2, 0.5, 1, 20) == pytest.approx(0.2)
    assert linear_schedule(0.2, 0.5, 20, 20) == pytest.approx(0.5)
    assert linear_schedule(2.5, 1.5, 11, 21) == pytest.approx(2.0)
    assert linear_schedule(0.2, 0.5, 1, 1) == 0.5


# -- the parameter-space fingerprint (the CPM's protocol menu) ---------------------------


def _fp(**change: object) -> str:
    from peerlm.agent.cpm.profile import parameter_space_fingerprint

    args: dict[str, object] = {
        "model_config": {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "vocab_size": 300},
        "tokenizer_hash": "a" * 64,
        "lora_r": 8,
        "lora_alpha": 16.0,
        "adapter_shapes": {"h.0.attn.c_attn.lora_A.weight": (8, 32)},
    }
    args.update(change)
    return parameter_space_fingerprint(**args)  # type: ignore[arg-type]


def test_fingerprint_is_bounded_and_deterministic() -> None:
    from peerlm.services.cpm.menu import check_param_space

    fp = _fp()
    assert fp == _fp() and fp.startswith("ps1:") and len(fp) == 4 + 64
    assert check_param_space(fp) == fp  # the CPM accepts what agents send


def test_fingerprint_ignores_names_paths_versions_and_dtype() -> None:
    base = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "vocab_size": 300}
    noisy = {
        **base,
        "_name_or_path": "/somewhere/else",
        "name_or_path": "x",
        "transformers_version": "9.9",
        "torch_dtype": "bfloat16",
        "use_cache": False,
    }
    assert _fp(model_config=noisy) == _fp(model_config=base)


@pytest.mark.parametrize(
    "change",
    [
        {"model_config": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "vocab_size": 300}},
        {"model_config": {"model_type": "qwen2", "n_embd": 32, "n_layer": 2, "vocab_size": 300}},
        {"tokenizer_hash": "b" * 64},
        {"lora_r": 4},
        {"lora_alpha": 32.0},
        {"adapter_shapes": {"h.0.attn.c_attn.lora_A.weight": (4, 32)}},
        {"adapter_shapes": {"h.0.mlp.c_fc.lora_A.weight": (8, 32)}},
    ],
)
def test_fingerprint_changes_with_what_makes_adapters_unmergeable(
    change: dict[str, object],
) -> None:
    assert _fp(**change) != _fp()


def test_agents_advertise_what_they_execute() -> None:
    from pathlib import Path

    from peerlm.agent.settings import AgentSettings
    from pydantic import ValidationError

    assert AgentSettings().executed_protocols() == ("akd", "akd_logits", "pmix")
    public = Path("public.jsonl")
    with_public = AgentSettings(public_file=public)
    assert with_public.executed_protocols() == ("akd", "akd_logits", "pmix", "svd_hka")
    assert AgentSettings(protocols=("akd",)).executed_protocols() == ("akd",)
    with pytest.raises(ValidationError, match="public_file"):
        AgentSettings(protocols=("akd", "svd_hka"))
    with pytest.raises(ValidationError):
        AgentSettings(protocols=("akd", "akd"))
    with pytest.raises(ValidationError):
        AgentSettings(protocols=("h_ties",))  # type: ignore[arg-type]
