"""The kernels' BLAS: which OpenBLAS kernels SciPy's OpenBLAS runs, chosen before it loads.

NumPy and SciPy ship OpenBLAS builds that pick their kernels ("core type") from the CPU when they
load. An OpenBLAS older than the CPU may not know it and fall back to older kernels: on an AMD
EPYC of family 26 it ran its Haswell (AVX2) kernels, at about half the GEMM rate of its SkylakeX
(AVX-512) ones (docs/measurements.md). OpenBLAS reads OPENBLAS_CORETYPE once, when it loads; the
kernels' BLAS is SciPy's (Numba's np.dot calls `scipy.linalg.cython_blas`), which loads at the first
kernel call, after NumPy's. So NumPy's OpenBLAS, already loaded, shows what OpenBLAS detects here,
and `choose_core` sets OPENBLAS_CORETYPE for SciPy's when that falls short of what the CPU can run.
Kernels for instructions the CPU lacks would crash, so a core type is only forced when NumPy's
runtime CPU detection (cpuid and the OS's support) reports every instruction set it uses.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

CORE_VARIABLE = "OPENBLAS_CORETYPE"
# Set next to OPENBLAS_CORETYPE, so that child processes, which inherit both, can tell a core type
# syncsgd chose from one the user chose.
CHOSEN_VARIABLE = "SYNCSGD_CHOSEN_OPENBLAS_CORETYPE"
SCIPY_BLAS_MODULES = ("scipy.linalg", "scipy.linalg.cython_blas")

AVX512_CORES = ("skylakex", "cooperlake", "sapphirerapids")
AVX2_CORES = ("haswell", "zen", *AVX512_CORES)
# Best first: (core type to force, NumPy's names of the CPU features its kernels use, the detected
# core types that are already as good, so nothing is forced).
LADDER = (
    ("SkylakeX", ("AVX512_SKX",), AVX512_CORES),
    ("Haswell", ("AVX2", "FMA3"), AVX2_CORES),
)


@dataclass(frozen=True)
class Choice:
    """The OPENBLAS_CORETYPE in force for the kernels' BLAS (None: OpenBLAS detects) and why."""

    core: str | None
    reason: str


_choice: Choice | None = None


def cpu_features() -> dict[str, bool]:
    """The CPU's instruction sets as NumPy's runtime dispatch found them; {} if it cannot tell."""
    for name in ("numpy._core._multiarray_umath", "numpy.core._multiarray_umath"):  # NumPy 2, 1
        try:
            return dict(importlib.import_module(name).__cpu_features__)
        except (ImportError, AttributeError):
            continue
    return {}


def openblas_libraries() -> list[dict]:
    """threadpoolctl's record of every OpenBLAS loaded in this process, in load order."""
    from threadpoolctl import threadpool_info  # type: ignore[import-untyped]

    return [info for info in threadpool_info() if info.get("internal_api") == "openblas"]


def decide(detected: str | None, features: Mapping[str, bool]) -> str | None:
    """The core type to force, given OpenBLAS's detected one and the CPU's features; None: keep."""
    if not detected:
        return None
    for core, needs, enough in LADDER:
        if all(features.get(name, False) for name in needs):
            return None if detected.lower() in enough else core
    return None


def choose_core() -> Choice:
    """Set OPENBLAS_CORETYPE before SciPy's OpenBLAS loads if OpenBLAS would settle for less."""
    global _choice
    if _choice is None:
        _choice = _choose()
    return _choice


def _choose() -> Choice:
    """`choose_core`'s decision, taken once per process."""
    given = os.environ.get(CORE_VARIABLE)
    if given:
        chosen = os.environ.get(CHOSEN_VARIABLE) == given
        return Choice(given, "chosen by syncsgd's parent process" if chosen else "set by the user")
    if any(name in sys.modules for name in SCIPY_BLAS_MODULES):
        return Choice(None, "OpenBLAS's own detection: SciPy's BLAS loaded before syncsgd chose")
    import numpy  # noqa: F401  (loads NumPy's OpenBLAS, whose detection is asked)

    numpy_blas = openblas_libraries()
    detected = numpy_blas[0].get("architecture") if numpy_blas else None
    if detected is None:
        return Choice(None, "OpenBLAS's own detection: NumPy's BLAS is not OpenBLAS to ask")
    core = decide(detected, cpu_features())
    if core is None:
        return Choice(None, f"OpenBLAS's own choice: it detects {detected}, as the CPU allows")
    os.environ[CORE_VARIABLE] = os.environ[CHOSEN_VARIABLE] = core
    needs = "+".join(next(needs for name, needs, _ in LADDER if name == core))
    return Choice(core, f"chosen by syncsgd: OpenBLAS detects {detected}, the CPU has {needs}")


def kernels_blas() -> dict | None:
    """threadpoolctl's record of SciPy's OpenBLAS, the kernels' BLAS; None before it loads."""
    libraries = openblas_libraries()
    scipy_own = [info for info in libraries if "scipy" in os.path.basename(
        os.path.dirname(info.get("filepath", "")))]  # fmt: skip
    if scipy_own:
        return scipy_own[-1]
    # NumPy's and SciPy's BLAS can be one library (a system OpenBLAS): then it is loaded.
    return libraries[-1] if libraries and "scipy.linalg.cython_blas" in sys.modules else None


def describe() -> str:
    """One line: the kernels' BLAS, its core type and threads, and why that core type."""
    choice = choose_core()
    setting = f"{CORE_VARIABLE}={choice.core}" if choice.core else f"{CORE_VARIABLE} unset"
    info = kernels_blas()
    if info is None:
        return f"SciPy's OpenBLAS, loaded at the first kernel call; {setting} ({choice.reason})"
    return (
        f"OpenBLAS {info.get('version')} running its {info.get('architecture')} kernels, "
        f"{info.get('num_threads')} thread(s); {setting} ({choice.reason})"
    )
