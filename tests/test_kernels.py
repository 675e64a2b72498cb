"""The layered passes (nn.local's local gradient and evaluate on an MLP) against a per-sample
plain-NumPy reference and against finite differences; the step's own kernels (gather_rows_,
divide_finite_), the BLAS threads and the first-load notice.

Tolerances: float64 kernels match the float64 reference to rtol 1e-10 (loss) and atol 1e-10 x the
largest gradient entry. float32 kernels are compared with the float64 reference run on the same
(float32) inputs, to 2e-4 relative (loss) and 2e-4 x (1 + the largest gradient entry) absolute: the
micro-batches and layers here are at most 16 wide, so float32 rounding (6e-8 per operation) stays
orders of magnitude below that.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from syncsgd.nn.backprop import EVALUATE_CHUNK, evaluate
from syncsgd.nn.kernels import divide_finite_, gather_rows_
from syncsgd.nn.local import local_gradient
from syncsgd.nn.mlp import mlp, sizes_of

TOLERANCE = {np.dtype(np.float64): 1e-10, np.dtype(np.float32): 2e-4}


def unpack(sizes, flat):
    """Weights and biases from the flat buffer, by the documented layout (W0, b0, W1, b1, ...)."""
    weights, biases, offset = [], [], 0
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:], strict=False):
        weights.append(flat[offset : offset + fan_in * fan_out].reshape(fan_in, fan_out))
        offset += fan_in * fan_out
        biases.append(flat[offset : offset + fan_out])
        offset += fan_out
    return weights, biases


def activation_of(model):
    """The hidden layers' activation of an MLP: "relu" or "tanh" (relu if it has none)."""
    return "tanh" if any(layer.kind == "tanh" for layer in model.layers) else "relu"


def reference(model, params, X, y):
    """(loss sum, hits, gradient sum) in float64, one sample at a time with outer products."""
    weights, biases = unpack(sizes_of(model), params.astype(np.float64))
    activation = activation_of(model)
    loss_sum, hits = 0.0, 0
    grads_W = [np.zeros_like(W) for W in weights]
    grads_b = [np.zeros_like(b) for b in biases]
    for i in range(len(X)):
        inputs = [X[i].astype(np.float64)]
        for layer, (W, b) in enumerate(zip(weights, biases, strict=True)):
            z = inputs[-1] @ W + b
            if layer < len(weights) - 1:
                z = np.maximum(z, 0) if activation == "relu" else np.tanh(z)
            inputs.append(z)
        logits = inputs.pop()
        if model.loss == "xent":
            top = logits.max()
            log_total = top + np.log(np.sum(np.exp(logits - top)))
            loss_sum += log_total - logits[y[i]]
            hits += int(np.argmax(logits) == y[i])
            delta = np.exp(logits - log_total)
            delta[y[i]] -= 1
        else:
            error = logits - y[i].astype(np.float64)
            loss_sum += np.mean(error**2)
            delta = 2 * error / len(error)
        for layer in range(len(weights) - 1, -1, -1):
            grads_W[layer] += np.outer(inputs[layer], delta)
            grads_b[layer] += delta
            if layer:
                a = inputs[layer]
                slope = (a > 0).astype(float) if activation == "relu" else 1 - a**2
                delta = (weights[layer] @ delta) * slope
    flat = [part for W, b in zip(grads_W, grads_b, strict=True) for part in (W.ravel(), b)]
    return loss_sum, hits, np.concatenate(flat)


def make_batch(model, m, seed, scale=1.0):
    """Random inputs and targets for `model` (labels for xent, floats for mse)."""
    rng = np.random.default_rng(seed)
    X = (scale * rng.standard_normal((m, model.in_shape[0]))).astype(model.dtype)
    if model.loss == "xent":
        y = rng.integers(0, model.outputs, m)
    else:
        y = rng.standard_normal((m, model.outputs)).astype(model.dtype)
    return X, y


