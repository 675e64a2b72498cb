"""The serial oracle checked on its own: finite differences, hand-computed steps, its sample order.

Then cross-checks of the oracle against syncsgd.training.data and syncsgd.nn.optim: two independent
implementations of the same formulas must agree.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from oracle import (
    batch_indices,
    loss_and_grad,
    per_sample_losses,
    schedule_lr,
    serial_sgd,
    sgd_update,
)

from syncsgd.nn import optim
from syncsgd.training import data


def random_problem(sizes, loss, seed, batch=7):
    """Random parameters (dict), inputs and targets for an MLP with layer sizes `sizes`."""
    rng = np.random.default_rng(seed)
    params = {}
    for layer, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        params[f"W{layer}"] = rng.normal(size=(fan_in, fan_out))
        params[f"b{layer}"] = rng.normal(size=fan_out) * 0.1
    X = rng.normal(size=(batch, sizes[0]))
    if loss == "xent":
        y = rng.integers(0, sizes[-1], size=batch)
    else:
        y = rng.normal(size=(batch, sizes[-1]))
    return params, X, y


def mean_loss(params, X, y, activation, loss):
    """The oracle's batch loss, through its forward pass only."""
    value, _ = loss_and_grad(params, X, y, hidden_activation=activation, loss=loss)
    return value


@pytest.mark.parametrize("sizes", [(3, 4), (3, 5, 4), (2, 6, 5, 3)])
@pytest.mark.parametrize("activation", ["relu", "tanh"])
@pytest.mark.parametrize("loss", ["xent", "mse"])
def test_gradient_matches_finite_differences(sizes, activation, loss):
    params, X, y = random_problem(sizes, loss, seed=len(sizes) * 10 + len(activation) + len(loss))
    _, grads = loss_and_grad(params, X, y, hidden_activation=activation, loss=loss)
    eps = 1e-6
    for name, value in params.items():
        numeric = np.zeros_like(value)
        for index in np.ndindex(value.shape):
            shifted = {k: v.copy() for k, v in params.items()}
            shifted[name][index] = value[index] + eps
            up = mean_loss(shifted, X, y, activation, loss)
            shifted[name][index] = value[index] - eps
            down = mean_loss(shifted, X, y, activation, loss)
            numeric[index] = (up - down) / (2 * eps)
        np.testing.assert_allclose(grads[name], numeric, rtol=1e-5, atol=1e-7, err_msg=name)


def test_losses_by_hand():
    # xent: logits (0, ln 3), label 1 -> log(1 + 3) - ln 3 = ln(4/3); label 0 -> ln 4
    logits = np.array([[0.0, math.log(3)], [0.0, math.log(3)]])
    xent = per_sample_losses(logits, np.array([1, 0]), "xent")
    np.testing.assert_allclose(xent, [math.log(4 / 3), math.log(4)], rtol=1e-14)
    # mse: mean over outputs of squared errors: ((1-0)^2 + (2-4)^2) / 2 = 2.5
    mse = per_sample_losses(np.array([[1.0, 2.0]]), np.array([[0.0, 4.0]]), "mse")
    np.testing.assert_allclose(mse, [2.5], rtol=1e-14)


