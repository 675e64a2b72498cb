"""BatchNorm: sync equals serial large-batch SGD with BatchNorm; local depends on P."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from conftest import requires_mpi, run_in_process, run_mpiexec
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import evaluation_loss, serial_sgd

from syncsgd import TrainConfig, train
from syncsgd.nn.local import local_gradient
from syncsgd.nn.mlp import mlp, sizes_of
from syncsgd.nn.network import Network
from syncsgd.training.loop import prepare


def oracle_for(config: TrainConfig) -> tuple[dict, list[float]]:
    """The plain-NumPy serial run with BatchNorm over the whole batch, from the same start."""
    run = prepare(config)
    init = run.model.to_arrays(run.model.init_params(config.seed))
    return serial_sgd(
        run.X, run.y, init, hidden_activation=config.activation, loss=config.loss,
        steps=run.steps, batch_size=config.batch_size, seed=config.seed, lr=config.lr,
        momentum=config.momentum, weight_decay=config.weight_decay,
        dtype=np.dtype(config.dtype), bn_eps=config.bn_eps, bn_momentum=config.bn_momentum,
    )  # fmt: skip


def relative_difference(ours: dict, theirs: dict) -> float:
    """max |ours - theirs| over every array, relative to max(1, max |theirs|)."""
    assert set(ours) == set(theirs)
    scale = max(1.0, max(float(np.abs(v).max()) for v in theirs.values()))
    return max(float(np.abs(ours[k] - theirs[k]).max()) for k in theirs) / scale


def small(**options) -> TrainConfig:
    """A few steps of a small classification run with BatchNorm."""
    defaults = dict(samples=97, features=5, hidden=(6, 4), batch_size=20, steps=6, seed=3,
                    lr=0.05, batchnorm="sync")  # fmt: skip
    return TrainConfig(**{**defaults, **options})


@given(
    ranks=st.integers(1, 12),
    batch_size=st.integers(2, 30),  # a batch of 1 is refused in training, as PyTorch does
    hidden=st.lists(st.integers(1, 7), min_size=1, max_size=2).map(tuple),
    dtype=st.sampled_from(["float64", "float32"]),
    activation=st.sampled_from(["relu", "tanh"]),
    loss=st.sampled_from(["xent", "mse"]),
    momentum=st.sampled_from([0.0, 0.9]),
)
@settings(max_examples=20)
def test_sync_equals_the_serial_oracle(ranks, batch_size, hidden, dtype, activation, loss,
                                       momentum):  # fmt: skip
    data = "synthetic-classification" if loss == "xent" else "synthetic-regression-mlp"
    config = small(batch_size=batch_size, hidden=hidden, dtype=dtype, activation=activation,
                   loss=loss, data=data, momentum=momentum, weight_decay=0.01)  # fmt: skip
    tolerance = 1e-9 if dtype == "float64" else 1e-4
    expected, expected_losses = oracle_for(config)
    result = train(config, ranks=ranks)
    assert relative_difference(result.arrays(), expected) <= tolerance
    np.testing.assert_allclose(result.losses, expected_losses, rtol=10 * tolerance,
                               atol=10 * tolerance)  # fmt: skip
    run = prepare(config)
    held = evaluation_loss(expected, run.X, run.y, hidden_activation=activation, loss=loss)
    assert result.final_loss == pytest.approx(held, rel=10 * tolerance, abs=10 * tolerance)


@given(
    ranks=st.lists(st.integers(2, 12), min_size=1, max_size=3),
    batch_size=st.integers(2, 24),  # a batch of 1 is refused in training
    hidden=st.lists(st.integers(1, 7), min_size=1, max_size=2).map(tuple),
    dtype=st.sampled_from(["float64", "float32"]),
    loss=st.sampled_from(["xent", "mse"]),
)
@settings(max_examples=15)
def test_exact_sync_is_bitwise_the_same_for_every_p(ranks, batch_size, hidden, dtype, loss):
    data = "synthetic-classification" if loss == "xent" else "synthetic-regression-mlp"
    config = small(batch_size=batch_size, hidden=hidden, dtype=dtype, loss=loss, data=data,
                   exact=True, momentum=0.9)  # fmt: skip
    serial = train(config, ranks=1).arrays()
    for count in ranks:  # P > B included: ranks with empty shards send zero sums
        got = train(config, ranks=count).arrays()
        assert all(got[k].tobytes() == serial[k].tobytes() for k in serial), count
    if batch_size >= 2 and dtype == "float64":  # and within float64 rounding of the oracle
        expected, _ = oracle_for(config)
        assert relative_difference(serial, expected) <= 1e-9


@given(
    ranks=st.integers(2, 6),
    extra=st.integers(1, 5),
    exact=st.booleans(),
    dtype=st.sampled_from(["float64", "float32"]),
)
@settings(max_examples=10)
def test_local_is_sync_at_one_rank_and_differs_on_uneven_shards(ranks, extra, exact, dtype):
    batch_size = 2 * ranks + extra % ranks or 2 * ranks + 1  # not a multiple of P
    config = small(batch_size=batch_size, exact=exact, dtype=dtype)
    local = TrainConfig(**{**config.__dict__, "batchnorm": "local"})
    sync_one = train(config, ranks=1)
    assert train(local, ranks=1).params.tobytes() == sync_one.params.tobytes()
    assert relative_difference(train(local, ranks=ranks).arrays(), sync_one.arrays()) > 1e-6


def local_oracle(config: TrainConfig, ranks: int) -> dict:
    """Serial SGD whose BatchNorm normalises each of the P contiguous shards on its own."""
    from oracle import batch_indices, initial_running, loss_and_grad, sgd_update, update_running

    run = prepare(config)
    theta = run.model.to_arrays(run.model.init_params(config.seed))
    running, velocity = initial_running(theta), None
    for step in range(run.steps):
        rows = batch_indices(step, len(run.X), config.batch_size, config.seed, config.shuffle)
        total = {name: np.zeros_like(value) for name, value in theta.items()}
        for number, shard in enumerate(np.array_split(rows, ranks)):
            if len(shard) == 0:  # an empty shard contributes nothing
                continue
            saved: list = []
            _, grads = loss_and_grad(theta, run.X[shard], run.y[shard], saved=saved,
                                     hidden_activation=config.activation, loss=config.loss)
            for name in total:  # the shard's gradient sum
                total[name] += grads[name] * len(shard)
            if number == 0:  # the run's running statistics are rank 0's
                update_running(running, saved, config.bn_momentum)
        mean = {name: value / len(rows) for name, value in total.items()}
        theta, velocity, _ = sgd_update(theta, mean, velocity, rate=config.lr,
                                        momentum=config.momentum)  # fmt: skip
    return {**theta, **running}


# uneven shards of 2 and more: a shard of 1 is refused in training (its output all zeros)
@pytest.mark.parametrize("ranks, batch_size", [(3, 20), (4, 9), (7, 16)])
def test_local_equals_serial_sgd_with_per_shard_statistics(ranks, batch_size):
    config = small(batch_size=batch_size, batchnorm="local", momentum=0.9)
    result = train(config, ranks=ranks)
    assert relative_difference(result.arrays(), local_oracle(config, ranks)) <= 1e-9


def finite_difference_gradient(model: Network, params: np.ndarray, X, y, h: float = 1e-6):
    """The mean loss's gradient by central differences, through the training-mode forward."""
    local = local_gradient(model, len(X))  # the statistics of the shard alone: no ranks
    running, sums = model.init_running(), np.zeros(model.n_params)

    def loss(theta: np.ndarray) -> float:
        return local(theta, X, y, sums, running=running)[0] / len(X)

    gradient = np.empty(model.n_params)
    for k in range(model.n_params):
        up, down = params.copy(), params.copy()
        up[k] += h
        down[k] -= h
        gradient[k] = (loss(up) - loss(down)) / (2 * h)
    loss(params)
    return gradient, sums[: model.n_params] / len(X)


