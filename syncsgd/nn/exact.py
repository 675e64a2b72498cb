"""Exact mode's kernels: sums whose bits do not depend on how the batch is split over ranks.

Two ingredients: per-sample products in a fixed order (batch-invariant), and an order-independent
fixed-point sum of the per-sample terms at a scale agreed by a MAX-allreduce of their peaks
(syncsgd.nn.numerics.Exact drives them). docs/exact-mode.md states the guarantee, the error bound
and the proof.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

PRODUCT_BLOCK_BYTES = 262144  # rows of W used together by a product: they stay in the L2 cache
ACCUMULATOR_TILE_BYTES = 16384  # weight-sum rows extracted together: they stay in the L1 cache
MIN_EXPONENT, MAX_EXPONENT = -1022, 1022  # keep M = 1.5 * 2^E and ulp(M) = 2^(E-52) in float64
UNIT_BITS = 52  # ulp(M) = 2^(E - 52)
PANEL_BYTES = 524288  # a widened factor's columns extracted together: they stay in the L2 cache
MIN_PANEL_COLUMNS = 128  # narrower panels would read the other factor too often


@njit(nogil=True, cache=True)
def add_scaled_row_(row, factor, weights):
    """row += factor * weights, element by element (one rounding for the product, one for +)."""
    for j in range(row.shape[0]):
        row[j] += factor * weights[j]


@njit(nogil=True, cache=True)
def fixed_order_product_(x, W, out):
    """out[i, j] = sum over ascending k of x[i, k] * W[k, j], the same order for any row count;
    eight terms of four rows per pass over a row of W."""
    # The same acc = acc + x[i, k] * W[k, j] in ascending k for every element, whatever the
    # grouping: eight k at a time for four rows, then the leftover k and rows one at a time.
    m, depth = x.shape
    n = W.shape[1]
    zero = out.dtype.type(0)
    for i in range(m):
        for j in range(n):
            out[i, j] = zero
    block = max(8, PRODUCT_BLOCK_BYTES // max(n * W.itemsize, 1) // 8 * 8)  # a block of W in L2
    for k_start in range(0, depth, block):  # blocks in ascending k: each element's order is kept
        k_stop = min(k_start + block, depth)
        for i in range(0, m - 3, 4):
            r0, r1, r2, r3 = out[i], out[i + 1], out[i + 2], out[i + 3]
            k = k_start
            while k + 8 <= k_stop:
                w0, w1, w2, w3, w4, w5, w6, w7 = W[k], W[k + 1], W[k + 2], W[k + 3], W[k + 4], \
                    W[k + 5], W[k + 6], W[k + 7]  # fmt: skip
                a, b, c, d = x[i, k : k + 8], x[i + 1, k : k + 8], x[i + 2, k : k + 8], \
                    x[i + 3, k : k + 8]  # fmt: skip
                a0, a1, a2, a3, a4, a5, a6, a7 = a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]
                b0, b1, b2, b3, b4, b5, b6, b7 = b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]
                c0, c1, c2, c3, c4, c5, c6, c7 = c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]
                d0, d1, d2, d3, d4, d5, d6, d7 = d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]
                for j in range(n):
                    v0, v1, v2, v3 = w0[j], w1[j], w2[j], w3[j]
                    v4, v5, v6, v7 = w4[j], w5[j], w6[j], w7[j]
                    r0[j] = (((((((r0[j] + a0 * v0) + a1 * v1) + a2 * v2) + a3 * v3) + a4 * v4)
                              + a5 * v5) + a6 * v6) + a7 * v7  # fmt: skip
                    r1[j] = (((((((r1[j] + b0 * v0) + b1 * v1) + b2 * v2) + b3 * v3) + b4 * v4)
                              + b5 * v5) + b6 * v6) + b7 * v7  # fmt: skip
                    r2[j] = (((((((r2[j] + c0 * v0) + c1 * v1) + c2 * v2) + c3 * v3) + c4 * v4)
                              + c5 * v5) + c6 * v6) + c7 * v7  # fmt: skip
                    r3[j] = (((((((r3[j] + d0 * v0) + d1 * v1) + d2 * v2) + d3 * v3) + d4 * v4)
                              + d5 * v5) + d6 * v6) + d7 * v7  # fmt: skip
                k += 8
            for tail in range(k, k_stop):
                for row in range(i, i + 4):
                    add_scaled_row_(out[row], x[row, tail], W[tail])
        for row in range(m - m % 4, m):  # leftover rows, one term at a time
            for k in range(k_start, k_stop):
                add_scaled_row_(out[row], x[row, k], W[k])


@njit(nogil=True, cache=True)
def peak_magnitude(values):
    """max |v| over a 1-D array, in float64; inf if any value is NaN or infinite (0 if empty)."""
    peak = 0.0
    for value in values:
        magnitude = abs(np.float64(value))
        if not magnitude <= peak:  # larger, or NaN
            peak = magnitude if magnitude < np.inf else np.inf
    return peak


@intrinsic
def float_bits(typingctx, value):
    """The IEEE-754 bit pattern of a float64 or float32, as an int64 or int32 (a bitcast: no
    instruction at all)."""
    width = {types.float64: types.int64, types.float32: types.int32}.get(value)
    if width is None:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(width))

    return width(value), codegen


@njit(nogil=True, cache=True)
def extract_outer_sum_(A, D, magic, unit, sums, counts):
    """sums[k, j] = sum over samples i of hi(A[i, k] * D[i, j]), hi(v) = (magic + v) - magic."""
    # D is float64 (float32 deltas are widened first). magic + v and magic share a binade, so
    # hi(v) / unit = bits(magic + v) - bits(magic): int64 counts of `unit` give the same exact sum
    # on integer lanes, without two more float additions per term.
    m, depth = A.shape
    n = D.shape[1]
    magic_bits = float_bits(magic)
    # Exact sums may be taken in any order: a tile of rows of `counts` stays in the L1 cache
    # while the samples' delta rows stream past it, four samples per load and store.
    tile = accumulator_rows(n)
    for start in range(0, depth, tile):
        stop = min(start + tile, depth)
        counts[: stop - start, :n] = 0
        for i in range(0, m - 3, 4):
            d0, d1, d2, d3 = D[i], D[i + 1], D[i + 2], D[i + 3]
            for k in range(start, stop):
                f0, f1 = np.float64(A[i, k]), np.float64(A[i + 1, k])
                f2, f3 = np.float64(A[i + 2, k]), np.float64(A[i + 3, k])
                if f0 == 0.0 and f1 == 0.0 and f2 == 0.0 and f3 == 0.0:
                    continue  # every product extracts to 0
                row = counts[k - start]
                for j in range(n):  # the products of widened float32 factors are exact
                    row[j] += four_counts(magic, magic_bits, f0, f1, f2, f3, d0[j], d1[j], d2[j],
                                          d3[j])  # fmt: skip
        for i in range(m - m % 4, m):
            delta = D[i]
            for k in range(start, stop):
                factor = np.float64(A[i, k])
                if factor == 0.0:
                    continue
                row = counts[k - start]
                for j in range(n):
                    row[j] += float_bits(magic + factor * delta[j]) - magic_bits
        counts_to_sums_(counts, sums, start, stop, unit)


@njit(nogil=True, cache=True, fastmath={"contract"})
def extract_outer_sum_widened_(A, D, magic, unit, sums, counts):
    """`extract_outer_sum_` for float32 factors (D widened from float32): the same sums, bit for
    bit, four rows of `counts` per pass over the delta rows (a quarter of the loads and stores)."""
    # A product of two float32 values is exact in float64, so magic + f * d rounds once whether
    # or not it is fused ("contract": one instruction). At extraction every factor is finite
    # (the agreed peaks are), so a zero factor extracts to a count of 0: nothing is skipped.
    m, depth = A.shape
    n = D.shape[1]
    magic_bits = float_bits(magic)
    tile = accumulator_rows(n)
    for start in range(0, depth, tile):
        stop = min(start + tile, depth)
        counts[: stop - start, :n] = 0
        for i in range(0, m - 3, 4):
            d0, d1, d2, d3 = D[i], D[i + 1], D[i + 2], D[i + 3]
            k = start
            while k + 4 <= stop:  # four rows of counts share each load of the delta rows
                f0, f1, f2, f3 = widened(A, i, k)
                g0, g1, g2, g3 = widened(A, i, k + 1)
                h0, h1, h2, h3 = widened(A, i, k + 2)
                q0, q1, q2, q3 = widened(A, i, k + 3)
                r0, r1 = counts[k - start], counts[k + 1 - start]
                r2, r3 = counts[k + 2 - start], counts[k + 3 - start]
                for j in range(n):
                    e0, e1, e2, e3 = d0[j], d1[j], d2[j], d3[j]
                    r0[j] += four_counts(magic, magic_bits, f0, f1, f2, f3, e0, e1, e2, e3)
                    r1[j] += four_counts(magic, magic_bits, g0, g1, g2, g3, e0, e1, e2, e3)
                    r2[j] += four_counts(magic, magic_bits, h0, h1, h2, h3, e0, e1, e2, e3)
                    r3[j] += four_counts(magic, magic_bits, q0, q1, q2, q3, e0, e1, e2, e3)
                k += 4
            for tail in range(k, stop):
                f0, f1, f2, f3 = widened(A, i, tail)
                row = counts[tail - start]
                for j in range(n):
                    row[j] += four_counts(magic, magic_bits, f0, f1, f2, f3, d0[j], d1[j], d2[j],
                                          d3[j])  # fmt: skip
        for i in range(m - m % 4, m):
            delta = D[i]
            for k in range(start, stop):
                factor = np.float64(A[i, k])
                row = counts[k - start]
                for j in range(n):
                    row[j] += float_bits(magic + factor * delta[j]) - magic_bits
        counts_to_sums_(counts, sums, start, stop, unit)


@njit(nogil=True, cache=True, inline="always")
def counts_to_sums_(counts, sums, start, stop, unit):
    """sums[start:stop] = the tile's counts (its rows from 0) times `unit`."""
    for k in range(start, stop):
        for j in range(sums.shape[1]):
            sums[k, j] = np.float64(counts[k - start, j]) * unit  # |count| < 2^53: exact