def perturbed_params(model, seed):
    """Initial parameters with random biases too, so that bias paths are exercised."""
    params = model.init_params(seed)
    rng = np.random.default_rng(seed + 1)
    params += (0.1 * rng.standard_normal(model.n_params)).astype(model.dtype)
    return params


def assert_matches_reference(model, params, X, y, loss_sum, hits, grad):
    """Kernel results against the reference at the dtype's tolerance."""
    ref_loss, ref_hits, ref_grad = reference(model, params, X, y)
    tolerance = TOLERANCE[model.dtype]
    assert loss_sum == pytest.approx(ref_loss, rel=tolerance, abs=tolerance)
    if model.dtype == np.float64:
        assert hits == ref_hits
    else:  # a float32 argmax may flip on a near tie
        assert abs(hits - ref_hits) <= 1
    scale = 1 + np.abs(ref_grad).max()
    np.testing.assert_allclose(grad, ref_grad, rtol=0, atol=tolerance * scale)


ACTIVATIONS = ["relu", "tanh"]
LOSSES = ["xent", "mse"]
HIDDEN = [(), (6,), (5, 4), (4, 3, 5)]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("hidden", HIDDEN, ids=lambda h: f"hidden{len(h)}")
@pytest.mark.parametrize("m", [0, 1, 7])
def test_gradient_matches_reference(activation, loss, hidden, m):
    model = mlp((5, *hidden, 3), activation, loss=loss)
    params = perturbed_params(model, 1)
    X, y = make_batch(model, m, 2)
    grad = np.full(model.n_params, np.nan)  # must be overwritten, not accumulated into
    loss_sum, hits = local_gradient(model, 8)(params, X, y, grad)
    assert isinstance(loss_sum, float) and isinstance(hits, int)
    assert_matches_reference(model, params, X, y, loss_sum, hits, grad)
    if m == 0:
        assert loss_sum == 0.0 and hits == 0 and not grad.any()
    if loss == "mse":
        assert hits == 0


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("hidden", HIDDEN, ids=lambda h: f"hidden{len(h)}")
def test_gradient_matches_central_differences(activation, loss, hidden):
    model = mlp((4, *hidden, 3), activation, loss=loss)
    params = perturbed_params(model, 3)
    X, y = make_batch(model, 5, 4)
    gradient = local_gradient(model, 5)
    grad, scratch = np.empty(model.n_params), np.empty(model.n_params)
    gradient(params, X, y, grad)
    step = 1e-6
    numeric = np.empty(model.n_params)
    for k in range(model.n_params):
        shifted = params.copy()
        shifted[k] += step
        above, _ = gradient(shifted, X, y, scratch)  # the loss sum of the same passes
        shifted[k] -= 2 * step
        below, _ = gradient(shifted, X, y, scratch)
        numeric[k] = (above - below) / (2 * step)
    np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-7)


@given(
    sizes=st.lists(st.integers(1, 16), min_size=2, max_size=5).map(tuple),
    m=st.integers(0, 16),
    spare=st.integers(0, 3),
    activation=st.sampled_from(ACTIVATIONS),
    loss=st.sampled_from(LOSSES),
    dtype=st.sampled_from([np.float64, np.float32]),
    seed=st.integers(0, 2**16),
)
def test_gradient_matches_reference_for_any_shape(sizes, m, spare, activation, loss, dtype, seed):
    model = mlp(sizes, activation, loss=loss, dtype=dtype)
    params = perturbed_params(model, seed)
    X, y = make_batch(model, m, seed)
    grad = np.full(model.n_params, 123, dtype=dtype)
    loss_sum, hits = local_gradient(model, m + spare)(params, X, y, grad)
    assert_matches_reference(model, params, X, y, loss_sum, hits, grad)