@pytest.mark.parametrize("activation", ["tanh", "relu"])
def test_backward_matches_finite_differences(activation):
    model = mlp((4, 5, 3, 3), activation=activation, batchnorm="local")
    rng = np.random.default_rng(5)
    params = model.init_params(1)
    views = model.views(params)
    for layer in (0, 1):  # gamma and beta away from 1 and 0: their gradients matter
        views[f"gamma{layer}"][...] = rng.uniform(0.5, 1.5, views[f"gamma{layer}"].shape)
        views[f"beta{layer}"][...] = rng.uniform(-0.5, 0.5, views[f"beta{layer}"].shape)
    X, y = rng.standard_normal((9, 4)), rng.integers(0, 3, 9)
    numeric, analytic = finite_difference_gradient(model, params, X, y)
    np.testing.assert_allclose(analytic, numeric, rtol=1e-5, atol=1e-7)


def test_none_keeps_the_layout_and_the_defaults():
    plain = mlp((5, 4, 3))
    assert plain.param_names() == ["W0", "b0", "W1", "b1"] and plain.n_running == 0
    normed = mlp((5, 4, 3), batchnorm="sync")
    assert normed.param_names() == ["W0", "b0", "gamma0", "beta0", "W1", "b1"]
    views = normed.views(normed.init_params(0))
    assert (views["gamma0"] == 1).all() and (views["beta0"] == 0).all()
    assert np.array_equal(views["W0"], plain.views(plain.init_params(0))["W0"])  # same draws
    stats = normed.running_views(normed.init_running())
    assert (stats["running_mean0"] == 0).all() and (stats["running_var0"] == 1).all()


