"""gemm_add_(a, b, out): out += a b through the kernels' BLAS (SciPy's, as np.dot in Numba), in
one call with beta = 1: a sum over chunks without a product into scratch and a pass to add it.

Numba's np.dot calls its helper `numba_xxgemm` with beta = 0; this calls the same helper with
beta = 1. It loads SciPy's BLAS at its first call, as np.dot does (syncsgd.nn.blas).
"""

from __future__ import annotations

import numpy as np
from numba import types
from numba.core.errors import TypingError
from numba.extending import overload

# alpha and beta: read through pointers by BLAS, one pair per dtype
ONES = {types.float32: np.ones(2, np.float32), types.float64: np.ones(2, np.float64)}


def gemm_add_(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out += a b: a (m, k), b (k, n), each C- or F-contiguous; out (m, n) C-contiguous."""
    out += a @ b


def xxgemm(dtype: types.Float) -> types.ExternalFunction:
    """Numba's BLAS helper: (kind, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c,
    ldc), column-major as BLAS's gemm."""
    pointer = types.CPointer(dtype)
    return types.ExternalFunction("numba_xxgemm", types.intc(
        types.char, types.char, types.char, types.intp, types.intp, types.intp, pointer,
        pointer, types.intp, pointer, types.intp, pointer, pointer, types.intp))  # fmt: skip


@overload(gemm_add_, jit_options={"nogil": True})
def gemm_add_kernel(a, b, out):  # type: ignore[no-untyped-def]
    """gemm_add_ in Numba: out^T = b^T a^T + out^T in BLAS's column-major terms."""
    if out.dtype not in ONES or a.dtype != out.dtype or b.dtype != out.dtype:
        raise TypingError("gemm_add_ takes float32 or float64 arrays of one dtype")
    if out.layout != "C" or a.layout not in "CF" or b.layout not in "CF":
        raise TypingError("gemm_add_ takes contiguous arrays and a C-contiguous out")
    gemm, ones = xxgemm(out.dtype), ONES[out.dtype]
    kind = ord("s") if out.dtype == types.float32 else ord("d")
    # a C-contiguous (m, k) is a column-major (k, m): a^T as it lies; an F-contiguous one, not
    a_as_is, b_as_is = a.layout == "C", b.layout == "C"
    as_is, transposed = ord("n"), ord("t")

    def kernel(a, b, out):  # type: ignore[no-untyped-def]
        m, k = a.shape
        n = b.shape[1]
        if m == 0 or n == 0 or k == 0:
            return
        status = gemm(kind, as_is if b_as_is else transposed, as_is if a_as_is else transposed,
                      n, m, k, ones.ctypes, b.ctypes, n if b_as_is else k, a.ctypes,
                      k if a_as_is else m, ones[1:].ctypes, out.ctypes, n)  # fmt: skip
        if status != 0:
            raise RuntimeError("gemm_add_: BLAS's gemm failed")

    return kernel
