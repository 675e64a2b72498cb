"""The memory one rank holds, measured from its allocations: `train --json`'s memory_bytes.

At start-up, before the timed steps, every rank builds a second step of its own (parameters,
optimizer, passes) under tracemalloc and takes two untimed steps with it, then lets it go. NumPy
reports every array it allocates to tracemalloc (domain 389047), with the traceback of the
allocation; an array's category is read from where it was allocated: the module, the function
and the name the statement assigns it to (SITES). Each category is the bytes of the arrays it
holds after the two steps: a step allocates no lasting array, so that is also their peak over a
step (tests/test_memory.py checks that the second step leaves none). Thread ranks share
one process: each rank's step runs under a frame whose file names the rank, which tells the
ranks' allocations apart. Numba's kernels would allocate outside NumPy, unseen: none of those a
step calls allocates (tests/test_memory.py reads their source). docs/memory.md describes the
categories.
"""

from __future__ import annotations

import ast
import functools
import os
import resource
import threading
import tracemalloc
import types
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "workspaces",
              "communication_buffers")  # fmt: skip
NUMPY_DOMAIN = 389047  # the tracemalloc domain NumPy reports its arrays' data in
FRAMES = 128  # frames kept per allocation: enough to reach the rank's frame
RANK_FILE = "<syncsgd rank {}>"
STEPS = (0, 1)  # the untimed steps: the first grows the passes' workspaces, the second reuses

# (module, function, assigned name, category): the first row that matches an allocation's most
# recent frame in syncsgd, then the next frame out, ... "*" matches anything.
SITES: tuple[tuple[str, str, str, str], ...] = (
    ("nn/arrays.py", "kept_zeros", "*", "activations"),
    ("nn/arrays.py", "scratch_zeros", "*", "workspaces"),
    ("nn/backprop.py", "*", "outputs", "activations"),
    ("nn/backprop.py", "*", "grads", "workspaces"),
    ("nn/backprop.py", "*", "_inputs", "activations"),
    ("nn/backprop.py", "*", "_losses", "activations"),
    ("nn/layers/batchnorm.py", "*", "*", "activations"),
    ("nn/numerics.py", "*", "*", "workspaces"),
    ("nn/exact.py", "*", "*", "workspaces"),
    ("nn/local.py", "*", "*", "activations"),  # the loss sum's one value
    ("nn/network.py", "Network.init_running", "*", "parameters"),  # BatchNorm's statistics
    ("nn/optim/", "*", "velocity", "optimizer_state"),
    ("nn/optim/", "*", "exp_avg", "optimizer_state"),
    ("nn/optim/", "*", "exp_avg_sq", "optimizer_state"),
    ("nn/optim/", "*", "*", "workspaces"),
    ("training/memory.py", "*", "params", "parameters"),
    ("training/step.py", "CommBuffer.build", "*", "gradients"),
    ("training/step.py", "*", "grad_mean", "gradients"),
    ("training/step.py", "*", "X_shard", "activations"),
    ("training/step.py", "*", "y_shard", "activations"),
    ("training/sharded.py", "*", "params_shard", "parameters"),  # its blocks (stage 3: all)
    ("training/sharded.py", "*", "grad_sums", "gradients"),  # stage 2's blocks of the sums
    ("training/sharded.py", "*", "grad_shard", "gradients"),
    ("training/sharded.py", "*", "carrier", "communication_buffers"),
    ("training/windows.py", "PlacedSums.__init__", "*", "gradients"),  # the buckets under way
    ("training/windows.py", "PlacedParams.__init__", "*", "parameters"),
    ("training/sharded.py", "*", "agreed", "communication_buffers"),
    ("training/sharded.py", "*", "limbs", "communication_buffers"),
    ("training/sharded.py", "*", "*", "workspaces"),  # the owned blocks' contiguous copies
    ("training/overlap.py", "*", "*", "communication_buffers"),
    ("training/layered.py", "*", "*", "activations"),
    ("training/data.py", "*", "*", "other"),  # the epoch's order, cached for the process
    ("collectives/", "*", "*", "communication_buffers"),
    ("comm/", "*", "*", "communication_buffers"),
)


