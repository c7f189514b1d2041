"""A member accepts only the proxy configuration its own base implies (a hostile owner's
sizes are refused before anything is built), and the harm report an update carries."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from peerlm.agent.fedproxy import config as fedproxy_config
from peerlm.agent.fedproxy.codec import HarmReport, decode_update, encode_update
from peerlm.agent.fedproxy.config import member_proxy_config
from peerlm.agent.fedproxy.proxy import PROXY_CONFIG_KEY, ProxyError, ProxyInfo, build_proxy
from peerlm.agent.models.tiny import SHIPPED_DIR
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig


def _offered(family: str, kept: tuple[int, ...]) -> tuple[PretrainedConfig, dict[str, Any], Any]:
    """(member's base config, the owner's proxy config as it travels, the owner's proxy)."""
    folder = SHIPPED_DIR / "tiny" / family
    proxy = build_proxy(AutoModelForCausalLM.from_pretrained(folder), kept, ratio=0.5)
    offered = json.loads(json.dumps(proxy.config.to_dict(), sort_keys=True))
    return AutoConfig.from_pretrained(folder), offered, proxy


@pytest.mark.parametrize("family", ["gpt2", "bloom", "gpt_neox", "qwen2"])
def test_the_owners_proxy_of_the_same_base_is_accepted_with_its_shapes(family: str) -> None:
    base, offered, proxy = _offered(family, (0,))
    derived = member_proxy_config(base, offered)
    assert derived.shapes == {k: tuple(v.shape) for k, v in proxy.state_dict().items()}
    assert derived.info.kept_blocks == (0,)
    assert derived.config.num_hidden_layers == 1


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"vocab_size": 10**9}, "config"),
        ({"n_embd": 1 << 20, "n_inner": 1 << 22}, "config"),
        ({"n_positions": 1 << 20}, "config"),  # the quadratic one: a causal mask of n^2
        ({"n_head": 64}, "config"),
        ({"tie_word_embeddings": False}, "config"),  # untied rows would name the tokens
        ({"add_cross_attention": True}, "config"),  # an extra trainable part
        ({"peerlm_extra_head": 4096}, "config"),  # a field the base does not have
        ({"model_type": "bloom"}, "config"),
        ({"n_layer": 40}, "config"),
    ],
)
def test_a_hostile_owners_configuration_is_refused_before_anything_is_built(
    change: dict[str, Any], reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    base, offered, _ = _offered("gpt2", (0, 3))
    built: list[Any] = []
    monkeypatch.setattr(
        fedproxy_config.AutoModelForCausalLM,
        "from_config",
        lambda config, **_: built.append(config),
    )
    with pytest.raises(ProxyError) as err:
        member_proxy_config(base, {**offered, **change})
    assert err.value.reason == reason
    assert next(iter(change)) in str(err.value)
    assert built == []  # refused before any model (meta or not) was constructed


def test_blocks_the_base_does_not_have_are_refused() -> None:
    base, offered, _ = _offered("gpt2", (0, 3))
    info = dict(offered[PROXY_CONFIG_KEY])
    for bad, reason in (
        ({**info, "kept_blocks": [0, 7]}, "blocks"),
        ({**info, "kept_blocks": [3, 0]}, "blocks"),
        ({**info, "source_layers": 40, "kept_blocks": [0, 39]}, "mismatch"),
        ({**info, "source_model_type": "qwen2"}, "mismatch"),
        ({**info, "blocks_path": "model.layers"}, "mismatch"),
    ):
        with pytest.raises(ProxyError) as err:
            member_proxy_config(base, {**offered, PROXY_CONFIG_KEY: bad})
        assert err.value.reason == reason, bad
    proxy_base = AutoConfig.from_pretrained(SHIPPED_DIR / "tiny" / "gpt2")
    setattr(proxy_base, PROXY_CONFIG_KEY, info)
    with pytest.raises(ProxyError) as err:
        member_proxy_config(proxy_base, offered)
    assert err.value.reason == "mismatch"


INFO = ProxyInfo("gpt2", 4, (0, 3), "transformer.h", 0.5)
STATE = {"w": torch.ones(2, 2)}


def test_a_harm_report_round_trips_in_the_update() -> None:
    report = HarmReport(3, 4.5, 2, 3.25)
    data = encode_update(STATE, INFO, 3, report)
    assert decode_update(data, STATE, INFO, max_bytes=1 << 20, round_=3).report == report
    plain = encode_update(STATE, INFO, 3)
    assert decode_update(plain, STATE, INFO, max_bytes=1 << 20, round_=3).report is None


@pytest.mark.parametrize(
    "raw",
    [
        {"round": 2, "loss": 1.0, "previous_round": 1, "previous_loss": 1.0},  # another round
        {"round": 3, "loss": 1.0, "previous_round": 3, "previous_loss": 1.0},  # not earlier
        {"round": 3, "loss": float("nan"), "previous_round": 1, "previous_loss": 1.0},
        {"round": 3, "loss": -1.0, "previous_round": 1, "previous_loss": 1.0},
        {"round": 3, "loss": "1", "previous_round": 1, "previous_loss": 1.0},
        {"round": 3, "loss": 1.0, "previous_round": 1},
        [1, 2, 3],
    ],
)
def test_a_malformed_harm_report_refuses_the_update(raw: Any) -> None:
    data = encode_update(STATE, INFO, 3)
    # Rewrite the header's metadata with the bad report (same tensors).
    from safetensors.torch import load, save

    good = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]
    bad = save(load(data), metadata={**good, "peerlm.report": json.dumps(raw)})
    with pytest.raises(ProxyError) as err:
        decode_update(bad, STATE, INFO, max_bytes=1 << 20, round_=3)
    assert err.value.reason == "report"
