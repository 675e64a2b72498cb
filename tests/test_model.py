"""The --hidden MLP's network: layout, views, init and file round trips; parse_hidden."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from syncsgd.nn.mlp import mlp, parse_hidden, sizes_of

layer_sizes = st.lists(st.integers(1, 9), min_size=2, max_size=5).map(tuple)


def naive_init(sizes, activation, seed):
    """The init contract written out: per layer in order, drawn in float64; zero biases."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for layer in range(len(sizes) - 1):
        fan_in, fan_out = sizes[layer], sizes[layer + 1]
        if activation == "relu":
            arrays[f"W{layer}"] = rng.standard_normal((fan_in, fan_out)) * np.sqrt(2 / fan_in)
        else:
            limit = np.sqrt(6 / (fan_in + fan_out))
            arrays[f"W{layer}"] = rng.uniform(-limit, limit, (fan_in, fan_out))
        arrays[f"b{layer}"] = np.zeros(fan_out)
    return arrays


@given(sizes=layer_sizes)
def test_layout_packs_w_then_b_per_layer_row_major(sizes):
    model = mlp(sizes)
    expected_names = [f"{kind}{layer}" for layer in range(len(sizes) - 1) for kind in "Wb"]
    assert model.param_names() == expected_names
    assert sizes_of(model) == sizes
    assert model.n_layers == 2 * (len(sizes) - 1) - 1  # dense relu ... dense
    assert model.n_params == sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:], strict=False))
    flat = np.arange(model.n_params, dtype=np.float64)
    views = model.views(flat)
    start = 0
    for layer in range(len(sizes) - 1):
        fan_in, fan_out = sizes[layer], sizes[layer + 1]
        W, b = views[f"W{layer}"], views[f"b{layer}"]
        assert W.shape == (fan_in, fan_out) and b.shape == (fan_out,)
        expected_W = np.arange(start, start + fan_in * fan_out).reshape(fan_in, fan_out)
        np.testing.assert_array_equal(W, expected_W)
        start += fan_in * fan_out
        np.testing.assert_array_equal(b, np.arange(start, start + fan_out))
        start += fan_out
    assert start == model.n_params


def test_views_write_through_to_the_flat_buffer():
    model = mlp((3, 4, 2))
    flat = np.zeros(model.n_params)
    views = model.views(flat)
    views["W1"][2, 1] = 7.0
    views["b0"][:] = 1.0
    assert flat[3 * 4 + 4 + 2 * 2 + 1] == 7.0
    assert flat[12:16].tolist() == [1.0] * 4
    assert all(np.shares_memory(view, flat) for view in views.values())


@pytest.mark.parametrize(
    "bad",
    [np.zeros(5), np.zeros((2, 13)), [0.0] * 26, np.zeros(52)[::2]],
    ids=["short", "2-d", "list", "strided"],
)
def test_views_reject_a_wrong_buffer(bad):
    model = mlp((3, 4, 2))  # 26 parameters
    with pytest.raises(ValueError, match="26 parameters|contiguous"):
        model.views(bad)


@pytest.mark.parametrize("activation", ["relu", "tanh"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_init_follows_the_seeded_recipe(activation, dtype):
    sizes = (5, 7, 3, 2)
    model = mlp(sizes, activation, dtype=dtype)
    flat = model.init_params(11)
    assert flat.dtype == dtype and flat.shape == (model.n_params,)
    for name, expected in naive_init(sizes, activation, 11).items():
        np.testing.assert_array_equal(model.views(flat)[name], expected.astype(dtype))
    np.testing.assert_array_equal(model.init_params(11), flat)
    assert not np.array_equal(model.init_params(12), flat)


def test_he_normal_statistics():
    model = mlp((400, 300, 200), "relu")
    views = model.views(model.init_params(0))
    for fan_in, name in ((400, "W0"), (300, "W1")):
        weights = views[name]
        std = np.sqrt(2 / fan_in)
        assert abs(weights.mean()) < 0.02 * std
        assert abs(weights.std() / std - 1) < 0.02
        # Normal, not uniform: about 4.55% of draws lie beyond 2 standard deviations.
        assert 0.04 < np.mean(np.abs(weights) > 2 * std) < 0.051
    assert not views["b0"].any() and not views["b1"].any()


def test_glorot_uniform_statistics():
    model = mlp((400, 300, 200), "tanh")
    views = model.views(model.init_params(0))
    for (fan_in, fan_out), name in (((400, 300), "W0"), ((300, 200), "W1")):
        weights = views[name]
        limit = np.sqrt(6 / (fan_in + fan_out))
        assert np.abs(weights).max() <= limit
        assert np.abs(weights).max() > 0.999 * limit
        assert abs(weights.std() / (limit / np.sqrt(3)) - 1) < 0.02
        assert abs(np.mean(np.abs(weights) < limit / 2) - 0.5) < 0.01


@given(sizes=layer_sizes, seed=st.integers(0, 2**32 - 1))
def test_arrays_round_trip(sizes, seed):
    model = mlp(sizes, "tanh", loss="mse", dtype=np.float32)
    flat = model.init_params(seed) + np.float32(0.5)
    arrays = model.to_arrays(flat)
    assert sorted(arrays) == sorted(model.param_names())
    assert not any(np.shares_memory(array, flat) for array in arrays.values())
    restored = model.from_arrays(arrays)
    assert restored.dtype == np.float32
    np.testing.assert_array_equal(restored, flat)


def test_npz_round_trip(tmp_path):
    model = mlp((4, 3, 2))
    flat = model.init_params(3)
    np.savez(tmp_path / "params.npz", **model.to_arrays(flat))
    with np.load(tmp_path / "params.npz", allow_pickle=False) as arrays:
        np.testing.assert_array_equal(model.from_arrays(arrays), flat)


def test_from_arrays_casts_to_the_model_dtype():
    model64, model32 = mlp((2, 3)), mlp((2, 3), dtype="float32")
    flat = model64.init_params(0)
    restored = model32.from_arrays(model64.to_arrays(flat))
    np.testing.assert_array_equal(restored, flat.astype(np.float32))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.pop("b1"), "missing parameter 'b1'"),
        (lambda a: a.update(W0=np.zeros((3, 4))), r"'W0' has shape \(3, 4\), expected \(4, 3\)"),
        (lambda a: a.update(W2=np.zeros((2, 2))), "'W2' does not belong"),
        (lambda a: a.update(b0=np.array([1.0, np.nan, 0.0])), "'b0' contains NaN"),
        (lambda a: a.update(b0=np.array(["a", "b", "c"])), "'b0' has non-numeric dtype"),
    ],
    ids=["missing", "shape", "extra-layer", "nan", "strings"],
)
def test_from_arrays_names_the_problem(change, message):
    model = mlp((4, 3, 2))
    arrays = model.to_arrays(model.init_params(0))
    change(arrays)
    with pytest.raises(ValueError, match=message):
        model.from_arrays(arrays)