def test_workspaces_are_reused_across_micro_batch_sizes():
    model = mlp((6, 8, 5, 4), "tanh", loss="xent")
    params = perturbed_params(model, 5)
    gradient = local_gradient(model, 9)
    grad = np.empty(model.n_params)
    for m in (9, 2, 0, 9, 5):
        X, y = make_batch(model, m, m)
        loss_sum, hits = gradient(params, X, y, grad)
        assert_matches_reference(model, params, X, y, loss_sum, hits, grad)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_cross_entropy_is_stable_for_huge_logits(dtype):
    model = mlp((3, 4), "relu", loss="xent", dtype=dtype)
    params = perturbed_params(model, 0)
    X, y = make_batch(model, 6, 1, scale=1e4)  # logits of order 1e4: exp would overflow
    grad = np.empty(model.n_params, dtype=dtype)
    loss_sum, hits = local_gradient(model, 6)(params, X, y, grad)
    assert np.isfinite(loss_sum) and np.all(np.isfinite(grad))
    assert_matches_reference(model, params, X, y, loss_sum, hits, grad)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_a_tie_counts_the_first_maximum_as_argmax_does(dtype):
    model = mlp((3, 4, 3), "relu", loss="xent", dtype=dtype)
    params = np.zeros(model.n_params, dtype=dtype)  # every logit is 0: a three-way tie
    X, _ = make_batch(model, 3, 0)
    grad = np.empty(model.n_params, dtype=dtype)
    labels = np.array([0, 0, 2])
    loss_sum, hits = local_gradient(model, 3)(params, X, labels, grad)
    assert hits == 2  # the samples labelled 0, as np.argmax picks the first maximum
    assert loss_sum == pytest.approx(3 * np.log(3), rel=TOLERANCE[model.dtype])
    assert_matches_reference(model, params, X, labels, loss_sum, hits, grad)


@pytest.mark.parametrize("loss", LOSSES)
def test_evaluate_matches_reference(loss):
    model = mlp((3, 5, 4), "relu", loss=loss)
    params = perturbed_params(model, 2)
    n_samples = EVALUATE_CHUNK + 37  # more than one chunk
    X, y = make_batch(model, n_samples, 3)
    mean_loss, accuracy = evaluate(model, params, X, y)
    ref_loss, ref_hits, _ = reference(model, params, X, y)
    assert mean_loss == pytest.approx(ref_loss / n_samples, rel=1e-10)
    if loss == "xent":
        assert accuracy == ref_hits / n_samples
    else:
        assert np.isnan(accuracy)


def test_evaluate_rejects_an_empty_data_set():
    model = mlp((3, 2))
    with pytest.raises(ValueError, match="at least one sample"):
        evaluate(model, model.init_params(0), np.zeros((0, 3)),
                 np.zeros(0, dtype=np.int64))  # fmt: skip


