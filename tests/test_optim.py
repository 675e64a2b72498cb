"""Learning-rate schedules, the SGD update (clip, weight decay, momentum, Nesterov, step), and the
optimizer registry."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from syncsgd import TrainConfig
from syncsgd.nn.optim import (
    OPTIMIZERS,
    SGD,
    OptimConfig,
    Optimizer,
    SGDOptions,
    clip_,
    global_norm,
    learning_rate,
    make_optimizer,
)

SGD_OPTIONS = ("momentum", "nesterov", "weight_decay")


def sgd_of(n_params, dtype=np.float64, **options):
    """An SGD from keyword options: SGD's own ones to SGDOptions, the others to OptimConfig."""
    own = {name: value for name, value in options.items() if name in SGD_OPTIONS}
    shared = {name: value for name, value in options.items() if name not in SGD_OPTIONS}
    return SGD(OptimConfig(**shared), n_params, dtype, SGDOptions(**own))

# --- schedules, against values computed by hand -------------------------------------------------


@pytest.mark.parametrize(
    ("options", "step", "expected"),
    [
        ({}, 0, 0.1),
        ({}, 1000, 0.1),
        ({"lr_scaling": "linear", "batch_size": 512, "base_batch": 256}, 3, 0.2),
        ({"lr_scaling": "linear", "batch_size": 64, "base_batch": 256}, 0, 0.025),
        ({"lr_scaling": "sqrt", "batch_size": 1024, "base_batch": 256}, 0, 0.2),
        ({"lr_scaling": "sqrt", "batch_size": 512, "base_batch": 256}, 0, 0.1414213562373095),
        ({"schedule": "warmup", "warmup_steps": 4}, 0, 0.025),
        ({"schedule": "warmup", "warmup_steps": 4}, 1, 0.05),
        ({"schedule": "warmup", "warmup_steps": 4}, 3, 0.1),
        ({"schedule": "warmup", "warmup_steps": 4}, 50, 0.1),
        ({"schedule": "cosine", "total_steps": 10}, 0, 0.1),
        ({"schedule": "cosine", "total_steps": 10}, 5, 0.05),
        ({"schedule": "cosine", "total_steps": 10}, 2, 0.0904508497187474),  # (1 + cos 36°) / 20
        ({"schedule": "cosine", "total_steps": 10}, 10, 0.0),
        ({"schedule": "cosine", "total_steps": 10, "warmup_steps": 2}, 0, 0.05),
        # (1 + cos 18°) / 20
        ({"schedule": "cosine", "total_steps": 10, "warmup_steps": 2}, 1, 0.0975528258147577),
        # noam, lr 1, d = 16, w = 4: 1/4 * min(t^-1/2, t/8)
        ({"lr": 1.0, "schedule": "noam", "noam_dim": 16, "warmup_steps": 4}, 0, 0.03125),
        ({"lr": 1.0, "schedule": "noam", "noam_dim": 16, "warmup_steps": 4}, 1, 0.0625),
        ({"lr": 1.0, "schedule": "noam", "noam_dim": 16, "warmup_steps": 4}, 3, 0.125),
        ({"lr": 1.0, "schedule": "noam", "noam_dim": 16, "warmup_steps": 4}, 15, 0.0625),
        # scaling and schedule multiply: 0.2 * 1/8 (noam, d = 1, w = 4, t = 1)
        (
            {"schedule": "noam", "warmup_steps": 4, "lr_scaling": "linear", "batch_size": 512},
            0,
            0.025,
        ),
    ],
)
def test_schedule_values_by_hand(options, step, expected):
    config = OptimConfig(**{"lr": 0.1, **options})
    assert learning_rate(config, step) == pytest.approx(expected, rel=1e-14, abs=1e-17)


@given(step=st.integers(0, 500), warmup=st.integers(1, 100))
def test_noam_peaks_at_the_end_of_warmup(step, warmup):
    config = OptimConfig(lr=1.0, schedule="noam", warmup_steps=warmup, noam_dim=64)
    peak = learning_rate(config, warmup - 1)
    assert learning_rate(config, step) <= peak * (1 + 1e-12)
    assert peak == pytest.approx(64**-0.5 * warmup**-0.5, rel=1e-12)


def test_learning_rate_rejects_negative_steps():
    with pytest.raises(ValueError, match="step must be >= 0"):
        learning_rate(OptimConfig(), -1)


# --- the update, against a hand-written scalar reference ---------------------------------------


