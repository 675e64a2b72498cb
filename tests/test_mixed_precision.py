"""Mixed precision: the passes in bf16 or fp16; the gradient sums compressed for the allreduce."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import serial_sgd

from syncsgd.apps import verify
from syncsgd.nn.mlp import mlp, sizes_of
from syncsgd.nn.network import Network
from syncsgd.nn.precision import ALLREDUCE_CODES, BF16, FP16, round_array
from syncsgd.training import data
from syncsgd.training.config import TrainConfig
from syncsgd.training.loop import train
from syncsgd.training.run import first_params, prepare

# An inf plus a -inf in the allreduce of an overflowed step: NumPy says so, the step is skipped.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

SMALL = {"samples": 256, "features": 8, "hidden": (16,), "batch_size": 60}


def compressed_step(config: TrainConfig, ranks: int) -> np.ndarray:
    """One step by hand: each rank's sum cast, the casts summed and cast again, then / B."""
    from syncsgd.nn.local import local_gradient

    run = prepare(config)
    params = first_params(run)
    fmt = ALLREDUCE_CODES[config.allreduce_dtype or ""]
    batch = data.SampleOrder(len(run.X), config.batch_size, config.seed, config.shuffle).batch(0)
    total = np.zeros(run.model.n_params)
    for rank in range(ranks):
        shard = data.contiguous_shard(batch, rank, ranks)
        local = np.empty(run.model.n_params)
        local_gradient(run.model, len(shard))(params, run.X[shard], run.y[shard], local)
        total += round_array(local, fmt)
    mean = round_array(total, fmt) / config.batch_size
    return params - config.lr * mean


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("ranks", [1, 3])
def test_compressed_allreduce_casts_each_sum_and_the_total(dtype: str, ranks: int) -> None:
    config = TrainConfig(**SMALL, steps=1, allreduce_dtype=dtype)
    result = train(config, ranks=ranks)
    # Three ranks' float64 additions may be taken in another order than ours: ulps apart.
    np.testing.assert_allclose(result.params, compressed_step(config, ranks), rtol=0, atol=1e-15)
    plain = train(config, ranks=ranks, allreduce_dtype=None)
    assert result.losses == plain.losses  # the loss sum rides along uncompressed
    assert not np.array_equal(result.params, plain.params)


def test_compressed_allreduce_is_refused_in_exact_mode_in_one_line() -> None:
    with pytest.raises(ValueError, match="--allreduce-dtype") as error:
        TrainConfig(exact=True, allreduce_dtype="float16")
    assert "\n" not in str(error.value)


def test_verify_shows_the_deviation_against_the_uncompressed_serial_run(capsys) -> None:
    config = TrainConfig(**SMALL, steps=5, allreduce_dtype="float16")
    status = verify.main(config, [1, 2], None, None)
    out = capsys.readouterr().out
    assert status == 1
    assert "allreduce in float16 (the serial run's in float64)" in out
    assert "P = 1 differs too" in out
    rows = verify.verify(config, [1, 2], 1e-9)
    assert all(0 < row.relative_diff < 1e-2 for row in rows)


def test_the_flag_is_read_into_its_field() -> None:
    from syncsgd.cli import build_parser, config_from_options

    options = build_parser().parse_args(["train", "--allreduce-dtype", "bfloat16"])
    assert config_from_options(options).allreduce_dtype == "bfloat16"


# --- --precision bf16|fp16: the passes in the format --------------------------------------------

FORMATS = {"bf16": BF16, "fp16": FP16}
BITS = {BF16: 8, FP16: 11}


