"""Exact mode: batch-invariant per-sample passes and order-independent extracted sums.

References: a whole-batch float64 NumPy forward/backward (independent of the Numba code), a
NumPy emulation of the documented summation order (bit for bit), exact rational arithmetic
(fractions.Fraction) for the error bound, and kernels.Gradient (float mode).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from syncsgd import run_threads
from syncsgd.collectives import ring_allreduce
from syncsgd.comm.world import constants
from syncsgd.nn.exact import ExactGradient, exactness_bound, extraction_exponents, slot_bounds
from syncsgd.nn.kernels import Gradient
from syncsgd.nn.mlp import MLP

pytestmark = pytest.mark.timeout(300)

DTYPES = [np.float64, np.float32]
ACTIVATIONS = ["relu", "tanh"]
LOSSES = ["xent", "mse"]
FLOAT_TOLERANCE = {np.dtype(np.float64): 1e-10, np.dtype(np.float32): 2e-4}


def make_problem(sizes, activation, loss, dtype, m, seed):
    """A model, parameters with random biases, and a batch of m samples."""
    model = MLP(tuple(sizes), activation, loss, np.dtype(dtype))
    rng = np.random.default_rng(seed)
    params = model.init_params(seed)
    params += (0.1 * rng.standard_normal(model.n_params)).astype(model.dtype)
    X = rng.standard_normal((m, model.sizes[0])).astype(model.dtype)
    if loss == "xent":
        y = rng.integers(0, model.sizes[-1], m)
    else:
        y = rng.standard_normal((m, model.sizes[-1])).astype(model.dtype)
    return model, params, X, y


def run_exact(model, params, X, y, global_batch=None):
    """One shard alone: (hits, bounds, float64 sums) of local_pass + accumulate."""
    gradient = ExactGradient(model, len(X))
    bounds = np.full(gradient.bound_count, np.nan)
    hits = gradient.local_pass(params, X, y, bounds)
    sums = np.full(model.n_params + 1, np.nan)
    gradient.accumulate(bounds, global_batch or max(len(X), 1), sums)
    return hits, bounds, sums


def reference(model, params, X, y):
    """Per-layer inputs and deltas, per-sample losses and the gradient sum, whole-batch float64."""
    views = {name: view.astype(np.float64) for name, view in model.views(params).items()}
    inputs, h = [], X.astype(np.float64)
    for layer in range(model.n_layers):
        inputs.append(h)
        z = h @ views[f"W{layer}"] + views[f"b{layer}"]
        last = layer == model.n_layers - 1
        h = z if last else (np.maximum(z, 0) if model.activation == "relu" else np.tanh(z))
    rows = np.arange(len(X))
    if model.loss == "xent":
        top = h.max(axis=1, keepdims=True)
        log_total = top[:, 0] + np.log(np.exp(h - top).sum(axis=1))
        losses = log_total - h[rows, y]
        delta = np.exp(h - log_total[:, None])
        delta[rows, y] -= 1
    else:
        error = h - y.astype(np.float64)
        losses = (error**2).mean(axis=1)
        delta = 2 * error / h.shape[1]
    deltas = [delta]
    for layer in range(model.n_layers - 1, 0, -1):
        a = inputs[layer]
        slope = (a > 0) if model.activation == "relu" else 1 - a * a
        deltas.insert(0, (deltas[0] @ views[f"W{layer}"].T) * slope)
    parts = []
    for a, d in zip(inputs, deltas, strict=True):
        parts += [(a.T @ d).ravel(), d.sum(axis=0)]
    return inputs, deltas, losses, np.concatenate([*parts, [losses.sum()]])


def bits(array):
    """The raw bytes of an array: equal bits, also telling +0 from -0."""
    return np.ascontiguousarray(array).tobytes()


def copied_terms(gradient):
    """Copies of the per-sample inputs, deltas and losses of the last pass."""
    inputs, deltas, losses = gradient.sample_terms()
    return [a.copy() for a in inputs], [d.copy() for d in deltas], losses.copy()


models = st.tuples(
    st.lists(st.integers(1, 9), min_size=2, max_size=4),  # 0..2 hidden layers
    st.sampled_from(ACTIVATIONS),
    st.sampled_from(LOSSES),
    st.sampled_from(DTYPES),
)


# (a) batch invariance ------------------------------------------------------------------------


@given(model_case=models, m=st.integers(1, 13), data=st.data(), seed=st.integers(0, 2**16))
def test_a_samples_terms_do_not_depend_on_its_micro_batch(model_case, m, data, seed):
    model, params, X, y = make_problem(*model_case, m, seed)
    gradient = ExactGradient(model, m)
    bounds = np.empty(gradient.bound_count)
    gradient.local_pass(params, X, y, bounds)
    whole = copied_terms(gradient)
    # The same samples reordered and regrouped: one alone, a sub-batch, a permutation.
    order = np.array(data.draw(st.permutations(range(m))))
    cut = data.draw(st.integers(1, m))
    for rows in (order, order[:cut], order[cut - 1 : cut]):
        gradient.local_pass(params, X[rows], y[rows], bounds)
        inputs, deltas, losses = gradient.sample_terms()
        for mine, full in zip(inputs + deltas, whole[0] + whole[1], strict=True):
            assert bits(mine) == bits(full[rows])
        assert bits(losses) == bits(whole[2][rows])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes", [(5, 3), (7, 6, 4, 3), (150, 512, 3)], ids=str)
def test_a_pass_follows_the_documented_order_bit_for_bit(dtype, sizes):
    """relu + mse in NumPy, one term at a time in the documented order, against the kernels.

    (150, 512, 3) crosses the product's blocks of rows of W (256 KiB) and its leftover k steps;
    11 samples use the four-row path and three leftover rows.
    """
    model, params, X, y = make_problem(sizes, "relu", "mse", dtype, 11, 3)
    gradient = ExactGradient(model, 11)
    gradient.local_pass(params, X, y, np.empty(gradient.bound_count))
    inputs, deltas, losses = gradient.sample_terms()
    views = model.views(params)
    h, expected_inputs = X, []
    for layer in range(model.n_layers):
        expected_inputs.append(h)
        W = views[f"W{layer}"]
        total = np.zeros((len(X), W.shape[1]), dtype=model.dtype)
        for k in range(W.shape[0]):  # NumPy rounds the product, then the sum: no FMA
            total = total + h[:, k : k + 1] * W[k]
        z = total + views[f"b{layer}"]
        h = z if layer == model.n_layers - 1 else np.maximum(z, 0)
    error = h - y
    delta = model.dtype.type(2.0 / h.shape[1]) * error
    expected_losses = np.zeros(len(X))
    for j in range(h.shape[1]):
        expected_losses += error[:, j].astype(np.float64) ** 2
    expected_deltas = [delta]
    for layer in range(model.n_layers - 1, 0, -1):
        W = views[f"W{layer}"]
        total = np.zeros((len(X), W.shape[0]), dtype=model.dtype)
        for j in range(W.shape[1]):
            total = total + delta[:, j : j + 1] * W[:, j]
        delta = np.where(expected_inputs[layer] <= 0, model.dtype.type(0), total)
        expected_deltas.insert(0, delta)
    for mine, expected in zip(inputs + deltas, expected_inputs + expected_deltas, strict=True):
        assert bits(mine) == bits(expected)
    assert bits(losses) == bits(expected_losses / h.shape[1])


# (b) order independence ----------------------------------------------------------------------


def shard_sums(model, params, X, y, cuts, global_batch):
    """Each shard's extracted sums, after a MAX over every shard's bounds (as the allreduce)."""
    shards = np.split(np.arange(len(X)), cuts)
    gradients = [ExactGradient(model, len(rows)) for rows in shards]
    local = np.zeros((len(shards), gradients[0].bound_count))
    hits = 0
    for gradient, rows, bounds in zip(gradients, shards, local, strict=True):
        hits += gradient.local_pass(params, X[rows], y[rows], bounds)
    agreed = local.max(axis=0)
    sums = np.zeros((len(shards), model.n_params + 1))
    for gradient, out in zip(gradients, sums, strict=True):
        gradient.accumulate(agreed, global_batch, out)
    return hits, agreed, sums


@given(
    model_case=models,
    batch=st.integers(1, 20),
    ranks=st.integers(1, 12),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_b_any_sharding_and_summation_order_gives_the_same_bits(
    model_case, batch, ranks, data, seed
):
    model, params, X, y = make_problem(*model_case, batch, seed)
    hits, bounds, whole = run_exact(model, params, X, y)
    # Samples shuffled, cut into `ranks` shards anywhere (empty shards included, P > B too).
    order = np.array(data.draw(st.permutations(range(batch))))
    cut_points = st.lists(st.integers(0, batch), min_size=ranks - 1, max_size=ranks - 1)
    cuts = sorted(data.draw(cut_points))
    shard_hits, agreed, sums = shard_sums(model, params, X[order], y[order], cuts, batch)
    assert shard_hits == hits
    assert bits(agreed) == bits(bounds)
    for _ in range(3):
        total = np.zeros(model.n_params + 1)
        for rank in data.draw(st.permutations(range(ranks))):
            total += sums[rank]
        assert bits(total) == bits(whole)
    # A different grouping: pairwise, as a tree of partial sums would add them.
    partial = list(sums)
    while len(partial) > 1:
        partial = [sum(partial[i : i + 2]) for i in range(0, len(partial), 2)]
    assert bits(partial[0]) == bits(whole)


def ring_rank(comm, model, params, X, y):
    """What a training step does on one rank: shard, pass, MAX, accumulate, ring SUM."""
    rank, size = comm.Get_rank(), comm.Get_size()
    rows = np.array_split(np.arange(len(X)), size)[rank]
    gradient = ExactGradient(model, len(rows))
    bounds = np.zeros(gradient.bound_count)
    gradient.local_pass(params, X[rows], y[rows], bounds)
    mpi = constants(comm)
    comm.Allreduce(mpi.IN_PLACE, bounds, op=mpi.MAX)
    sums = np.zeros(model.n_params + 1)
    gradient.accumulate(bounds, len(X), sums)
    return ring_allreduce(sums, comm)


@given(
    model_case=models,
    batch=st.integers(1, 16),
    ranks=st.integers(1, 12),
    seed=st.integers(0, 2**16),
)
def test_b_ring_allreduce_on_thread_ranks_gives_the_serial_bits(model_case, batch, ranks, seed):
    model, params, X, y = make_problem(*model_case, batch, seed)
    _, _, serial = run_exact(model, params, X, y)
    results = run_threads(ranks, ring_rank, model, params, X, y)
    assert all(bits(result) == bits(serial) for result in results)


# (c) closeness -------------------------------------------------------------------------------


@given(model_case=models, batch=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_c_extracted_sums_are_within_the_stated_bound_of_the_exact_sums(model_case, batch, seed):
    model, params, X, y = make_problem(*model_case, batch, seed)
    gradient = ExactGradient(model, batch)
    bounds = np.empty(gradient.bound_count)
    gradient.local_pass(params, X, y, bounds)
    sums = np.empty(model.n_params + 1)
    gradient.accumulate(bounds, batch, sums)
    bound = exactness_bound(model, bounds, batch)
    for got, exact, allowed in zip(sums, exact_sums_by_layer(model, gradient), bound, strict=True):
        assert abs(Fraction(float(got)) - exact) <= batch * Fraction(float(allowed))
    # The stated constant: below B v_s 2^-51 (+ 2^-53 v_s + 2^-1075 for float64 weights).
    per_slot = slot_bounds(bounds)
    for slot, (_, _, offset) in enumerate(model.layout()):
        weights64 = model.dtype == np.float64 and slot % 2 == 0
        extra = per_slot[slot] * 2.0**-53 + 2.0**-1075 if weights64 else 0
        assert bound[offset] <= max(batch * per_slot[slot] * 2.0**-51, 2.0**-1075) + extra


def exact_sums_by_layer(model, gradient):
    """The exact rational sums of the last pass's per-sample terms, in the flat layout."""
    inputs, deltas, losses = gradient.sample_terms()
    sums = []
    for a, d in zip(inputs, deltas, strict=True):
        a_q = [[Fraction(float(v)) for v in row] for row in a]
        d_q = [[Fraction(float(v)) for v in row] for row in d]
        samples = range(len(a_q))
        for k in range(a.shape[1]):
            for j in range(d.shape[1]):
                sums.append(sum((a_q[i][k] * d_q[i][j] for i in samples), Fraction(0)))
        for j in range(d.shape[1]):
            sums.append(sum((d_q[i][j] for i in samples), Fraction(0)))
    sums.append(sum((Fraction(float(v)) for v in losses), Fraction(0)))
    return sums