def reference_run(params, grads, *, lr, momentum, nesterov, weight_decay, clip_norm):
    """The update in pure Python floats, one list element at a time; returns params and norms."""
    theta = list(params)
    velocity = [0.0] * len(theta)
    norms = []
    for grad in grads:
        g = list(grad)
        norm = math.sqrt(math.fsum(x * x for x in g))
        norms.append(norm)
        if clip_norm is not None and norm > clip_norm:
            g = [x * clip_norm / norm for x in g]
        g = [x + weight_decay * p for x, p in zip(g, theta, strict=True)]
        if momentum:
            velocity = [momentum * v + x for v, x in zip(velocity, g, strict=True)]
            if nesterov:
                direction = [x + momentum * v for x, v in zip(g, velocity, strict=True)]
            else:
                direction = velocity
        else:
            direction = g
        theta = [p - lr * d for p, d in zip(theta, direction, strict=True)]
    return theta, norms


def run_sgd(options, params, grads, dtype=np.float64):
    """syncsgd.nn.optim.SGD over a list of gradients; returns final params and the step infos."""
    flat = np.array(params, dtype=dtype)
    sgd = sgd_of(len(flat), dtype, **options)
    infos = [sgd.step_(flat, np.array(grad, dtype=dtype), step) for step, grad in enumerate(grads)]
    return flat, infos


@pytest.mark.parametrize(
    ("nesterov", "expected"),
    [
        # step 0: g = (3, 4), norm 5, clipped to (0.6, 0.8); + 0.5 theta = (1.1, 1.8); v = g
        #   plain: theta = (1, 2) - 0.1 (1.1, 1.8) = (0.89, 1.82)
        # step 1: g = (0.3, 0.4), norm 0.5, not clipped; + 0.5 theta = (0.745, 1.31)
        #   v = 0.9 (1.1, 1.8) + g = (1.735, 2.93); theta = (0.89, 1.82) - 0.1 v = (0.7165, 1.527)
        (False, [0.7165, 1.527]),
        # step 0: nesterov direction g + 0.9 v = 1.9 (1.1, 1.8) = (2.09, 3.42) -> (0.791, 1.658)
        # step 1: g = (0.3, 0.4) + 0.5 (0.791, 1.658) = (0.6955, 1.229)
        #   v = (0.99, 1.62) + g = (1.6855, 2.849); direction = g + 0.9 v = (2.21245, 3.7931)
        #   theta = (0.791, 1.658) - 0.1 direction = (0.569755, 1.27869)
        (True, [0.569755, 1.27869]),
    ],
)
def test_update_order_by_hand(nesterov, expected):
    options = dict(lr=0.1, momentum=0.9, nesterov=nesterov, weight_decay=0.5, clip_norm=1.0)
    final, infos = run_sgd(options, [1.0, 2.0], [[3.0, 4.0], [0.3, 0.4]])
    np.testing.assert_allclose(final, expected, rtol=1e-14)
    assert [info["grad_norm"] for info in infos] == pytest.approx([5.0, 0.5], rel=1e-15)
    assert [info["lr"] for info in infos] == [0.1, 0.1]


