"""`syncsgd lab check`'s grade as it prints it: correctness (the first failure as a minimal
reproduction), the busiest rank's bytes against the bound, the time against syncsgd's own."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from syncsgd.apps.lab_kinds import Kind

TIME_LENGTH = 1 << 16  # elements of the timed buffer (float64: 512 KiB)


def grade(kind: Kind, runner: Any, options: argparse.Namespace, cost_sizes: tuple[int, ...],
          time_size: int) -> int:  # fmt: skip
    """Correctness, cost, time: print the grade; 0 when it all holds."""
    from syncsgd.apps.lab_grade import Hang

    print(f"syncsgd lab check: {runner.answer.name} in {options.answer.partition(':')[0]} as "
          f"{kind.name}, on {runner.backend}", flush=True)  # fmt: skip
    try:
        if not correct(kind, runner, options.examples):
            return 1
        optimal = bandwidth(kind, runner, cost_sizes)
        if optimal is None:
            return 1
        if options.repeats:
            timing(kind, runner, time_size, options.repeats)
    except Hang as hang:
        print(f"FAIL hang: {hang}", flush=True)
        print("  the ranks above waited for messages that never came: look at the calls named, "
              "in that order, on each rank")
        return 1
    print(f"{'PASS' if optimal else 'FAIL'} {kind.name}: "
          + ("correct and bandwidth-optimal" if optimal else "correct, not bandwidth-optimal"))
    return 0 if optimal else 1


def correct(kind: Kind, runner: Any, examples: int) -> bool:
    """The property tests, then the standard cases; the first failure printed, minimal."""
    from syncsgd.apps.lab_grade import judge, search, standard_cases

    found = search(kind, runner, examples)
    if found.failure is not None:
        failure = found.failure
        flaky = (" - flaky: run again, this case passed (a race between the ranks, or "
                 "randomness)") if found.flaky else ""
        print_failure(kind, failure.case, failure.outcome, failure.problem,
                      f"the smallest case hypothesis found (after {found.cases} runs){flaky}")
        return False
    standard = standard_cases(kind, runner.sizes)
    for case in standard:
        outcome = runner.run(case)
        problem = judge(kind, case, outcome)
        if problem is not None:
            print_failure(kind, case, outcome, problem, "a standard case (not shrunk)")
            return False
    sizes = sorted(found.sizes | {case.size for case in standard})
    cases = ("B from 1 to 3P+2, float and exact mode" if kind.cases else
             f"lengths 0 to {max(c.inputs[0].size for c in standard)}, float32 and float64")
    print(f"correct: {found.cases} drawn and {len(standard)} standard cases, P = {_span(sizes)}, "
          f"{cases}: every rank holds {_what(kind)}", flush=True)  # fmt: skip
    return True


def _span(sizes: list[int]) -> str:
    return f"{sizes[0]}-{sizes[-1]}" if len(sizes) > 2 else ", ".join(map(str, sizes))


def _what(kind: Kind) -> str:
    same = ", the same bits on every rank" if kind.same_bits else ""
    if kind.bitwise is not None:
        return f"serial SGD's step (exact mode: bit for bit){same}"
    return f"the true result within float rounding{same}"


def print_failure(kind: Kind, case: Any, outcome: Any, problem: str, found: str) -> None:
    """The failing case as a minimal reproduction: P, n, inputs, expected and got per rank
    (of a long buffer, the elements around the first wrong one)."""
    root = f", root {case.root}" if kind.rooted else ""
    shown = (kind.cases.shown(case) if kind.cases
             else f"P = {case.size}, n = {case.inputs[0].size}, {case.dtype}{root}")  # fmt: skip
    expected = kind.expected(case)
    where = _window(case.inputs[0].size, expected, outcome.results)
    lines = [f"FAIL {kind.name}: {problem}", f"  {found}:", f"    {shown}"]
    if where.stop - where.start < case.inputs[0].size:
        lines.append(f"    elements {where.start} to {where.stop - 1} of {case.inputs[0].size}:")
    lines += _rows("input", [_shown(x[where]) for x in case.inputs])
    lines += _rows("expected", [_shown(want.astype(case.dtype)[where],
                                       None if mask is None else mask[where])
                                for want, mask in expected])  # fmt: skip
    if outcome.results is not None:
        lines += _rows("got", [_shown(x[where]) for x in outcome.results])
    print("\n".join(lines), flush=True)


WINDOW = 8  # elements of a long buffer a failure shows


def _window(length: int, expected: Any, results: Any) -> slice:
    """The elements a failure shows: all of a short buffer, else WINDOW from just before the
    first element some rank got wrong."""
    if length <= 2 * WINDOW:
        return slice(0, length)
    first = length
    for got, (want, _) in zip(results or [], expected, strict=False):
        differ = np.flatnonzero(got.astype(np.float64) != want)
        if differ.size:
            first = min(first, int(differ[0]))
    start = 0 if first == length else max(min(first - 2, length - WINDOW), 0)
    return slice(start, start + WINDOW)


def _rows(label: str, texts: list[str]) -> list[str]:
    """`label   every rank: ...` if every rank's is the same, else a line per rank, aligned."""
    if len(set(texts)) == 1 and len(texts) > 1:
        return [f"    {label:<9} every rank: {texts[0]}"]
    return [f"    {label if r == 0 else '':<9} rank {r}: {text}" for r, text in enumerate(texts)]