@given(model_case=models, batch=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_c_sums_are_whole_multiples_of_the_agreed_unit(model_case, batch, seed):
    model, params, X, y = make_problem(*model_case, batch, seed)
    _, bounds, sums = run_exact(model, params, X, y, global_batch=batch + 3)
    exponents = extraction_exponents(bounds, batch + 3)
    for slot, (_, shape, offset) in enumerate(model.layout()):
        counts = np.ldexp(sums[offset : offset + math.prod(shape)], 52 - exponents[slot])
        assert np.array_equal(counts, np.round(counts))
    assert np.ldexp(sums[-1], 52 - exponents[-1]) % 1 == 0


@given(model_case=models, batch=st.integers(1, 16), seed=st.integers(0, 2**16))
def test_c_exact_mean_is_close_to_float64_reference_and_to_float_mode(model_case, batch, seed):
    model, params, X, y = make_problem(*model_case, batch, seed)
    hits, bounds, sums = run_exact(model, params, X, y)
    *_, expected = reference(model, params, X, y)
    # The factors themselves are rounded in the model's dtype (the reference's in float64): the
    # float tolerance of test_kernels, on top of the stated extraction bound.
    scale = 1 + np.abs(expected).max()
    allowed = exactness_bound(model, bounds, batch) + FLOAT_TOLERANCE[model.dtype] * scale / batch
    assert np.all(np.abs(sums / batch - expected / batch) <= allowed)
    float_grad = np.empty(model.n_params, dtype=model.dtype)
    loss_sum, float_hits = Gradient(model, batch)(params, X, y, float_grad)
    assert np.all(np.abs(sums[:-1] - float_grad) / batch <= allowed[:-1])
    assert abs(sums[-1] - loss_sum) / batch <= allowed[-1]
    if model.dtype == np.float64:
        assert hits == float_hits
    else:  # a float32 argmax may flip on a near tie
        assert abs(hits - float_hits) <= 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("hidden", [(), (7,), (6, 5)], ids=lambda h: f"hidden{len(h)}")
def test_c_every_configuration_matches_the_reference(dtype, activation, loss, hidden):
    model, params, X, y = make_problem((8, *hidden, 4), activation, loss, dtype, 9, 11)
    hits, bounds, sums = run_exact(model, params, X, y)
    inputs, deltas, losses, expected = reference(model, params, X, y)
    allowed = exactness_bound(model, bounds, 9) + FLOAT_TOLERANCE[model.dtype] * (
        1 + np.abs(expected).max()
    )
    np.testing.assert_array_less(np.abs(sums - expected) / 9, allowed)
    gradient = ExactGradient(model, 9)
    gradient.local_pass(params, X, y, bounds)
    got_inputs, got_deltas, got_losses = gradient.sample_terms()
    tolerance = FLOAT_TOLERANCE[model.dtype]
    for got, want in zip(got_inputs + got_deltas, inputs + deltas, strict=True):
        np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)
    np.testing.assert_allclose(got_losses, losses, rtol=tolerance)


