"""Every cell of mode x precision x BatchNorm x overlap trains, with the guarantee of its mode."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from syncsgd import TrainConfig, train

TINY = dict(samples=48, features=5, classes=3, hidden=(6, 5), batch_size=12, steps=3, lr=0.2,
            bucket_bytes=0)  # fmt: skip


def digest(values: np.ndarray | None) -> str:
    """SHA-256 of a flat buffer ('' for none)."""
    return "" if values is None else hashlib.sha256(values.tobytes()).hexdigest()


@pytest.mark.parametrize("batchnorm", ["none", "local", "sync"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("exact", [False, True])
def test_every_cell_trains_and_overlap_changes_no_bit(exact, precision, batchnorm):
    # A fixed fp16 loss scale: the dynamic one starts at 2^16 and would skip these few steps.
    scale = "128" if precision == "fp16" else None
    config = TrainConfig(exact=exact, precision=precision, batchnorm=batchnorm, loss_scale=scale,
                         **TINY)  # fmt: skip
    serial = train(config, ranks=1)
    plain = train(config, ranks=3)
    overlapped = train(config, ranks=3, overlap=True)
    assert np.isfinite(plain.params).all() and not plain.skipped_steps
    assert digest(overlapped.params) == digest(plain.params)
    assert digest(overlapped.running) == digest(plain.running)
    if batchnorm == "local":  # each shard's own statistics: another function at every P
        assert digest(plain.params) != digest(serial.params)
    elif exact:  # bitwise the serial run
        assert digest(plain.params) == digest(serial.params)
        assert digest(plain.running) == digest(serial.running)
    else:  # float mode: the ring's order of the sums, within rounding of the format
        tolerance = 1e-12 if precision == "fp32" else 0.05
        assert np.abs(plain.params - serial.params).max() < tolerance
