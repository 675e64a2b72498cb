"""The kernels' BLAS core type: forced only when OpenBLAS settles for less than the CPU runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from syncsgd.nn import blas

AVX512 = {"AVX512_SKX": True, "AVX2": True, "FMA3": True}
AVX2 = {"AVX512_SKX": False, "AVX2": True, "FMA3": True}


@pytest.mark.parametrize(
    ("detected", "features", "expected"),
    [
        ("Haswell", AVX512, "SkylakeX"),  # an OpenBLAS that does not know the CPU
        ("Zen", AVX512, "SkylakeX"),
        ("SkylakeX", AVX512, None),  # already the best it has
        ("COOPERLAKE", AVX512, None),  # a better one than syncsgd would force: kept
        ("SapphireRapids", AVX512, None),
        ("Haswell", AVX2, None),  # no AVX-512 on the CPU: never forced
        ("Prescott", AVX2, "Haswell"),
        ("Prescott", {}, None),  # features unknown: nothing forced
        ("Haswell", {"AVX512F": True, "AVX2": True, "FMA3": True}, None),  # AVX512F alone
        (None, AVX512, None),  # nothing detected to compare with
    ],
)
def test_decide_forces_only_what_the_cpu_runs(detected, features, expected):
    assert blas.decide(detected, features) == expected


def run_python(code: str, **env: str) -> str:
    """The stdout of `code` in a fresh interpreter, with `env` set and OPENBLAS_CORETYPE unset."""
    environment = {k: v for k, v in os.environ.items()
                   if k not in (blas.CORE_VARIABLE, blas.CHOSEN_VARIABLE)}  # fmt: skip
    environment.update(env, OPENBLAS_NUM_THREADS="1")
    finished = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True,
                              text=True, timeout=300, check=True)  # fmt: skip
    return finished.stdout.strip()


CALL_KERNEL = """
import numpy as np
from syncsgd.nn import blas, local
from syncsgd.nn.mlp import mlp
model = mlp((3, 4, 2), "relu", loss="xent", dtype=np.dtype("float64"))
local.local_gradient(model, 2)(model.init_params(0), np.ones((2, 3)), np.array([0, 1]),
                             np.empty(model.n_params))
info = blas.kernels_blas()
print(blas.choose_core().core, info["architecture"], blas.choose_core().reason)
"""


def test_a_misdetecting_openblas_gets_the_cpus_kernels():
    # NumPy's OpenBLAS is made to detect Haswell; SciPy's, loaded at the first kernel call, must
    # then run the best kernels the CPU has (SkylakeX with AVX-512, else as detected: Haswell).
    code = "import os, numpy\ndel os.environ['OPENBLAS_CORETYPE']\n" + CALL_KERNEL
    core, architecture, reason = run_python(code, OPENBLAS_CORETYPE="Haswell").split(" ", 2)
    if blas.cpu_features().get("AVX512_SKX"):
        assert (core, architecture) == ("SkylakeX", "SkylakeX")
        assert reason.startswith("chosen by syncsgd: OpenBLAS detects Haswell")
    else:
        assert (core, architecture) == ("None", "Haswell")


@pytest.mark.skipif(not blas.cpu_features().get("AVX2"), reason="needs a CPU with AVX2")
def test_the_users_core_type_wins():
    core, architecture, reason = run_python(CALL_KERNEL, OPENBLAS_CORETYPE="Haswell").split(" ", 2)
    assert (core, architecture, reason) == ("Haswell", "Haswell", "set by the user")


def test_a_child_process_knows_the_choice_was_syncsgds():
    inherited = {"OPENBLAS_CORETYPE": "Haswell", blas.CHOSEN_VARIABLE: "Haswell"}
    core, _, reason = run_python(CALL_KERNEL, **inherited).split(" ", 2)
    assert (core, reason) == ("Haswell", "chosen by syncsgd's parent process")


def test_no_choice_once_scipys_blas_is_loaded():
    code = "import scipy.linalg\n" + CALL_KERNEL
    core, _, reason = run_python(code).split(" ", 2)
    assert core == "None"
    assert "loaded before" in reason


def test_describe_names_the_running_kernels():
    line = run_python(CALL_KERNEL.replace("print(", "print(blas.describe()) or print("))
    assert "running its" in line.splitlines()[0]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(("a_order", "b_order"), [("C", "C"), ("C", "F"), ("F", "C"), ("F", "F")])
def test_gemm_add_adds_the_product_to_out_for_every_layout(dtype, a_order, b_order):
    import numpy as np
    from numba import njit

    from syncsgd.nn.gemm import gemm_add_

    add = njit(lambda a, b, out: gemm_add_(a, b, out))
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((5, 3)), rng.standard_normal((3, 4))
    out = rng.standard_normal((5, 4)).astype(dtype)
    expected = out + (a @ b).astype(dtype)
    add(np.asarray(a, dtype, order=a_order), np.asarray(b, dtype, order=b_order), out)
    tolerance = 1e-5 if dtype == "float32" else 1e-12
    np.testing.assert_allclose(out, expected, rtol=tolerance, atol=tolerance)