def test_threads_with_their_own_instances_get_their_own_results():
    model = mlp((6, 12, 3), "relu", loss="xent")
    params = perturbed_params(model, 0)
    batches = [make_batch(model, 10, seed) for seed in range(4)]
    results = [None] * len(batches)

    def work(index):
        grad = np.empty(model.n_params)
        gradient = local_gradient(model, 10)
        for _ in range(20):
            loss_sum, hits = gradient(params, *batches[index], grad)
        results[index] = (loss_sum, hits, grad)

    threads = [threading.Thread(target=work, args=(index,)) for index in range(len(batches))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for (X, y), (loss_sum, hits, grad) in zip(batches, results, strict=True):
        assert_matches_reference(model, params, X, y, loss_sum, hits, grad)


def test_inputs_are_converted_when_harmless():
    model = mlp((3, 2), "tanh", loss="xent", dtype=np.float32)
    params = perturbed_params(model, 0)
    X64, y = make_batch(mlp((3, 2), "tanh", loss="xent"), 4, 0)  # float64 inputs, int32 labels
    grad = np.empty(model.n_params, dtype=np.float32)
    loss_sum, hits = local_gradient(model, 4)(params, np.asfortranarray(X64), y.astype(np.int32),
                                              grad)  # fmt: skip
    assert_matches_reference(model, params, X64.astype(np.float32), y, loss_sum, hits, grad)


def test_read_only_inputs_are_accepted():
    model = mlp((3, 4, 2), "relu", loss="xent")
    params = read_only(perturbed_params(model, 0))
    X, y = (read_only(array) for array in make_batch(model, 5, 0))
    grad = np.empty(model.n_params)
    loss_sum, hits = local_gradient(model, 5)(params, X, y, grad)
    assert_matches_reference(model, params, X, y, loss_sum, hits, grad)
    assert evaluate(model, params, X, y) == pytest.approx((loss_sum / 5, hits / 5),
                                                                    rel=1e-12)  # fmt: skip


def read_only(array):
    """`array`, made read-only."""
    array.flags.writeable = False
    return array


def bad_call(name):
    """Arguments for one invalid call on an MLP (3, 2) xent with max_batch 4."""
    model = mlp((3, 2))
    args = {
        "params": model.init_params(0),
        "X": np.zeros((2, 3)),
        "y": np.array([0, 1]),
        "grad_out": np.zeros(model.n_params),
    }
    changes = {
        "short-params": ("params", np.zeros(5)),
        "float32-params": ("params", np.zeros(model.n_params, dtype=np.float32)),
        "read-only-grad": ("grad_out", read_only(np.zeros(model.n_params))),
        "X-features": ("X", np.zeros((2, 4))),
        "X-1d": ("X", np.zeros(3)),
        "too-many": ("X", np.zeros((5, 3))),
        "label-too-big": ("y", np.array([0, 2])),
        "label-negative": ("y", np.array([-1, 0])),
        "label-float": ("y", np.array([0.0, 1.0])),
        "label-count": ("y", np.array([0])),
    }
    key, value = changes[name]
    args[key] = value
    return model, args


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("short-params", r"params must be a float64 array of shape \(8,\)"),
        ("float32-params", "params must be a float64 array"),
        ("read-only-grad", r"grad_out must be a writable array of shape \(8,\)"),
        ("X-features", r"X must have shape \(m, 3\)"),
        ("X-1d", r"X must have shape \(m, 3\)"),
        ("too-many", "exceeds max_batch=4"),
        ("label-too-big", r"labels must lie in \[0, 2\)"),
        ("label-negative", r"labels must lie in \[0, 2\)"),
        ("label-float", "labels must be an integer array"),
        ("label-count", r"labels must be an integer array of shape \(2,\)"),
    ],
)
def test_bad_arguments_raise_clear_errors(name, message):
    model, args = bad_call(name)
    with pytest.raises(ValueError, match=message):
        local_gradient(model, 4)(**args)


def test_mse_targets_must_match_the_outputs():
    model = mlp((3, 2), loss="mse")
    with pytest.raises(ValueError, match=r"targets must have shape \(2, 2\)"):
        local_gradient(model, 4)(model.init_params(0), np.zeros((2, 3)), np.zeros(2), np.zeros(8))


@pytest.mark.parametrize("max_batch", [-1, 2.5, True])
def test_max_batch_is_validated(max_batch):
    with pytest.raises(ValueError, match="max_batch"):
        local_gradient(mlp((3, 2)), max_batch)