def test_from_arrays_ignores_unrelated_keys():
    model = mlp((4, 2))
    arrays = {**model.to_arrays(model.init_params(0)), "velocity": np.zeros(3), "step": 5}
    np.testing.assert_array_equal(model.from_arrays(arrays), model.init_params(0))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sizes": (4,)}, "at least input and output"),
        ({"sizes": (4, 0, 2)}, "integers >= 1"),
        ({"sizes": (4, 2.0)}, "integers >= 1"),
        ({"sizes": (4, True)}, "integers >= 1"),
        ({"sizes": (4, 2), "activation": "sigmoid"}, "unknown activation 'sigmoid'"),
        ({"sizes": (4, 2), "loss": "hinge"}, "unknown loss 'hinge'"),
        ({"sizes": (4, 2), "dtype": "float16"}, "unsupported dtype float16"),
        ({"sizes": (4, 2), "dtype": "floaty"}, "unknown dtype 'floaty'"),
    ],
)
def test_model_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        mlp(**kwargs)


def test_model_normalises_fields():
    model = mlp([3, np.int64(2)], dtype="float32")
    assert sizes_of(model) == (3, 2) and type(sizes_of(model)[1]) is int
    assert model.in_shape == (3,) and model.outputs == 2 and type(model.outputs) is int
    assert model.dtype == np.dtype(np.float32)

    def described(network):  # what the model is: a Network compares its layers by identity
        return (network.spec, network.in_shape, network.outputs, network.loss, network.dtype,
                network.layout(), network.running_layout(), network.name_map)

    assert described(model) == described(mlp((3, 2), dtype=np.float32))
    assert described(model) == described(mlp((3, 2), dtype="f4"))


@pytest.mark.parametrize(
    ("text", "expected"),
    [("64,64", (64, 64)), ("", ()), ("  ", ()), (" 8 , 4 ", (8, 4)), ("1", (1,)), ("007", (7,))],
)
def test_parse_hidden(text, expected):
    assert parse_hidden(text) == expected


@pytest.mark.parametrize("text", ["a", "64,", ",", "0", "-1", "1.5", "64;64", "64,,64", "²", "1e3"])
def test_parse_hidden_rejects(text):
    with pytest.raises(ValueError, match="hidden layer sizes must be positive integers"):
        parse_hidden(text)


def test_batchnorm_arrays_keep_the_file_format_and_ride_with_their_dense_layer():
    model = mlp((4, 3, 2), batchnorm="sync")  # dense batchnorm relu dense
    assert model.param_names() == ["W0", "b0", "gamma0", "beta0", "W1", "b1"]
    assert [name for name, _, _ in model.running_layout()] == ["running_mean0", "running_var0"]
    assert [model.layer_of(name) for name in model.param_names()] == [0, 0, 0, 0, 3, 3]
    flat = model.init_params(0)
    per_layer = model.layer_views(flat)  # the passes see the layers' own names
    assert np.shares_memory(per_layer[1]["weight"], model.views(flat)["gamma0"])
    with pytest.raises(ValueError, match="'running_mean1' does not belong to a model with "
                                         "batchnorm sync and sizes 4,3,2"):  # fmt: skip
        model.running_from_arrays({"running_mean1": np.zeros(3)})
    with pytest.raises(ValueError, match="'running_var0' holds a negative variance"):
        model.running_from_arrays({"running_var0": -np.ones(3)})