@given(
    momentum=st.sampled_from([0.0, 0.5, 0.9]),
    nesterov=st.booleans(),
    weight_decay=st.sampled_from([0.0, 1e-4, 0.3]),
    clip_norm=st.sampled_from([None, 0.05, 1.0, 1e6]),
    lr=st.floats(1e-3, 1.0),
    seed=st.integers(0, 2**32),
    size=st.integers(1, 12),
)
def test_update_matches_scalar_reference(
    momentum, nesterov, weight_decay, clip_norm, lr, seed, size
):
    nesterov = nesterov and momentum > 0
    rng = np.random.default_rng(seed)
    params = rng.normal(size=size).tolist()
    grads = [rng.normal(size=size).tolist() for _ in range(4)]
    options = dict(
        lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, clip_norm=clip_norm
    )
    expected, norms = reference_run(params, grads, **options)
    final, infos = run_sgd(options, params, grads)
    np.testing.assert_allclose(final, expected, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose([info["grad_norm"] for info in infos], norms, rtol=1e-14)
    final32, _ = run_sgd(options, params, grads, dtype=np.float32)
    assert final32.dtype == np.float32
    np.testing.assert_allclose(final32, expected, rtol=1e-5, atol=1e-5)


def test_clipping_uses_the_norm_before_weight_decay():
    # with decay added first the norm would be |(3, 4) + (10, 0)| = 13.6, not 5
    options = dict(lr=1.0, weight_decay=1.0, clip_norm=2.5)
    final, infos = run_sgd(options, [10.0, 0.0], [[3.0, 4.0]])
    assert infos[0]["grad_norm"] == 5.0
    np.testing.assert_allclose(final, [10.0 - 1.5 - 10.0, 0.0 - 2.0], rtol=1e-15)


def test_gradient_norm_accumulates_in_float64():
    huge = np.full(4, 1e20, dtype=np.float32)  # squares overflow float32
    assert global_norm(huge) == pytest.approx(2e20, rel=1e-7)
    tiny = np.full(100, 1e-23, dtype=np.float32)  # squares underflow float32
    assert global_norm(tiny) == pytest.approx(1e-22, rel=1e-6)
    values = np.random.default_rng(0).normal(size=1001)
    assert global_norm(values, np.empty(1001)) == pytest.approx(
        math.sqrt(math.fsum(values**2)), rel=1e-14
    )


def test_clip_only_scales_down():
    grad = np.array([0.6, 0.8])
    assert not clip_(grad, 2.0, 1.0)
    np.testing.assert_array_equal(grad, [0.6, 0.8])
    assert clip_(grad, 0.5, 1.0)
    np.testing.assert_allclose(grad, [0.3, 0.4], rtol=1e-15)


def test_state_round_trip_resumes_bitwise():
    options = dict(lr=0.05, momentum=0.9, nesterov=True, schedule="cosine", total_steps=6)
    rng = np.random.default_rng(3)
    start = rng.normal(size=10)
    grads = [rng.normal(size=10) for _ in range(6)]
    straight, _ = run_sgd(options, start, grads)
    first = sgd_of(10, **options)
    resumed = start.copy()
    for step in range(3):
        first.step_(resumed, grads[step].copy(), step)
    state = first.state_arrays()
    state["velocity"][:] = 0  # a copy: does not change the optimizer
    state = first.state_arrays()
    second = sgd_of(10, **options)
    second.load_state_arrays({**state, "something_else": np.zeros(1)})
    for step in range(3, 6):
        second.step_(resumed, grads[step].copy(), step)
    np.testing.assert_array_equal(resumed, straight)
    assert SGD(OptimConfig(), 10, np.float64).state_arrays() == {}


def test_state_errors():
    sgd = sgd_of(3, np.float32, momentum=0.5)
    with pytest.raises(ValueError, match="no 'velocity' array"):
        sgd.load_state_arrays({})
    with pytest.raises(ValueError, match=r"shape \(4,\).*expected \(3,\) float32"):
        sgd.load_state_arrays({"velocity": np.zeros(4, np.float32)})
    with pytest.raises(ValueError, match="dtype float64.*expected"):
        sgd.load_state_arrays({"velocity": np.zeros(3)})


def test_step_rejects_mismatched_buffers():
    sgd = SGD(OptimConfig(), 3, "float32")
    good = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match=r"grad has shape \(4,\)"):
        sgd.step_(good, np.zeros(4, np.float32), 0)
    with pytest.raises(ValueError, match="params has shape .* dtype float64"):
        sgd.step_(np.zeros(3), good, 0)
    with pytest.raises(ValueError, match="contiguous"):
        sgd.step_(np.zeros(6, np.float32)[::2], good, 0)
    for dtype in ("float16", None, "nonsense"):
        with pytest.raises(ValueError, match="dtype must be float64 or float32"):
            SGD(OptimConfig(), 3, dtype)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"lr": 0.0}, "lr must be a finite number > 0"),
        ({"lr": -0.1}, "lr must be"),
        ({"lr": float("nan")}, "lr must be"),
        ({"lr": float("inf")}, "lr must be"),
        ({"lr": "0.1"}, "lr must be a number"),
        ({"clip_norm": 0.0}, "clip_norm must be a finite number > 0"),
        ({"clip_norm": float("inf")}, "clip_norm must be"),
        ({"schedule": "step"}, "unknown schedule 'step': expected one of constant, cosine"),
        ({"schedule": "warmup"}, "schedule 'warmup' needs warmup_steps >= 1"),
        ({"schedule": "noam", "warmup_steps": 0}, "schedule 'noam' needs warmup_steps >= 1"),
        ({"warmup_steps": -1}, "warmup_steps must be >= 0"),
        ({"warmup_steps": 2.5}, "warmup_steps must be an integer"),
        ({"total_steps": 0}, "total_steps must be >= 1"),
        ({"lr_scaling": "log"}, "unknown lr_scaling 'log'"),
        ({"base_batch": 0}, "base_batch must be >= 1"),
        ({"batch_size": 0}, "batch_size must be >= 1"),
        ({"noam_dim": 0}, "noam_dim must be >= 1"),
    ],
)
def test_config_validation(options, match):
    with pytest.raises(ValueError, match=match) as info:
        OptimConfig(**options)
    assert "\n" not in str(info.value)