def measure(comm: Any, run: Any, make_step: Callable[[Any, np.ndarray, Any], Any],
            first_params: np.ndarray) -> dict[str, int]:  # fmt: skip
    """Every rank: build a step with `make_step(comm, params, optimizer)` from a copy of
    `first_params`, take two untimed steps, and return the bytes per category, each the largest
    over the ranks, the total and the process's peak resident memory."""
    threads = type(comm).__name__ == "ThreadComm"
    rank = comm.Get_rank()
    # One step untraced first: the kernels load (Numba's caches: many small allocations, which
    # tracemalloc would trace with their frames, slowly), and the traced steps find them loaded;
    # on a communicator of its own, and the collectives' plans and scratch (kept per thread) let
    # go after it: the traced step allocates its own.
    from syncsgd.collectives.executor import forget_plans

    warm = comm.Dup()
    try:
        _traced_steps(warm, run, make_step, first_params, steps=STEPS[:1])
    finally:
        forget_plans()
        if hasattr(warm, "Free"):
            warm.Free()
    ours = _start(rank, threads, comm)
    try:
        held_step = _as_rank(rank, _traced_steps, comm, run, make_step, first_params)
        comm.Barrier()
        snapshot = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.DomainFilter(True, NUMPY_DOMAIN)])
        comm.Barrier()  # every rank has its snapshot before tracing stops
        del held_step  # let it go: the run's own step comes next
    finally:
        _stop(ours, rank, threads)
    held = by_category(snapshot, RANK_FILE.format(rank) if threads else None)
    mine = [held.get(name, 0) for name in (*CATEGORIES, "other")]
    largest = _largest(comm, [*mine, sum(mine)])
    result = dict(zip((*CATEGORIES, "other", "total"), largest, strict=True))
    result["peak_resident"] = peak_resident()
    return result


def _traced_steps(comm: Any, run: Any, make_step: Callable[[Any, np.ndarray, Any], Any],
                  first_params: np.ndarray, steps: tuple[int, ...] = STEPS) -> Any:  # fmt: skip
    """Build the step from copies and take the untimed steps; the step, held until the
    snapshot."""
    from syncsgd.nn.optim import make_optimizer

    config = run.config
    params = first_params.copy()
    optimizer = None
    if not config.zero_stage:
        optimizer = make_optimizer(config.optimizer, run.optim, run.model.n_params,
                                   run.model.dtype, config, run.model.layout())  # fmt: skip
    stepper = make_step(comm, params, optimizer)
    try:
        for step in steps:
            stepper.take_(step)
    finally:
        stepper.close()
    return stepper


def quiet_riders(riders: list[Any]) -> list[Any]:
    """The hooks' riders with their slots, but reading and writing nothing of the hooks'."""
    return [replace(rider, fill_=_nothing, read_=_nothing) for rider in riders]


def _nothing(*_: Any) -> None:
    """A rider's fill or read that does nothing."""


_TRACING_LOCK = threading.Lock()


def _start(rank: int, threads: bool, comm: Any) -> bool:
    """Start tracing (thread ranks: rank 0, once); True if this call started it."""
    ours = False
    if rank == 0 or not threads:
        with _TRACING_LOCK:
            if not tracemalloc.is_tracing():
                tracemalloc.start(FRAMES)
                ours = True
    comm.Barrier()
    return ours


def _stop(ours: bool, rank: int, threads: bool) -> None:
    """Stop the tracing this process started."""
    if ours and (rank == 0 or not threads):
        tracemalloc.stop()


def _as_rank(rank: int, function: Callable[..., Any], *args: Any) -> Any:
    """function(*args), called from a frame whose file names the rank (in tracemalloc's
    tracebacks: which thread rank allocated)."""
    code = _call.__code__.replace(co_filename=RANK_FILE.format(rank))
    caller = types.FunctionType(code, _call.__globals__)
    return caller(function, *args)


