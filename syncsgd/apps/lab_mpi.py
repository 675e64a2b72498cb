"""`syncsgd lab check --mpi`: the answer on MPI's processes, one rank each.

Rank 0 leads: it draws the cases (hypothesis runs there alone), broadcasts each to the other
ranks, and every rank runs the answer on a communicator of the case's own (a Dup of
COMM_WORLD, so that a stray message of one case never reaches the next), then gathers what each
holds and sent. The other ranks follow until rank 0 says it is done. A hang ends at --timeout:
the watchdog prints one line naming the call each rank waits in, and ends the job; an exception
on a rank ends the job too, after one line naming it, the case and the answer's line.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from syncsgd.apps.lab_comm import Answer, Counts, LabComm, load_answer, raised
from syncsgd.apps.lab_grade import Outcome, slowest, timed
from syncsgd.apps.lab_kinds import Case, Kind, call
from syncsgd.comm.watchdog import end_job, watching
from syncsgd.util.lines import print_line


class AgreedError(ValueError):
    """An error every rank raised alike (the answer's file): rank 0 reports it, once."""

    uniform = True


class MpiRunner:
    """Rank 0's side runs a case on every rank; the others `follow` until it is done."""

    backend = "MPI"

    def __init__(self, kind: Kind, answer: Answer, world: Any) -> None:
        self.kind, self.answer, self.world = kind, answer, world
        self.sizes = (world.Get_size(),)

    def _tell(self, job: Any) -> Any:
        with watching("lab check: the next case (bcast from rank 0)", 0):
            return self.world.bcast(job, root=0)

    def _gather(self, mine: Any) -> Any:
        with watching("lab check: the results (gather to rank 0)", None):
            return self.world.gather(mine, root=0)

    def run(self, case: Case) -> Outcome:
        self._tell(("case", case, 0))
        parts = self._gather(self._part(case))
        return Outcome([buf for buf, _ in parts], [counts for _, counts in parts])

    def time(self, case: Case, repeats: int) -> dict[str, float]:
        self._tell(("time", case, repeats))
        return slowest(self._gather(self._time_part(case, repeats)))

    def stop(self) -> None:
        self._tell(None)

    def follow(self) -> None:
        """Run each case rank 0 sends, until it sends None."""
        while True:
            job = self._tell(None)
            if job is None:
                return
            what, case, repeats = job
            self._gather(self._part(case) if what == "case" else self._time_part(case, repeats))

    def _part(self, case: Case) -> tuple[np.ndarray, Counts]:
        """This rank's run of the answer; an exception ends the job, in one line."""
        rank, comm = self.world.Get_rank(), self.world.Dup()
        lab = LabComm(comm, self.answer.path, f"{self.answer.name} (n = {case.inputs[0].size})")
        buf = case.inputs[rank].copy()
        try:
            call(self.kind, self.answer.function, buf, lab, case)
        except Exception as exc:  # noqa: BLE001 - the answer's error: end the job, say where
            print_line(f"syncsgd: error: lab check: rank {rank} raised "
                       f"{raised(exc, self.answer.path)} (P = {case.size}, n = "
                       f"{case.inputs[0].size}, {case.dtype}); ending the job")  # fmt: skip
            end_job(self.world)
        comm.Free()
        return buf, lab.counts

    def _time_part(self, case: Case, repeats: int) -> dict[str, list[float]]:
        comm = self.world.Dup()
        lab = LabComm(comm, self.answer.path, self.answer.name)
        kind, function = self.kind, self.answer.function
        ops = {"yours": lambda buf: call(kind, function, buf, lab, case),
               f"syncsgd's {kind.library_name}": lambda buf: kind.library(buf, comm, case),
               "the MPI library's": lambda buf: kind.mpi(buf, comm, case)}  # fmt: skip
        seconds = timed(comm, ops, case.inputs[self.world.Get_rank()], repeats)
        comm.Free()
        return seconds


def check(kind: Kind, options: argparse.Namespace) -> int:
    """Grade on every rank of COMM_WORLD: rank 0 prints the grade; its status is the job's."""
    from syncsgd.apps.lab_report import grade
    from syncsgd.comm.watchdog import collective_timeout
    from syncsgd.comm.world import mpi_world

    world = mpi_world()
    try:
        answer = load_answer(options.answer, kind.function)
    except ValueError as exc:
        raise AgreedError(str(exc)) from None
    runner = MpiRunner(kind, answer, world)
    size = world.Get_size()
    with collective_timeout(world, options.timeout):
        if world.Get_rank() != 0:
            runner.follow()
            return 0
        try:
            return grade(kind, runner, options, (size,), size)
        finally:
            runner.stop()