def narrow_reference(model: Network, params: np.ndarray, X: np.ndarray, y: np.ndarray,
                     fmt: int) -> np.ndarray:  # fmt: skip
    """The rounded passes written again with NumPy (float64 sums of the format's values)."""

    def r(values: np.ndarray) -> np.ndarray:
        return round_array(np.asarray(values, np.float64), fmt)

    views = {name: r(v) for name, v in model.views(params).items()}
    inputs, a = [], r(X)
    n_layers = len(sizes_of(model)) - 1  # dense layers
    for layer in range(n_layers):
        inputs.append(a)
        z = r(a @ views[f"W{layer}"] + views[f"b{layer}"])
        a = z if layer == n_layers - 1 else r(np.tanh(z))
    shifted = np.exp(a - a.max(axis=1, keepdims=True))
    delta = shifted / shifted.sum(axis=1, keepdims=True)
    delta[np.arange(len(y)), y] -= 1
    delta = r(delta)
    grads = {}
    for layer in range(n_layers - 1, -1, -1):
        grads[f"W{layer}"] = r(inputs[layer].T @ delta)
        grads[f"b{layer}"] = r(delta.sum(axis=0))
        if layer:
            delta = r(r(delta @ views[f"W{layer}"].T) * (1 - inputs[layer] ** 2))
    return np.concatenate([grads[name].ravel() for name in model.param_names()])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_narrow_gradient_is_the_rounded_passes(precision: str) -> None:
    from syncsgd.nn.local import local_gradient

    fmt = FORMATS[precision]
    model = mlp((6, 12, 10, 3), "tanh", loss="xent")
    params = model.init_params(3)
    rng = np.random.default_rng(4)
    X, y = rng.standard_normal((40, 6)), rng.integers(0, 3, 40)
    narrow = np.empty(model.n_params)
    local_gradient(model, 40, precision=precision)(params, X, y, narrow)
    assert np.array_equal(round_array(narrow, fmt), narrow)  # every sum is a value of the format
    expected = narrow_reference(model, params, X, y, fmt)
    peak = np.abs(expected).max()
    # float32 sums in BLAS against NumPy's float64 sums: now and then one rounding goes the
    # other way, which is a unit in the last place of the format, propagated.
    assert np.abs(narrow - expected).max() <= peak * 2.0 ** (4 - BITS[fmt])
    full = np.empty(model.n_params)
    local_gradient(model, 40)(params, X, y, full)
    deviation = np.abs(narrow - full).max() / np.abs(full).max()
    assert 0 < deviation < 2.0 ** (6 - BITS[fmt])


def test_a_power_of_two_loss_scale_scales_every_sum_exactly() -> None:
    from syncsgd.nn.local import local_gradient

    model = mlp((6, 12, 3), "relu", loss="xent")
    params = model.init_params(5)
    rng = np.random.default_rng(6)
    X, y = rng.standard_normal((30, 6)), rng.integers(0, 3, 30)
    kernel = local_gradient(model, 30, precision="fp16")
    plain, scaled = np.empty(model.n_params), np.empty(model.n_params)
    kernel(params, X, y, plain)
    kernel(params, X, y, scaled, 2.0**10)
    assert np.array_equal(scaled / 2.0**10, plain)


def test_fp32_rounds_nothing_the_passes_stay_in_the_dtype() -> None:
    # fp32 names the passes without a narrow format: in --dtype float64 they are the float64
    # oracle's within float64 rounding, far closer than even a float32 rounding would put them.
    config = TrainConfig(**SMALL, steps=3, precision="fp32")
    run = prepare(config)
    expected, _ = serial_sgd(run.X, run.y, run.model.to_arrays(first_params(run)),
                             hidden_activation=config.activation, steps=3,
                             batch_size=config.batch_size, lr=config.lr)  # fmt: skip
    ours = run.model.to_arrays(train(config, ranks=2).params)
    assert max(float(np.abs(ours[k] - expected[k]).max()) for k in expected) < 1e-13


@settings(max_examples=6, deadline=None)
@given(precision=st.sampled_from(["bf16", "fp16"]), seed=st.integers(0, 50),
       batch=st.integers(5, 40), activation=st.sampled_from(["relu", "tanh"]),
       loss=st.sampled_from(["xent", "mse"]),
       dtype=st.sampled_from(["float64", "float32"]))  # fmt: skip
def test_exact_mode_in_a_narrow_precision_is_bitwise_the_same_for_every_p(
    precision: str, seed: int, batch: int, activation: str, loss: str, dtype: str
) -> None:
    config = TrainConfig(samples=96, features=5, hidden=(9, 7), batch_size=batch, steps=4,
                         seed=seed, activation=activation, loss=loss, dtype=dtype, exact=True,
                         precision=precision)  # fmt: skip
    serial = train(config, ranks=1).params.tobytes()
    for ranks in (2, 3, 5):
        assert train(config, ranks=ranks).params.tobytes() == serial, ranks
    assert train(config, ranks=1, precision="fp32").params.tobytes() != serial


# --- loss scaling -----------------------------------------------------------------------------

SCALED = {"samples": 512, "features": 8, "hidden": (16,), "batch_size": 64,
          "precision": "fp16"}  # fmt: skip


def every_rank(config: TrainConfig, ranks: int) -> list:
    """The results of every thread rank, not only rank 0's."""
    from syncsgd.comm.threads import run_threads
    from syncsgd.training.loop import train_rank

    return run_threads(ranks, train_rank, prepare(config))


def gradscaler_scales(skipped: list[int], steps: int, window: int, scale: float = 2.0**16,
                      good: int = 0) -> list[float]:  # fmt: skip
    """GradScaler's scale per step, given the steps it skipped: halve on one, double per window."""
    scales = []
    for step in range(steps):
        scales.append(scale)
        if step in skipped:
            scale, good = scale / 2, 0
        else:
            good += 1
            if good == window:
                scale, good = scale * 2, 0
    return scales


