"""The `syncsgd` command line: one console script, one subcommand per job."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad option in one line (no usage dump) and exits with status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="syncsgd",
        description="A reference simulator of synchronous data-parallel SGD "
        "with a hand-written ring allreduce.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True

    bench = commands.add_parser("bench", help="benchmarks (OSU / nccl-tests style)")
    benchmarks = bench.add_subparsers(dest="benchmark", metavar="BENCHMARK", parser_class=_Parser)
    benchmarks.required = True
    from syncsgd.benchmarks import allreduce

    sweep = benchmarks.add_parser(
        "allreduce", help="ring vs the library's Allreduce, 8 B to 64 MiB",
        description=allreduce.__doc__.split("\n")[0],
    )  # fmt: skip
    allreduce.add_arguments(sweep)
    sweep.set_defaults(run=allreduce.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `syncsgd` console script."""
    options = build_parser().parse_args(argv)
    try:
        return options.run(options)
    except KeyboardInterrupt:
        print("syncsgd: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, RuntimeError) as exc:
        if options.debug:
            raise
        rank = getattr(exc, "__notes__", None)
        where = f" {rank[-1]}" if rank and os.environ.get("SYNCSGD_VERBOSE_ERRORS") else ""
        print(f"syncsgd: error: {exc}{where}", file=sys.stderr)
        _abort_mpi_job()
        return 1


def _abort_mpi_job() -> None:
    """Under MPI with several ranks, end the whole job so that no rank waits forever for this one."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        world = mpi.COMM_WORLD
        if world.Get_size() > 1:
            sys.stderr.flush()
            world.Abort(1)


if __name__ == "__main__":
    sys.exit(main())