@njit(nogil=True, cache=True, inline="always")
def widened(A, i, k):
    """A[i : i + 4, k] in float64."""
    return (np.float64(A[i, k]), np.float64(A[i + 1, k]), np.float64(A[i + 2, k]),
            np.float64(A[i + 3, k]))  # fmt: skip


@njit(nogil=True, cache=True, inline="always")
def four_counts(magic, magic_bits, f0, f1, f2, f3, e0, e1, e2, e3):
    """The counts of `unit` in hi(f_s e_s) of four samples s, summed."""
    c0 = float_bits(magic + f0 * e0) - magic_bits
    c1 = float_bits(magic + f1 * e1) - magic_bits
    c2 = float_bits(magic + f2 * e2) - magic_bits
    c3 = float_bits(magic + f3 * e3) - magic_bits
    return (c0 + c1) + (c2 + c3)


@njit(nogil=True, cache=True)
def accumulator_rows(n):
    """Rows of an (n wide) int64 accumulator tile that fit ACCUMULATOR_TILE_BYTES."""
    return max(1, ACCUMULATOR_TILE_BYTES // (8 * max(n, 1)))


@njit(nogil=True, cache=True)
def extract_column_sum_(D, magic, sums):
    """sums[j] = sum over samples i of hi(D[i, j])."""
    m, n = D.shape
    for j in range(n):
        sums[j] = 0.0
    for i in range(m):
        for j in range(n):
            sums[j] += (magic + np.float64(D[i, j])) - magic


@njit(nogil=True, cache=True)
def panel_columns(m, n):
    """Columns of an (m, n) factor, widened to float64, that fit PANEL_BYTES (n if all do)."""
    return max(1, min(n, PANEL_BYTES // (8 * max(m, 1))))


@njit(nogil=True, cache=True)
def extract_outer_sum_in_panels_(A, B, magic, unit, sums, wide, counts):
    """extract_outer_sum_ a panel of B's columns at a time, widened into `wide`: the panel stays
    in the L2 cache while every tile of counts passes over it (the same exact sums)."""
    m, n = B.shape
    width = panel_columns(m, n)
    for start in range(0, n, width):
        stop = min(start + width, n)
        columns = stop - start
        panel = wide[: m * columns].reshape((m, columns))
        for i in range(m):
            for j in range(start, stop):
                panel[i, j - start] = np.float64(B[i, j])
        tile = counts[: accumulator_rows(columns) * columns].reshape((-1, columns))
        extract_outer_sum_(A, panel, magic, unit, sums[:, start:stop], tile)


@njit(nogil=True, cache=True)
def extract_sparse_outer_sum_(A, B, magic, unit, sums, counts):
    """sums[k, j] = sum over rows i of hi(A[i, k] * B[i, j]), hi(v) = (magic + v) - magic, for
    an A mostly of zeros (a conv's deltas after max pooling): a zero of A adds nothing."""
    # The same terms as extract_outer_sum_ (the widened factors' products, their counts of
    # `unit`), added in another order: the sums are exact, so their bits are the same. A zero
    # factor's terms all extract to 0 (the peaks are finite: B holds no inf or NaN). The counts
    # of every row k, (depth, n) int64, stay in the L2 cache while the rows of B stream past.
    m, depth = A.shape
    n = B.shape[1]
    magic_bits = float_bits(magic)
    counts[:depth, :n] = 0
    for i in range(m):
        factors = B[i]
        for k in range(depth):
            factor = np.float64(A[i, k])
            if factor == 0.0:
                continue
            row = counts[k]
            for j in range(n):
                row[j] += float_bits(magic + factor * np.float64(factors[j])) - magic_bits
    counts_to_sums_(counts, sums, 0, depth, unit)


@njit(nogil=True, cache=True)
def all_finite(values):
    """Whether a 1-D array holds no inf and no NaN."""
    for value in values:
        if not abs(value) < np.inf:
            return False
    return True


@njit(nogil=True, cache=True)
def sparse_fixed_order_product_(x, W, out, taken):
    """out = x W as fixed_order_product_ gives it, for an x mostly of zeros, skipping its zeros
    (taken: int64 scratch of at least x's columns)."""
    # A sum that starts at +0 never becomes -0 (x + -x rounds to +0), and a finite W makes
    # 0 * W[k, j] a zero: adding it leaves the sum's bits as they are. Skipping it is then the
    # same order over ascending k. A W with an inf or NaN takes every term.
    if not all_finite(W.reshape(-1)):
        fixed_order_product_(x, W, out)
        return
    m, depth = x.shape
    n = W.shape[1]
    zero = out.dtype.type(0)
    # taken[:count]: a row's nonzero k, ascending
    for i in range(m):
        count = 0
        for k in range(depth):
            if x[i, k] != 0:
                taken[count] = k
                count += 1
        row = out[i]
        for j in range(n):
            row[j] = zero
        t = 0
        while t + 4 <= count:  # four terms per load and store of the row, in ascending k
            k0, k1, k2, k3 = taken[t], taken[t + 1], taken[t + 2], taken[t + 3]
            f0, f1, f2, f3 = x[i, k0], x[i, k1], x[i, k2], x[i, k3]
            w0, w1, w2, w3 = W[k0], W[k1], W[k2], W[k3]
            for j in range(n):
                row[j] = (((row[j] + f0 * w0[j]) + f1 * w1[j]) + f2 * w2[j]) + f3 * w3[j]
            t += 4
        for tail in range(t, count):
            add_scaled_row_(row, x[i, taken[tail]], W[taken[tail]])


def slot_exponent(value: float, global_batch: int) -> int:
    """The least integer E with 2^E >= 2 * B * value, clamped to [-1022, 1022]."""
    if not math.isfinite(value):
        raise ValueError(
            f"gradient too large for exact mode: a term bound of {value} overflows float64"
        )
    if value == 0.0:
        return MIN_EXPONENT
    numerator, denominator = float(value).as_integer_ratio()  # denominator = 2^d, exact
    target = 2 * global_batch * numerator
    # 2^(E + d) >= target  <=>  E + d >= bit_length(target - 1)
    exponent = (target - 1).bit_length() - (denominator.bit_length() - 1)
    if exponent > MAX_EXPONENT:
        raise ValueError(
            f"gradient too large for exact mode: term bound {value:.3g} times 2 x batch "
            f"{global_batch} exceeds the float64 range"
        )
    return max(exponent, MIN_EXPONENT)


__all__ = ["extract_column_sum_", "extract_outer_sum_", "extract_outer_sum_widened_",
           "fixed_order_product_", "slot_exponent"]


# -- the exact sum of squares: a global norm whose bits do not depend on how it is split ----------
# Every finite float64 is an integer times 2^-1074. A square's integer, cut into 32-bit digits at
# its place, is added digit by digit into int64 limbs of 32 bits: exact, in any order, for fewer
# than 2^31 squares (each limb stays below 2^63); partial limbs from several ranks add exactly,
# and the total is rounded once. docs/sharded.md uses it for the norms of a sharded step.
SQUARE_LIMBS = 70  # 2^-1074 .. 2^1024 and the carries: 2,098 bits of place, 32 to a limb


@njit(nogil=True, cache=True)
def add_square_limbs_(values, limbs):
    """limbs += the squares of `values` (squared in float64), as 32-bit digits at their places;
    returns False if a square is not finite (then limbs mean nothing)."""
    for value in values:
        square = np.float64(value) * np.float64(value)
        if not square < np.inf:  # inf or NaN
            return False
        if square == 0.0:
            continue
        fraction, exponent = math.frexp(square)
        mantissa = np.int64(math.ldexp(fraction, 53))  # square = mantissa * 2^(exponent - 53)
        place = exponent - 53 + 1074
        if place < 0:  # a subnormal square: its low bits are zeros, shift them out exactly
            mantissa >>= -place
            place = 0
        limb, shift = place // 32, place % 32
        low = (mantissa & ((np.int64(1) << (32 - shift)) - 1)) << shift
        rest = mantissa >> (32 - shift)  # below 2^52
        limbs[limb] += low
        limbs[limb + 1] += rest & np.int64(0xFFFFFFFF)
        limbs[limb + 2] += rest >> 32
    return True


def limbs_value(limbs: np.ndarray) -> float:
    """The sum the limbs hold, rounded once to float64."""
    from fractions import Fraction

    total = sum(int(limb) << (32 * place) for place, limb in enumerate(limbs))
    return float(Fraction(total, 1 << 1074))


def exact_square_sum(values: np.ndarray) -> float:
    """The sum of the float64 squares of `values`, rounded once: the same bits in any order and
    however the array is split (inf if a square is not finite)."""
    limbs = np.zeros(SQUARE_LIMBS, np.int64)
    return limbs_value(limbs) if add_square_limbs_(values.reshape(-1), limbs) else math.inf
