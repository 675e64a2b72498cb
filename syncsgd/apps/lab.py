"""`syncsgd lab`: students write a collective, syncsgd grades it.

    syncsgd lab new ring-allreduce lab1/            # lab1/ring_allreduce.py: the stub
    syncsgd lab check lab1/ring_allreduce.py --kind ring-allreduce
    mpiexec -n 4 syncsgd lab check lab1/ring_allreduce.py --kind ring-allreduce --mpi

`lab check` runs the student's function through property tests (hypothesis: P = 1-9, lengths
0 to 3P+2, float32 and float64; the first failure shrunk to a minimal case), then standard
cases, counts what every rank sends against the fewest bytes any answer moves, and times it
against syncsgd's own. Exit status 0 only when every rank holds the right result, with the
same bits on every rank, and the answer is bandwidth-optimal. docs/lab.md: the two-week lab.
"""

from __future__ import annotations

import argparse
import os

from syncsgd.apps.lab_kinds import KINDS, NAMES, Kind, stub_text
from syncsgd.util.argtypes import nonnegative_int, positive_float, positive_int

THREAD_COST_SIZES = (3, 4, 8)  # P of the cost cases on thread ranks
CHECK_ABOUT = (
    "Grade a student's function: property tests (hypothesis: P = 1-9, lengths 0 to 3P+2, "
    "float32 and float64; the first failure shrunk to a minimal case), standard cases, what "
    "every rank sends against the fewest bytes any answer moves, the time against syncsgd's own. "
    "Exit status 0 only when every rank holds the right result (the same bits on every rank) "
    "and the answer is bandwidth-optimal. docs/lab.md: the two-week lab."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`syncsgd lab new KIND FOLDER` and `syncsgd lab check SOURCE[:FUNCTION] --kind KIND`."""
    from syncsgd.util.options import DEBUG

    actions = parser.add_subparsers(dest="lab", metavar="ACTION", parser_class=type(parser))
    actions.required = True
    kinds = ", ".join(NAMES)
    new = actions.add_parser("new", help="write a stub for a student: signature, contract, hints",
                             description="Write KIND's stub into the directory FOLDER (made if "
                             "its parent exists); an existing file is never replaced.")
    new.add_argument("kind", metavar="KIND", choices=NAMES, help=f"one of: {kinds}")
    new.add_argument("folder", metavar="FOLDER", help="where the stub goes (KIND.py, dashes as _)")
    new.set_defaults(run=main_new, command_parser=new)
    check = actions.add_parser("check", help="grade a student's function (exit status 0: it holds)",
                               description=CHECK_ABOUT)
    check.add_argument("answer", metavar="SOURCE[:FUNCTION]",
                       help="the student's Python file, and its function (default: the stub's)")
    check.add_argument("--kind", required=True, choices=NAMES, help=f"one of: {kinds}")
    check.add_argument("--mpi", action="store_true",
                       help="run on the processes mpiexec started, one rank each (default: P "
                       "thread ranks in this process)")  # fmt: skip
    check.add_argument("--examples", type=positive_int, default=100,
                       help="cases hypothesis draws before the standard ones (default 100)")
    check.add_argument("--repeats", type=nonnegative_int, default=5,
                       help="timed calls of the answer and of syncsgd's own; 0: no timing "
                       "(default 5)")  # fmt: skip
    check.add_argument("--timeout", type=positive_float, default=10.0, metavar="SECONDS",
                       help="end a case whose ranks make no progress for SECONDS, naming "
                       "where each waits (default 10)")  # fmt: skip
    check.set_defaults(run=main_check, command_parser=check)
    for sub in (new, check):
        DEBUG.add(sub, default=argparse.SUPPRESS)


def kind_of(name: str) -> Kind:
    """The kind `name` (one of NAMES; ddp-step's module is imported only for it)."""
    if name == "ddp-step":
        from syncsgd.apps.lab_ddp import KIND

        return KIND
    return KINDS[name]


def main(options: argparse.Namespace) -> int:
    """`syncsgd lab new` or `syncsgd lab check` (each also sets its own `run`)."""
    return main_new(options) if options.lab == "new" else main_check(options)


# -- lab new ------------------------------------------------------------------------------------


def stub_name(kind: Kind) -> str:
    """The file `lab new` writes: the kind with underscores, .py."""
    return kind.name.replace("-", "_") + ".py"


def main_new(options: argparse.Namespace) -> int:
    """Write the stub; refuse to replace a file."""
    from syncsgd.util.files import check_directory_writable, create_new

    kind, folder = kind_of(options.kind), options.folder
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"{folder} is not a directory")
    if not os.path.isdir(folder):
        parent = os.path.dirname(os.path.abspath(folder))
        if not os.path.isdir(parent):
            raise ValueError(f"cannot make {folder}: its parent directory does not exist")
        check_directory_writable(parent)
        os.mkdir(folder)
    check_directory_writable(folder)
    path = os.path.join(folder, stub_name(kind))
    try:
        create_new(path, stub_text(kind, path))
    except FileExistsError:
        raise ValueError(f"{path} exists: lab new never replaces a file (move it away)") from None
    print(f"wrote {path}: {kind.about}")
    print(f"grade it: syncsgd lab check {path} --kind {kind.name}")
    return 0


# -- lab check ----------------------------------------------------------------------------------


def main_check(options: argparse.Namespace) -> int:
    """Grade the answer on thread ranks, or with --mpi on MPI's processes."""
    from syncsgd.apps.lab_comm import load_answer

    if not _hypothesis_installed():
        raise ValueError("lab check needs hypothesis: pip install hypothesis "
                         "(or 'syncsgd[test-tools]')")
    kind = kind_of(options.kind)
    if options.mpi:
        from syncsgd.apps import lab_mpi
        from syncsgd.comm.world import launched_by_mpi

        if not launched_by_mpi():
            raise ValueError(f"--mpi runs the answer on the processes mpiexec starts: mpiexec -n 4 "
                             f"syncsgd lab check {options.answer} --kind {kind.name} --mpi")
        return lab_mpi.check(kind, options)
    from syncsgd.apps.lab_grade import ThreadRunner
    from syncsgd.apps.lab_report import grade

    answer = load_answer(options.answer, kind.function)
    runner = ThreadRunner(kind, answer, options.timeout)
    return grade(kind, runner, options, THREAD_COST_SIZES, 4)


def _hypothesis_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("hypothesis") is not None