def test_two_steps_by_hand():
    # Linear regression y = w x + b, one feature, one output, batch of 1 sample, no shuffle:
    # step 0 uses sample 0 (x=1, t=2), step 1 uses sample 1 (x=2, t=4). lr 0.1 with warmup over
    # 2 steps (lr 0.05, then 0.1), clip_norm 1, weight decay 0.1, momentum 0.5.
    X = np.array([[1.0], [2.0], [3.0]])
    y = np.array([[2.0], [4.0], [9.0]])
    params = {"W0": np.array([[1.0]]), "b0": np.array([0.0])}
    # step 0: z = 1, loss (1-2)^2 = 1, dz = 2(z-t) = -2, g = (gw, gb) = (-2, -2), |g| = sqrt(8)
    #   clipped: (-1/sqrt2, -1/sqrt2); + wd*theta: (-1/sqrt2 + 0.1, -1/sqrt2); v = g
    #   w = 1 - 0.05 * (0.1 - 1/sqrt2), b = 0.05/sqrt2
    r2 = 1 / math.sqrt(2)
    v_w, v_b = 0.1 - r2, -r2
    w, b = 1 - 0.05 * v_w, -0.05 * v_b
    assert (w, b) == pytest.approx((1.0303553390593274, 0.035355339059327376), rel=1e-15)
    # step 1: z = 2w + b, dz = 2(z - 4), g = (2 dz, dz), norm sqrt5 * abs(dz) > 1: (-2, -1)/sqrt5
    z = 2 * w + b
    loss_1 = (z - 4) ** 2
    r5 = 1 / math.sqrt(5)
    g_w, g_b = -2 * r5 + 0.1 * w, -r5 + 0.1 * b
    v_w, v_b = 0.5 * v_w + g_w, 0.5 * v_b + g_b
    w, b = w - 0.1 * v_w, b - 0.1 * v_b
    final, losses = serial_sgd(
        X, y, params, hidden_activation="relu", loss="mse", steps=2, batch_size=1,
        shuffle=False, lr=0.1, schedule="warmup", warmup_steps=2, clip_norm=1.0,
        weight_decay=0.1, momentum=0.5,
    )  # fmt: skip
    assert losses == pytest.approx([1.0, loss_1], rel=1e-14)
    assert loss_1 == pytest.approx(3.6249646, rel=1e-7)  # (2.0960660 - 4)^2, by hand
    np.testing.assert_allclose(final["W0"], [[w]], rtol=1e-14)
    np.testing.assert_allclose(final["b0"], [b], rtol=1e-14)
    assert (w, b) == pytest.approx((1.1398498, 0.1150785), rel=1e-6)  # by hand


def test_two_steps_nesterov_by_hand():
    # One parameter pair, xent with 2 classes and no hidden layer: logits (x w0 + b0, x w1 + b1).
    # x = 1, label 0, params all zero -> softmax (1/2, 1/2), dz = (-1/2, 1/2), loss ln 2.
    X = np.array([[1.0]])
    y = np.array([0])
    params = {"W0": np.zeros((1, 2)), "b0": np.zeros(2)}
    # step 0: g = (-1/2, 1/2) for W and b; v = g; direction = g + 0.9 g = 1.9 g; lr 1
    #   -> W = b = (0.95, -0.95)
    # step 1: logits (1.9, -1.9); p0 = 1 / (1 + e^-3.8); dz = (p0 - 1, 1 - p0)
    #   v = 0.9 v + g; direction = g + 0.9 v
    p0 = 1 / (1 + math.exp(-3.8))
    g = np.array([p0 - 1, 1 - p0])
    v = 0.9 * np.array([-0.5, 0.5]) + g
    expected = np.array([0.95, -0.95]) - (g + 0.9 * v)
    final, losses = serial_sgd(
        X, y, params, hidden_activation="tanh", loss="xent", steps=2, batch_size=1, lr=1.0,
        momentum=0.9, nesterov=True,
    )  # fmt: skip
    assert losses == pytest.approx([math.log(2), -math.log(p0)], rel=1e-14)
    np.testing.assert_allclose(final["W0"][0], expected, rtol=1e-14)
    np.testing.assert_allclose(final["b0"], expected, rtol=1e-14)


def test_batch_mean_is_the_mean_of_per_sample_gradients():
    params, X, y = random_problem((4, 6, 3), "xent", seed=3, batch=5)
    _, grads = loss_and_grad(params, X, y, hidden_activation="tanh", loss="xent")
    singles = [
        loss_and_grad(params, X[i : i + 1], y[i : i + 1], hidden_activation="tanh", loss="xent")[1]
        for i in range(len(X))
    ]
    for name in params:
        np.testing.assert_allclose(grads[name], np.mean([s[name] for s in singles], axis=0))


def test_order_across_epochs_with_tail_dropped():
    # 7 samples, batches of 2: 3 steps per epoch, the 7th sample of each epoch's order is skipped.
    # Six shuffled steps equal 3 unshuffled steps on X[perm_0] then 3 on X[perm_1].
    params, X, y = random_problem((3, 4, 2), "mse", seed=5, batch=7)
    options = dict(hidden_activation="relu", loss="mse", batch_size=2, lr=0.05)
    final, losses = serial_sgd(X, y, params, steps=6, seed=11, shuffle=True, **options)
    chained, chained_losses = dict(params), []
    for epoch in range(2):
        perm = np.random.default_rng([11, epoch]).permutation(7)
        chained, part = serial_sgd(X[perm], y[perm], chained, steps=3, shuffle=False, **options)
        chained_losses += part
    assert losses == pytest.approx(chained_losses, rel=1e-14)
    for name in params:
        np.testing.assert_allclose(final[name], chained[name], rtol=1e-14)


