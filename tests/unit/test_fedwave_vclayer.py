"""The VCLayer (FedWave Eq. 1) on every bundled architecture, and its file/wire format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peerlm.agent.fedwave.errors import FedWaveError
from peerlm.agent.fedwave.vclayer import (
    VCLAYER_FILE,
    VCCausalLM,
    VCLayer,
    VCLayerSettings,
    decode_vclayer,
    encode_vclayer,
    load_expert,
    masked_mean,
    save_expert,
)
from peerlm.agent.models.lora import LoraSettings, apply_lora
from peerlm.agent.models.tiny import ARCHITECTURES, SHIPPED_DIR
from pydantic import ValidationError
from safetensors.torch import save as st_save
from transformers import AutoModelForCausalLM, PreTrainedModel

SMALL = VCLayerSettings(d_vc=16, heads=2)


@pytest.fixture(autouse=True)
def _offline(offline_hub: None) -> None:
    """Every load here is from the shipped tiny models (tests/conftest.py)."""


def tiny(arch: str) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(SHIPPED_DIR / "tiny" / arch)
    model.eval()
    return model  # type: ignore[no-any-return]


def layer_for(model: torch.nn.Module, seed: int = 0) -> VCLayer:
    width = int(model.config.hidden_size)  # type: ignore[union-attr]
    return VCLayer(width, SMALL, generator=torch.Generator().manual_seed(seed))


def ids(seed: int = 0, batch: int = 2, length: int = 7) -> torch.Tensor:
    return torch.randint(3, 200, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("with_lora", [False, True])
def test_a_zero_branch_leaves_the_model_unchanged(arch: str, with_lora: bool) -> None:
    """H is what the LM head reads: with W_o = 0 the wrapper gives the LM's own logits."""
    model = tiny(arch)
    lm = apply_lora(model, LoraSettings(r=4, dropout=0.0)) if with_lora else model
    wrapped = VCCausalLM(lm, layer_for(model))
    with torch.no_grad():
        wrapped.vclayer.w_o.zero_()
        x = ids()
        mask = torch.ones_like(x)
        expected = lm(input_ids=x, attention_mask=mask).logits
        out = wrapped(x, mask)
    torch.testing.assert_close(out.logits, expected)
    assert out.hidden.shape == (*x.shape, model.config.hidden_size)
    assert float(out.branch.abs().max()) == 0.0


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_branch_changes_logits_and_trains_with_lora_only(arch: str) -> None:
    model = tiny(arch)
    lm = apply_lora(model, LoraSettings(r=4, dropout=0.0))
    wrapped = VCCausalLM(lm, layer_for(model))
    x = ids(1)
    out = wrapped(x)
    with torch.no_grad():
        plain = lm(input_ids=x).logits
    assert not torch.allclose(out.logits, plain)
    out.logits.logsumexp(-1).sum().backward()
    for name in ("w_q", "w_k", "w_v", "w_o", "stage_embedding"):
        grad = getattr(wrapped.vclayer, name).grad
        assert grad is not None and float(grad.abs().sum()) > 0, name
    frozen = [n for n, p in lm.named_parameters() if p.grad is not None and "lora_" not in n]
    assert frozen == []


def test_the_attention_is_causal() -> None:
    layer = VCLayer(32, SMALL, generator=torch.Generator().manual_seed(3))
    hidden = torch.randn(1, 6, 32, generator=torch.Generator().manual_seed(4))
    changed = hidden.clone()
    changed[0, 4:] += 5.0
    with torch.no_grad():
        a, b = layer.branch(hidden), layer.branch(changed)
    torch.testing.assert_close(a[0, :4], b[0, :4])
    assert not torch.allclose(a[0, 4:], b[0, 4:])


def test_padding_is_ignored_and_never_gives_nan() -> None:
    layer = VCLayer(32, SMALL, generator=torch.Generator().manual_seed(5))
    real = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(6))
    junk = torch.full((1, 3, 32), 9.0)
    left = torch.cat([junk, real], dim=1)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1]])
    with torch.no_grad():
        padded = layer.branch(left, mask)
        alone = layer.branch(real)
    assert bool(torch.isfinite(padded).all())
    torch.testing.assert_close(padded[:, 3:], alone)
    torch.testing.assert_close(layer.pooled_branch(left, mask), alone.mean(dim=1))