def _call(function: Callable[..., Any], *args: Any) -> Any:
    return function(*args)


def by_category(snapshot: tracemalloc.Snapshot, rank_file: str | None) -> dict[str, int]:
    """Bytes of the snapshot's live arrays per category; `rank_file`: only those allocated under
    that rank's frame (thread ranks)."""
    held: dict[str, int] = {}
    for trace in snapshot.traces:
        frames = list(trace.traceback)  # oldest first
        if rank_file is not None and all(frame.filename != rank_file for frame in frames):
            continue
        category = category_of(frames)
        held[category] = held.get(category, 0) + trace.size
    return held


def category_of(frames: list[tracemalloc.Frame]) -> str:
    """The category of the first row of SITES that matches a frame, the most recent first, up
    to the rank's frame (the ones below it start the rank)."""
    for frame in reversed(frames):
        if frame.filename.startswith(RANK_FILE.partition("{")[0]):
            break
        module = _syncsgd_module(frame.filename)
        if module is None:
            continue
        function, name = statement_at(frame.filename, frame.lineno)
        for site_module, site_function, site_name, category in SITES:
            if (module.startswith(site_module) and site_function in ("*", function)
                    and site_name in ("*", name)):  # fmt: skip
                return category
    return "other"


PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _syncsgd_module(filename: str) -> str | None:
    """'nn/backprop.py' for a file of this package, else None."""
    path = os.path.abspath(filename)
    if not path.startswith(PACKAGE + os.sep):
        return None
    return os.path.relpath(path, PACKAGE).replace(os.sep, "/")


@functools.lru_cache(maxsize=4096)
def statement_at(filename: str, lineno: int) -> tuple[str, str]:
    """(the function's qualified name, the name the statement assigns to or appends to) of
    the statement at a line of a source file ("" where there is none)."""
    nodes = _parsed(filename)
    function, name = "", ""
    for node, qualified in nodes:
        end = node.end_lineno or node.lineno
        if not node.lineno <= lineno <= end:
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = qualified
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Expr, ast.Return)):
            name = _target(node) or name
    return function, name


# CPython 3.11's parser is not safe to enter from two threads at once ("AST constructor recursion
# depth mismatch"): thread ranks read their snapshots at the same time.
_PARSING = threading.Lock()


@functools.lru_cache(maxsize=256)
def _parsed(filename: str) -> list[tuple[ast.stmt, str]]:
    """Every function and statement of a file, outermost first, with functions' qualified
    names."""
    with open(filename, encoding="utf-8") as file, _PARSING:
        tree = ast.parse(file.read())
    found: list[tuple[ast.stmt, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            qualified = prefix
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qualified = f"{prefix}.{child.name}" if prefix else child.name
            if isinstance(child, ast.stmt):
                found.append((child, qualified))
            visit(child, qualified)

    visit(tree, "")
    return found


def _target(node: ast.AST) -> str:
    """The last name a statement assigns to (self.x = ...: x), or appends to (xs.append(...):
    xs); "" for none."""
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        called = node.value.func
        targets = [called.value] if isinstance(called, ast.Attribute) else []
    else:
        return ""
    for target in reversed(targets):
        while isinstance(target, ast.Subscript):
            target = target.value
        if isinstance(target, ast.Attribute):
            return target.attr
        if isinstance(target, ast.Name):
            return target.id
    return ""


def _largest(comm: Any, values: list[int]) -> list[int]:
    """Each value's largest over the ranks."""
    from syncsgd.comm.world import constants

    array = np.array(values, np.int64)
    comm.Allreduce(constants(comm).IN_PLACE, array, op=constants(comm).MAX)
    return [int(value) for value in array]


def peak_resident() -> int:
    """The process's peak resident memory in bytes (Linux reports kibibytes)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
