"""FedProxy's Block Influence (Eq. 4), proxy compression and plug-in fusion (Section 4.3)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peerlm.agent.fedproxy.compress import (
    block_influence,
    blocks_to_keep,
    cosine_sums,
    kept_count,
    token_batches,
)
from peerlm.agent.fedproxy.proxy import (
    ProxyError,
    ProxyInfo,
    block_list,
    build_proxy,
    fuse_into,
    fuse_state,
    proxy_info,
    proxy_state,
)
from peerlm.agent.models.tiny import ARCHITECTURES, SHIPPED_DIR
from peerlm.agent.tasks.dataset import Problem, write_jsonl
from transformers import AutoModelForCausalLM, PreTrainedModel
from typer.testing import CliRunner

from peerlm.app.cli_models import app

PROPS = settings(max_examples=30, deadline=None)
#: The output projections of a block: zeroing them (weights and biases) makes the block the
#: identity, since every bundled architecture adds them to a residual stream.
OUT_PROJECTIONS = {
    "gpt2": ("attn.c_proj", "mlp.c_proj"),
    "gpt_neox": ("attention.dense", "mlp.dense_4h_to_h"),
    "bloom": ("self_attention.dense", "mlp.dense_4h_to_h"),
    "qwen2": ("self_attn.o_proj", "mlp.down_proj"),
}


@pytest.fixture(autouse=True)
def _offline(offline_hub: None) -> None:
    """Every load here is from a local directory (tests/conftest.py)."""


def tiny(arch: str) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(SHIPPED_DIR / "tiny" / arch)
    model.eval()
    return model


def batches(vocab: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in (12, 7, 3, 10)]
    return token_batches(rows, batch_size=3, pad_id=0)


def skipping(model: PreTrainedModel, removed: set[int]) -> Callable[[], None]:
    """Make the blocks ``removed`` pass their input through; returns the undo."""

    def hook(_m: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
        x = args[0] if args else kwargs["hidden_states"]
        return x if isinstance(out, torch.Tensor) else (x, *out[1:])

    handles = [
        block.register_forward_hook(hook, with_kwargs=True)
        for i, block in enumerate(block_list(model))
        if i in removed
    ]
    return lambda: [h.remove() for h in handles] and None


# ----------------------------------------------------------------------------- Eq. 4


vectors = st.lists(
    st.lists(st.floats(-10, 10, allow_nan=False), min_size=4, max_size=4), min_size=1, max_size=6
)


@PROPS
@given(rows=vectors, scale=st.floats(0.01, 100))
def test_a_block_that_only_rescales_tokens_has_influence_zero(
    rows: list[list[float]], scale: float
) -> None:
    x = torch.tensor(rows, dtype=torch.float64) + 0.5  # keep every row away from zero
    x[:, 0] = 11.0
    total, n = cosine_sums(x, scale * x)
    assert n == len(rows)
    assert 1.0 - total / n == pytest.approx(0.0, abs=1e-12)
    total, n = cosine_sums(x, -x)
    assert 1.0 - total / n == pytest.approx(2.0, abs=1e-12)


def test_cosine_sums_counts_only_unmasked_tokens_and_refuses_mismatches() -> None:
    x = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]])
    y = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [-1.0, -1.0]]])
    mask = torch.tensor([[1, 1, 0]])
    assert cosine_sums(x, y, mask) == (pytest.approx(1.0), 2)  # 1 + 0; the third is padding
    with pytest.raises(ProxyError) as err:
        cosine_sums(x, y[:, :2])
    assert err.value.reason == "shape"
    with pytest.raises(ProxyError):
        cosine_sums(x, y, torch.ones(2, 3))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_block_influence_of_an_identity_block_is_zero(arch: str) -> None:
    model = tiny(arch)
    target = len(block_list(model)) - 1
    block = block_list(model)[target]
    with torch.no_grad():
        for name in OUT_PROJECTIONS[arch]:
            layer = block.get_submodule(name)
            for param in layer.parameters():
                param.zero_()
    data = batches(model.config.vocab_size)
    influence = block_influence(model, data)
    assert len(influence) == model.config.num_hidden_layers
    assert influence[target] == pytest.approx(0.0, abs=1e-6)
    assert all(v > 1e-4 for i, v in enumerate(influence) if i != target)
    assert model.training is False  # restored (it was in eval mode)
    with pytest.raises(ProxyError) as err:
        block_influence(model, [])
    assert err.value.reason == "empty"


def test_token_batches_pad_right_and_skip_empty_rows() -> None:
    out = token_batches([[5, 6, 7], [], [8]], batch_size=2, pad_id=0)
    assert len(out) == 1
    ids, mask = out[0]
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    with pytest.raises(ProxyError):
        token_batches([[1]], batch_size=0, pad_id=0)


@pytest.mark.parametrize(
    ("layers", "ratio", "kept"),
    [(4, 0.5, 2), (3, 0.5, 2), (2, 0.5, 1), (1, 0.5, 1), (10, 0.3, 7), (10, 0.7, 3), (4, 0.0, 4)],
)
def test_kept_count_removes_floor_of_ratio_times_layers(
    layers: int, ratio: float, kept: int
) -> None:
    assert kept_count(layers, ratio) == kept


@pytest.mark.parametrize("ratio", [1.0, -0.1, float("nan"), 2.0])
def test_kept_count_refuses_a_ratio_outside_zero_one(ratio: float) -> None:
    with pytest.raises(ProxyError) as err:
        kept_count(4, ratio)
    assert err.value.reason == "ratio"


def test_blocks_to_keep_takes_the_highest_influence_and_breaks_ties_by_index() -> None:
    assert blocks_to_keep([0.9, 0.1, 0.5, 0.2], 0.5) == (0, 2)
    assert blocks_to_keep([0.3, 0.3, 0.3, 0.3], 0.5) == (0, 1)
    assert blocks_to_keep([0.1, 0.2, 0.2], 0.5) == (1, 2)
    with pytest.raises(ProxyError) as err:
        blocks_to_keep([0.1, float("nan")], 0.5)
    assert err.value.reason == "non_finite"


# ----------------------------------------------------------------------------- compress


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_compress_keeps_the_chosen_blocks_and_equals_the_model_with_the_others_skipped(
    arch: str, tmp_path: Path
) -> None:
    model = tiny(arch)
    layers = model.config.num_hidden_layers
    data = batches(model.config.vocab_size)
    influence = block_influence(model, data)
    kept = blocks_to_keep(influence, 0.5)
    assert len(kept) == kept_count(layers, 0.5) == layers - layers // 2
    proxy = build_proxy(model, kept, ratio=0.5, influence=influence)
    proxy.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    info = proxy_info(loaded)
    assert info == ProxyInfo(
        source_model_type=model.config.model_type,
        source_layers=layers,
        kept_blocks=kept,
        blocks_path=info.blocks_path if info else "",
        ratio=0.5,
        block_influence=tuple(influence),
    )
    assert loaded.config.num_hidden_layers == len(kept) == len(block_list(loaded))
    undo = skipping(model, set(range(layers)) - set(kept))
    with torch.no_grad():
        for ids, mask in data:
            want = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            got = loaded(input_ids=ids, attention_mask=mask, use_cache=False).logits
            assert torch.allclose(got, want, atol=1e-6, rtol=0)
    undo()
    with torch.no_grad():  # and the skip is real: the full model differs
        ids, mask = data[0]
        full = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        small = loaded(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert not torch.allclose(full, small, atol=1e-3)


def test_a_proxy_of_a_proxy_records_indices_into_the_source() -> None:
    model = tiny("gpt2")
    first = build_proxy(model, (0, 2, 3), ratio=0.25)
    second = build_proxy(first, (1, 2), ratio=0.34)
    info = proxy_info(second)
    assert info is not None
    assert info.kept_blocks == (2, 3)
    assert info.source_layers == 4
    assert info.ratio == pytest.approx(0.5)


def test_build_proxy_refuses_bad_blocks_and_position_dependent_blocks() -> None:
    model = tiny("gpt2")
    for kept in ((), (1, 0), (0, 4), (1, 1)):
        with pytest.raises(ProxyError) as err:
            build_proxy(model, kept, ratio=0.5)
        assert err.value.reason == "blocks"
    model.config.scale_attn_by_inverse_layer_idx = True
    with pytest.raises(ProxyError) as err:
        build_proxy(model, (0, 1), ratio=0.5)
    assert err.value.reason == "model"


def test_proxy_state_renames_kept_blocks_and_keeps_the_rest() -> None:
    t = {
        name: torch.tensor([float(i)]) for i, name in enumerate(["emb", "h.0.w", "h.1.w", "h.2.w"])
    }
    out = proxy_state(t, "h", (0, 2), 3)
    assert set(out) == {"emb", "h.0.w", "h.1.w"}
    assert out["h.1.w"] is t["h.2.w"]
    with pytest.raises(ProxyError):
        proxy_state({"h.5.w": torch.zeros(1)}, "h", (0,), 3)


def test_proxy_info_refuses_a_malformed_record() -> None:
    good = ProxyInfo("gpt2", 4, (0, 3), "transformer.h", 0.5).to_dict()
    assert ProxyInfo.from_dict(good).kept_blocks == (0, 3)
    for bad in ({**good, "kept_blocks": [3, 0]}, {**good, "kept_blocks": [0, 4]}, {"x": 1}, 3):
        with pytest.raises(ProxyError):
            ProxyInfo.from_dict(bad)


# ----------------------------------------------------------------------------- fuse


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_fusing_an_untrained_proxy_gives_back_the_model(arch: str) -> None:
    model = tiny(arch)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kept = (0,) if model.config.num_hidden_layers == 2 else (0, 2)
    proxy = build_proxy(model, kept, ratio=0.5)
    assert fuse_into(model, proxy) == ()
    after = model.state_dict()
    assert set(after) == set(before)
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_a_changed_proxy_block_changes_exactly_that_block(tmp_path: Path) -> None:
    model = tiny("gpt2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    proxy = build_proxy(model, (1, 3), ratio=0.5)
    with torch.no_grad():
        proxy.transformer.h[1].mlp.c_fc.weight.add_(0.5)  # proxy block 1 is source block 3
    changed = fuse_into(model, proxy)
    assert changed == ("transformer.h.3.mlp.c_fc.weight",)
    after = model.state_dict()
    differs = {k for k in before if not torch.equal(after[k], before[k])}
    assert differs == {"transformer.h.3.mlp.c_fc.weight"}
    assert torch.equal(
        after["transformer.h.3.mlp.c_fc.weight"], proxy.transformer.h[1].mlp.c_fc.weight
    )
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(
        reloaded.state_dict()["transformer.h.3.mlp.c_fc.weight"],
        after["transformer.h.3.mlp.c_fc.weight"],
    )


def test_fuse_refuses_a_proxy_of_another_model_and_bad_tensors() -> None:
    gpt2, bloom = tiny("gpt2"), tiny("bloom")
    proxy = build_proxy(bloom, (0, 2), ratio=0.5)
    with pytest.raises(ProxyError) as err:
        fuse_into(gpt2, proxy)
    assert err.value.reason == "mismatch"
    with pytest.raises(ProxyError) as err:
        fuse_into(gpt2, tiny("gpt2"))  # not a proxy
    assert err.value.reason == "model"
    other = build_proxy(tiny("gpt_neox"), (0,), ratio=0.5)
    other.config.peerlm_proxy = {**other.config.peerlm_proxy, "source_model_type": "bloom"}
    with pytest.raises(ProxyError) as err:
        fuse_into(bloom, other)  # claims bloom, has gpt_neox's blocks
    assert err.value.reason == "mismatch"
    info = proxy_info(proxy)
    assert info is not None
    base = bloom.state_dict()
    good = proxy.state_dict()
    nan = {
        **good,
        "transformer.ln_f.weight": torch.full_like(good["transformer.ln_f.weight"], float("nan")),
    }
    wide = {**good, "transformer.ln_f.weight": torch.zeros(3)}
    extra = {**good, "transformer.h.2.ln.weight": torch.zeros(1)}
    missing = {k: v for k, v in good.items() if k != "transformer.ln_f.bias"}
    for state, reason in ((nan, "non_finite"), (wide, "shape"), (extra, "keys"), (missing, "keys")):
        with pytest.raises(ProxyError) as err:
            fuse_state(base, state, info)
        assert err.value.reason == reason
    assert torch.equal(
        bloom.state_dict()["transformer.ln_f.weight"], base["transformer.ln_f.weight"]
    )


# ----------------------------------------------------------------------------- CLI


def _public(path: Path) -> Path:
    problems = [
        Problem(
            task_id=f"public/x/{i}",
            category="x",
            prompt=f'def f{i}(x: int) -> int:\n    """Add {i}."""\n    ',
            reference=f"return x + {i}\n",
            tests=f"assert f{i}(1) == {i + 1}",
            entry_point=f"f{i}",
        )
        for i in range(6)
    ]
    write_jsonl(path, problems)
    return path


def test_cli_compress_then_fuse_round_trip(tmp_path: Path) -> None:
    data = _public(tmp_path / "public.jsonl")
    source = SHIPPED_DIR / "tiny" / "bloom"
    proxy_dir, fused_dir = tmp_path / "proxy", tmp_path / "fused"
    args = ["compress", "--model", str(source), "--public-data", str(data)]
    result = CliRunner().invoke(app, [*args, "--out", str(proxy_dir), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["layers"] == 3 and len(report["kept_blocks"]) == 2
    assert report["parameters"]["proxy"] < report["parameters"]["model"]
    assert report["texts"] == 6 and report["tokens"] > 0
    loaded = AutoModelForCausalLM.from_pretrained(proxy_dir)
    assert list(loaded.config.peerlm_proxy["kept_blocks"]) == report["kept_blocks"]
    assert (proxy_dir / "tokenizer.json").is_file()
    # a second run into the same folder needs --force
    again = CliRunner().invoke(app, [*args, "--out", str(proxy_dir)])
    assert again.exit_code == 2 and "not empty" in again.output
    fused = CliRunner().invoke(
        app,
        [
            "fuse",
            "--base",
            str(source),
            "--proxy",
            str(proxy_dir),
            "--out",
            str(fused_dir),
            "--json",
        ],
    )
    assert fused.exit_code == 0, fused.output
    assert json.loads(fused.stdout)["changed_tensors"] == []
    want, got = (
        tiny("bloom").state_dict(),
        AutoModelForCausalLM.from_pretrained(fused_dir).state_dict(),
    )
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_cli_compress_refuses_bad_input(tmp_path: Path) -> None:
    data = _public(tmp_path / "public.jsonl")
    source = str(SHIPPED_DIR / "tiny" / "gpt2")
    runner = CliRunner()
    bad_ratio = runner.invoke(
        app,
        [
            "compress",
            "--model",
            source,
            "--public-data",
            str(data),
            "--out",
            str(tmp_path / "o"),
            "--ratio",
            "1",
        ],
    )
    assert bad_ratio.exit_code == 2 and "ratio" in bad_ratio.output
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    bad_data = runner.invoke(
        app,
        [
            "compress",
            "--model",
            source,
            "--public-data",
            str(tmp_path / "bad.jsonl"),
            "--out",
            str(tmp_path / "o"),
        ],
    )
    assert bad_data.exit_code == 2 and "public-data" in bad_data.output
    no_model = runner.invoke(
        app,
        [
            "compress",
            "--model",
            str(tmp_path),
            "--public-data",
            str(data),
            "--out",
            str(tmp_path / "o"),
        ],
    )
    assert no_model.exit_code == 2 and "not a model directory" in no_model.output
    assert not (tmp_path / "o").exists()
    not_proxy = runner.invoke(
        app, ["fuse", "--base", source, "--proxy", source, "--out", str(tmp_path / "f")]
    )
    assert not_proxy.exit_code == 2 and "peerlm_proxy" in not_proxy.output
