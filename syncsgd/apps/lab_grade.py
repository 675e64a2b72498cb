"""`syncsgd lab check`'s grading: the property tests, the cost and the time of an answer.

A runner runs one case - P ranks, each with its input - and returns what every rank holds and
what it sent; `ThreadRunner` here on thread ranks, `lab_mpi.MpiRunner` on MPI's processes. The
grade is the same for both: hypothesis draws cases (P, length, dtype, inputs, root) and shrinks
the first failing one to a minimal reproduction; standard cases (lengths 0, 1, P-1, P, P+1,
2P+3) follow; then the busiest rank's bytes are compared with the fewest any answer moves, and
the answer is timed against syncsgd's own.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from syncsgd.apps.lab_comm import Answer, Counts, LabComm, raised
from syncsgd.apps.lab_kinds import Case, Kind, call
from syncsgd.comm.watchdog import current_frames

DTYPES = ("float64", "float32")
TOLERANCE = {"float64": 1e-12, "float32": 1e-5}
COST_LENGTH = 480  # elements per rank of the cost cases (a multiple of 1..8 and of 9 - 3)


@dataclass
class Outcome:
    """What one case left: every rank's buffer (None after an error), and what each sent."""

    results: list[np.ndarray] | None
    counts: list[Counts]
    error: str | None = None


class Hang(BaseException):
    """The ranks made no progress for --timeout seconds: grading stops (hypothesis does not
    catch a BaseException, so it neither shrinks nor retries a case that takes that long)."""


class Wrong(Exception):
    """A case whose result is wrong: hypothesis shrinks it."""

    def __init__(self, case: Case, outcome: Outcome, problem: str) -> None:
        super().__init__(problem)
        self.case, self.outcome, self.problem = case, outcome, problem


# -- the thread ranks ---------------------------------------------------------------------------


class ThreadRunner:
    """Runs a case on P thread ranks; a timeout raises Hang, naming where each rank waited."""

    backend = "threads"

    def __init__(self, kind: Kind, answer: Answer, timeout: float) -> None:
        self.kind, self.answer, self.timeout = kind, answer, timeout
        self.sizes = tuple(range(1, 10))

    def run(self, case: Case) -> Outcome:
        from syncsgd.comm.threads import CollectiveTimeout, DeadlockError, run_threads
        from syncsgd.comm.watchdog import within_timeout

        labs: list[LabComm | None] = [None] * case.size
        done = [False] * case.size
        threads = [0] * case.size

        def rank_main(comm: Any) -> np.ndarray:
            rank = comm.Get_rank()
            threads[rank] = threading.get_ident()
            lab = labs[rank] = LabComm(comm, self.answer.path, self.answer.name)
            buf = case.inputs[rank].copy()
            call(self.kind, self.answer.function, buf, lab, case)
            done[rank] = True
            return buf

        counts = lambda: [lab.counts if lab else Counts() for lab in labs]  # noqa: E731
        try:
            results = run_threads(case.size, within_timeout(rank_main, self.timeout))
        except CollectiveTimeout as exc:
            busy = _not_waiting(labs, done, threads, self.answer.path)
            raise Hang(f"P = {case.size}, n = {case.inputs[0].size}, {case.dtype}: {exc}{busy}"
                       ) from None
        except DeadlockError:
            return Outcome(None, counts(), "deadlock: every rank waits for another: "
                           + "; ".join(_waits(labs)))  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - the answer's error is the case's result
            rank = _failed_rank(exc)
            return Outcome(None, counts(), f"{rank}raised {raised(exc, self.answer.path)}")
        return Outcome(results, counts())

    def ops(self, lab: LabComm, comm: Any, case: Case) -> dict[str, Callable[[np.ndarray], Any]]:
        """The timed calls: the answer, and syncsgd's own."""
        kind, function = self.kind, self.answer.function
        return {"yours": lambda buf: call(kind, function, buf, lab, case),
                f"syncsgd's {kind.library_name}": lambda buf: kind.library(buf, comm, case)}

    def time(self, case: Case, repeats: int) -> dict[str, float]:
        """Seconds per call, the slowest rank's, median over `repeats`: the answer and ours."""
        from syncsgd.comm.threads import run_threads
        from syncsgd.comm.watchdog import within_timeout

        def rank_main(comm: Any) -> dict[str, list[float]]:
            lab = LabComm(comm, self.answer.path, self.answer.name)
            rank = comm.Get_rank()
            return timed(comm, self.ops(lab, comm, case), case.inputs[rank], repeats)

        try:
            return slowest(run_threads(case.size, within_timeout(rank_main, self.timeout)))
        except Exception as exc:  # noqa: BLE001 - a deadlock or a timeout at the timed size
            raise Hang(f"the timed calls, P = {case.size}, n = {case.inputs[0].size}: "
                       f"{_failed_rank(exc)}{raised(exc, self.answer.path)}") from None


