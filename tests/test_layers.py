"""--model networks: the layers against the oracle, every mode and precision, PyTorch's names."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest
from conftest import run_in_process
from hypothesis import given
from hypothesis import strategies as st
from oracle import network_loss_and_grad, serial_sgd

from syncsgd import TrainConfig, train
from syncsgd.nn.layers.base import IDENTITY
from syncsgd.nn.network import build, parse_spec
from syncsgd.training.run import prepare

SMALL = dict(samples=48, features=5, classes=3, batch_size=12, steps=4, lr=0.2)


def digest(params: np.ndarray) -> str:
    """SHA-256 of a flat parameter buffer."""
    return hashlib.sha256(params.tobytes()).hexdigest()


def relative(ours: dict, theirs: dict) -> float:
    """max |ours - theirs| / max(1, max |theirs|) over every array."""
    scale = max(1.0, max(float(np.abs(v).max()) for v in theirs.values()))
    return max(float(np.abs(ours[k] - theirs[k]).max()) for k in theirs) / scale


hidden_layers = st.lists(
    st.tuples(st.integers(1, 7), st.sampled_from(["relu", "tanh", ""])), max_size=3
).map(lambda layers: " ".join(f"dense({w}) {act}".strip() for w, act in layers))
specs = hidden_layers.map(lambda hidden: f"{hidden} dense".strip())


# -- one computation two ways: the layers' sums against the oracle's, per layer --------------------


def local_sums(network, X, y, mode: str, precision: str = "fp32",
               micro_batches: int = 1) -> tuple[float, np.ndarray]:  # fmt: skip
    """The loss sum and the gradient sums of the samples X, in `micro_batches` passes."""
    from syncsgd.nn.local import local_gradient

    params, sums = network.init_params(3), np.zeros(network.n_params, network.dtype)
    gradient = local_gradient(network, len(X), exact=mode == "exact", precision=precision,
                              micro_batches=micro_batches)  # fmt: skip
    loss_sum, _ = gradient(params, X, y, sums)
    return loss_sum, sums


@pytest.mark.parametrize("loss", ["xent", "mse"])
@pytest.mark.parametrize("mode", ["float", "exact"])
def test_gradient_sums_are_the_oracles(loss, mode):
    network = build("dense(6) relu dense(5) tanh dense", (4,), 3, loss, "float64")
    rng = np.random.default_rng(0)
    X = rng.standard_normal((9, 4))
    y = rng.integers(0, 3, 9) if loss == "xent" else rng.standard_normal((9, 3))
    loss_sum, sums = local_sums(network, X, y, mode)
    expected_loss, expected = network_loss_and_grad(network.spec,
                                                    network.to_arrays(network.init_params(3)),
                                                    X, y, loss)  # fmt: skip
    assert loss_sum / 9 == pytest.approx(expected_loss, rel=1e-13)
    ours = {name: view / 9 for name, view in network.views(sums).items()}
    assert relative(ours, expected) < 1e-13


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["float", "exact"])
def test_a_relu_absorbed_by_its_dense_layer_gives_the_relus_own_bits(mode, precision,
                                                                     micro_batches):  # fmt: skip
    spec = "dense(6) relu dense(5) tanh dense(4) relu relu dense"
    absorbing = build(spec, (4,), 3, "xent", "float32")
    assert absorbing.absorbed == {1, 5}  # after a dense; never after tanh or another relu
    apart = build(spec, (4,), 3, "xent", "float32")
    apart.absorbed = frozenset()
    for layer in apart.layers:
        layer.activation = IDENTITY
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((9, 4)), rng.integers(0, 3, 9)
    X[0] = 0.0  # a sample whose first pre-activations are the bias alone
    ours = local_sums(absorbing, X, y, mode, precision, micro_batches)
    theirs = local_sums(apart, X, y, mode, precision, micro_batches)
    assert ours[0] == theirs[0] and ours[1].tobytes() == theirs[1].tobytes()


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["float", "exact"])
def test_a_relu_absorbed_by_its_conv_layer_gives_the_relus_own_bits(mode, precision,
                                                                    micro_batches):  # fmt: skip
    spec = "conv(3, 3, pad=1) relu maxpool(2) conv(2, 3) relu relu flatten dense"
    absorbing = build(spec, (2, 6, 6), 3, "xent", "float32")
    assert absorbing.absorbed == {1, 4}  # after a conv; never after another relu
    apart = build(spec, (2, 6, 6), 3, "xent", "float32")
    apart.absorbed = frozenset()
    for layer in apart.layers:
        layer.activation, layer.mask_handed, layer.masks = IDENTITY, False, False
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((9, 72)), rng.integers(0, 3, 9)
    X[0] = 0.0  # a sample whose first pre-activations are the bias alone
    ours = local_sums(absorbing, X, y, mode, precision, micro_batches)
    theirs = local_sums(apart, X, y, mode, precision, micro_batches)
    assert ours[0] == theirs[0] and ours[1].tobytes() == theirs[1].tobytes()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["float", "exact"])
def test_a_max_pool_after_a_convs_relu_applies_its_mask_with_the_relus_own_bits(mode, precision):
    spec = "conv(3, 3, pad=1) relu maxpool(2) conv(2, 3) relu maxpool(2, stride=1) flatten dense"
    masking = build(spec, (2, 10, 10), 3, "xent", "float32")
    assert [layer.mask_handed for layer in masking.layers if layer.kind == "conv"] == [True, True]
    apart = build(spec, (2, 10, 10), 3, "xent", "float32")
    for layer in apart.layers:
        layer.mask_handed, layer.masks = False, False  # the conv's passes apply the mask
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((9, 200)), rng.integers(0, 3, 9)
    X[0] = 0.0  # a sample whose first pre-activations are the bias alone: whole windows at 0
    ours = local_sums(masking, X, y, mode, precision)
    theirs = local_sums(apart, X, y, mode, precision)
    assert ours[0] == theirs[0] and ours[1].tobytes() == theirs[1].tobytes()


dense_alone = st.lists(st.tuples(st.integers(1, 7), st.booleans()), max_size=3)


@given(layers=dense_alone, in_out=st.booleans(), m=st.integers(0, 9), cut=st.integers(0, 7),
       dtype=st.sampled_from(["float32", "float64"]))  # fmt: skip
def test_dense_layers_alone_take_each_pass_in_one_call_with_the_layers_own_bits(
        layers, in_out, m, cut, dtype):  # fmt: skip
    from syncsgd.nn.backprop import Backprop
    from syncsgd.nn.mlp import mlp
    from syncsgd.nn.numerics import Float

    if in_out:  # the --hidden MLP: W stored (in, out), every hidden layer's relu absorbed
        network = mlp((4, *(width for width, _ in layers), 3), dtype=dtype)
    else:
        spec = " ".join(f"dense({width})" + " relu" * relu for width, relu in layers)
        network = build(f"{spec} dense".strip(), (4,), 3, "xent", dtype)
    rng = np.random.default_rng(m)
    X, y = rng.standard_normal((m, 4)), rng.integers(0, 3, m)
    params = network.init_params(1)
    results = []
    for chained in (True, False):
        nx = Float(network.dtype, network.largest_weight())
        passes = Backprop(network, 9, nx)
        assert passes.chain is not None
        if not chained:
            passes.chain = None
        nx.begin_micro_batch_(0, 1.0)
        sums = np.full(network.n_params, np.nan, network.dtype)  # the first sums are written
        loss_sum, hits = passes.forward_loss_(params, X, y)
        top, split = network.n_layers - 1, min(cut, network.n_layers - 1)
        passes.backward_(sums, top, split + 1)  # in two pieces, as --overlap takes them
        passes.backward_(sums, split, 0)
        results.append((loss_sum, hits, sums.tobytes()))
    assert results[0] == results[1]


def test_only_float_mode_on_dense_layers_alone_takes_the_chain():
    from syncsgd.nn.local import local_gradient

    dense = build("dense(5) relu dense", (4,), 3, "xent", "float32")
    assert local_gradient(dense, 4).passes.chain is not None
    assert local_gradient(dense, 4, exact=True).passes.chain is None
    assert local_gradient(dense, 4, precision="bf16").passes.chain is None
    tanh = build("dense(5) tanh dense", (4,), 3, "xent", "float32")
    assert local_gradient(tanh, 4).passes.chain is None


# -- the headline: distributed == serial for any P, exact mode bitwise for any P -------------------


@given(spec=specs, ranks=st.integers(1, 7), batch_size=st.integers(1, 14),
       loss=st.sampled_from(["xent", "mse"]), momentum=st.sampled_from([0.0, 0.9]))  # fmt: skip
def test_a_network_trains_as_the_oracle_on_any_number_of_ranks(spec, ranks, batch_size, loss,
                                                               momentum):  # fmt: skip
    data = "synthetic-classification" if loss == "xent" else "synthetic-regression"
    config = TrainConfig(model=spec, data=data, loss=loss, samples=30, features=4, classes=3,
                         batch_size=batch_size, steps=3, lr=0.1, momentum=momentum)  # fmt: skip
    result = train(config, ranks=ranks)
    run = prepare(config)
    start = run.model.to_arrays(run.model.init_params(config.seed))
    expected, losses = serial_sgd(run.X, run.y, start, spec=spec, loss=loss, steps=3,
                                  batch_size=batch_size, lr=0.1, momentum=momentum)  # fmt: skip
    assert relative(run.model.to_arrays(result.params), expected) < 1e-9
    assert result.losses == pytest.approx(losses, rel=1e-9)


@given(spec=specs, ranks=st.integers(2, 9), batch_size=st.integers(1, 12),
       precision=st.sampled_from(["fp32", "bf16", "fp16"]),
       dtype=st.sampled_from(["float64", "float32"]))  # fmt: skip
def test_exact_mode_is_bitwise_the_serial_run_for_any_number_of_ranks(
        spec, ranks, batch_size, precision, dtype):  # fmt: skip
    config = TrainConfig(model=spec, exact=True, precision=precision, dtype=dtype, **{
        **SMALL, "batch_size": batch_size, "steps": 3})  # fmt: skip
    serial = train(config, ranks=1)
    assert digest(train(config, ranks=ranks).params) == digest(serial.params)


# -- every cell of mode x precision x overlap ------------------------------------------------------


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_overlap_gives_the_same_bits_in_every_mode_and_precision(exact, precision):
    config = TrainConfig(model="dense(7) tanh dense(6) relu dense", exact=exact,
                         precision=precision, bucket_bytes=0, **SMALL)  # fmt: skip
    plain = train(config, ranks=3)
    overlapped = train(config, ranks=3, overlap=True)
    assert digest(overlapped.params) == digest(plain.params)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_narrow_precision_stays_near_fp32(precision):
    config = TrainConfig(model="dense(8) relu dense", loss_scale="none", **SMALL)
    wide = train(config, ranks=2)
    narrow = train(config, ranks=2, precision=precision)
    assert 0 < float(np.abs(narrow.params - wide.params).max()) < 0.05


# -- PyTorch's names and shapes, and the starting point handed over --------------------------------


def test_parameter_names_and_shapes_are_pytorchs():
    network = build("dense(8) relu dense(6) tanh dense", (5,), 3, "xent", "float64")
    assert [(name, shape) for name, shape, _ in network.layout()] == [
        ("0.weight", (8, 5)), ("0.bias", (8,)), ("2.weight", (6, 8)), ("2.bias", (6,)),
        ("4.weight", (3, 6)), ("4.bias", (3,)),
    ]  # fmt: skip
    assert network.summary() == "dense(8) relu dense(6) tanh dense(3)"


def test_a_torch_sequential_has_the_same_state_dict_and_gradient():
    torch = pytest.importorskip("torch", reason="PyTorch (the peers extra) is not installed")
    network = build("dense(8) relu dense(6) tanh dense", (5,), 3, "xent", "float64")
    params = network.init_params(1)
    module = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 6),
                                 torch.nn.Tanh(), torch.nn.Linear(6, 3)).double()  # fmt: skip
    assert list(module.state_dict()) == network.param_names()
    module.load_state_dict({k: torch.from_numpy(v) for k, v in network.to_arrays(params).items()})
    rng = np.random.default_rng(2)
    X, y = rng.standard_normal((10, 5)), rng.integers(0, 3, 10)
    loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(X)), torch.from_numpy(y))
    loss.backward()
    theirs = {k: p.grad.numpy() for k, p in module.named_parameters()}
    from syncsgd.nn.backprop import Backprop
    from syncsgd.nn.numerics import Float

    sums = np.zeros(network.n_params)
    passes = Backprop(network, 10, Float(network.dtype, network.largest_weight()))
    loss_sum, _ = passes.forward_loss_(params, X, y)
    passes.backward_(sums, network.n_layers - 1, 0)
    assert loss_sum / 10 == pytest.approx(float(loss.detach()), rel=1e-12)
    ours = {k: v / 10 for k, v in network.views(sums).items()}
    assert relative(ours, theirs) < 1e-12


def test_the_saved_starting_point_trains_in_the_oracle_as_in_syncsgd(tmp_path):
    start = tmp_path / "start.npz"
    spec = "dense(6) relu dense"
    train(TrainConfig(model=spec, steps=0, **{k: v for k, v in SMALL.items() if k != "steps"}),
          ranks=1, save=str(start))  # fmt: skip
    with np.load(start) as archive:
        arrays = {name: archive[name] for name in archive.files}
    assert list(arrays) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    config = TrainConfig(model=spec, init=str(start), **SMALL)
    result = train(config, ranks=3)
    run = prepare(config)
    expected, _ = serial_sgd(run.X, run.y, arrays, spec=spec, steps=SMALL["steps"],
                             batch_size=SMALL["batch_size"], lr=SMALL["lr"])  # fmt: skip
    assert relative(run.model.to_arrays(result.params), expected) < 1e-12


# -- the spec's grammar: one line naming the bad token ---------------------------------------------


@pytest.mark.parametrize("spec, named", [
    ("dense(8) relux dense", "'relux'"),
    ("dense(8 relu", "unbalanced parentheses in 'dense(8'"),
    ("dense(x) dense", "'x'"),
    ("dense(4, 5) dense", "too many arguments"),
    ("dense(width=4, depth=2)", "no argument 'depth'"),
    ("", "names no layer"),
])  # fmt: skip
def test_a_malformed_spec_is_one_line_naming_the_token(spec, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        parse_spec(spec)


def test_a_spec_that_does_not_fit_the_data_is_refused():
    with pytest.raises(ValueError, match="needs a width"):
        build("dense relu dense", (4,), 3, "xent", "float64")
    with pytest.raises(ValueError, match="3 outputs"):
        build("dense(4) relu", (4,), 3, "xent", "float64")


def test_the_command_line_refuses_a_bad_spec_in_one_line():
    done = subprocess.run([sys.executable, "-m", "syncsgd.cli", "train", "--model",
                           "dense(8) rellu dense"], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode != 0
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert "'rellu'" in done.stderr


def test_help_lists_every_layer():
    done = run_in_process(["train", "--help"])
    for signature in ("dense(width)", "relu", "tanh"):
        assert signature in done.stdout


# -- batchnorm where the spec puts it: sync is serial SGD, local depends on P ----------------------

BN_SPEC = "dense(6) batchnorm relu dense(5) batchnorm tanh dense"


@pytest.mark.parametrize("ranks, batch_size", [(1, 12), (3, 12), (5, 7), (13, 12)])
def test_sync_batchnorm_trains_as_the_oracle(ranks, batch_size):
    config = TrainConfig(model=BN_SPEC, **{**SMALL, "batch_size": batch_size})
    result = train(config, ranks=ranks)
    run = prepare(config)
    start = run.model.to_arrays(run.model.init_params(config.seed))
    expected, _ = serial_sgd(run.X, run.y, start, spec=BN_SPEC, steps=SMALL["steps"],
                             batch_size=batch_size, lr=SMALL["lr"])  # fmt: skip
    ours = {**run.model.to_arrays(result.params), **run.model.running_views(result.running)}
    assert sorted(ours) == sorted(expected)
    assert relative(ours, expected) < 1e-9


def test_local_batchnorm_on_one_rank_is_the_serial_run_and_differs_on_two():
    config = TrainConfig(model=BN_SPEC, batchnorm="local", **SMALL)
    sync_one = train(config, ranks=1, batchnorm="sync")
    assert digest(train(config, ranks=1).params) == digest(sync_one.params)
    assert digest(train(config, ranks=2).params) != digest(sync_one.params)


@given(ranks=st.integers(2, 6), batch_size=st.integers(2, 12),  # a batch of 1: refused
       precision=st.sampled_from(["fp32", "bf16"]))  # fmt: skip
def test_exact_sync_batchnorm_is_bitwise_for_any_number_of_ranks(ranks, batch_size, precision):
    config = TrainConfig(model=BN_SPEC, exact=True, precision=precision,
                         **{**SMALL, "batch_size": batch_size, "steps": 3})  # fmt: skip
    serial = train(config, ranks=1)
    distributed = train(config, ranks=ranks)
    assert digest(distributed.params) == digest(serial.params)
    assert digest(distributed.running) == digest(serial.running)


@pytest.mark.parametrize("exact", [False, True])
def test_overlap_with_sync_batchnorm_gives_the_same_bits(exact):
    config = TrainConfig(model=BN_SPEC, exact=exact, bucket_bytes=0, **SMALL)
    plain, overlapped = train(config, ranks=3), train(config, ranks=3, overlap=True)
    assert digest(overlapped.params) == digest(plain.params)
    assert digest(overlapped.running) == digest(plain.running)


def test_batchnorm_state_dict_is_pytorchs_and_evaluation_uses_the_running_statistics(tmp_path):
    torch = pytest.importorskip("torch", reason="PyTorch (the peers extra) is not installed")
    saved = tmp_path / "bn.npz"
    config = TrainConfig(model="dense(6) batchnorm relu dense", **SMALL)
    result = train(config, ranks=2, save=str(saved))
    module = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.BatchNorm1d(6),
                                 torch.nn.ReLU(), torch.nn.Linear(6, 3)).double()  # fmt: skip
    with np.load(saved) as archive:
        state = {name: torch.from_numpy(archive[name]) for name in archive.files}
    missing, unexpected = module.load_state_dict(state, strict=False)
    assert set(missing) <= {"1.num_batches_tracked"} and not unexpected
    module.eval()
    run = prepare(config)
    logits = module(torch.from_numpy(run.X))
    loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(run.y))
    assert result.final_loss == pytest.approx(float(loss.detach()), rel=1e-12)