# (d) empty shards, zero gradients, bounds ----------------------------------------------------


@pytest.mark.parametrize("loss", LOSSES)
def test_d_an_empty_shard_contributes_zeros(loss):
    model, params, _, _ = make_problem((4, 5, 3), "relu", loss, np.float64, 0, 1)
    X = np.empty((0, 4))
    y = np.empty(0, dtype=np.int64) if loss == "xent" else np.empty((0, 3))
    gradient = ExactGradient(model, 0)
    bounds = np.full(gradient.bound_count, np.nan)
    assert gradient.local_pass(params, X, y, bounds) == 0
    assert bits(bounds) == bits(np.zeros(gradient.bound_count))
    sums = np.full(model.n_params + 1, np.nan)
    gradient.accumulate(np.full(gradient.bound_count, 3.0), 7, sums)
    assert bits(sums) == bits(np.zeros(model.n_params + 1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_d_an_all_zero_gradient_is_plus_zero_everywhere(dtype):
    model = MLP((3, 4, 2), "relu", "mse", np.dtype(dtype))
    params = np.zeros(model.n_params, dtype=dtype)
    X = np.ones((5, 3), dtype=dtype)
    y = np.zeros((5, 2), dtype=dtype)  # outputs 0 = targets: every delta and loss is 0
    hits, bounds, sums = run_exact(model, params, X, y)
    assert bounds[-1] == 0 and not bounds[1::2].any()
    assert bits(sums) == bits(np.zeros(model.n_params + 1))
    assert np.all(exactness_bound(model, bounds, 5) == 2.0**-1075)


@given(
    value=st.floats(0, 1e280, allow_subnormal=True),
    batch=st.integers(1, 2**40),
)
def test_d_exponents_are_the_least_power_of_two_above_2_b_v(value, batch):
    exponents = extraction_exponents(np.array([1.0, value, 0.0]), batch)
    target = 2 * batch * Fraction(value)
    assert exponents[2] == -1022  # a zero bound
    for exponent in exponents[:2]:
        if value == 0 or target <= Fraction(2) ** -1022:
            assert exponent == -1022
        else:
            assert Fraction(2) ** int(exponent) >= target > Fraction(2) ** int(exponent - 1)


# bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["X", "params"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_value_is_refused_on_every_rank_after_the_max(where, value):
    model, params, X, y = make_problem((3, 4, 2), "relu", "xent", np.float64, 6, 2)
    (X if where == "X" else params)[1] = value
    gradient = ExactGradient(model, 6)
    bounds = np.zeros(gradient.bound_count)
    gradient.local_pass(params, X, y, bounds)
    assert np.isinf(bounds).any() and not np.isnan(bounds).any()  # inf survives a MAX
    with pytest.raises(ValueError, match="non-finite gradient"):
        gradient.accumulate(bounds, 6, np.zeros(model.n_params + 1))


def test_bounds_that_were_not_reduced_are_refused():
    model, params, X, y = make_problem((3, 4, 2), "relu", "xent", np.float64, 6, 2)
    gradient = ExactGradient(model, 6)
    bounds = np.zeros(gradient.bound_count)
    gradient.local_pass(params, X, y, bounds)
    with pytest.raises(ValueError, match="MAX-allreduce"):
        gradient.accumulate(bounds / 2, 6, np.zeros(model.n_params + 1))
    with pytest.raises(ValueError, match="too large"):
        gradient.accumulate(np.full(gradient.bound_count, 1e300), 6, np.zeros(model.n_params + 1))


def test_bad_arguments_get_one_line_messages():
    model, params, X, y = make_problem((3, 2), "relu", "xent", np.float64, 4, 0)
    gradient = ExactGradient(model, 4)
    bounds = np.zeros(gradient.bound_count)
    sums = np.zeros(model.n_params + 1)
    cases = [
        (lambda: gradient.accumulate(bounds, 4, sums), "local_pass first"),
        (lambda: gradient.local_pass(params, X, y, np.zeros(2)), "bounds_out"),
        (lambda: gradient.local_pass(params[:-1], X, y, bounds), "params"),
        (lambda: gradient.local_pass(params, np.zeros((5, 3)), np.zeros(5, int), bounds), "max_b"),
        (lambda: gradient.local_pass(params, X, y + 5, bounds), "labels"),
        (lambda: ExactGradient(model, -1), "max_batch"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    gradient.local_pass(params, X, y, bounds)
    for call, message in [
        (lambda: gradient.accumulate(bounds, 3, sums), "smaller than"),
        (lambda: gradient.accumulate(bounds, 0, sums), "global_batch"),
        (lambda: gradient.accumulate(bounds, 4, sums.astype(np.float32)), "sums_out"),
        (lambda: gradient.accumulate(bounds[:-1], 4, sums), "bounds"),
        (lambda: gradient.accumulate(-bounds - 1, 4, sums), ">= 0"),
    ]:
        with pytest.raises(ValueError, match=message) as info:
            call()
        assert "\n" not in str(info.value)