def timed(comm: Any, ops: dict[str, Callable[[np.ndarray], Any]], data: np.ndarray,
          repeats: int) -> dict[str, list[float]]:  # fmt: skip
    """Each op's seconds per call on this rank, `repeats` times each, one warm-up first."""
    seconds: dict[str, list[float]] = {name: [] for name in ops}
    for attempt in range(repeats + 1):
        for name, op in ops.items():
            buf = data.copy()
            comm.Barrier()
            start = time.perf_counter()
            op(buf)
            if attempt:
                seconds[name].append(time.perf_counter() - start)
    return seconds


def slowest(per_rank: list[dict[str, list[float]]]) -> dict[str, float]:
    """Per op: the median over the repeats of the slowest rank's time."""
    names = per_rank[0]
    return {name: statistics.median(max(times) for times in
                                    zip(*(rank[name] for rank in per_rank), strict=True))
            for name in names}  # fmt: skip


def _failed_rank(exc: BaseException) -> str:
    """'rank 2 ' from run_threads' note naming the lowest failing rank, if there is one."""
    for note in getattr(exc, "__notes__", []):
        if note.startswith("(raised on rank "):
            return f"rank {note.split()[3]} "
    return ""


def _waits(labs: list[LabComm | None]) -> list[str]:
    """Where each rank waits (or that it is done or busy)."""
    return [f"rank {rank} in {lab.waiting}" if lab and lab.waiting
            else f"rank {rank} not in a call" for rank, lab in enumerate(labs)]  # fmt: skip


def _not_waiting(labs: list[LabComm | None], done: list[bool], threads: list[int],
                 path: str) -> str:  # fmt: skip
    """The ranks the timeout's message leaves out: returned already, or busy in their code
    (at the answer's line its thread is on)."""
    frames = current_frames()
    others = [f"rank {rank} had returned" if done[rank]
              else f"rank {rank} was in its own code ({_line_of(frames.get(threads[rank]), path)})"
              for rank, lab in enumerate(labs) if not (lab and lab.waiting)]  # fmt: skip
    return f"; {'; '.join(others)}" if others else ""


def _line_of(frame: Any, path: str) -> str:
    """The answer's line a thread's innermost frame in `path` is at."""
    while frame is not None:
        if frame.f_code.co_filename == path:
            return f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return "outside the answer's file"


# -- the cases and their verdicts ---------------------------------------------------------------


def judge(kind: Kind, case: Case, outcome: Outcome) -> str | None:
    """What is wrong with an outcome, in one line; None if every rank holds what it must."""
    if outcome.error is not None or outcome.results is None:
        return outcome.error or "no result"
    expected = kind.expected(case)
    bitwise = kind.bitwise is not None and kind.bitwise(case)
    for rank, (got, (want, mask)) in enumerate(zip(outcome.results, expected, strict=True)):
        if bitwise and got.tobytes() != want.astype(got.dtype).tobytes():
            element = int(np.flatnonzero(got != want)[0]) if got.shape == want.shape else 0
            return f"rank {rank} holds other bits than serial SGD at element {element}"
        bad = _wrong_elements(got, want, mask, case)
        if bad.size:
            return f"rank {rank} holds a wrong value at element {int(bad[0])}"
    if kind.same_bits:
        first = outcome.results[0].view(np.uint8).reshape(-1)
        for rank, got in enumerate(outcome.results[1:], 1):
            differ = np.flatnonzero(got.view(np.uint8).reshape(-1) != first)
            if differ.size:
                element = int(differ[0]) // got.itemsize
                return f"rank {rank}'s bits differ from rank 0's at element {element}"
    return None


def _wrong_elements(got: np.ndarray, want: np.ndarray, mask: np.ndarray | None,
                    case: Case) -> np.ndarray:  # fmt: skip
    """The elements of `got` not within the float tolerance of `want` (where `mask` says)."""
    if got.shape != want.shape:
        return np.arange(max(want.size, 1))
    tolerance = TOLERANCE[case.dtype]
    scale = sum(np.abs(x.astype(np.float64)) for x in case.inputs) if case.inputs else 0
    fine = np.abs(got.astype(np.float64) - want) <= tolerance * (np.abs(want) + scale + 1e-30)
    fine |= (got == want)
    if mask is not None:
        fine |= ~mask
    return np.flatnonzero(~fine)


def make_case(kind: Kind, size: int, length: int, dtype: str, values: list[list[float]],
              root: int = 0) -> Case:  # fmt: skip
    """A case from plain numbers (P lists of `length` values)."""
    inputs = tuple(np.array(row, dtype=dtype).reshape(length) for row in values)
    return Case(size, dtype, inputs, root if kind.rooted else 0)