@pytest.mark.parametrize("exact", [False, True])
def test_an_overflow_skips_the_same_steps_and_halves_the_scale_on_every_rank(exact: bool) -> None:
    # A huge learning rate drives the weights, and with them the scaled gradients, beyond fp16.
    config = TrainConfig(**SCALED, steps=24, lr=50.0, scale_window=3, exact=exact)
    results = every_rank(config, 3)
    first = results[0]
    assert first.skipped_steps[0] == 0  # 2^16 times a delta of about 1 is beyond 65504
    assert len(first.skipped_steps) > 3
    for result in results[1:]:
        assert result.skipped_steps == first.skipped_steps
        assert result.loss_scales == first.loss_scales
        assert result.params.tobytes() == first.params.tobytes()
    assert first.loss_scales == gradscaler_scales(first.skipped_steps, 24, window=3)
    assert max(first.loss_scales) > min(first.loss_scales) * 2  # halved more than once


def test_a_fixed_scale_neither_changes_nor_skips() -> None:
    from syncsgd.training.result import NonFiniteError

    result = train(TrainConfig(**SCALED, steps=4, loss_scale="512"), ranks=2)
    assert result.loss_scales == [512.0] * 4 and result.skipped_steps == []
    with pytest.raises(NonFiniteError):  # an overflow under a fixed scale is the usual error
        train(TrainConfig(**SCALED, steps=4, loss_scale="1e6"), ranks=2)
    with pytest.raises(ValueError, match="--loss-scale .* needs --precision"):
        TrainConfig(loss_scale="dynamic")


def test_the_log_and_the_summary_carry_the_scale_and_the_skipped_steps(tmp_path) -> None:
    import json

    from syncsgd.training.result import summary

    log = tmp_path / "log.jsonl"
    result = train(TrainConfig(**SCALED, steps=5), ranks=2, log=str(log))
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["loss_scale"] for line in lines] == result.loss_scales
    assert lines[0]["loss_scale"] == 2.0**16
    skipped = len(result.skipped_steps)
    assert f", {skipped} step{'s' * (skipped != 1)} skipped by the loss scaler" in summary(
        result, 2, "threads")  # fmt: skip


def test_resume_restores_the_scale_and_the_count_of_finite_steps_bitwise(tmp_path) -> None:
    from syncsgd.training import checkpoint

    config = TrainConfig(**SCALED, steps=16, scale_window=4, lr=2.0)
    whole = train(config, ranks=2)
    assert 0 < len(whole.skipped_steps) < 14  # the scale went down and up again
    directory = str(tmp_path / "ckpt")
    first = train(config, ranks=2, steps=7, checkpoint=directory)
    state = checkpoint.load(checkpoint.path_for(directory, 7), prepare(config).fingerprint,
                            whole.model.n_params, whole.model.dtype)  # fmt: skip
    # The next step's scale, and the finite steps in a row since the last change, by the rule.
    good = 0
    for step in range(7):
        good = 0 if step in whole.skipped_steps else (good + 1) % 4
    assert float(state.scaler["scale"]) == whole.loss_scales[7]
    assert int(state.scaler["good_steps"]) == good
    resumed = train(config, ranks=2, resume=directory)
    assert first.loss_scales + resumed.loss_scales == whole.loss_scales
    assert resumed.params.tobytes() == whole.params.tobytes()


def test_adam_in_bf16_steps_apart_where_a_gradient_cancels_and_verify_says_why(capsys) -> None:
    config = TrainConfig(steps=1, optimizer="adam", precision="bf16")
    start = first_params(prepare(config))
    serial_step = verify.run(config, 1).params - start
    split_step = verify.run(config, 2).params - start
    apart = np.abs(split_step - serial_step) > 1e-2 * config.lr
    assert 0 < np.count_nonzero(apart) < 1e-2 * start.size
    # where they part, one run stepped by about lr and the other the other way or not at all
    assert np.all(np.sign(serial_step[apart]) * np.sign(split_step[apart]) <= 0)
    assert np.all(np.abs(split_step - serial_step) <= 2 * config.lr)
    assert verify.main(replace(config, steps=3), [1, 2], None, None) == 1
    out = capsys.readouterr().out.replace("\n# ", " ")
    assert "Adam divides each element's step by that element's own gradient size" in out


def test_verify_names_no_such_cause_where_the_passes_are_in_the_dtype() -> None:
    plain = TrainConfig(optimizer="adam")
    assert verify.reasons(plain, [2]) == []
    assert verify.reasons(replace(plain, precision="bf16", exact=True), [2]) == []
    fp16 = verify.reasons(replace(plain, optimizer="sgd", precision="fp16"), [2, 3])
    assert len(fp16) == 1 and "skip different steps" in fp16[0]
