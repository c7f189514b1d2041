"""OnePeFT's SVD aggregation (Eq. 3) and the LoRA-factor baselines
(peerlm.agent.merging.lora_merge)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peerlm.agent.adapter_codec import AdapterError, encode_adapter
from peerlm.agent.merging.lora_merge import (
    ClientAdapter,
    aggregate_fedavg_factors,
    aggregate_ffa,
    aggregate_svd,
    delta_weights,
    normalise_weights,
    svd_of_product,
)
from peerlm.agent.modelhost import ModelHost
from peerlm.agent.models.lora import LoraSettings, default_target_modules
from peerlm.agent.models.tiny import build_models
from peerlm.bench.lora_merge import peft_svd_merge
from transformers import AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

A, B = ".lora_A.weight", ".lora_B.weight"
PROPS = settings(max_examples=25, deadline=None)


def client(
    seed: int,
    r: int,
    *,
    alpha: float | None = None,
    shapes: Sequence[tuple[str, int, int]] = (("m.q", 12, 10), ("m.v", 6, 10)),
    examples: int | None = 1,
    name: str = "",
) -> ClientAdapter:
    """A client with random A and non-zero random B (as after training), float64."""
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for module, out, inp in shapes:
        state[module + A] = torch.randn(r, inp, generator=gen, dtype=torch.float64)
        state[module + B] = torch.randn(out, r, generator=gen, dtype=torch.float64)
    return ClientAdapter(state, r, 2.0 * r if alpha is None else alpha, examples, name)


def ideal(clients: Sequence[ClientAdapter], lam: Sequence[float]) -> dict[str, torch.Tensor]:
    """Σ λ_i s_i B_i A_i per module, by the definition, densely."""
    out: dict[str, torch.Tensor] = {}
    for c, w in zip(clients, lam, strict=True):
        for m, dw in delta_weights(c.state, r=c.r, alpha=c.alpha).items():
            out[m] = out.get(m, torch.zeros_like(dw)) + w * dw
    return out


def merged_delta(merged: object) -> dict[str, torch.Tensor]:
    from peerlm.agent.merging.lora_merge import MergedAdapter

    assert isinstance(merged, MergedAdapter)
    return delta_weights(merged.state, r=merged.r, alpha=merged.alpha)


def close(x: torch.Tensor, y: torch.Tensor, tol: float = 1e-9) -> bool:
    return bool(torch.allclose(x, y, rtol=0, atol=tol * max(1.0, float(y.abs().max()))))


clients_st = st.lists(
    st.tuples(st.integers(0, 10_000), st.integers(1, 6), st.integers(1, 50)),
    min_size=1,
    max_size=5,
)


# ------------------------------------------------------------------------ SVD (Eq. 3)


@PROPS
@given(specs=clients_st, r=st.integers(1, 14))
def test_svd_aggregate_is_the_truncated_svd_of_the_weighted_sum(
    specs: list[tuple[int, int, int]], r: int
) -> None:
    """Eckart–Young: exact when r >= rank(ΔW_avg), otherwise off by the tail's norm, and
    equal to the dense truncated SVD (heterogeneous client ranks, any target rank)."""
    clients = [client(seed, ri, examples=n) for seed, ri, n in specs]
    merged = aggregate_svd(clients, r=r, dtype=torch.float64)
    target = ideal(clients, merged.weights)
    got = merged_delta(merged)
    assert merged.r == r and merged.alpha == r
    for m, dw in target.items():
        u, s, vh = torch.linalg.svd(dw, full_matrices=False)
        tail = float(torch.linalg.vector_norm(s[r:]))
        err = float(torch.linalg.matrix_norm(dw - got[m]))
        assert err == pytest.approx(tail, abs=1e-8 * max(1.0, float(s[0])))
        assert merged.error[m] == pytest.approx(tail, abs=1e-8 * max(1.0, float(s[0])))
        rank = int((s > 1e-10 * s[0]).sum())
        if r >= rank:
            assert close(got[m], dw)
        elif float(s[r - 1] - s[r]) > 1e-6 * float(s[0]):  # unique truncation
            k = r
            assert close(got[m], (u[:, :k] * s[:k]) @ vh[:k], 1e-7)


@PROPS
@given(
    seed=st.integers(0, 10_000),
    m=st.integers(1, 9),
    n=st.integers(1, 9),
    rs=st.lists(st.integers(1, 12), min_size=1, max_size=4),
)
def test_svd_of_product_matches_the_dense_svd(seed: int, m: int, n: int, rs: list[int]) -> None:
    gen = torch.Generator().manual_seed(seed)
    total = sum(rs)
    b = torch.randn(m, total, generator=gen, dtype=torch.float64)
    a = torch.randn(total, n, generator=gen, dtype=torch.float64)
    u, s, vh = svd_of_product(b, a)
    dense = torch.linalg.svdvals(b @ a)
    assert s.shape[0] <= min(m, n, total)
    assert torch.allclose(s, dense[: s.shape[0]], atol=1e-9 * float(dense[0]))
    assert close((u * s) @ vh, b @ a)


def test_paper_split_and_output_scaling() -> None:
    """alpha = r: B̃ = U_r Σ_r, Ã = V_rᵀ (orthonormal rows); another alpha divides its
    scaling out of B̃ only, and the applied update is the same."""
    clients = [client(1, 3), client(2, 5, alpha=7.0)]
    plain = aggregate_svd(clients, r=4, dtype=torch.float64)
    for m in ("m.q", "m.v"):
        a = plain.state[m + A]
        assert close(a @ a.T, torch.eye(4, dtype=torch.float64))
        col_norms = torch.linalg.vector_norm(plain.state[m + B], dim=0)
        assert bool((col_norms[:-1] >= col_norms[1:] - 1e-12).all())  # Σ descending
    host_like = aggregate_svd(clients, r=4, alpha=16.0, dtype=torch.float64)
    assert host_like.scaling == 4.0
    for m, dw in merged_delta(plain).items():
        assert close(merged_delta(host_like)[m], dw)
        assert close(host_like.state[m + B] * 4.0, plain.state[m + B])
        assert torch.equal(host_like.state[m + A], plain.state[m + A])


@PROPS
@given(specs=clients_st, scale=st.floats(1e-3, 1e3))
def test_weights_are_normalised_and_scale_free(
    specs: list[tuple[int, int, int]], scale: float
) -> None:
    clients = [client(seed, ri, examples=n) for seed, ri, n in specs]
    by_share = aggregate_svd(clients, r=6, dtype=torch.float64)
    assert math.fsum(by_share.weights) == pytest.approx(1.0)
    total = sum(n for _, _, n in specs)
    assert by_share.weights == pytest.approx([n / total for _, _, n in specs])
    scaled = aggregate_svd(
        clients, r=6, weights=[scale * n for _, _, n in specs], dtype=torch.float64
    )
    assert scaled.weights == pytest.approx(by_share.weights)
    for m, dw in merged_delta(by_share).items():
        assert close(merged_delta(scaled)[m], dw, 1e-7)


@PROPS
@given(specs=clients_st, data=st.data())
def test_client_order_does_not_matter(
    specs: list[tuple[int, int, int]], data: st.DataObject
) -> None:
    clients = [client(seed, ri, examples=n) for seed, ri, n in specs]
    order = data.draw(st.permutations(range(len(clients))))
    r = data.draw(st.integers(1, 10))
    a = aggregate_svd(clients, r=r, dtype=torch.float64)
    b = aggregate_svd([clients[i] for i in order], r=r, dtype=torch.float64)
    # The factors may differ by the sign of a singular pair; the update may not, where the
    # truncation is unique (always when r covers the rank).
    for m, dw in merged_delta(a).items():
        assert a.error[m] == pytest.approx(b.error[m], abs=1e-8 * max(1.0, float(dw.abs().max())))
        if a.error[m] < 1e-9:
            assert close(merged_delta(b)[m], dw)


@PROPS
@given(seed=st.integers(0, 10_000), ri=st.integers(1, 6), extra=st.integers(0, 4))
def test_one_client_gets_its_own_update_back(seed: int, ri: int, extra: int) -> None:
    c = client(seed, ri, alpha=3.0)
    merged = aggregate_svd([c], r=ri + extra, weights=[1.0], dtype=torch.float64)
    assert merged.weights == (1.0,)
    own = delta_weights(c.state, r=c.r, alpha=c.alpha)
    for m, dw in merged_delta(merged).items():
        assert close(dw, own[m])


def test_rank_above_the_matrix_pads_with_zeros() -> None:
    merged = aggregate_svd([client(3, 4, shapes=(("m.x", 3, 2),))], r=5, dtype=torch.float64)
    assert merged.state["m.x" + A].shape == (5, 2) and merged.state["m.x" + B].shape == (3, 5)
    assert float(merged.state["m.x" + A][2:].abs().max()) == 0.0
    own = delta_weights(client(3, 4, shapes=(("m.x", 3, 2),)).state, r=4, alpha=8.0)
    assert close(merged_delta(merged)["m.x"], own["m.x"])


def test_bfloat16_clients_are_merged_in_float64() -> None:
    """Adapters trained on CUDA are bfloat16; their values are merged exactly as float64."""
    wide = [client(1, 2), client(2, 3)]
    narrow = [
        ClientAdapter({k: v.to(torch.bfloat16) for k, v in c.state.items()}, c.r, c.alpha, 1)
        for c in wide
    ]
    as_f64 = [
        ClientAdapter({k: v.to(torch.float64) for k, v in c.state.items()}, c.r, c.alpha, 1)
        for c in narrow
    ]
    got = aggregate_svd(narrow, r=5, dtype=torch.float64)
    want = ideal(as_f64, got.weights)
    for m, dw in merged_delta(got).items():
        assert close(dw, want[m])


def test_output_dtype_is_float32_by_default() -> None:
    merged = aggregate_svd([client(1, 2), client(2, 3)], r=4)
    assert {t.dtype for t in merged.state.values()} == {torch.float32}


# ------------------------------------------------------------------------------ baselines


def _axis_clients() -> list[ClientAdapter]:
    """ΔW_1 = e1 e1ᵀ, ΔW_2 = e2 e2ᵀ (rank 1, scaling 1)."""
    one = ClientAdapter(
        {"m" + A: torch.tensor([[1.0, 0.0]]), "m" + B: torch.tensor([[1.0], [0.0]])}, 1, 1.0, 1
    )
    two = ClientAdapter(
        {"m" + A: torch.tensor([[0.0, 1.0]]), "m" + B: torch.tensor([[0.0], [1.0]])}, 1, 1.0, 1
    )
    return [one, two]


def test_fedavg_of_factors_adds_cross_terms() -> None:
    """Hand-built: the ideal average is I/2; averaging A and B gives
    B̄Ā = (λ1 B1 + λ2 B2)(λ1 A1 + λ2 A2) = ¼ (B1A1 + B2A2 + B1A2 + B2A1) = ¼·ones:
    the cross terms B1A2 and B2A1 put ¼ off the diagonal, and the diagonal loses half."""
    clients = _axis_clients()
    fedavg = aggregate_fedavg_factors(clients)
    got = merged_delta(fedavg)["m"]
    assert torch.allclose(got, torch.full((2, 2), 0.25, dtype=torch.float64))
    assert fedavg.error["m"] == pytest.approx(0.5)  # ‖I/2 − ¼·ones‖_F
    svd = aggregate_svd(clients, r=2)
    assert torch.allclose(merged_delta(svd)["m"], 0.5 * torch.eye(2, dtype=torch.float64))
    assert svd.error["m"] == pytest.approx(0.0, abs=1e-12)


@PROPS
@given(
    seeds=st.lists(st.integers(0, 10_000), min_size=2, max_size=4, unique=True), r=st.integers(1, 5)
)
def test_fedavg_of_factors_is_the_average_of_the_factors(seeds: list[int], r: int) -> None:
    clients = [client(s, r, examples=i + 1) for i, s in enumerate(seeds)]
    merged = aggregate_fedavg_factors(clients, dtype=torch.float64)
    assert (merged.r, merged.alpha, merged.method) == (r, 2.0 * r, "fedavg_factors")
    target = ideal(clients, merged.weights)
    for m in ("m.q", "m.v"):
        for suffix in (A, B):
            avg = sum(w * c.state[m + suffix] for w, c in zip(merged.weights, clients, strict=True))
            assert isinstance(avg, torch.Tensor) and close(merged.state[m + suffix], avg)
        err = float(torch.linalg.matrix_norm(target[m] - merged_delta(merged)[m]))
        assert merged.error[m] == pytest.approx(err, rel=1e-9, abs=1e-12)
        assert err > 1e-6  # distinct random clients: the cross terms do not cancel


@PROPS
@given(seeds=st.lists(st.integers(0, 10_000), min_size=1, max_size=4), r=st.integers(1, 5))
def test_ffa_with_a_shared_a_is_exact(seeds: list[int], r: int) -> None:
    shared = client(99, r)
    clients = []
    for i, s in enumerate(seeds):
        own = client(s, r, examples=i + 2)
        state = dict(own.state)
        state.update({k: v for k, v in shared.state.items() if k.endswith(A)})
        clients.append(ClientAdapter(state, r, own.alpha, own.examples))
    merged = aggregate_ffa(clients, dtype=torch.float64)
    target = ideal(clients, merged.weights)
    for m, dw in merged_delta(merged).items():
        assert torch.equal(merged.state[m + A], shared.state[m + A])
        assert close(dw, target[m])
        assert merged.error[m] == pytest.approx(0.0, abs=1e-9 * max(1.0, float(dw.abs().max())))


def test_ffa_tolerates_rounding_but_not_another_a() -> None:
    base, other = client(5, 2), client(6, 2)
    same_a = {k: base.state[k] + 1e-8 if k.endswith(A) else v for k, v in other.state.items()}
    aggregate_ffa([base, ClientAdapter(same_a, 2, 4.0, 1)])
    with pytest.raises(AdapterError, match=r"client 1's A of module m\.q differs") as err:
        aggregate_ffa([base, other])
    assert err.value.reason == "frozen_a"
    with pytest.raises(AdapterError, match="atol"):
        aggregate_ffa([base], atol=float("nan"))


# ------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("merge", [aggregate_svd, aggregate_fedavg_factors, aggregate_ffa])
def test_no_adapters_is_refused(merge: object) -> None:
    kwargs = {"r": 2} if merge is aggregate_svd else {}
    with pytest.raises(AdapterError, match="K = 0") as err:
        merge([], **kwargs)  # type: ignore[operator]
    assert err.value.reason == "empty"


@pytest.mark.parametrize(
    ("weights", "match"),
    [
        ([1.0, -0.5], "weight 1 is -0.5"),
        ([float("nan"), 1.0], "weight 0 is nan"),
        ([1.0, float("inf")], "weight 1 is inf"),
        ([0.0, 0.0], "all weights are zero"),
        ([1.0], "1 weights for 2 adapters"),
    ],
)
def test_bad_weights_are_refused(weights: list[float], match: str) -> None:
    with pytest.raises(AdapterError, match=match) as err:
        aggregate_svd([client(1, 2), client(2, 2)], r=2, weights=weights)
    assert err.value.reason == "weights"


def test_missing_data_size_is_refused() -> None:
    with pytest.raises(AdapterError, match="client 1 \\(b\\) has no data size") as err:
        aggregate_svd([client(1, 2), client(2, 2, examples=None, name="b")], r=2)
    assert err.value.reason == "weights"
    assert normalise_weights([0.0, 2.0]) == (0.0, 1.0)


def _with(c: ClientAdapter, **changes: torch.Tensor) -> ClientAdapter:
    state = dict(c.state)
    state.update(changes)
    return ClientAdapter(state, c.r, c.alpha, c.examples, c.name)


def _without(c: ClientAdapter, key: str) -> ClientAdapter:
    return ClientAdapter({k: v for k, v in c.state.items() if k != key}, c.r, c.alpha, c.examples)


@pytest.mark.parametrize(
    ("second", "reason", "match"),
    [
        (client(2, 2, shapes=(("m.q", 12, 10),)), "keys", "client 1 lacks module m.v"),
        (client(2, 2, shapes=(("m.q", 12, 10), ("m.v", 6, 10), ("m.k", 6, 10))), "keys",
         "client 1 has extra module m.k"),
        (client(2, 2, shapes=(("m.q", 12, 10), ("m.v", 7, 10))), "shape",
         "module m.v is 7x10 .* client 0's is 6x10"),
        (client(2, 2, shapes=(("m.q", 12, 11), ("m.v", 6, 10))), "shape", "module m.q is 12x11"),
        (_with(client(2, 2), **{"m.v" + B: torch.full((6, 2), float("nan"))}), "non_finite",
         "module m.v lora_B is not finite"),
        (_with(client(2, 2), **{"m.q" + A: torch.full((2, 10), float("inf"))}), "non_finite",
         "module m.q lora_A is not finite"),
        (_with(client(2, 2), **{"m.q" + A: torch.ones((3, 10))}), "shape",
         r"module m.q has A \(3, 10\)"),
        (_with(client(2, 2), **{"m.q" + A: torch.ones((2, 10), dtype=torch.int64)}), "dtype",
         "module m.q lora_A is torch.int64"),
        (_with(client(2, 2), **{"m.q.bias": torch.ones(3)}), "keys", "m.q.bias is not a LoRA"),
        (_without(client(2, 2), "m.v" + B), "keys", "module m.v has no lora_B"),
        (ClientAdapter({}, 2, 4.0, 1), "keys", "client 1 has no tensors"),
        (ClientAdapter(client(2, 2).state, 0, 4.0, 1), "lora_config", "r must be a positive"),
        (ClientAdapter(client(2, 2).state, 2, float("nan"), 1), "lora_config", "alpha must be"),
        (ClientAdapter(client(2, 2).state, 2, 0.0, 1), "lora_config", "alpha must be"),
    ],
)  # fmt: skip
def test_bad_adapters_are_refused_naming_the_module(
    second: ClientAdapter, reason: str, match: str
) -> None:
    for merge in (aggregate_svd, aggregate_fedavg_factors, aggregate_ffa):
        kwargs = {"r": 2} if merge is aggregate_svd else {}
        with pytest.raises(AdapterError, match=match) as err:
            merge([client(1, 2), second], **kwargs)  # type: ignore[operator]
        assert err.value.reason == reason, merge


@pytest.mark.parametrize(("r", "alpha"), [(0, None), (2, 0.0), (2, float("inf"))])
def test_bad_output_rank_or_alpha_is_refused(r: int, alpha: float | None) -> None:
    with pytest.raises(AdapterError, match=r"target rank|output alpha") as err:
        aggregate_svd([client(1, 2)], r=r, alpha=alpha)
    assert err.value.reason == "lora_config"


@pytest.mark.parametrize("merge", [aggregate_fedavg_factors, aggregate_ffa])
def test_factor_baselines_need_equal_rank_and_alpha(merge: object) -> None:
    for other in (client(2, 3), client(2, 2, alpha=5.0)):
        with pytest.raises(AdapterError, match="needs equal LoRA r and alpha") as err:
            merge([client(1, 2), other])  # type: ignore[operator]
        assert err.value.reason == "lora_config"


# ---------------------------------------------------------------- peft and a real model


@pytest.fixture(scope="module")
def models(micro_models_dir: Path, offline_hub: None) -> dict[str, Path]:
    return {i.arch: Path(i.path) for i in build_models(micro_models_dir, size="micro")}


def _model_clients(host: ModelHost, ranks: Sequence[int], seed: int) -> list[ClientAdapter]:
    """Random clients of other ranks on the host's modules (peft names and (out, in))."""
    spec = host.adapter_spec()
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, r in enumerate(ranks):
        state = {}
        for key, shape in spec.shapes.items():
            dims = (r, shape[1]) if key.endswith(A) else (shape[0], r)
            state[key] = torch.randn(dims, generator=gen) * 0.3
        out.append(ClientAdapter(state, r, 2.0 * r, examples=10 * (i + 1)))
    return out


