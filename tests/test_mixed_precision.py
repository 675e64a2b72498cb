"""Compressed allreduce: the gradient sums cast to a narrow format around the allreduce."""

from __future__ import annotations

import numpy as np
import pytest

from syncsgd.apps import verify
from syncsgd.nn.precision import ALLREDUCE_CODES, round_array
from syncsgd.training import data
from syncsgd.training.config import TrainConfig
from syncsgd.training.loop import train
from syncsgd.training.run import first_params, prepare

SMALL = {"samples": 256, "features": 8, "hidden": (16,), "batch_size": 60}


def compressed_step(config: TrainConfig, ranks: int) -> np.ndarray:
    """One step by hand: each rank's sum cast, the casts summed and cast again, then / B."""
    from syncsgd.nn.kernels import Gradient

    run = prepare(config)
    params = first_params(run)
    fmt = ALLREDUCE_CODES[config.allreduce_dtype or ""]
    batch = data.SampleOrder(len(run.X), config.batch_size, config.seed, config.shuffle).batch(0)
    total = np.zeros(run.model.n_params)
    for rank in range(ranks):
        shard = data.contiguous_shard(batch, rank, ranks)
        local = np.empty(run.model.n_params)
        Gradient(run.model, len(shard))(params, run.X[shard], run.y[shard], local)
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
