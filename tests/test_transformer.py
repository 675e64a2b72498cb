"""Transformers on token data: the layers against the oracle, the causal mask, any P, PyTorch."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from conftest import requires_mpi, run_mpiexec
from hypothesis import example, given, settings
from hypothesis import strategies as st
from oracle import layer_forward, network_loss_and_grad, serial_sgd

from syncsgd import TrainConfig, train
from syncsgd.nn.backprop import Backprop
from syncsgd.nn.local import local_gradient
from syncsgd.nn.network import build
from syncsgd.nn.numerics import Float
from syncsgd.training.data import load_dataset, token_windows
from syncsgd.training.run import prepare

VOCABULARY = 10


def digest(params: np.ndarray) -> str:
    """SHA-256 of a flat parameter buffer."""
    return hashlib.sha256(params.tobytes()).hexdigest()


def relative(ours: dict, theirs: dict) -> float:
    """max |ours - theirs| / max(1, max |theirs|) over every array, the keys' bias left out."""
    ours, theirs = without_key_bias(ours), without_key_bias(theirs)
    scale = max(1.0, max(float(np.abs(v).max()) for v in theirs.values()))
    return max(float(np.abs(ours[k] - theirs[k]).max()) for k in theirs) / scale


def without_key_bias(arrays: dict) -> dict:
    """The arrays, attention's in_proj_bias without its middle third (the keys' bias): a shift of
    every key moves no softmax, so its gradient is 0 plus rounding errors, which Adam's
    normalised step magnifies to the learning rate's order in a few steps."""
    kept = dict(arrays)
    for name, value in arrays.items():
        if name.endswith("attn.in_proj_bias"):
            d = len(value) // 3
            kept[name] = np.concatenate([value[:d], value[2 * d :]])
    return kept