LIMIT_THEN_CALL = """
import numpy as np
from syncsgd.nn.local import local_gradient
from syncsgd.nn.kernels import limit_blas_threads
from syncsgd.nn.mlp import mlp
first = limit_blas_threads(1)
model = mlp((3, 2))
local_gradient(model, 1)(model.init_params(0), np.zeros((1, 3)), np.zeros(1, int), np.zeros(8))
print(first, limit_blas_threads(1), __import__("os").environ.get("OPENBLAS_NUM_THREADS"))
"""


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        ({}, "True False 1"),
        ({"OPENBLAS_NUM_THREADS": "2"}, "False False 2"),
        ({"OMP_NUM_THREADS": "2"}, "False False None"),
    ],
    ids=["unset", "openblas-set", "omp-set"],
)
def test_limit_blas_threads_only_before_the_blas_loads_and_if_unset(preset, expected):
    from syncsgd.nn.kernels import BLAS_THREAD_VARIABLES

    env = {k: v for k, v in os.environ.items() if k not in BLAS_THREAD_VARIABLES}
    command = [sys.executable, "-c", LIMIT_THEN_CALL]
    done = subprocess.run(
        command, env={**env, **preset}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == expected.split()


@given(
    values=st.lists(st.floats(allow_nan=True, allow_infinity=True, width=64), max_size=40),
    count=st.integers(1, 5000),
    source=st.sampled_from(["float64", "float32"]),
    target=st.sampled_from(["float64", "float32", "in place"]),
)
def test_divide_finite_is_np_divide_and_a_finiteness_check(values, count, source, target):
    if target == "float64" and source == "float32":
        target = "in place"  # float32 sums go to a float32 mean (training never widens)
    with np.errstate(all="ignore"):
        total = np.array(values, dtype=source)
        out = total.copy() if target == "in place" else np.empty(len(values), dtype=target)
        expected = np.divide(total, count, out=np.empty_like(out))
    divisor = total.dtype.type(count)  # as training passes it
    finite = divide_finite_(total, divisor, total if target == "in place" else out)
    result = total if target == "in place" else out
    assert np.array_equal(result.view(np.uint8), expected.view(np.uint8))  # the same bits
    assert finite == bool(np.all(np.isfinite(expected)))


def test_divide_finite_does_not_overflow_on_large_finite_values():
    big = np.full(8, 1e308)  # their plain sum would be inf
    assert divide_finite_(big, 1.0, np.empty(8))
    assert divide_finite_(big, 1.0, big)
    assert not divide_finite_(big, 2.0, np.empty(8, np.float32))  # 5e307 is inf in float32


# --- the first-load notice --------------------------------------------------------------------


def test_a_slow_first_call_is_announced_once(monkeypatch):
    import io
    import time

    from syncsgd.nn import kernels

    monkeypatch.setattr(kernels, "SLOW_LOAD_SECONDS", 0.01)
    notice, stream = kernels.FirstLoadNotice(), io.StringIO()
    notice.arm(stream)
    with notice.timing():
        time.sleep(0.2)
    with notice.timing():  # the notice was taken by the first call
        time.sleep(0.2)
    assert stream.getvalue() == kernels.LOADING_MESSAGE + "\n"


def test_a_fast_or_unarmed_first_call_says_nothing():
    import io

    from syncsgd.nn.kernels import FirstLoadNotice

    fast, stream = FirstLoadNotice(), io.StringIO()
    fast.arm(stream)
    with fast.timing():
        pass
    with FirstLoadNotice().timing():
        pass
    assert stream.getvalue() == ""
    assert fast.armed is None


@pytest.mark.parametrize("quiet", [True, False])
def test_only_the_first_rank_of_a_run_that_talks_arms_the_notice(monkeypatch, quiet):
    from syncsgd.comm.world import launch
    from syncsgd.nn import kernels
    from syncsgd.training.config import TrainConfig
    from syncsgd.training.loop import train_rank
    from syncsgd.training.run import prepare

    armed = []
    monkeypatch.setattr(kernels.first_load, "arm", armed.append)
    run = prepare(TrainConfig(samples=64, features=4, hidden=(3,), classes=2, batch_size=8,
                              steps=1))  # fmt: skip
    launch(train_rank, run, backend="threads", ranks=2, quiet=quiet)
    assert armed == ([] if quiet else [sys.stderr])


@given(st.integers(0, 9), st.integers(0, 12), st.integers(1, 5),
       st.sampled_from(["float32", "float64"]), st.randoms())  # fmt: skip
def test_gather_rows_copies_what_np_take_copies(n_rows, n_picked, width, dtype, rng):
    X = np.arange(max(n_rows, 1) * width, dtype=dtype).reshape(-1, width)
    rows = np.array([rng.randrange(len(X)) for _ in range(n_picked)], dtype=np.int64)
    out = np.full((n_picked + 2, width), -1, dtype)
    gather_rows_(X, rows, out[:n_picked])
    np.testing.assert_array_equal(out[:n_picked], np.take(X, rows, axis=0))
    assert (out[n_picked:] == -1).all()  # nothing past the shard is written