def test_aggregate_loads_into_a_host_and_applies_the_average(models: dict[str, Path]) -> None:
    """Through the codec and ModelHost.load_adapter_bytes: the merged model's logits equal
    the base model with W0 + ΔW_avg written into its weights by hand (GPT-2: Conv1D)."""
    path = models["gpt2"]
    host = ModelHost.load(path, LoraSettings(r=8, alpha=16.0), device="cpu")
    clients = _model_clients(host, (2, 3, 1), seed=7)  # Σ r_i = 6 <= 8: exact
    merged = aggregate_svd(clients, r=host.lora.r, alpha=host.lora.alpha)
    host.load_adapter_bytes(encode_adapter(merged.state, host.adapter_spec()))

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 14, 3, 7, 2, 11]])
    with torch.no_grad():
        before = base(ids).logits
        target = ideal(clients, merged.weights)
        modules = dict(base.named_modules())
        for name, dw in target.items():
            layer = modules[name.removeprefix("base_model.model.")]
            weight = layer.weight
            weight += (dw.T if isinstance(layer, Conv1D) else dw).to(weight.dtype)
        expected = base(ids).logits
        got = host.model(ids).logits
    assert float((expected - before).abs().max()) > 1e-3  # the update does change the output
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_peft_svd_merge_computes_the_same_update(models: dict[str, Path], arch: str) -> None:
    """peft's add_weighted_adapter(svd) with the normalised weights gives Eq. 3's update
    (fan_in_fan_out GPT-2 and plain Linear qwen2; ranks 2, 4, 3 to rank 4)."""
    from peft import LoraConfig, get_peft_model
    from peft.utils import set_peft_model_state_dict

    host = ModelHost.load(models[arch], LoraSettings(r=4), device="cpu")
    clients = _model_clients(host, (2, 4, 3), seed=3)
    base = AutoModelForCausalLM.from_pretrained(models[arch], dtype=torch.float32)
    targets = default_target_modules(arch)
    model = None
    for i, c in enumerate(clients):
        cfg = LoraConfig(
            r=c.r, lora_alpha=c.alpha, target_modules=targets, fan_in_fan_out=arch == "gpt2"
        )  # type: ignore[arg-type]
        if model is None:
            model = get_peft_model(base, cfg, adapter_name=f"c{i}")
        else:
            model.add_adapter(f"c{i}", cfg)
        set_peft_model_state_dict(model, dict(c.state), adapter_name=f"c{i}")
    assert model is not None
    ours = aggregate_svd(clients, r=4)
    theirs = peft_svd_merge(model, ["c0", "c1", "c2"], ours.weights, 4, "merged")
    assert set(theirs) == set(ours.state)
    peft_dw = delta_weights(theirs, r=4, alpha=4.0)
    for m, dw in merged_delta(ours).items():
        assert torch.allclose(peft_dw[m], dw, atol=1e-5 * max(1.0, float(dw.abs().max())))