def tokens(batch: int, positions: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random token ids and next-token labels, (batch, positions) each."""
    rng = np.random.default_rng(seed)
    return (rng.integers(0, VOCABULARY, (batch, positions)).astype(np.float64),
            rng.integers(0, VOCABULARY, (batch, positions)))  # fmt: skip


# -- each layer against the oracle's plain NumPy: forward, backward, per-sample sums ---------------


@pytest.mark.parametrize("spec", [
    "embed(4) layernorm dense", "embed(4) gelu dense(6) dense", "embed(4) block(4,1) dense",
    "embed(4) block(4,4) layernorm dense", "embed(6) block(6,2) block(6,3) layernorm dense",
])  # fmt: skip
@pytest.mark.parametrize("positions", [1, 3])
@pytest.mark.parametrize("exact", [False, True])
def test_each_layer_is_the_oracles(spec, positions, exact):
    network = build(spec, (positions,), VOCABULARY, "xent", "float64")
    params = network.init_params(4)
    X, y = tokens(5, positions)
    grads = np.zeros(network.n_params)
    loss_sum, _ = local_gradient(network, 5, exact=exact)(params, X, y, grads)
    expected_loss, expected = network_loss_and_grad(spec, network.to_arrays(params), X, y, "xent")
    terms = 5 * positions  # the mean over every token of the batch
    assert loss_sum / terms == pytest.approx(expected_loss, rel=1e-13)
    assert relative({k: v / terms for k, v in network.views(grads).items()}, expected) < 1e-13


def test_a_future_token_moves_no_earlier_output():
    spec = "embed(4) block(4,2) block(4,2) layernorm dense"
    network = build(spec, (5,), VOCABULARY, "xent", "float64")
    params = network.init_params(1)
    X, y = tokens(3, 5)
    passes = Backprop(network, 3, Float(network.dtype, network.largest_weight()))

    def logits(ids: np.ndarray) -> np.ndarray:
        passes.forward_loss_(params, ids, y)
        return passes._plan[-1][1].copy()

    before = logits(X)
    changed = X.copy()
    changed[:, 3] = (changed[:, 3] + 1) % VOCABULARY
    after = logits(changed)
    assert np.array_equal(after[:, :3], before[:, :3])  # bitwise: nothing flowed back in time
    assert not np.array_equal(after[:, 3], before[:, 3])
    oracle_logits = X  # and the oracle's masked attention gives the same logits
    views = network.to_arrays(params)
    for position, layer in enumerate(["embed", "block", "block", "layernorm", "dense"]):
        p = {k.partition(".")[2]: v for k, v in views.items() if k.startswith(f"{position}.")}
        oracle_logits = layer_forward(layer, p, oracle_logits, {"heads": 2})
    assert np.abs(oracle_logits - before).max() < 1e-12


def test_float32_kernels_are_within_their_stated_errors():
    import math

    from numba import njit

    from syncsgd.nn.layers import gelu

    @njit
    def apply(kernel_index, values, out):  # type: ignore[no-untyped-def]
        for i in range(values.size):
            out[i] = gelu.erf_float32(values[i]) if kernel_index == 0 else gelu.exp_float32(
                values[i])  # fmt: skip

    x = np.linspace(-8, 8, 20_001).astype(np.float32)
    wide = x.astype(np.float64)
    erf, exp = np.empty_like(x), np.empty_like(x)
    apply(0, x, erf)
    assert np.abs(erf - np.array([math.erf(v) for v in wide])).max() < 4.5e-7
    powers = np.linspace(-87, 88, 20_001).astype(np.float32)
    apply(1, powers, exp)
    reference = np.exp(powers.astype(np.float64))
    assert (np.abs(exp - reference) / reference).max() < 1.0e-7
    y, dx = np.empty_like(x), np.empty_like(x)
    gelu.gelu_float32_(x, y)
    gelu.gelu_backward_float32_(x, np.ones_like(x), dx)
    y_wide, dx_wide = np.empty_like(wide), np.empty_like(wide)
    gelu.gelu_(wide, np.empty_like(wide), y_wide)
    gelu.gelu_backward_(wide, np.array([math.erf(v / math.sqrt(2)) for v in wide]),
                        np.ones_like(wide), dx_wide)  # fmt: skip
    assert (np.abs(y - y_wide) / np.maximum(1.0, np.abs(wide))).max() < 2.7e-7
    assert np.abs(dx - dx_wide).max() < 2.8e-7


@pytest.mark.parametrize("spec", ["embed(8) gelu dense", "gpt(layers=2,d=16,heads=4)"])
def test_float_modes_float32_kernels_give_its_float64_gradient_to_float32_rounding(spec):
    positions = 12
    wide, narrow = (build(spec, (positions,), VOCABULARY, "xent", dtype)
                    for dtype in ("float64", "float32"))  # fmt: skip
    params = wide.init_params(2)
    X, y = tokens(6, positions)
    grads = {}
    for network in (wide, narrow):
        grads[network.dtype] = np.zeros(network.n_params, network.dtype)
        local_gradient(network, 6)(params.astype(network.dtype), X.astype(network.dtype), y,
                                   grads[network.dtype])  # fmt: skip
    expected = grads[np.dtype(np.float64)]
    error = np.abs(grads[np.dtype(np.float32)] - expected).max() / np.abs(expected).max()
    assert 0 < error < 2e-6  # about 2e-7 seen


def test_a_narrow_format_does_not_round_token_ids():
    network = build("embed(4) dense", (3,), 400, "xent", "float64")  # bf16 holds integers to 256
    params = network.init_params(0)
    ids, labels = np.array([[257.0, 301.0, 399.0]]), np.zeros((1, 3), np.int64)
    outputs = []
    for precision in ("fp32", "bf16"):
        passes = local_gradient(network, 1, precision=precision).passes
        passes.forward_loss_(params, ids, labels)
        outputs.append(passes._plan[0][1].copy())
    assert np.abs(outputs[1] - outputs[0]).max() < 0.01 * np.abs(outputs[0]).max()


# -- token data: windows of a text, the B x T division ---------------------------------------------


def test_token_windows_are_the_texts_characters_by_code_point():
    X, y = token_windows("t", "abcab ba", 3)  # 7 // 3 = 2 windows; vocabulary " ", a, b, c
    assert X.tolist() == [[1, 2, 3], [1, 2, 0]] and y.tolist() == [[2, 3, 1], [2, 0, 2]]
    with pytest.raises(ValueError, match="needs 4"):
        token_windows("t", "abc", 3)


def test_numbers_to_words_is_seeded_lines_of_a_number_and_its_digits(tmp_path):
    X, y, _ = load_dataset("numbers-to-words", samples=20, context=8, seed=3)
    again, _, _ = load_dataset("numbers-to-words", samples=20, context=8, seed=3)
    assert X.shape == y.shape == (20, 8) and np.array_equal(X, again)
    assert np.array_equal(X[1:, 0], y[:-1, -1])  # the windows tile the text
    path = tmp_path / "text.txt"
    path.write_text("héllo wörld\n" * 3, encoding="utf-8")
    X, y, _ = load_dataset(str(path), context=4)
    assert X.shape == (8, 4) and int(max(X.max(), y.max())) == 9  # 10 distinct characters


@pytest.mark.parametrize("options, message", [
    (dict(data="numbers-to-words"), "starts with embed"),
    (dict(model="embed(4) block(4,2) dense"), "give token data"),
    (dict(context=8), "--context is the window of token data"),
    (dict(data="numbers-to-words", model="embed(4) dense", noise_scale=True), "not on token"),
])  # fmt: skip
def test_token_data_and_an_embedding_go_together(options, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**options)


def test_the_command_line_reads_token_data_and_its_context(tmp_path, capsys):
    from syncsgd.cli import build_parser, config_from_options, main

    argv = ["train", "--data", "numbers-to-words", "--context", "8", "--model",
            "gpt(layers=1, d=4, heads=2)"]  # fmt: skip
    config = config_from_options(build_parser().parse_args(argv))
    assert (config.data, config.context, config.model) == (argv[2], 8, argv[6])
    assert main(["train", "--model", "gpt(layers=1,d=4)", "--data", "numbers-to-words"]) != 0
    error = capsys.readouterr().err.strip()
    assert error.startswith("syncsgd: ") and "needs heads" in error and "\n" not in error


def test_a_text_shorter_than_a_window_is_one_line(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("abc", encoding="utf-8")
    with pytest.raises(ValueError, match="3 characters"):
        prepare(TrainConfig(data=str(path), model="embed(4) dense", context=8))


# -- the headline: distributed == the oracle for any P; exact mode bitwise for any P ---------------

SMALL = dict(data="numbers-to-words", samples=12, steps=3, lr=0.01)


@st.composite
def transformers(draw):
    """A tiny transformer spec and its context: 1-2 blocks of width 4, 1, 2 or 4 heads."""
    # width 4: a LayerNorm of width 2 has a gradient of rounding errors alone, which Adam's
    # normalised step magnifies past any tolerance
    heads = draw(st.sampled_from([1, 2, 4]))
    blocks = " ".join([f"block(4,{heads})"] * draw(st.integers(1, 2)))
    return f"embed(4) {blocks} layernorm dense", draw(st.integers(1, 3))


@settings(max_examples=6)
@given(spec=transformers(), ranks=st.integers(1, 5), batch_size=st.integers(1, 6),
       optimizer=st.sampled_from(["adam", "adamw", "sgd", "lamb", "lars"]))  # fmt: skip
@example(spec=("embed(4) block(4,4) layernorm dense", 3), ranks=5, batch_size=2,
         optimizer="adamw")  # more ranks than sequences, an odd P, d = heads  # fmt: skip
def test_a_transformer_trains_as_the_oracle_on_any_number_of_ranks(spec, ranks, batch_size,
                                                                   optimizer):  # fmt: skip
    spec, context = spec
    config = TrainConfig(model=spec, context=context, batch_size=batch_size, optimizer=optimizer,
                         weight_decay=0.01, **SMALL)  # fmt: skip
    result = train(config, ranks=ranks)
    run = prepare(config)
    start = run.model.to_arrays(run.model.init_params(config.seed))
    expected, losses = serial_sgd(run.X, run.y, start, spec=spec, steps=3, batch_size=batch_size,
                                  lr=0.01, optimizer=optimizer, weight_decay=0.01)  # fmt: skip
    assert relative(run.model.to_arrays(result.params), expected) < 1e-9
    assert result.losses == pytest.approx(losses, rel=1e-9)


@settings(max_examples=5)
@given(spec=transformers(), ranks=st.integers(2, 7), batch_size=st.integers(1, 6),
       dtype=st.sampled_from(["float64", "float32"]))  # fmt: skip
@example(spec=("embed(4) block(4,1) block(4,1) layernorm dense", 1), ranks=3, batch_size=2,
         dtype="float32")  # T = 1, heads = 1, P > B  # fmt: skip
def test_exact_mode_trains_a_transformer_bitwise_alike_on_any_number_of_ranks(spec, ranks,
                                                                              batch_size, dtype):
    spec, context = spec
    config = TrainConfig(model=spec, context=context, batch_size=batch_size, exact=True,
                         dtype=dtype, optimizer="adamw", **SMALL)  # fmt: skip
    assert digest(train(config, ranks=ranks).params) == digest(train(config, ranks=1).params)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_narrow_transformer_is_bitwise_alike_in_exact_mode_and_near_fp32(precision):
    config = TrainConfig(model="gpt(layers=1,d=4,heads=2)", context=4, batch_size=6,
                         exact=True, loss_scale="none", **SMALL)  # fmt: skip
    narrow = train(config, ranks=3, precision=precision)
    assert digest(narrow.params) == digest(train(config, ranks=1, precision=precision).params)
    wide = train(config, ranks=1)
    assert 0 < float(np.abs(narrow.params - wide.params).max()) < 0.05


@pytest.mark.parametrize("exact, precision", [(False, "fp32"), (True, "bf16")])
def test_overlap_gives_a_transformer_the_same_bits(exact, precision):
    config = TrainConfig(model="gpt(layers=1,d=4,heads=2)", context=4, batch_size=6, exact=exact,
                         precision=precision, bucket_bytes=0, optimizer="adam", **SMALL)
    plain = train(config, ranks=3)
    assert digest(train(config, ranks=3, overlap=True).params) == digest(plain.params)


@requires_mpi
@pytest.mark.mpi_once  # under each library: test_reproducibility's and test_conv's exact runs
def test_under_mpiexec_exact_mode_is_the_serial_runs_bits(tmp_path):
    args = ["--model", "gpt(layers=1,d=4,heads=2)", "--data", "numbers-to-words", "--samples",
            "12", "--context", "4", "--batch-size", "5", "--steps", "3", "--lr", "0.01",
            "--optimizer", "adamw", "--exact"]  # fmt: skip
    saved = tmp_path / "mpi.npz"
    done = run_mpiexec(3, ["-m", "syncsgd.cli", "train", *args, "--save", str(saved),
                           "--quiet"], timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr
    config = TrainConfig(model=args[1], context=4, batch_size=5, exact=True, optimizer="adamw",
                         **SMALL)  # fmt: skip
    serial = train(config, ranks=1)
    with np.load(saved, allow_pickle=False) as got:
        assert all(got[k].tobytes() == v.tobytes() for k, v in serial.arrays().items())


# -- PyTorch: the same GPT from the same saved parameters, the same steps --------------------------


@pytest.mark.parametrize("optimizer, clip_norm", [("adamw", None), ("adam", 0.05)])
def test_a_gpt_trained_on_3_ranks_is_pytorchs_serial_training(tmp_path, optimizer, clip_norm):
    torch = pytest.importorskip("torch", reason="PyTorch (the peers extra) is not installed")
    config = TrainConfig(model="gpt(layers=2,d=8,heads=2)", data="numbers-to-words", samples=24,
                         context=4, batch_size=6, steps=4, lr=0.01, optimizer=optimizer,
                         clip_norm=clip_norm, weight_decay=0.1, shuffle=False)  # fmt: skip
    start = tmp_path / "start.npz"
    train(config, ranks=1, steps=0, save=str(start))
    result = train(config, ranks=3, init=str(start))
    run = prepare(config)
    from benchmarks.transformer import torch_gpt  # the benchmark's: one PyTorch twin

    module = torch_gpt(torch, run.model.outputs, 4, 8, 2, 2).double()
    with np.load(start) as arrays:
        assert list(module.state_dict()) == list(arrays.files)
        module.load_state_dict({name: torch.from_numpy(arrays[name]) for name in arrays.files})
    kind = torch.optim.AdamW if optimizer == "adamw" else torch.optim.Adam
    update = kind(module.parameters(), lr=0.01, weight_decay=0.1)
    for step in range(4):
        rows = slice(step * 6, (step + 1) * 6)
        ids, labels = torch.from_numpy(run.X[rows].astype(np.int64)), torch.from_numpy(run.y[rows])
        update.zero_grad()
        logits = module(ids)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 labels.reshape(-1))  # fmt: skip
        assert result.losses[step] == pytest.approx(loss.item(), rel=1e-9)
        loss.backward()
        if clip_norm is not None:  # clip_grad_norm_'s, but scaled by clip / norm, where torch
            # takes clip / (norm + 1e-6): a relative 1e-6 / norm apart, past the tolerance
            grads = [value.grad for value in module.parameters()]
            norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
            for grad in grads if norm > clip_norm else []:
                grad.mul_(clip_norm / norm)
        update.step()
    theirs = {name: value.detach().numpy() for name, value in module.state_dict().items()}
    assert relative(run.model.to_arrays(result.params), theirs) < 1e-9