@pytest.mark.parametrize("exact", [False, True])
def test_resume_carries_the_running_statistics_bitwise(tmp_path, exact):
    config = small(steps=8, exact=exact, momentum=0.9)
    whole = train(config, ranks=2)
    train(config, ranks=2, steps=3, checkpoint=str(tmp_path))
    resumed = train(config, ranks=3 if exact else 2, resume=str(tmp_path))
    assert resumed.running is not None and whole.running is not None
    assert resumed.running.tobytes() == whole.running.tobytes()
    assert resumed.params.tobytes() == whole.params.tobytes()


def test_save_and_init_carry_the_batchnorm_keys(tmp_path):
    saved = tmp_path / "bn.npz"
    result = train(small(), ranks=2, save=str(saved))
    with np.load(saved) as arrays:
        assert {"gamma0", "beta1", "running_mean0", "running_var1"} <= set(arrays.files)
        assert arrays["running_var1"].tobytes() == result.arrays()["running_var1"].tobytes()
    # --init starts from the saved statistics: one step moves them by a tenth of the way.
    again = train(small(steps=1, bn_momentum=0.0), ranks=1, init=str(saved))
    assert again.running.tobytes() == result.running.tobytes()
    # A file saved without BatchNorm starts gamma, beta and the statistics at their defaults.
    plain = tmp_path / "plain.npz"
    train(small(batchnorm="none"), ranks=1, save=str(plain))
    started = train(small(steps=1, bn_momentum=0.0), ranks=1, init=str(plain))
    assert started.running.tobytes() == started.model.init_running().tobytes()
    run = prepare(small(init=str(plain)))
    views = run.model.views(run.init)
    assert (views["gamma0"] == 1).all() and (views["beta0"] == 0).all()


def cli(*args: str) -> subprocess.CompletedProcess:
    """`syncsgd args` by the console script's main in this process (tests/test_cli_train.py runs
    it in fresh ones)."""
    return run_in_process(list(args))


