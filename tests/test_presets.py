"""The named networks: each preset expands to its layers and trains like any spec."""

from __future__ import annotations

import hashlib

import pytest

from syncsgd import TrainConfig, train
from syncsgd.nn.network import build, parse_spec
from syncsgd.nn.presets import PRESETS
from syncsgd.training.run import widest


def test_lenet5_is_lecuns_layers_on_28_by_28_digits():
    network = build("lenet5", (1, 28, 28), 10, "xent", "float64")
    assert network.summary() == ("conv(6, 5, pad=2) tanh avgpool(2) conv(16, 5) tanh avgpool(2) "
                                 "flatten dense(120) tanh dense(84) tanh dense(10)")  # fmt: skip
    assert [shape for _, shape, _ in network.layout()][:4] == [(6, 1, 5, 5), (6,), (16, 6, 5, 5),
                                                               (16,)]  # fmt: skip
    assert network.n_params == 61706  # LeNet-5's parameters with a 10-way output


def test_simple_cnn_is_shallue_et_als():
    network = build("simple-cnn", (1, 28, 28), 10, "xent", "float32")
    assert network.layers[-3].in_shape == (64 * 7 * 7,)
    assert network.summary().endswith("flatten dense(1024) relu dense(10)")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_preset_parses_as_its_expansion(name):
    assert parse_spec(name) == parse_spec(PRESETS[name])


def test_lenet5_trains_bitwise_alike_on_one_and_three_ranks_in_exact_mode():
    config = TrainConfig(model="lenet5", input_shape=(1, 28, 28), features=784, classes=10,
                         samples=24, batch_size=6, steps=2, exact=True)  # fmt: skip
    serial, three = train(config, ranks=1), train(config, ranks=3)
    assert hashlib.sha256(serial.params.tobytes()).digest() == hashlib.sha256(
        three.params.tobytes()).digest()  # fmt: skip


@pytest.mark.parametrize(
    ("spec", "in_shape", "width"),
    [
        ("lenet5", (1, 28, 28), 120),  # its widest dense layer, wider than 16 channels
        ("conv(32, 3) relu flatten dense", (1, 6, 6), 32),  # a conv's channels, not its columns
        ("dense", (7,), 7),  # no hidden layer: the inputs' width
        ("flatten dense", (2, 3, 3), 18),
    ],
)
def test_the_noam_schedules_d_is_the_model_width(spec, in_shape, width):
    assert widest(build(spec, in_shape, 10, "xent", "float64")) == width


def test_a_gpts_noam_d_is_its_blocks_width_and_its_products_are_counted():
    network = build("gpt(layers=2,d=8,heads=2)", (4,), 11, "xent", "float64")
    assert widest(network) == 8
    # per block: in_proj 3d², out_proj d², fc1 and fc2 4d² each, at T positions; QKᵀ and AV
    t, d = 4, 8
    assert network.multiply_adds()[1] == t * 12 * d * d + 2 * t * t * d
