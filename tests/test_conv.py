"""Convolutional layers: conv, maxpool, avgpool, flatten against the oracle and PyTorch, trained on
P ranks (exact mode bitwise for any P), with batchnorm after a conv, --overlap, bf16."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from conftest import requires_mpi, run_mpiexec
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from oracle import layer_backward, layer_forward, named_args, read_spec, serial_sgd

from syncsgd import TrainConfig, train
from syncsgd.nn.network import build, make_layer, parse_spec
from syncsgd.training.run import prepare

SPEC = "conv(4, 3, pad=1) relu maxpool(2) flatten dense"
SHAPE = (2, 6, 6)
SMALL = dict(samples=36, features=72, input_shape=SHAPE, classes=3, batch_size=12, steps=3,
             lr=0.1)  # fmt: skip


def digest(values: np.ndarray) -> str:
    """SHA-256 of an array's bytes."""
    return hashlib.sha256(values.tobytes()).hexdigest()


def relative(ours: dict, theirs: dict) -> float:
    """max |ours - theirs| / max(1, max |theirs|) over every array."""
    scale = max(1.0, max(float(np.abs(v).max()) for v in theirs.values()))
    return max(float(np.abs(ours[k] - theirs[k]).max()) for k in theirs) / scale


def one_layer(text: str, in_shape: tuple, mode: str, x: np.ndarray, dy_seed: int = 1):
    """(the layer, its params, y, the sums of its parameters' gradients, dy, dx) of one layer
    alone, its passes run with the numerics of `mode` as Backprop runs them."""
    from syncsgd.nn.numerics import numerics

    [token] = parse_spec(text)
    layer = make_layer(token)
    layer.build(0, in_shape, 1, False)
    rng = np.random.default_rng(dy_seed)
    p = {param.name: param.draw(rng) for param in layer.params()}
    sizes = [v.size for v in p.values()]
    block = len(x) * max(np.prod(in_shape), np.prod(layer.out_shape))
    nx: Any = numerics(mode == "exact", "fp32", np.dtype(np.float64), max(sizes, default=0), block,
                  sum(sizes))  # fmt: skip
    flat = np.zeros(sum(sizes))
    g, offset = {}, 0
    for name, value in p.items():
        g[name] = flat[offset : offset + value.size].reshape(value.shape)
        offset += value.size
    m = len(x)
    y = np.zeros((m, *layer.out_shape))
    dy = rng.standard_normal(y.shape)
    dx = np.full(x.shape, np.nan)
    nx.begin_step_(flat, m)
    layer.forward_(nx, p, x, y)
    layer.backward_sums_(nx, p, g, x, y, dy)
    layer.backward_input_(nx, p, x, y, dy, dx)
    nx.agree_(flat, np.zeros(1))  # exact mode: the peaks are this pass's own
    nx.layers_(lambda top, bottom: None, 0, 0)  # exact mode: extracted; float: already summed
    return layer, p, y, g, dy, dx


def oracle_of(text: str, p: dict, x: np.ndarray, dy: np.ndarray):
    """(y, sums, dx) of the oracle's layer."""
    [(kind, args, kwargs)] = read_spec(text, with_args=True)
    named = named_args(kind, args, kwargs)
    y = layer_forward(kind, p, x, named)
    sums, dx = layer_backward(kind, p, x, y, dy, named)
    return y, sums, dx


LAYERS = ["conv(3, 3)", "conv(4, 3, pad=1)", "conv(2, 2, stride=2)", "conv(3, 3, stride=2, pad=1)",
          "conv(2, 1)", "conv(3, 5, pad=2)", "conv(2, 5, stride=2, pad=1)", "maxpool(2)",
          "maxpool(3, stride=1)", "avgpool(2)", "avgpool(2, stride=1)", "flatten"]  # fmt: skip


SUMS = {"float": 1e-13, "exact": 1e-10}  # how far the gradient sums may be from the oracle's