def test_bench_reports_agreement_with_peft() -> None:
    """`peerlm bench lora-merge` on a small stack: the report's figures are the comparison."""
    from peerlm.bench.lora_merge import MergeBenchConfig, run_benchmark

    cfg = MergeBenchConfig(
        modules=2, dim_in=12, dim_out=9, ranks=(2, 3), alphas=(4.0, 3.0), examples=(1, 3),
        target_rank=5, repeats=1,
    )  # fmt: skip
    report = run_benchmark(cfg)
    assert report["weights"] == pytest.approx([0.25, 0.75]) and report["exact_possible"]
    assert len(report["modules"]) == 2
    assert report["max_abs_diff_ours_peft"] < 1e-5
    for row in report["modules"]:
        # exact up to the float32 output: the target rank covers Σ r_i
        assert row["ours_error_fro"] < 1e-5 * row["max_abs_delta"]
    assert report["ours_median_s"] > 0 and report["peft_median_s"] > 0
    # What docs/onepeft.md says of peft's merge (this peft version): no normalisation of the
    # weights, one adapter keeps its rank, a rank above min(m, n) gives B and A that do not
    # match the configured rank.
    quirks = report["peft_quirks"]
    assert quirks["raw_weight_ratio"] == pytest.approx([4.0, 4.0], rel=1e-4)
    assert quirks["one_adapter_shapes"] == {"lora_A": [3, 6], "lora_B": [5, 3]}
    assert quirks["rank_above_min_shapes"] == {"lora_A": [6, 6], "lora_B": [5, 5]}