def _shown(values: np.ndarray, mask: np.ndarray | None = None) -> str:
    """An array on one line; elements the kind does not care about as `_`."""
    text = [np.format_float_positional(v, trim="-") for v in values.tolist()]
    if mask is not None:
        text = [t if m else "_" for t, m in zip(text, mask.tolist(), strict=True)]
    return "[" + " ".join(text) + "]"


def bandwidth(kind: Kind, runner: Any, sizes: tuple[int, ...]) -> bool | None:
    """The busiest rank's bytes on one case per P against the kind's bound; True if optimal,
    None if the answer fails on a cost case."""
    from syncsgd.apps.lab_grade import cost_cases, cost_of, judge

    costs = []
    for case in cost_cases(kind, sizes):
        outcome = runner.run(case)
        problem = judge(kind, case, outcome)
        if problem is not None:  # as long a buffer as no case before had
            print_failure(kind, case, outcome, problem, "the cost case (not shrunk)")
            return None
        costs.append(cost_of(kind, case, outcome))
    print(f"cost: the busiest rank's bytes, sent or received, against {kind.bound_text} "
          "(the fewest any answer moves)")
    print(f"  {'P':>3} {'n bytes':>9} {'messages':>9} {'busiest':>9} {'bound':>9} {'ratio':>6}")
    for cost in costs:
        print(f"  {cost.size:>3} {cost.nbytes:>9} {cost.messages:>9} {cost.busiest:>9} "
              f"{cost.bound:>9.0f} {cost.ratio:>6.2f}")  # fmt: skip
    worst = max(costs, key=lambda cost: cost.ratio)
    if all(cost.optimal for cost in costs):
        print(f"bandwidth-optimal: the busiest rank moves at most {worst.ratio:.2f}x "
              f"{kind.bound_text}", flush=True)  # fmt: skip
        return True
    growing = len(costs) > 1 and costs[-1].ratio > 1.2 * costs[0].ratio
    why = (", more as P grows (an answer that moves whole buffers to or from one rank makes it "
           "move (P-1)·n: correct, but it does not scale)") if growing else ""
    print(f"NOT bandwidth-optimal: at P = {worst.size} the busiest rank moves {worst.ratio:.2f}x "
          f"{kind.bound_text}{why}", flush=True)  # fmt: skip
    return False


def timing(kind: Kind, runner: Any, size: int, repeats: int) -> None:
    """The answer's time against syncsgd's own (and the MPI library's) at TIME_LENGTH."""
    from syncsgd.apps.lab_grade import make_case

    if kind.cases:
        case = kind.cases.timed(size)
    else:
        length = TIME_LENGTH // size * size
        values = np.random.default_rng(0).integers(-9, 10, (size, length)).tolist()
        case = make_case(kind, size, length, "float64", values, 0)
    seconds = runner.time(case, repeats)
    yours = seconds["yours"]
    others = "; ".join(f"{name} {t * 1e3:.2f} ms (yours takes {yours / t:.2f}x)"
                       for name, t in seconds.items() if name != "yours")  # fmt: skip
    print(f"time: P = {size}, n = {case.inputs[0].nbytes} bytes, median of {repeats} calls (the "
          f"slowest rank's): yours {yours * 1e3:.2f} ms; {others}", flush=True)  # fmt: skip