def test_config_normalises_numbers():
    config = OptimConfig(lr=np.float32(0.5), warmup_steps=np.int64(3))
    assert type(config.lr) is float and type(config.warmup_steps) is int
    options = SGDOptions(momentum=np.float32(0.5), weight_decay=0)
    assert type(options.momentum) is float and type(options.weight_decay) is float


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"momentum": 1.0}, "--momentum must be in [0, 1), got 1.0"),
        ({"momentum": 2.0}, "--momentum must be in [0, 1), got 2.0"),
        ({"momentum": -0.1}, "--momentum must be in [0, 1), got -0.1"),
        ({"momentum": float("nan")}, "--momentum must be a finite number, got nan"),
        ({"momentum": "0.9"}, "--momentum must be a number, not '0.9'"),
        ({"nesterov": True}, "--nesterov needs --momentum > 0"),
        ({"nesterov": 1, "momentum": 0.5}, "--nesterov must be True or False, not 1"),
        ({"weight_decay": -1e-4}, "--weight-decay must be >= 0, got -0.0001"),
    ],
)
def test_sgd_options_name_their_flags(options, message):
    with pytest.raises(ValueError) as info:
        SGDOptions(**options)
    assert str(info.value) == message
    with pytest.raises(ValueError) as info:  # TrainConfig takes the same declarations
        TrainConfig(**options)
    assert str(info.value) == message


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_fused_update_is_bitwise_numpys_two_passes(dtype, momentum):
    # The update's fused loops round as NumPy's passes do: mu * v, then + g; lr * d, then -.
    rng = np.random.default_rng(7)
    params = (rng.standard_normal(1001) * 10).astype(dtype)
    grads = [(rng.standard_normal(1001) * 1e3).astype(dtype) for _ in range(3)]
    sgd = sgd_of(params.size, dtype, lr=0.0123456789, momentum=momentum)
    expected, velocity = params.copy(), np.zeros_like(params)
    for step, grad in enumerate(grads):
        direction = grad
        if momentum:
            velocity *= momentum
            velocity += grad
            direction = velocity
        expected -= np.multiply(direction, 0.0123456789)
        sgd.step_(params, grad.copy(), step, want_norm=False)
    assert params.tobytes() == expected.tobytes()


# --- the registry and the protocol -------------------------------------------------------------


def test_the_registry_builds_sgd_with_the_options_of_its_settings():
    assert list(OPTIMIZERS) == ["sgd", "adam", "adamw", "lamb", "lars"]
    plain = make_optimizer("sgd", OptimConfig(), 4, "float32")
    assert isinstance(plain, SGD) and plain.options == SGDOptions() and plain.dtype == np.float32
    settings = TrainConfig(momentum=0.9, nesterov=True, weight_decay=0.01)
    built = make_optimizer(settings.optimizer, OptimConfig(), 4, "float64", settings)
    assert isinstance(built, SGD)
    assert built.options == SGDOptions(momentum=0.9, nesterov=True, weight_decay=0.01)
    assert set(built.state_arrays()) == {"velocity"}
    with pytest.raises(ValueError, match="unknown optimizer 'rmsprop': expected one of sgd"):
        make_optimizer("rmsprop", OptimConfig(), 4, "float64")
    with pytest.raises(ValueError, match=r"--nesterov needs --momentum > 0"):
        make_optimizer("sgd", OptimConfig(), 4, "float64",
                       SimpleNamespace(momentum=0.0, nesterov=True, weight_decay=0.0))  # fmt: skip


def test_an_sgd_step_through_the_protocol_is_bitwise_numpys_by_hand():
    dtype = np.float32
    rng = np.random.default_rng(5)
    theta = rng.standard_normal(7).astype(dtype)
    grads = [(rng.standard_normal(7) * 3).astype(dtype) for _ in range(3)]
    settings = SimpleNamespace(momentum=0.9, nesterov=True, weight_decay=0.01)
    optimizer: Optimizer = make_optimizer("sgd", OptimConfig(lr=0.05, clip_norm=2.0), 7, dtype,
                                          settings)  # fmt: skip
    params, expected, velocity = theta.copy(), theta.copy(), np.zeros(7, dtype)
    for step, grad in enumerate(grads):
        g = grad.copy()
        norm = math.sqrt(float(np.square(g, dtype=np.float64).sum()))
        assert norm > 2.0  # clipped: the ratio formed in float64, rounded once to float32
        g = g * dtype(2.0 / norm)
        g = g + expected * dtype(0.01)  # weight decay
        velocity = velocity * dtype(0.9) + g  # v = mu v + g
        g = g + velocity * dtype(0.9)  # Nesterov: g + mu v
        expected = expected - g * dtype(0.05)  # lr * direction rounded, then subtracted
        info = optimizer.step_(params, grad.copy(), step, want_norm=False)
        assert params.tobytes() == expected.tobytes()
        assert info == {"lr": 0.05, "grad_norm": norm}
    np.testing.assert_array_equal(optimizer.state_arrays()["velocity"], velocity)