# -- one computation two ways: each layer against the oracle's definition -------------------------


@pytest.mark.parametrize("mode", ["float", "exact"])
@pytest.mark.parametrize("text", LAYERS)
@pytest.mark.parametrize("in_shape", [(2, 6, 6), (1, 5, 5)])
def test_each_layer_is_the_oracles(text, in_shape, mode):
    x = np.random.default_rng(0).standard_normal((3, *in_shape))
    _, p, y, g, dy, dx = one_layer(text, in_shape, mode, x)
    y_expected, sums_expected, dx_expected = oracle_of(text, p, x, dy)
    np.testing.assert_allclose(y, y_expected, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(dx, dx_expected, rtol=1e-13, atol=1e-14)
    assert sorted(g) == sorted(sums_expected)
    for name in g:  # exact mode: each product on the fixed point of its sum's bound
        np.testing.assert_allclose(g[name], sums_expected[name], rtol=1e-13, atol=SUMS[mode])


@settings(deadline=None)
@given(channels=st.integers(1, 3), out=st.integers(1, 4), height=st.integers(3, 7),
       width=st.integers(3, 7), kernel=st.integers(1, 3), stride=st.integers(1, 3),
       pad=st.integers(0, 1), m=st.integers(1, 4), exact=st.booleans())  # fmt: skip
def test_any_conv_is_the_oracles(channels, out, height, width, kernel, stride, pad, m, exact):
    text = f"conv({out}, {kernel}, stride={stride}, pad={pad})"
    x = np.random.default_rng(m).standard_normal((m, channels, height, width))
    _, p, y, g, dy, dx = one_layer(text, (channels, height, width), "exact" if exact else "float",
                                   x)  # fmt: skip
    y_expected, sums_expected, dx_expected = oracle_of(text, p, x, dy)
    np.testing.assert_allclose(y, y_expected, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(dx, dx_expected, rtol=1e-13, atol=1e-14)
    for name in g:
        np.testing.assert_allclose(g[name], sums_expected[name], rtol=1e-13,
                                   atol=SUMS["exact" if exact else "float"])  # fmt: skip


@pytest.mark.parametrize("channels_last", [8, 1])  # the patches from NCHW; from channels last
@pytest.mark.parametrize("patch_bytes", [1, 2 * 50 * 36 * 8])  # a sample a chunk; 2, 2 and 1
@pytest.mark.parametrize("text", ["conv(3, 5, pad=2)", "conv(2, 3, stride=2, pad=1)"])
def test_float_mode_conv_in_chunks_of_samples_is_the_oracles(text, patch_bytes, channels_last,
                                                             monkeypatch):  # fmt: skip
    from syncsgd.nn.layers import conv

    monkeypatch.setattr(conv, "PATCH_BYTES", patch_bytes)
    monkeypatch.setattr(conv, "CHANNELS_LAST", channels_last)
    x = np.random.default_rng(5).standard_normal((5, 2, 6, 6))
    _, p, y, g, dy, dx = one_layer(text, (2, 6, 6), "float", x)
    y_expected, sums_expected, dx_expected = oracle_of(text, p, x, dy)
    np.testing.assert_allclose(y, y_expected, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(dx, dx_expected, rtol=1e-13, atol=1e-14)
    for name in g:
        np.testing.assert_allclose(g[name], sums_expected[name], rtol=1e-13, atol=SUMS["float"])


def test_a_max_pool_tie_goes_to_the_first_maximum():
    x = np.zeros((1, 1, 4, 4))
    x[0, 0, 2:, 2:] = [[5.0, 7.0], [7.0, 7.0]]  # three maxima: the first in row-major order
    _, _, y, _, dy, dx = one_layer("maxpool(2)", (1, 4, 4), "float", x)
    assert y[0, 0].tolist() == [[0.0, 0.0], [0.0, 7.0]]
    expected = np.zeros((4, 4))
    expected[::2, ::2] = dy[0, 0]  # the zero windows: their top-left
    expected[2, 2], expected[2, 3] = 0.0, dy[0, 0, 1, 1]
    assert dx[0, 0].tolist() == expected.tolist()
    assert oracle_of("maxpool(2)", {}, x, dy)[2][0, 0].tolist() == expected.tolist()


def test_a_layer_that_does_not_fit_its_input_is_refused_in_one_line():
    with pytest.raises(ValueError, match="--input-shape"):
        build("conv(4, 3) flatten dense", (72,), 3, "xent", "float64")
    with pytest.raises(ValueError, match="does not fit an input of 2x2"):
        build("conv(4, 3) flatten dense", (1, 2, 2), 3, "xent", "float64")
    with pytest.raises(ValueError, match="stride must be >= 1"):
        build("conv(4, 3, stride=0) flatten dense", SHAPE, 3, "xent", "float64")


# -- against PyTorch in float64 -------------------------------------------------------------------


def torch_module(torch, text: str, channels: int):
    """The torch.nn module of one of our layers."""
    [(kind, args, kwargs)] = read_spec(text, with_args=True)
    a = named_args(kind, args, kwargs)
    if kind == "conv":
        return torch.nn.Conv2d(channels, a["out_channels"], a["kernel"], a["stride"], a["pad"])
    if kind == "maxpool":
        return torch.nn.MaxPool2d(a["k"], a["stride"])
    if kind == "avgpool":
        return torch.nn.AvgPool2d(a["k"], a["stride"])
    return torch.nn.Flatten()


@pytest.mark.parametrize("text", LAYERS)
def test_each_layer_is_pytorchs(text):
    torch = pytest.importorskip("torch", reason="PyTorch (the peers extra) is not installed")
    x = np.random.default_rng(4).standard_normal((3, *SHAPE))
    layer, p, y, g, dy, dx = one_layer(text, SHAPE, "float", x)
    module = torch_module(torch, text, SHAPE[0]).double()
    module.load_state_dict({k: torch.from_numpy(v) for k, v in p.items()})
    x_torch = torch.from_numpy(x.copy()).requires_grad_(True)
    y_torch = module(x_torch)
    (y_torch * torch.from_numpy(dy)).sum().backward()
    np.testing.assert_allclose(y, y_torch.detach().numpy(), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(dx, x_torch.grad.numpy(), rtol=1e-12, atol=1e-13)
    for name, param in module.named_parameters():
        np.testing.assert_allclose(g[name], param.grad.numpy(), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("channels_last", [8, 1])  # the conv + relu's patches from NCHW; not
def test_a_torch_sequential_has_the_same_state_dict_and_gradient(channels_last, monkeypatch):
    torch = pytest.importorskip("torch", reason="PyTorch (the peers extra) is not installed")
    from syncsgd.nn.layers import conv
    from syncsgd.nn.local import local_gradient

    monkeypatch.setattr(conv, "CHANNELS_LAST", channels_last)

    network = build(SPEC, SHAPE, 3, "xent", "float64")
    module = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.ReLU(),
                                 torch.nn.MaxPool2d(2), torch.nn.Flatten(),
                                 torch.nn.Linear(36, 3)).double()  # fmt: skip
    assert [(k, tuple(v.shape)) for k, v in module.state_dict().items()] == [
        (name, shape) for name, shape, _ in network.layout()]  # fmt: skip
    params = network.init_params(1)
    module.load_state_dict({k: torch.from_numpy(v) for k, v in network.to_arrays(params).items()})
    rng = np.random.default_rng(2)
    X, y = rng.standard_normal((10, 72)), rng.integers(0, 3, 10)
    logits = module(torch.from_numpy(X).reshape(10, *SHAPE))
    loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(y))
    loss.backward()
    sums = np.zeros(network.n_params)
    loss_sum, _ = local_gradient(network, 10)(params, X, y, sums)
    assert loss_sum / 10 == pytest.approx(float(loss.detach()), rel=1e-12)
    ours = {k: v / 10 for k, v in network.views(sums).items()}
    assert relative(ours, {k: p.grad.numpy() for k, p in module.named_parameters()}) < 1e-12


# -- trained on P ranks ---------------------------------------------------------------------------


def oracle_run(config: TrainConfig) -> tuple[dict, list[float]]:
    """The oracle's serial SGD of this config, from the same first parameters and data."""
    run = prepare(config)
    start = run.model.to_arrays(run.model.init_params(config.seed))
    assert config.steps is not None
    return serial_sgd(run.X, run.y, start, spec=config.model, steps=config.steps,
                      batch_size=config.batch_size, lr=config.lr, in_shape=SHAPE)  # fmt: skip


@functools.cache
def serial_digest(**overrides) -> str:
    """The digest of a run on one rank (computed once per config)."""
    return digest(train(TrainConfig(model=SPEC, **{**SMALL, **overrides}), ranks=1).params)


def test_float_mode_trains_as_the_oracle():
    config = TrainConfig(model=SPEC, **SMALL)
    result = train(config, ranks=3)
    expected, losses = oracle_run(config)
    assert relative(prepare(config).model.to_arrays(result.params), expected) < 1e-9
    assert result.losses == pytest.approx(losses, rel=1e-9)


@pytest.mark.parametrize("ranks", [2, 3, 5])  # against the run on one rank
def test_exact_mode_is_bitwise_for_any_number_of_ranks(ranks):
    config = TrainConfig(model=SPEC, exact=True, **SMALL)
    assert digest(train(config, ranks=ranks).params) == serial_digest(exact=True)


def test_exact_mode_is_bitwise_with_more_ranks_than_samples():
    config = TrainConfig(model=SPEC, exact=True, **{**SMALL, "batch_size": 3})
    assert digest(train(config, ranks=5).params) == serial_digest(exact=True, batch_size=3)


def test_exact_mode_is_near_the_oracle():
    config = TrainConfig(model=SPEC, exact=True, **SMALL)
    result = train(config, ranks=2)
    expected, _ = oracle_run(config)
    assert relative(prepare(config).model.to_arrays(result.params), expected) < 1e-9


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_bf16_exact_mode_is_bitwise_for_any_number_of_ranks(dtype):
    config = TrainConfig(model=SPEC, exact=True, precision="bf16", dtype=dtype, **SMALL)
    serial = serial_digest(exact=True, precision="bf16", dtype=dtype)
    assert digest(train(config, ranks=3).params) == serial


@pytest.mark.parametrize("exact", [False, True])
def test_overlap_gives_the_same_bits(exact):
    config = TrainConfig(model=SPEC, exact=exact, bucket_bytes=0, **SMALL)
    plain, overlapped = train(config, ranks=3), train(config, ranks=3, overlap=True)
    assert digest(overlapped.params) == digest(plain.params)


def test_avgpool_and_a_strided_conv_train_as_the_oracle():
    config = TrainConfig(model="conv(3, 2, stride=2) tanh avgpool(3) flatten dense", **SMALL)
    result = train(config, ranks=2)
    expected, _ = oracle_run(config)
    assert relative(prepare(config).model.to_arrays(result.params), expected) < 1e-9


@pytest.mark.parametrize("ranks, exact", [(3, False), (2, True)])
def test_sync_batchnorm_after_a_conv_trains_as_the_oracle(ranks, exact):
    spec = "conv(3, 3) batchnorm relu flatten dense"
    config = TrainConfig(model=spec, exact=exact, **SMALL)
    result = train(config, ranks=ranks)
    run = prepare(config)
    expected, _ = oracle_run(config)
    ours = {**run.model.to_arrays(result.params), **run.model.running_views(result.running)}
    assert sorted(ours) == sorted(expected)
    assert relative(ours, expected) < 1e-9


@st.composite
def conv_specs(draw: Any) -> tuple[str, tuple[int, int, int]]:
    """(a conv spec that fits, its input shape): conv [batchnorm] activation [pool] ... dense."""
    shape = (draw(st.integers(1, 2)), draw(st.integers(3, 6)), draw(st.integers(3, 6)))
    layers = []
    for _ in range(draw(st.integers(1, 2))):
        kernel, stride = draw(st.integers(1, 3)), draw(st.integers(1, 2))
        pad = draw(st.integers(0, 1))
        layers.append(f"conv({draw(st.integers(1, 3))}, {kernel}, stride={stride}, pad={pad})")
        layers += ["batchnorm"] * draw(st.booleans())
        layers.append(draw(st.sampled_from(["relu", "tanh"])))
        layers += [draw(st.sampled_from(["", "maxpool(2)", "avgpool(2, stride=1)"]))]
    spec = " ".join(layer for layer in [*layers, "flatten", "dense"] if layer)
    try:
        build(spec, shape, 3, "xent", "float64")
    except ValueError:  # a window that does not fit the shape before it
        assume(False)
    return spec, shape


@settings(deadline=None, max_examples=12)
@given(drawn=conv_specs(), ranks=st.integers(2, 6), batch_size=st.integers(1, 10),
       dtype=st.sampled_from(["float64", "float32"]),
       momentum=st.sampled_from([0.0, 0.9]))  # fmt: skip
def test_exact_mode_is_bitwise_for_drawn_conv_specs_and_any_p(drawn, ranks, batch_size, dtype,
                                                              momentum):  # fmt: skip
    spec, shape = drawn
    config = TrainConfig(model=spec, input_shape=shape, samples=20, features=int(np.prod(shape)),
                         classes=3, batch_size=batch_size, steps=2, lr=0.1, momentum=momentum,
                         dtype=dtype, exact=True, seed=3)  # fmt: skip
    serial, distributed = train(config, ranks=1), train(config, ranks=ranks)  # P > B too
    assert digest(distributed.params) == digest(serial.params)
    if serial.running is not None:  # sync batchnorm's statistics
        assert digest(distributed.running) == digest(serial.running)
    assert distributed.losses == serial.losses


# -- the same under a real mpiexec: one SHA-256 for every P and both backends ---------------------

MPI_SPEC = "conv(3, 3, pad=1) batchnorm relu maxpool(2) conv(2, 2) tanh flatten dense"
MPI_ARGS = ["--model", MPI_SPEC, "--samples", "36", "--features", "72", "--input-shape", "2,6,6",
            "--classes", "3", "--batch-size", "12", "--steps", "3", "--lr", "0.1",
            "--momentum", "0.9", "--exact", "--quiet"]  # fmt: skip


def saved_digest(path: Any) -> str:
    """SHA-256 of a saved run's arrays, in name order."""
    with np.load(path, allow_pickle=False) as saved:
        return hashlib.sha256(b"".join(saved[name].tobytes() for name in sorted(saved))).hexdigest()


@functools.cache
def thread_digests() -> dict[str, str]:
    """The SHA-256 of MPI_ARGS's run on 1 and 3 thread ranks (computed once)."""
    import tempfile

    from syncsgd.cli import main

    runs = {}
    with tempfile.TemporaryDirectory() as scratch:
        for ranks in (1, 3):
            path = f"{scratch}/{ranks}.npz"
            assert main(["train", *MPI_ARGS, "--ranks", str(ranks), "--save", path]) == 0
            runs[f"threads P={ranks}"] = saved_digest(path)
    return runs


@requires_mpi
@pytest.mark.parametrize("ranks", [pytest.param(2, marks=pytest.mark.mpi_once), 3])
def test_mpiexec_exact_conv_training_has_one_sha256_for_every_p(tmp_path, ranks):
    path = tmp_path / "mpi.npz"
    done = run_mpiexec(ranks, ["-m", "syncsgd.cli", "train", *MPI_ARGS, "--save", str(path)],
                       timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr
    runs = {**thread_digests(), f"mpiexec P={ranks}": saved_digest(path)}
    assert len(set(runs.values())) == 1, runs


# -- every guarantee of the MLP, for a conv net with batchnorm ------------------------------------

BN_SPEC = "conv(3, 3, pad=1) batchnorm relu maxpool(2) flatten dense"
GUARDED = TrainConfig(model=BN_SPEC, exact=True, momentum=0.9, **SMALL)


def state(result: Any) -> str:
    """One digest of the parameters and the running statistics."""
    return digest(result.params) + digest(result.running)


def overlap_in_buckets(tmp_path: Any) -> None:
    """--overlap with 64-byte buckets on 3 ranks: the serial bits."""
    overlapped = train(GUARDED, ranks=3, overlap=True, bucket_bytes=64)
    assert state(overlapped) == state(train(GUARDED, ranks=1))


def resume_on_another_p(tmp_path: Any) -> None:
    """A checkpoint written on 2 ranks, resumed on 5: the uninterrupted serial bits."""
    train(GUARDED, ranks=2, steps=2, checkpoint=str(tmp_path))
    assert state(train(GUARDED, ranks=5, resume=str(tmp_path))) == state(train(GUARDED, ranks=1))


def fp16_loss_scaling(tmp_path: Any) -> None:
    """fp16 with the dynamic loss scale: the same skipped steps, scales and bits for any P."""
    config = replace(GUARDED, precision="fp16", loss_scale="dynamic", scale_window=1, steps=4)
    serial, parallel = train(config, ranks=1), train(config, ranks=3)
    assert serial.skipped_steps  # 2^16 x the gradient overflows fp16's 65504 at first
    assert parallel.skipped_steps == serial.skipped_steps
    assert parallel.loss_scales == serial.loss_scales and state(parallel) == state(serial)


def verify_and_its_pitfalls(tmp_path: Any) -> None:
    """verify passes the correct run and fails each pitfall that changes a conv net's sums."""
    from syncsgd.apps.verify import TOLERANCE, verify

    config = replace(GUARDED, batch_size=10)  # 4, 3, 3 samples on 3 ranks
    assert verify(config, [3], TOLERANCE)[0].bitwise_equal
    for pitfall in ("mean-of-means", "pad-duplicate", "unsynced-shuffle"):
        assert not verify(replace(config, pitfall=pitfall), [3], TOLERANCE)[0].matches


def timeline_of_each_allreduce(tmp_path: Any) -> None:
    """The timeline holds each step's allreduces: batchnorm's three and the gradient's."""
    import json

    trace = tmp_path / "trace.json"
    train(replace(GUARDED, exact=False), ranks=2, timeline=str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    per_rank = [e for e in events if e.get("cat") == "allreduce" and e["tid"] == 0]
    assert len(per_rank) == 3 * (3 + 1) * 2  # steps x allreduces x (reduce-scatter, allgather)


@pytest.mark.parametrize("check", [overlap_in_buckets, resume_on_another_p, fp16_loss_scaling,
                                   verify_and_its_pitfalls, timeline_of_each_allreduce],
                         ids=lambda check: check.__name__)  # fmt: skip
def test_a_conv_net_keeps_every_guarantee(check, tmp_path):
    check(tmp_path)


def test_an_input_shape_is_refused_unless_it_holds_the_datas_features():
    with pytest.raises(ValueError, match="--input-shape 2,6,5 holds 60 values, the data's"):
        prepare(TrainConfig(model=SPEC, **{**SMALL, "input_shape": (2, 6, 5)}))
    with pytest.raises(ValueError, match="give a --model"):
        TrainConfig(input_shape=SHAPE)


def mostly_zeros(draw: Any, shape: tuple[int, int], dtype: str, seed: int) -> np.ndarray:
    """Values of which about three quarters are zeros (some -0.0), as a conv's pooled deltas."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(shape).astype(dtype)
    values[rng.random(shape) < draw(st.floats(0.0, 1.0))] = 0.0
    values[rng.random(shape) < 0.1] = -0.0
    return values


@given(data=st.data(), m=st.integers(1, 9), depth=st.integers(1, 11), n=st.integers(1, 13),
       dtype=st.sampled_from(["float64", "float32"]), seed=st.integers(0, 2**16))  # fmt: skip
def test_the_sparse_exact_kernels_give_the_dense_kernels_bits(data, m, depth, n, dtype, seed):
    from syncsgd.nn import exact as ex

    x = mostly_zeros(data.draw, (m, depth), dtype, seed)
    W = np.random.default_rng(seed + 1).standard_normal((depth, n)).astype(dtype)
    if data.draw(st.booleans()):  # an inf or a NaN in W: every term is taken, as the dense one
        W[data.draw(st.integers(0, depth - 1)), data.draw(st.integers(0, n - 1))] = data.draw(
            st.sampled_from([np.inf, -np.inf, np.nan]))  # fmt: skip
    dense, sparse = np.full((m, n), 7.0, dtype), np.full((m, n), 7.0, dtype)
    ex.fixed_order_product_(x, W, dense)
    ex.sparse_fixed_order_product_(x, W, sparse, np.empty(depth, np.int64))
    assert dense.tobytes() == sparse.tobytes()

    b = np.random.default_rng(seed + 2).standard_normal((m, n)).astype(dtype)
    magic, unit = 1.5 * 2.0**10, 2.0 ** (10 - ex.UNIT_BITS)
    sums = [np.full((depth, n), 7.0), np.full((depth, n), 7.0)]
    counts = np.zeros(max(depth * n, ex.ACCUMULATOR_TILE_BYTES // 8), np.int64)
    tile = ex.accumulator_rows(n)
    ex.extract_outer_sum_(x, b.astype(np.float64), magic, unit, sums[0],
                          counts[: tile * n].reshape(tile, n))  # fmt: skip
    ex.extract_sparse_outer_sum_(x, b, magic, unit, sums[1], counts[: depth * n].reshape(depth, n))
    assert sums[0].tobytes() == sums[1].tobytes()


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_exact_mode_conv_relu_has_the_dense_kernels_bits(dtype, monkeypatch):
    from syncsgd.nn.numerics import Exact

    config = TrainConfig(model=SPEC, exact=True, dtype=dtype, **SMALL)
    sparse = digest(train(config, ranks=2).params)
    monkeypatch.setattr(Exact, "sparse_outer_sum_", Exact.outer_sum_)
    monkeypatch.setattr(Exact, "sparse_matmul_",
                        lambda self, a, b, out: Exact.matmul_(self, a, b, out, False))  # fmt: skip
    assert digest(train(config, ranks=2).params) == sparse


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_exact_sums_in_panels_give_the_whole_kernels_bits(dtype):
    from syncsgd.nn import exact as ex

    m, depth = 4, 5
    n = ex.panel_columns(m, 10**9) * 2 + 3  # two whole panels and a part of one
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, depth)).astype(dtype)
    a[rng.random(a.shape) < 0.5] = 0.0
    b = rng.standard_normal((m, n)).astype(dtype)
    magic, unit = 1.5 * 2.0**10, 2.0 ** (10 - ex.UNIT_BITS)
    sums = [np.full((depth, n), 7.0), np.full((depth, n), 7.0)]
    counts = np.zeros(depth * n, np.int64)
    ex.extract_outer_sum_(a, b.astype(np.float64), magic, unit, sums[0],
                          counts[: n].reshape(1, n))  # fmt: skip
    ex.extract_outer_sum_in_panels_(a, b, magic, unit, sums[1], np.zeros(m * n), counts)
    assert sums[0].tobytes() == sums[1].tobytes()