def standard_cases(kind: Kind, sizes: tuple[int, ...]) -> list[Case]:
    """Lengths 0, 1, P-1, P, P+1 and 2P+3 (multiples of P where the kind needs them), both
    dtypes, small integers (exact sums) and one row of fractions; the last rank as the root."""
    if kind.cases:
        return list(kind.cases.standard(sizes))
    cases = []
    for size in sizes:
        lengths = ((0, size, 2 * size, 3 * size) if kind.multiple
                   else sorted({0, 1, max(size - 1, 0), size, size + 1, 2 * size + 3}))  # fmt: skip
        for index, (length, dtype) in enumerate((n, d) for n in lengths for d in DTYPES):
            rng = np.random.default_rng([size, length, index])
            values = rng.integers(-9, 10, (size, length)).tolist()
            if index % 3 == 2:
                values = rng.uniform(-1, 1, (size, length)).tolist()
            cases.append(make_case(kind, size, length, dtype, values, size - 1))
    return cases


@dataclass
class Search:
    """The outcome of the property tests: how many cases ran, the first failure (shrunk)."""

    cases: int = 0
    failure: Wrong | None = None
    flaky: bool = False  # the failing case passed when hypothesis ran it again
    sizes: set[int] = field(default_factory=set)


def search(kind: Kind, runner: Any, examples: int) -> Search:
    """Hypothesis: `examples` drawn cases, the first failure shrunk (Hang passes through)."""
    from hypothesis import HealthCheck, Verbosity, given, settings

    found = Search()

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              report_multiple_bugs=False, verbosity=Verbosity.quiet,
              suppress_health_check=list(HealthCheck), print_blob=False)  # fmt: skip
    @given(kind.cases.drawn(runner.sizes) if kind.cases else drawn_cases(kind, runner.sizes))
    def property_holds(case: Case) -> None:
        found.cases += 1
        found.sizes.add(case.size)
        outcome = runner.run(case)
        problem = judge(kind, case, outcome)
        if problem is not None:
            raise Wrong(case, outcome, problem)

    try:
        property_holds()
    except Wrong as wrong:
        found.failure = wrong
    except Exception as exc:  # noqa: BLE001 - hypothesis' FlakyFailure: a case failed once
        found.failure = first_wrong(exc)
        if found.failure is None:
            raise
        found.flaky = True
    return found


def first_wrong(exc: BaseException) -> Wrong | None:
    """The first Wrong inside an exception group (hypothesis' report of a flaky failure)."""
    if isinstance(exc, Wrong):
        return exc
    for inner in getattr(exc, "exceptions", ()):
        found = first_wrong(inner)
        if found is not None:
            return found
    return None


def drawn_cases(kind: Kind, sizes: tuple[int, ...]) -> Any:
    """The strategy: P among `sizes`, a length (0, < P, ...), a dtype, small values, a root."""
    from hypothesis import strategies as st

    @st.composite
    def cases(draw: Any) -> Case:
        size = draw(st.sampled_from(sizes))
        blocks = st.integers(0, 3)
        length = size * draw(blocks) if kind.multiple else draw(st.integers(0, 3 * size + 2))
        dtype = draw(st.sampled_from(DTYPES))
        divisor = 10.0 if draw(st.booleans()) else 1.0  # fractions: sums rounded in any order
        row = st.lists(st.integers(-9, 9), min_size=length, max_size=length)
        values = [[v / divisor for v in draw(row)] for _ in range(size)]
        root = draw(st.integers(0, size - 1)) if kind.rooted else 0
        return make_case(kind, size, length, dtype, values, root)

    return cases()


# -- the cost: bytes of the busiest rank against the bound ---------------------------------------


class Cost(NamedTuple):
    """What the ranks of one case moved."""

    size: int
    nbytes: int  # n: the buffer's bytes
    messages: int  # the most any rank sent
    busiest: int  # the most bytes any rank sent or received
    bound: float  # the fewest the busiest rank can move
    slack: float  # how much more it may move and still be bandwidth-optimal

    @property
    def ratio(self) -> float:
        return self.busiest / self.bound if self.bound else float(self.busiest > 0) or 1.0

    @property
    def optimal(self) -> bool:
        return self.busiest <= self.slack * self.bound + 8 * self.size


def cost_of(kind: Kind, case: Case, outcome: Outcome) -> Cost:
    """The busiest rank's bytes (sent or received) and the most messages any rank sent."""
    received = [0] * case.size
    for counts in outcome.counts:
        for dest, sent in counts.to.items():
            if 0 <= dest < case.size:
                received[dest] += sent
    busiest = max(max(c.sent, r) for c, r in zip(outcome.counts, received, strict=True))
    nbytes = case.inputs[0].nbytes
    return Cost(case.size, nbytes, max(c.messages for c in outcome.counts), busiest,
                kind.bound(nbytes, case.size), kind.slack)  # fmt: skip


def cost_cases(kind: Kind, sizes: tuple[int, ...]) -> list[Case]:
    """One float64 case per P with COST_LENGTH-ish elements (a multiple of P), integer data."""
    if kind.cases:
        return [kind.cases.cost(size) for size in sizes]
    cases = []
    for size in sizes:
        length = COST_LENGTH // size * size
        values = np.random.default_rng(size).integers(-9, 10, (size, length)).tolist()
        cases.append(make_case(kind, size, length, "float64", values, size - 1))
    return cases