@pytest.mark.parametrize("args, says", [
    (["--batchnorm", "sync", "--hidden", ""], "hidden layers"),
    (["--bn-momentum", "1.5"], "--bn-momentum must be in [0, 1]"),
    (["--bn-eps", "0"], "--bn-eps"),
    (["--batchnorm", "bogus"], "--batchnorm"),
])  # fmt: skip
def test_bad_batchnorm_options_are_one_line(args, says):
    done = cli("train", "--steps", "1", *args)
    assert done.returncode != 0 and says in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) <= 2


def test_verify_local_names_the_cause_and_sync_passes():
    common = ["verify", "--ranks", "1,3", "--samples", "120", "--features", "5", "--hidden", "6",
              "--batch-size", "20", "--steps", "4", "--exact"]  # fmt: skip
    local = cli(*common, "--batchnorm", "local")
    assert local.returncode == 1, local.stdout + local.stderr
    assert "statistics of its own shard" in local.stdout.replace("\n# ", " ")
    synced = cli(*common, "--batchnorm", "sync")
    assert synced.returncode == 0, synced.stdout + synced.stderr


# -- PyTorch's BatchNorm1d in training mode, on the whole batch --


def torch_run(config: TrainConfig):
    """The same run in PyTorch: Linear, BatchNorm1d, activation; SGD on the same batches."""
    torch = pytest.importorskip("torch")
    from oracle import batch_indices

    run = prepare(config)
    init = run.model.to_arrays(run.model.init_params(config.seed))
    layers: list = []
    n_layers = len(sizes_of(run.model)) - 1  # dense layers
    for layer in range(n_layers):
        linear = torch.nn.Linear(*init[f"W{layer}"].shape).double()
        linear.weight.data = torch.tensor(init[f"W{layer}"].T.copy())
        linear.bias.data = torch.tensor(init[f"b{layer}"])
        layers.append(linear)
        if layer < n_layers - 1:
            norm = torch.nn.BatchNorm1d(linear.out_features, eps=config.bn_eps,
                                        momentum=config.bn_momentum).double()  # fmt: skip
            layers += [norm, torch.nn.ReLU() if config.activation == "relu" else torch.nn.Tanh()]
    net = torch.nn.Sequential(*layers).train()
    sgd = torch.optim.SGD(net.parameters(), lr=config.lr, momentum=config.momentum,
                          weight_decay=config.weight_decay)  # fmt: skip
    for step in range(run.steps):
        rows = batch_indices(step, len(run.X), config.batch_size, config.seed, config.shuffle)
        logits = net(torch.tensor(run.X[rows]))
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor(run.y[rows]))
        sgd.zero_grad()
        loss.backward()
        sgd.step()
    return net


def test_sync_equals_torch_batchnorm1d_in_training_mode():
    config = small(momentum=0.9, weight_decay=0.01, steps=8)
    net = torch_run(config)
    trained = train(config, ranks=3)
    result = trained.arrays()
    linears = [m for m in net if hasattr(m, "weight") and m.weight.dim() == 2]
    norms = [m for m in net if hasattr(m, "running_mean")]
    theirs = {}
    for layer, linear in enumerate(linears):
        theirs[f"W{layer}"] = linear.weight.detach().numpy().T
        theirs[f"b{layer}"] = linear.bias.detach().numpy()
    for layer, norm in enumerate(norms):
        theirs[f"gamma{layer}"] = norm.weight.detach().numpy()
        theirs[f"beta{layer}"] = norm.bias.detach().numpy()
        theirs[f"running_mean{layer}"] = norm.running_mean.numpy()
        theirs[f"running_var{layer}"] = norm.running_var.numpy()
    assert relative_difference(result, theirs) <= 1e-9
    import torch  # evaluation mode: the running statistics, on every sample

    run = prepare(config)
    with torch.no_grad():
        logits = net.eval()(torch.tensor(run.X))
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor(run.y)).item()
    assert trained.final_loss == pytest.approx(loss, rel=1e-9)


# -- the same under a real mpiexec --