def test_masked_mean_counts_only_real_tokens() -> None:
    values = torch.tensor([[[1.0], [3.0], [100.0]]])
    assert masked_mean(values, torch.tensor([[1, 1, 0]])).item() == 2.0
    assert masked_mean(values, None).item() == pytest.approx(104 / 3)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_an_expert_saves_and_loads_with_its_adapter(arch: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    lm = apply_lora(tiny(arch), LoraSettings(r=4, dropout=0.0))
    with torch.no_grad():  # B starts at zero: make the adapter matter
        for name, param in lm.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    expert = VCCausalLM(lm, layer_for(lm, seed=9))
    expert.eval()
    save_expert(expert, tmp_path, stage="implement")
    assert (tmp_path / VCLAYER_FILE).is_file() and (tmp_path / "adapter_config.json").is_file()
    loaded, stage = load_expert(tiny(arch), tmp_path, settings=SMALL)
    loaded.eval()
    assert stage == "implement"
    x = ids(2)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, expert(x).logits)


def test_a_wrong_width_or_bad_settings_are_refused() -> None:
    model = tiny("gpt2")
    with pytest.raises(FedWaveError, match="width 7 for a model of width") as info:
        VCCausalLM(model, VCLayer(7, SMALL))
    assert info.value.reason == "shape"
    with pytest.raises(FedWaveError, match="no backbone"):
        VCCausalLM(torch.nn.Linear(2, 2), VCLayer(2, SMALL))
    with pytest.raises(ValidationError, match="multiple of heads"):
        VCLayerSettings(d_vc=10, heads=4)


def _blob(layer: VCLayer, **tensors: torch.Tensor) -> bytes:
    good = decode_vclayer(encode_vclayer(layer))[0]
    state = {n: getattr(good, n).detach() for n in ("w_q", "w_k", "w_v", "w_o")}
    state["stage_embedding"] = good.stage_embedding.detach()
    state.update(tensors)
    meta = {"format": "pt", "peerlm.format": "peerlm-vclayer/1", "peerlm.stage": "s",
            "peerlm.vclayer": json.dumps({"hidden_size": 32, **SMALL.model_dump()})}  # fmt: skip
    return st_save(state, metadata=meta)


def _with_header(blob: bytes, **entries: object) -> bytes:
    """``blob`` with its JSON header entries replaced (the data section kept)."""
    size = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + size]) | entries
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + blob[8 + size :]


def test_decoding_refuses_what_does_not_fit() -> None:
    layer = VCLayer(32, SMALL, generator=torch.Generator().manual_seed(1))
    blob = encode_vclayer(layer, stage="test")
    back, stage = decode_vclayer(blob, hidden_size=32, settings=SMALL)
    assert stage == "test"
    torch.testing.assert_close(back.w_q, layer.w_q)
    cases: list[tuple[bytes, dict[str, object], str]] = [
        (blob, {"hidden_size": 48}, "shape"),
        (blob, {"settings": VCLayerSettings(d_vc=32, heads=2)}, "shape"),
        (blob, {"max_bytes": 100}, "too_large"),
        (b"\x00" * 4, {}, "decode"),
        (blob[:200], {}, "decode"),
        (st_save({"w": torch.zeros(2)}, metadata={"format": "pt"}), {}, "format"),
        (_blob(layer, w_q=torch.full((32, 16), float("nan"))), {}, "non_finite"),
        (_blob(layer, w_q=torch.zeros(32, 8)), {}, "shape"),
        (_blob(layer, extra=torch.zeros(1)), {}, "keys"),
        (_blob(layer, w_o=torch.zeros(16, 32, dtype=torch.float16)), {}, "dtype"),
        (_with_header(blob, __metadata__=["not", "a", "map"]), {}, "decode"),
        (
            _with_header(blob, w_k={"dtype": "F32", "shape": [32, 16], "data_offsets": [0, 2048]}),
            {},
            "decode",
        ),  # overlaps another tensor
        (blob + b"\0" * 4, {}, "decode"),  # bytes no tensor owns
    ]
    for data, kwargs, reason in cases:
        with pytest.raises(FedWaveError) as info:
            decode_vclayer(data, **kwargs)  # type: ignore[arg-type]
        assert info.value.reason == reason, (reason, str(info.value))
