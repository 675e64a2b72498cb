"""Exact mode: batch-invariant per-sample passes and order-independent extracted sums.

The passes are `Backprop` with the `Exact` numerics, driven in the step's two phases (`Shard`):
the per-sample forward and backward pass registers every sum as a term with its peaks, every rank
agrees on the peaks (a MAX), and the terms are extracted at the agreed fixed points.

References: a whole-batch float64 NumPy forward/backward (independent of the Numba code), a
NumPy emulation of the documented summation order (bit for bit), exact rational arithmetic
(fractions.Fraction) for the error bound, and nn.local's local gradient (float mode, and exact
mode on one process).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from syncsgd import run_threads
from syncsgd.collectives import ring_allreduce
from syncsgd.comm.world import constants
from syncsgd.nn.backprop import Backprop
from syncsgd.nn.exact import slot_exponent
from syncsgd.nn.local import local_gradient
from syncsgd.nn.mlp import mlp, sizes_of
from syncsgd.nn.numerics import Exact, numerics

pytestmark = pytest.mark.timeout(300)

DTYPES = [np.float64, np.float32]
ACTIVATIONS = ["relu", "tanh"]
LOSSES = ["xent", "mse"]
FLOAT_TOLERANCE = {np.dtype(np.float64): 1e-10, np.dtype(np.float32): 2e-4}


def make_problem(sizes, activation, loss, dtype, m, seed):
    """A model, parameters with random biases, and a batch of m samples."""
    model = mlp(tuple(sizes), activation, loss=loss, dtype=np.dtype(dtype))
    rng = np.random.default_rng(seed)
    params = model.init_params(seed)
    params += (0.1 * rng.standard_normal(model.n_params)).astype(model.dtype)
    X = rng.standard_normal((m, sizes[0])).astype(model.dtype)
    if loss == "xent":
        y = rng.integers(0, sizes[-1], m)
    else:
        y = rng.standard_normal((m, sizes[-1])).astype(model.dtype)
    return model, params, X, y


class Shard:
    """One rank's exact-mode gradient in the step's two phases, around the MAX of the peaks."""

    def __init__(self, model, max_batch):
        network = self.network = model
        self.nx = numerics(True, "fp32", network.dtype, network.largest_weight(),
                           max_batch * network.largest_block(), network.n_params)  # fmt: skip
        assert isinstance(self.nx, Exact)
        self.passes = Backprop(network, max_batch, self.nx)
        self.grads = np.zeros(network.n_params)  # the terms are extracted into it
        self.top = network.n_layers - 1

    def local_pass(self, params, X, y):
        """Phase 1: the per-sample passes register every sum; (hits, this shard's peaks)."""
        self.nx.begin_step_(self.grads, max(len(X), 1))
        _, hits = self.passes.forward_loss_(params, X, y)
        self.passes.backward_(self.grads, self.top, 0)
        bounds = np.full(len(self.nx.peaks), np.nan)
        self.nx.bounds(bounds)
        return hits, bounds

    def accumulate(self, bounds, global_batch):
        """Phase 2: the sums extracted at the agreed peaks: the gradient, then the loss."""
        self.grads[:] = 0
        scales = self.nx.scales(bounds, global_batch)
        loss_sum = self.nx.extract_loss(scales)
        self.nx.accumulate_(scales, self.top, 0)
        return np.append(self.grads, loss_sum)

    def error_bound(self, bounds, global_batch):
        """Per element of the gradient, then the loss: the stated bound on the mean's error."""
        return self.nx.error_bound(bounds, global_batch, self.grads)

    def sample_terms(self):
        """Views of the last pass's factors, layer by layer: each dense layer's (m, fan_in)
        input and (m, fan_out) delta; the per-sample losses."""
        terms = self.nx.terms
        outer = [term for term in terms if term.kind == "outer"][::-1]  # registered top down
        columns = [term for term in terms if term.kind == "columns"][::-1]
        for weight, bias in zip(outer, columns, strict=True):  # a bias sums the weight's deltas
            assert weight.b is bias.a
        (loss,) = [term for term in terms if term.kind == "loss"]
        return [t.a for t in outer], [t.b for t in outer], loss.a[:, 0]

    def term_slices(self):
        """Per registered term: (term, its elements in the gradient-then-loss vector)."""
        base = self.grads.__array_interface__["data"][0]
        slices = []
        for term in self.nx.terms:
            if term.kind == "loss":
                slices.append((term, slice(-1, None)))
                continue
            start = (term.out.__array_interface__["data"][0] - base) // self.grads.itemsize
            slices.append((term, slice(start, start + term.out.size)))
        return slices

    def term_bound(self, bounds, term):
        """v: the agreed bound on |every per-sample term| of a registered sum."""
        value = float(bounds[term.first_bound])
        return value * float(bounds[term.first_bound + 1]) if term.kind == "outer" else value


def run_exact(model, params, X, y, global_batch=None):
    """One shard alone: (hits, its peaks, float64 sums: the gradient, then the loss)."""
    shard = Shard(model, len(X))
    hits, bounds = shard.local_pass(params, X, y)
    return hits, bounds, shard.accumulate(bounds, global_batch or max(len(X), 1))


def activation_of(model):
    """The hidden layers' activation of an MLP: "relu" or "tanh" (relu if it has none)."""
    return "tanh" if any(layer.kind == "tanh" for layer in model.layers) else "relu"


def reference(model, params, X, y):
    """Per-layer inputs and deltas, per-sample losses and the gradient sum, whole-batch float64."""
    views = {name: view.astype(np.float64) for name, view in model.views(params).items()}
    inputs, h = [], X.astype(np.float64)
    n_layers, activation = len(sizes_of(model)) - 1, activation_of(model)  # dense layers
    for layer in range(n_layers):
        inputs.append(h)
        z = h @ views[f"W{layer}"] + views[f"b{layer}"]
        last = layer == n_layers - 1
        h = z if last else (np.maximum(z, 0) if activation == "relu" else np.tanh(z))
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
    for layer in range(n_layers - 1, 0, -1):
        a = inputs[layer]
        slope = (a > 0) if activation == "relu" else 1 - a * a
        deltas.insert(0, (deltas[0] @ views[f"W{layer}"].T) * slope)
    parts = []
    for a, d in zip(inputs, deltas, strict=True):
        parts += [(a.T @ d).ravel(), d.sum(axis=0)]
    return inputs, deltas, losses, np.concatenate([*parts, [losses.sum()]])


def bits(array):
    """The raw bytes of an array: equal bits, also telling +0 from -0."""
    return np.ascontiguousarray(array).tobytes()


def copied_terms(shard):
    """Copies of the per-sample inputs, deltas and losses of the last pass."""
    inputs, deltas, losses = shard.sample_terms()
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
    shard = Shard(model, m)
    shard.local_pass(params, X, y)
    whole = copied_terms(shard)
    # The same samples reordered and regrouped: one alone, a sub-batch, a permutation.
    order = np.array(data.draw(st.permutations(range(m))))
    cut = data.draw(st.integers(1, m))
    for rows in (order, order[:cut], order[cut - 1 : cut]):
        shard.local_pass(params, X[rows], y[rows])
        inputs, deltas, losses = shard.sample_terms()
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
    shard = Shard(model, 11)
    shard.local_pass(params, X, y)
    inputs, deltas, losses = shard.sample_terms()
    views = model.views(params)
    h, expected_inputs = X, []
    n_layers = len(sizes) - 1  # dense layers
    for layer in range(n_layers):
        expected_inputs.append(h)
        W = views[f"W{layer}"]
        total = np.zeros((len(X), W.shape[1]), dtype=model.dtype)
        for k in range(W.shape[0]):  # NumPy rounds the product, then the sum: no FMA
            total = total + h[:, k : k + 1] * W[k]
        z = total + views[f"b{layer}"]
        h = z if layer == n_layers - 1 else np.maximum(z, 0)
    error = h - y
    delta = model.dtype.type(2.0 / h.shape[1]) * error
    expected_losses = np.zeros(len(X))
    for j in range(h.shape[1]):
        expected_losses += error[:, j].astype(np.float64) ** 2
    expected_deltas = [delta]
    for layer in range(n_layers - 1, 0, -1):
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
    rows_of = np.split(np.arange(len(X)), cuts)
    shards = [Shard(model, len(rows)) for rows in rows_of]
    hits, local = 0, []
    for shard, rows in zip(shards, rows_of, strict=True):
        shard_hits, bounds = shard.local_pass(params, X[rows], y[rows])
        hits, local = hits + shard_hits, [*local, bounds]
    agreed = np.max(local, axis=0)
    return hits, agreed, [shard.accumulate(agreed, global_batch) for shard in shards]


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
    # The single-process convenience is the same two phases on one shard.
    serial = np.empty(model.n_params)
    loss_sum, serial_hits = local_gradient(model, batch, exact=True)(params, X, y, serial)
    assert serial_hits == hits
    assert bits(np.append(serial, loss_sum)) == bits(whole)
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
    shard = Shard(model, len(rows))
    _, bounds = shard.local_pass(params, X[rows], y[rows])
    mpi = constants(comm)
    comm.Allreduce(mpi.IN_PLACE, bounds, op=mpi.MAX)
    return ring_allreduce(shard.accumulate(bounds, len(X)), comm)


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
    shard = Shard(model, batch)
    _, bounds = shard.local_pass(params, X, y)
    sums = shard.accumulate(bounds, batch)
    bound = shard.error_bound(bounds, batch)
    for got, exact, allowed in zip(sums, exact_sums_by_layer(shard), bound, strict=True):
        assert abs(Fraction(float(got)) - exact) <= batch * Fraction(float(allowed))
    # The stated constant: below B v 2^-51 (+ 2^-53 v + 2^-1075 for float64 weights), one v per
    # registered sum: a weight sum's is the product of its two factors' peaks.
    for term, elements in shard.term_slices():
        value = shard.term_bound(bounds, term)
        weights64 = model.dtype == np.float64 and term.kind == "outer"
        extra = value * 2.0**-53 + 2.0**-1075 if weights64 else 0
        assert np.all(bound[elements] <= max(batch * value * 2.0**-51, 2.0**-1075) + extra)


def exact_sums_by_layer(shard):
    """The exact rational sums of the last pass's per-sample terms, in the flat layout."""
    inputs, deltas, losses = shard.sample_terms()
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
    shard = Shard(model, batch)
    _, bounds = shard.local_pass(params, X, y)
    sums = shard.accumulate(bounds, batch + 3)
    scales = shard.nx.scales(bounds, batch + 3)
    slices = shard.term_slices()
    covered = np.zeros(model.n_params + 1, bool)
    for (term, elements), (magic, unit) in zip(slices, scales, strict=True):
        exponent = slot_exponent(shard.term_bound(bounds, term), batch + 3)
        assert (magic, unit) == (np.ldexp(1.5, exponent), np.ldexp(1.0, exponent - 52))
        counts = sums[elements] / unit  # a power of two: exact
        assert np.array_equal(counts, np.round(counts))
        covered[elements] = True
    assert covered.all()  # every element is one registered sum's


@given(model_case=models, batch=st.integers(1, 16), seed=st.integers(0, 2**16))
def test_c_exact_mean_is_close_to_float64_reference_and_to_float_mode(model_case, batch, seed):
    model, params, X, y = make_problem(*model_case, batch, seed)
    shard = Shard(model, batch)
    hits, bounds = shard.local_pass(params, X, y)
    sums = shard.accumulate(bounds, batch)
    *_, expected = reference(model, params, X, y)
    # The factors themselves are rounded in the model's dtype (the reference's in float64): the
    # float tolerance of test_kernels, on top of the stated extraction bound.
    scale = 1 + np.abs(expected).max()
    allowed = shard.error_bound(bounds, batch) + FLOAT_TOLERANCE[model.dtype] * scale / batch
    assert np.all(np.abs(sums / batch - expected / batch) <= allowed)
    float_grad = np.empty(model.n_params, dtype=model.dtype)
    loss_sum, float_hits = local_gradient(model, batch)(params, X, y, float_grad)
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
    shard = Shard(model, 9)
    _, bounds = shard.local_pass(params, X, y)
    sums = shard.accumulate(bounds, 9)
    inputs, deltas, losses, expected = reference(model, params, X, y)
    allowed = shard.error_bound(bounds, 9) + FLOAT_TOLERANCE[model.dtype] * (
        1 + np.abs(expected).max()
    )
    np.testing.assert_array_less(np.abs(sums - expected) / 9, allowed)
    got_inputs, got_deltas, got_losses = shard.sample_terms()
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
    shard = Shard(model, 0)
    hits, bounds = shard.local_pass(params, X, y)
    assert hits == 0
    assert len(bounds) == 2 * 3 + 1  # per dense layer: its weight's two peaks, its bias's; loss
    assert bits(bounds) == bits(np.zeros(len(bounds)))
    sums = shard.accumulate(np.full(len(bounds), 3.0), 7)
    assert bits(sums) == bits(np.zeros(model.n_params + 1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_d_an_all_zero_gradient_is_plus_zero_everywhere(dtype):
    model = mlp((3, 4, 2), "relu", loss="mse", dtype=np.dtype(dtype))
    params = np.zeros(model.n_params, dtype=dtype)
    X = np.ones((5, 3), dtype=dtype)
    y = np.zeros((5, 2), dtype=dtype)  # outputs 0 = targets: every delta and loss is 0
    shard = Shard(model, 5)
    _, bounds = shard.local_pass(params, X, y)
    sums = shard.accumulate(bounds, 5)
    for term in shard.nx.terms:  # every peak is 0 but the layers' inputs'
        assert bounds[term.first_bound + (term.kind == "outer")] == 0
    assert bits(sums) == bits(np.zeros(model.n_params + 1))
    assert np.all(shard.error_bound(bounds, 5) == 2.0**-1075)


@given(
    value=st.floats(0, 1e280, allow_subnormal=True),
    batch=st.integers(1, 2**40),
)
def test_d_exponents_are_the_least_power_of_two_above_2_b_v(value, batch):
    assert slot_exponent(0.0, batch) == -1022  # a zero bound
    exponent = slot_exponent(value, batch)
    target = 2 * batch * Fraction(value)
    if value == 0 or target <= Fraction(2) ** -1022:
        assert exponent == -1022
    else:
        assert Fraction(2) ** exponent >= target > Fraction(2) ** (exponent - 1)


# bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["X", "params"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_value_is_refused_after_the_max(where, value):
    model, params, X, y = make_problem((3, 4, 2), "relu", "xent", np.float64, 6, 2)
    (X if where == "X" else params)[1] = value
    shard = Shard(model, 6)
    _, bounds = shard.local_pass(params, X, y)
    assert np.isinf(bounds).any() and not np.isnan(bounds).any()  # inf survives a MAX
    with pytest.raises(ValueError, match="too large for exact mode"):
        shard.accumulate(bounds, 6)


def non_finite_rank(comm, model, params, X, y):
    """One step's local gradient on a rank whose shard holds a NaN only on rank 1."""
    from syncsgd.training.config import TrainConfig
    from syncsgd.training.layered import RankGradient
    from syncsgd.training.step import CommBuffer

    rank, size = comm.Get_rank(), comm.Get_size()
    rows = np.array_split(np.arange(len(X)), size)[rank]
    config = TrainConfig(batch_size=len(X), exact=True)
    buffer = CommBuffer(model.n_params, np.dtype(np.float64))
    local = RankGradient(config, model, comm, len(rows), buffer)
    sums = buffer.build()
    local(params, X[rows], y[rows], sums)
    return local.local.nx.agreed, sums


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_value_on_one_rank_is_refused_on_every_rank_after_the_max(value):
    model, params, X, y = make_problem((3, 4, 2), "relu", "xent", np.float64, 6, 2)
    X[3] = value  # rank 1's first sample of three ranks
    for scales, sums in run_threads(3, non_finite_rank, model, params, X, y):
        assert scales is None  # no rank extracts: every rank skips (or stops) alike
        assert np.isnan(sums[: model.n_params + 1]).all()  # the gradient and the loss sum


def test_bounds_that_were_not_reduced_are_refused():
    model, params, X, y = make_problem((3, 4, 2), "relu", "xent", np.float64, 6, 2)
    shard = Shard(model, 6)
    _, bounds = shard.local_pass(params, X, y)
    with pytest.raises(ValueError, match="MAX-allreduce"):
        shard.accumulate(bounds / 2, 6)
    with pytest.raises(ValueError, match="too large"):
        shard.accumulate(np.full(len(bounds), 1e300), 6)
    # Why it matters: below the true peaks a term may leave M's binade and the sums are wrong.
    assert bits(shard.accumulate(bounds, 6)) == bits(run_exact(model, params, X, y)[2])


def test_bad_arguments_get_one_line_messages():
    model, params, X, y = make_problem((3, 2), "relu", "xent", np.float64, 4, 0)
    shard = Shard(model, 4)
    _, bounds = shard.local_pass(params, X, y)
    network, nx = shard.network, shard.nx
    cases = [
        (lambda: shard.local_pass(params[:-1], X, y), "params"),
        (lambda: shard.local_pass(params.astype(np.float32), X, y), "params"),
        (lambda: shard.local_pass(params, np.zeros((5, 3)), np.zeros(5, int)), "max_batch"),
        (lambda: shard.local_pass(params, X, y + 5), "labels"),
        (lambda: Backprop(network, -1, nx), "max_batch"),
        (lambda: local_gradient(model, 4)(params, X, y, np.zeros(3)), "grad_out"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            call()
        assert "\n" not in str(info.value)
    shard.local_pass(params, X, y)  # a failed pass leaves no terms: extract the last good one's
    for call, message in [
        (lambda: shard.accumulate(bounds[:-1], 4), "bounds"),
        (lambda: shard.accumulate(bounds, 3), "smaller than"),
        (lambda: shard.accumulate(bounds, 0), "smaller than"),
    ]:
        with pytest.raises(ValueError, match=message) as info:
            call()
        assert "\n" not in str(info.value)


@given(m=st.integers(0, 11), depth=st.integers(1, 13), width=st.sampled_from([1, 3, 8, 2100]),
       seed=st.integers(0, 2**16), batch=st.integers(12, 300))  # fmt: skip
def test_the_extraction_of_float32_factors_is_the_general_ones_bit_for_bit(m, depth, width, seed,
                                                                          batch):  # fmt: skip
    from syncsgd.nn import exact as ex

    rng = np.random.default_rng(seed)
    spread = np.exp2(rng.integers(-30, 10, (m, depth)))  # factors of many binades, and zeros
    A = (rng.standard_normal((m, depth)) * spread).astype(np.float32)
    A[rng.random((m, depth)) < 0.4] = 0.0
    D = (rng.standard_normal((m, width)) * np.exp2(rng.integers(-20, 5, (m, width))))
    D = D.astype(np.float32).astype(np.float64)  # float32 deltas, widened as the numerics do
    peak = float(np.abs(A).max(initial=0.0)) * float(np.abs(D).max(initial=0.0))
    exponent = slot_exponent(peak, batch)
    magic, unit = float(np.ldexp(1.5, exponent)), float(np.ldexp(1.0, exponent - ex.UNIT_BITS))
    counts = np.zeros((ex.accumulator_rows(width), width), np.int64)
    general, widened = np.full((depth, width), np.nan), np.full((depth, width), np.nan)
    ex.extract_outer_sum_(A, D, magic, unit, general, counts)
    ex.extract_outer_sum_widened_(A, D, magic, unit, widened, counts)
    assert general.tobytes() == widened.tobytes()


@given(rows=st.integers(1, 43), columns=st.integers(1, 37),
       dtype=st.sampled_from(["float64", "float32"]), seed=st.integers(0, 2**16))  # fmt: skip
def test_the_transpose_in_strips_is_numpys_bit_for_bit(rows, columns, dtype, seed):
    from syncsgd.nn.numerics import copy_transposed_in_strips_

    W = np.random.default_rng(seed).standard_normal((rows, columns)).astype(dtype)
    W.reshape(-1)[:3] = [np.nan, -0.0, np.inf][: W.size]
    strips = np.full((columns, rows), 7.0, dtype)
    copy_transposed_in_strips_(W, strips)
    assert strips.tobytes() == np.ascontiguousarray(W.T).tobytes()


def same_bits_but_nan_payloads(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bits, a NaN matching any NaN (its payload depends on the operands' order)."""
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b)) and a[~nan].tobytes() == b[~nan].tobytes())


@given(m=st.integers(1, 11), depth=st.integers(1, 45), n=st.sampled_from([1, 3, 13, 1031]),
       dtype=st.sampled_from(["float64", "float32"]), seed=st.integers(0, 2**16))  # fmt: skip
def test_the_fixed_order_product_is_numpys_term_by_term_sum(m, depth, n, dtype, seed):
    from syncsgd.nn import exact as ex

    rng = np.random.default_rng(seed)  # a wide W takes more than one block of k (float64)
    x = rng.standard_normal((m, depth)).astype(dtype)
    W = (rng.standard_normal((depth, n)) * np.exp2(rng.integers(-20, 20, (depth, n)))).astype(dtype)
    W.reshape(-1)[rng.integers(0, W.size)] = rng.choice([np.nan, np.inf, -0.0])
    kernel, by_terms = np.full((m, n), 7.0, dtype), np.zeros((m, n), dtype)
    ex.fixed_order_product_(x, W, kernel)
    with np.errstate(invalid="ignore", over="ignore"):
        for k in range(depth):  # each product rounded, then each sum, in ascending k
            by_terms = by_terms + x[:, k : k + 1] * W[k]
    assert same_bits_but_nan_payloads(kernel, by_terms)