@requires_mpi
@pytest.mark.mpi_once  # under each library: test_overlap's mpiexec BatchNorm runs
def test_under_mpiexec_sync_is_exact_and_local_differs(tmp_path):
    args = ["--samples", "97", "--features", "5", "--hidden", "6,4", "--batch-size", "20",
            "--steps", "6", "--seed", "3", "--lr", "0.05"]  # fmt: skip
    for mode in ("sync", "local"):
        saved = tmp_path / f"{mode}.npz"
        done = run_mpiexec(3, ["-m", "syncsgd.cli", "train", "--exact", "--batchnorm", mode,
                               *args, "--save", str(saved), "--quiet"], timeout=240)  # fmt: skip
        assert done.returncode == 0, done.stderr
        serial = train(small(exact=True, batchnorm=mode), ranks=1).arrays()
        with np.load(saved, allow_pickle=False) as got:
            same = all(got[k].tobytes() == v.tobytes() for k, v in serial.items())
        assert same == (mode == "sync"), mode
    saved = tmp_path / "float.npz"  # float mode: within 1e-9 of the oracle
    done = run_mpiexec(3, ["-m", "syncsgd.cli", "train", "--batchnorm", "sync", *args,
                           "--save", str(saved), "--quiet"], timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr
    expected, _ = oracle_for(small())
    with np.load(saved, allow_pickle=False) as got:
        assert relative_difference(dict(got), expected) <= 1e-9


# -- what the extra allreduces cost --


def test_the_cost_model_predicts_the_batchnorm_allreduces():
    from syncsgd.apps.costmodel import Params, batchnorm_messages, batchnorm_seconds, predict

    assert batchnorm_messages([4]) == [40, 40, 64]
    assert len(batchnorm_messages([4, 5], exact=True)) == 12
    params = Params(1e-6, 1e-9, 0.0)
    assert batchnorm_seconds([4], "ring", 8, params) == pytest.approx(
        2 * predict("ring", 8, 40, params) + predict("ring", 8, 64, params))
    done = cli("model", "--ranks", "2,1024", "--batchnorm", "64,64")
    assert done.returncode == 0 and "--batchnorm sync, hidden 64,64: 6 more" in done.stdout


def test_timeline_and_bench_step_show_the_batchnorm_allreduces(tmp_path):
    import json

    trace = tmp_path / "trace.json"
    train(small(steps=2), ranks=2, timeline=str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    per_rank = [e for e in events if e.get("cat") == "allreduce" and e["tid"] == 0]
    # Two steps, each: 3 BatchNorm allreduces per hidden layer (2 layers) and the gradient's;
    # the ring on 2 ranks takes one reduce-scatter and one allgather step per allreduce.
    assert len(per_rank) == 2 * (3 * 2 + 1) * 2
    report = tmp_path / "bench.json"
    done = cli("bench", "step", "--ranks", "2", "--scaling", "strong", "--global-batch", "32",
               "--samples", "64", "--features", "8", "--hidden", "8", "--steps", "3",
               "--repeats", "1", "--warmup", "1", "--cli-runs", "0", "--batchnorm", "sync",
               "--no-overhead",
               "--json", str(report))  # fmt: skip
    assert done.returncode == 0, done.stderr
    row = json.loads(report.read_text())["scaling"][0]
    assert 0 < row["batchnorm_allreduce_ms"] <= row["allreduce_ms"]


@pytest.mark.parametrize("mode, exact", [("sync", False), ("sync", True), ("local", False)])
def test_overlap_composes_with_batchnorm_bitwise(mode, exact):
    # More cases (P, sizes, buckets, MPI) in test_overlap.py.
    options = dict(batchnorm=mode, exact=exact, bucket_bytes=0)
    plain = train(small(**options), ranks=3)
    overlapped = train(small(**options, overlap=True), ranks=3)
    assert overlapped.params.tobytes() == plain.params.tobytes()
    assert overlapped.running.tobytes() == plain.running.tobytes()