def test_float32_run_stays_close_to_float64():
    params, X, y = random_problem((5, 8, 3), "xent", seed=8, batch=32)
    options = dict(hidden_activation="relu", loss="xent", steps=5, batch_size=8, lr=0.1)
    final64, _ = serial_sgd(X, y, params, **options)
    final32, _ = serial_sgd(X, y, params, dtype=np.float32, **options)
    for name in params:
        assert final32[name].dtype == np.float32
        np.testing.assert_allclose(final32[name], final64[name], rtol=1e-4, atol=1e-5)


# --- cross-checks with syncsgd.training.data and syncsgd.nn.optim (independent implementations) --


@given(
    n_samples=st.integers(1, 60),
    batch_size=st.integers(1, 60),
    step=st.integers(0, 200),
    seed=st.integers(0, 2**32),
    shuffle=st.booleans(),
)
def test_oracle_order_equals_data_global_batch(n_samples, batch_size, step, seed, shuffle):
    batch_size = min(batch_size, n_samples)
    np.testing.assert_array_equal(
        batch_indices(step, n_samples, batch_size, seed, shuffle),
        data.global_batch(step, n_samples, batch_size, seed, shuffle),
    )


optim_configs = st.fixed_dictionaries(
    {
        "lr": st.floats(1e-4, 2.0),
        "schedule": st.sampled_from(optim.SCHEDULES),
        "warmup_steps": st.integers(1, 20),
        "total_steps": st.integers(1, 50),
        "lr_scaling": st.sampled_from(optim.LR_SCALINGS),
        "base_batch": st.integers(1, 512),
        "batch_size": st.integers(1, 512),
        "noam_dim": st.integers(1, 1024),
    }
)


@given(config=optim_configs, step=st.integers(0, 60))
def test_oracle_schedule_equals_optim_learning_rate(config, step):
    expected = schedule_lr(step, **config)
    assert optim.learning_rate(optim.OptimConfig(**config), step) == pytest.approx(
        expected, rel=1e-13
    )


@given(
    momentum=st.sampled_from([0.0, 0.5, 0.9]),
    nesterov=st.booleans(),
    weight_decay=st.sampled_from([0.0, 1e-3, 0.1]),
    clip_norm=st.sampled_from([None, 0.1, 1.0, 100.0]),
    dtype=st.sampled_from([np.float64, np.float32]),
    seed=st.integers(0, 2**16),
)
def test_oracle_update_equals_optim_sgd(momentum, nesterov, weight_decay, clip_norm, dtype, seed):
    nesterov = nesterov and momentum > 0
    config = optim.OptimConfig(lr=0.3, clip_norm=clip_norm, schedule="warmup", warmup_steps=3)
    options = optim.SGDOptions(momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
    rng = np.random.default_rng(seed)
    shapes = {"W0": (3, 4), "b0": (4,), "W1": (4, 2), "b1": (2,)}
    params = {k: rng.normal(size=s).astype(dtype) for k, s in shapes.items()}
    flat = np.concatenate([p.ravel() for p in params.values()])
    sgd = optim.SGD(config, flat.size, dtype, options)
    velocity = None
    for step in range(4):
        grads = {k: rng.normal(size=s).astype(dtype) for k, s in shapes.items()}
        flat_grad = np.concatenate([g.ravel() for g in grads.values()])
        rate = schedule_lr(step, lr=0.3, schedule="warmup", warmup_steps=3)
        params, velocity, norm = sgd_update(
            params, grads, velocity, rate=rate, momentum=momentum, nesterov=nesterov,
            weight_decay=weight_decay, clip_norm=clip_norm,
        )  # fmt: skip
        info = sgd.step_(flat, flat_grad, step)
        assert info["lr"] == pytest.approx(rate, rel=1e-15)
        assert info["grad_norm"] == pytest.approx(norm, rel=1e-12)
    tolerance = 1e-13 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(
        flat, np.concatenate([p.ravel() for p in params.values()]), rtol=tolerance, atol=tolerance
    )
