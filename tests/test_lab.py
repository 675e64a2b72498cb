"""`syncsgd lab`: the stub, and the grade of a right, a wrong, a naive, a deadlocking and a hanging
answer, on thread ranks and under mpiexec."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import requires_mpi, run_mpiexec

from syncsgd.apps.lab import kind_of
from syncsgd.apps.lab_comm import LabComm, load_answer
from syncsgd.apps.lab_grade import Outcome, judge
from syncsgd.apps.lab_kinds import KINDS, NAMES, Case
from syncsgd.cli import main

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The library's ring (syncsgd.collectives.schedules.ring_schedule's chunks and steps), written as
# a student would: Sendrecv around the ring, a scratch array for what arrives.
RING = '''
import numpy as np


def allreduce(buf, comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    sizes = [len(part) for part in np.array_split(np.arange(buf.size), size)]
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    chunk = [slice(bounds[c], bounds[c + 1]) for c in range(size)]
    right, left = (rank + 1) % size, (rank - 1) % size
    scratch = np.empty_like(buf)
    for s in range(size - 1):  # reduce-scatter
        send, recv = (rank - s) % size, (rank - s - 1) % size
        incoming = scratch[: chunk[recv].stop - chunk[recv].start]
        comm.Sendrecv(buf[chunk[send]], right, recvbuf=incoming, source=left)
        buf[chunk[recv]] += incoming
    for s in range(size - 1):  # allgather
        send, recv = (rank + 1 - s) % size, (rank - s) % size
        comm.Sendrecv(buf[chunk[send]], right, recvbuf=buf[chunk[recv]], source=left)
'''
# The allgather's chunks one round behind: an off-by-one chunk index.
OFF_BY_ONE = RING.replace("send, recv = (rank + 1 - s) % size, (rank - s) % size",
                          "send, recv = (rank - s) % size, (rank - s - 1) % size")  # fmt: skip
NAIVE = '''
import numpy as np


def allreduce(buf, comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    if rank == 0:
        incoming = np.empty_like(buf)
        for source in range(1, size):  # gather to the root, adding in rank order
            comm.Recv(incoming, source=source)
            buf += incoming
        for dest in range(1, size):  # then broadcast the sum
            comm.Send(buf, dest=dest)
    else:
        comm.Send(buf, dest=0)
        comm.Recv(buf, source=0)
'''
DEADLOCK = '''
import numpy as np


def allreduce(buf, comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    incoming = np.empty_like(buf)
    for s in range(size - 1):  # every rank receives first: nobody sends
        comm.Recv(incoming, source=(rank - 1) % size)
        buf += incoming
        comm.Send(buf, dest=(rank + 1) % size)
'''
SLEEPY = '''
import time


def allreduce(buf, comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    if size > 1 and rank == 0:
        time.sleep(60)  # rank 0 never sends: the others wait for it
    if rank:
        comm.Recv(buf, source=0)
'''
# The other collectives, on the buffer layout of syncsgd.collectives.schedules.
PARTS = '''
import numpy as np


def _blocks(n, size):
    sizes = [len(part) for part in np.array_split(np.arange(n), size)]
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    return [slice(bounds[b], bounds[b + 1]) for b in range(size)]


def broadcast(buf, comm, root):
    rank, size = comm.Get_rank(), comm.Get_size()
    v = (rank - root) % size
    block = _blocks(buf.size, size)
    right, left = (rank + 1) % size, (rank - 1) % size
    for step in range(max(v - 1, 0), v + size):
        send, recv = step - v, step - v + 1
        sends = v < size - 1 and 0 <= send < size
        recvs = v > 0 and recv < size
        if sends and recvs:
            comm.Sendrecv(buf[block[send]], right, recvbuf=buf[block[recv]], source=left)
        elif sends:
            comm.Send(buf[block[send]], right)
        elif recvs:
            comm.Recv(buf[block[recv]], left)


def reduce(buf, comm, root):
    rank, size = comm.Get_rank(), comm.Get_size()
    v = size - 1 - (rank - root) % size  # 0: the farthest from the root
    block = _blocks(buf.size, size)
    ahead, behind = (rank - 1) % size, (rank + 1) % size
    scratch = np.empty_like(buf)
    for step in range(max(v - 1, 0), v + size):
        send, recv = step - v, step - v + 1
        sends = v < size - 1 and 0 <= send < size
        recvs = v > 0 and recv < size
        incoming = scratch[block[recv]] if recvs else None
        if sends and recvs:
            comm.Sendrecv(buf[block[send]], ahead, recvbuf=incoming, source=behind)
        elif sends:
            comm.Send(buf[block[send]], ahead)
        elif recvs:
            comm.Recv(incoming, behind)
        if recvs:
            buf[block[recv]] += incoming


def allgather(buf, comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    block = _blocks(buf.size, size)
    for s in range(size - 1):
        send, recv = (rank - s) % size, (rank - s - 1) % size
        comm.Sendrecv(buf[block[send]], (rank + 1) % size, recvbuf=buf[block[recv]],
                      source=(rank - 1) % size)


def reduce_scatter(buf, comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    block = _blocks(buf.size, size)
    scratch = np.empty_like(buf)
    for s in range(size - 1):
        send, recv = (rank - s - 1) % size, (rank - s - 2) % size
        incoming = scratch[block[recv]]
        comm.Sendrecv(buf[block[send]], (rank + 1) % size, recvbuf=incoming,
                      source=(rank - 1) % size)
        buf[block[recv]] += incoming


def alltoall(buf, comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    block = _blocks(buf.size, size)
    sent = buf.copy()
    for s in range(1, size):
        dest, source = (rank + s) % size, (rank - s) % size
        comm.Sendrecv(sent[block[dest]], dest, recvbuf=buf[block[source]], source=source)


def naive_broadcast(buf, comm, root):
    rank, size = comm.Get_rank(), comm.Get_size()
    if rank == root:
        for dest in range(size):
            if dest != root:
                comm.Send(buf, dest)
    else:
        comm.Recv(buf, root)
'''
FAST = ["--kind", "ring-allreduce", "--examples", "30", "--repeats", "1"]


def answer(tmp_path, name: str, code: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(code.lstrip("\n"))
    return str(path)


def grade(capsys, path: str, *more: str) -> tuple[int, str, str]:
    code = main(["lab", "check", path, *FAST, *more])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_librarys_ring_as_a_student_file_passes(tmp_path, capsys):
    code, out, err = grade(capsys, answer(tmp_path, "ring", RING))
    assert code == 0, out + err
    assert "correct: 30 drawn and 102 standard cases, P = 1-9" in out
    assert "bandwidth-optimal: the busiest rank moves at most 1.00x 2(P-1)/P·n" in out
    assert "yours takes" in out and "syncsgd's ring" in out
    assert out.rstrip().endswith("PASS ring-allreduce: correct and bandwidth-optimal")


def test_an_off_by_one_chunk_index_fails_with_a_minimal_case(tmp_path, capsys):
    code, out, _ = grade(capsys, answer(tmp_path, "off", OFF_BY_ONE))
    assert code == 1
    assert "FAIL ring-allreduce: rank 0 holds a wrong value at element 0" in out
    assert "P = 2, n = 1, float64" in out  # shrunk: two ranks, one element
    assert "input     rank 0: [0]\n              rank 1: [1]" in out
    assert "expected  every rank: [1]" in out and "got       every rank: [0]" in out
    assert "cost:" not in out  # a wrong answer is not measured


def test_gather_then_broadcast_is_correct_but_not_bandwidth_optimal(tmp_path, capsys):
    code, out, _ = grade(capsys, answer(tmp_path, "naive", NAIVE), "--repeats", "0")
    assert code == 1
    assert "correct: 30 drawn" in out
    assert "NOT bandwidth-optimal: at P = 8 the busiest rank moves 4.00x 2(P-1)/P·n" in out
    assert "FAIL ring-allreduce: correct, not bandwidth-optimal" in out
    assert "time:" not in out


def test_a_deadlock_names_each_ranks_call_and_line(tmp_path, capsys):
    code, out, _ = grade(capsys, answer(tmp_path, "deadlock", DEADLOCK))
    assert code == 1
    assert ("deadlock: every rank waits for another: rank 0 in allreduce: call 1, Recv from "
            "rank 1 (deadlock.py:8); rank 1 in allreduce: call 1, Recv from rank 0") in out
    assert "P = 2, n = 0" in out


def test_a_hang_ends_at_the_timeout_naming_where_each_rank_is(tmp_path):
    # A process of its own: rank 0's thread sleeps on after the grade has ended.
    path = answer(tmp_path, "sleepy", SLEEPY)
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-m", "syncsgd.cli", "lab", "check", path, *FAST,
                           "--timeout", "0.5"], capture_output=True, text=True, timeout=60,
                          env=env)  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "FAIL hang: P = " in done.stdout
    assert "no progress for 0.5 s (--timeout): rank 1 in allreduce: call 1, Recv from rank 0 " \
           "(sleepy.py:9), waiting for rank 0" in done.stdout
    assert "rank 0 was in its own code (sleepy.py:7)" in done.stdout


def test_an_exception_and_a_library_collective_are_named(tmp_path, capsys):
    raising = "def allreduce(buf, comm):\n    buf[comm.Get_rank() + len(buf)] = 0\n"
    code, out, _ = grade(capsys, answer(tmp_path, "raising", raising))
    assert code == 1 and "rank 0 raised IndexError: index 0 is out of bounds" in out
    assert "(raising.py:2)" in out
    cheat = "def allreduce(buf, comm):\n    comm.Allreduce(buf, buf)\n"
    code, out, _ = grade(capsys, answer(tmp_path, "cheat", cheat))
    assert code == 1 and "the lab's communicator has no Allreduce" in out


def test_lab_new_writes_a_stub_that_check_grades_and_never_replaces_it(tmp_path, capsys):
    folder = tmp_path / "lab1"
    assert main(["lab", "new", "ring-allreduce", str(folder)]) == 0
    stub = folder / "ring_allreduce.py"
    text = stub.read_text()
    assert "def allreduce(buf, comm):" in text and "reduce-scatter" in text
    assert f"syncsgd lab check {stub} --kind ring-allreduce" in text
    code, out, _ = grade(capsys, str(stub))
    assert code == 1 and "raised NotImplementedError: write the ring allreduce" in out
    stub.write_text("# the student's work\n")
    assert main(["lab", "new", "ring-allreduce", str(folder)]) == 1
    err = capsys.readouterr().err
    assert "exists: lab new never replaces a file" in err and err.count("\n") == 1
    assert stub.read_text() == "# the student's work\n"


def test_the_verdict_compares_values_within_rounding_and_bits_across_ranks():
    kind = KINDS["ring-allreduce"]
    inputs = (np.array([0.1, 0.2]), np.array([0.3, 0.4]))
    case = Case(2, "float64", inputs)
    exact = inputs[0] + inputs[1]
    nudged = exact.copy()
    nudged[1] = np.nextafter(nudged[1], 1)
    assert judge(kind, case, Outcome([exact, exact], [])) is None
    assert judge(kind, case, Outcome([exact, nudged], [])) == (
        "rank 1's bits differ from rank 0's at element 1")
    assert judge(kind, case, Outcome([exact, exact + 1e-3], [])) == (
        "rank 1 holds a wrong value at element 0")


def test_the_communicator_counts_bytes_per_destination():
    from syncsgd import run_threads

    def rank_main(comm):
        lab = LabComm(comm, "none.py", "test")
        data = np.arange(4.0)
        if comm.Get_rank() == 0:
            lab.Send(data, 1)
            lab.Isend(data[:2], 1).Wait()
        else:
            lab.Recv(data, 0)
            lab.Irecv(data[:2], 0).Wait()
        return lab.counts

    sender, receiver = run_threads(2, rank_main)
    assert (sender.messages, sender.sent, sender.to) == (2, 48, {1: 48})
    assert receiver.messages == 0


@requires_mpi
@pytest.mark.timeout(180)
def test_under_mpiexec_the_ring_passes_and_the_off_by_one_fails(tmp_path):
    ring, off = answer(tmp_path, "ring", RING), answer(tmp_path, "off", OFF_BY_ONE)
    command = ["-m", "syncsgd.cli", "lab", "check"]
    done = run_mpiexec(3, [*command, ring, *FAST, "--mpi"], timeout=120)
    assert done.returncode == 0, done.stderr
    assert "on MPI" in done.stdout and "PASS ring-allreduce" in done.stdout
    assert "the MPI library's" in done.stdout
    done = run_mpiexec(3, [*command, off, *FAST, "--mpi"], timeout=120)
    assert done.returncode == 1 and "P = 3, n = 1, float64" in done.stdout


@requires_mpi
@pytest.mark.timeout(180)
def test_under_mpiexec_a_deadlock_ends_at_the_timeout(tmp_path):
    path = answer(tmp_path, "deadlock", DEADLOCK)
    done = run_mpiexec(2, ["-m", "syncsgd.cli", "lab", "check", path, *FAST, "--mpi",
                           "--timeout", "5"], timeout=120)  # fmt: skip  (5 s: MPI_Init too)
    assert done.returncode != 0
    assert ("collective timeout: no progress for 5 s (--timeout): rank 0 in allreduce (n = 0): "
            "call 1, Recv from rank 1 (deadlock.py:8), waiting for rank 1; rank 1 in allreduce "
            "(n = 0): call 1, Recv from rank 0 (deadlock.py:8)") in done.stderr


@pytest.mark.parametrize("code, spec, line", [
    ("def allreduce(buf, comm)\n    pass\n", "bad.py", "bad.py:1: syntax error: expected ':'"),
    ("import no_such_module\n", "bad.py", "bad.py: importing it raised ModuleNotFoundError: "
     "No module named 'no_such_module' (bad.py:1)"),
    ("def helper(buf, comm):\n    pass\n", "bad.py", "bad.py has no function allreduce (its "
     "functions: helper); name it as SOURCE:FUNCTION"),
    ("def helper(buf, comm):\n    pass\n", "bad.py:other", "bad.py has no function other"),
])  # fmt: skip
def test_an_answer_that_does_not_load_is_one_line(tmp_path, monkeypatch, capsys, code, spec, line):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.py").write_text(code)
    assert main(["lab", "check", spec, "--kind", "ring-allreduce"]) == 1
    err = capsys.readouterr().err
    assert err == f"syncsgd: error: {line}\n" or (line in err and err.count("\n") == 1), err


@pytest.mark.parametrize("kind", [kind for kind in KINDS if kind != "ring-allreduce"])
def test_every_other_collective_is_graded(tmp_path, capsys, kind):
    path = answer(tmp_path, "parts", PARTS)
    function = KINDS[kind].function
    code = main(["lab", "check", f"{path}:{function}", "--kind", kind, "--examples", "20",
                 "--repeats", "1"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"PASS {kind}: correct and bandwidth-optimal" in out and "syncsgd's" in out


def test_a_broadcast_from_the_root_to_each_rank_is_not_bandwidth_optimal(tmp_path, capsys):
    path = answer(tmp_path, "parts", PARTS)
    code = main(["lab", "check", f"{path}:naive_broadcast", "--kind", "broadcast",
                 "--examples", "20", "--repeats", "0"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 1 and "NOT bandwidth-optimal: at P = 8 the busiest rank moves 7.00x n" in out


def test_a_wrong_reduce_scatter_shows_only_the_elements_that_count(tmp_path, capsys):
    wrong = PARTS.replace("send, recv = (rank - s - 1) % size, (rank - s - 2) % size",
                          "send, recv = (rank - s) % size, (rank - s - 1) % size")  # fmt: skip
    path = answer(tmp_path, "parts", wrong)
    code = main(["lab", "check", f"{path}:reduce_scatter", "--kind", "reduce-scatter",
                 "--examples", "30"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 1 and "FAIL reduce-scatter: rank" in out
    assert "    expected  rank 0: [" in out and "_" in out  # others' blocks: not compared


@pytest.mark.parametrize("kind", NAMES)
def test_every_stub_loads_and_names_its_function(tmp_path, kind):
    assert main(["lab", "new", kind, str(tmp_path)]) == 0
    stub = tmp_path / (kind.replace("-", "_") + ".py")
    loaded = load_answer(str(stub), kind_of(kind).function)
    assert loaded.name == kind_of(kind).function
    assert f"--kind {kind}" in stub.read_text()
    lines = [line for line in stub.read_text().splitlines() if str(stub) not in line]
    assert max(len(line) for line in lines) <= 100  # the student's editor: no wrapped lines


# Rabenseifner folds the whole buffer onto a neighbour at P not a power of two: 1.5x at P = 3.
@pytest.mark.parametrize("algorithm, status", [("ring", 0), ("naive", 1), ("rabenseifner", 1)])
def test_the_librarys_own_allreduces_called_as_an_answer(tmp_path, capsys, algorithm, status):
    code = ("from syncsgd.collectives import allreduce as library_allreduce\n\n\n"
            f"def allreduce(buf, comm):\n    library_allreduce(buf, comm, {algorithm!r})\n")
    got, out, _ = grade(capsys, answer(tmp_path, algorithm, code), "--repeats", "0")
    assert got == status, out
    assert ("PASS" if status == 0 else "NOT bandwidth-optimal") in out


# The data-parallel step: the shard, the local sum, the allreduce, divide once by B, the update.
STEP = '''
import numpy as np

from syncsgd.collectives import allreduce


def ddp_step(params, comm, X, y, lr, local_sum):
    rank, size = comm.Get_rank(), comm.Get_size()
    part = np.array_split(np.arange(len(X)), size)[rank]
    out = np.empty_like(params)
    local_sum(params, X[part], y[part], out)
    allreduce(out, comm)
    out /= len(X)
    params -= lr * out
'''
# Each rank's mean, then the mean of the means: wrong where the parts differ in size.
MEAN_OF_MEANS = STEP.replace("    allreduce(out, comm)\n    out /= len(X)\n",
                             "    out /= max(len(part), 1)\n    allreduce(out, comm)\n"
                             "    out /= size\n")  # fmt: skip
# lr / B in one factor: the same value, other bits than serial SGD's divide-then-step.
SCALED = STEP.replace("    out /= len(X)\n    params -= lr * out\n",
                      "    params -= (lr / len(X)) * out\n")  # fmt: skip


def test_the_data_parallel_step_is_graded_against_serial_sgd(tmp_path, capsys):
    path = answer(tmp_path, "step", STEP)
    code = main(["lab", "check", path, "--kind", "ddp-step", "--examples", "20", "--repeats", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "float and exact mode: every rank holds serial SGD's step (exact mode: bit" in out
    assert "PASS ddp-step" in out


@pytest.mark.parametrize("code, problem, case", [
    (MEAN_OF_MEANS, "rank 0 holds a wrong value at element 0", "P = 2, B = 1, float mode"),
    (SCALED, "rank 0 holds other bits than serial SGD at element", ", exact mode,"),
])  # fmt: skip
def test_a_wrong_data_parallel_step_fails_with_a_minimal_case(tmp_path, capsys, code, problem,
                                                               case):  # fmt: skip
    path = answer(tmp_path, "step", code)
    assert main(["lab", "check", path, "--kind", "ddp-step", "--examples", "30"]) == 1
    out = capsys.readouterr().out
    assert f"FAIL ddp-step: {problem}" in out and case in out
    assert "elements " in out and " of 67:" in out  # a window of the 67 parameters


def test_a_flaky_answer_is_reported_without_a_traceback(tmp_path, capsys):
    flaky = ("import os\n\nfrom syncsgd.collectives import allreduce as ring\n\n\n"
             "def allreduce(buf, comm):\n    ring(buf, comm)\n"
             "    if buf.size and comm.Get_rank() == 0 and os.urandom(1)[0] < 51:\n"
             "        buf[0] += 1\n")  # fmt: skip
    code, out, err = grade(capsys, answer(tmp_path, "flaky", flaky), "--repeats", "0")
    assert code == 1 and "FAIL ring-allreduce: rank 0 holds a wrong value" in out
    assert "Traceback" not in out + err


def test_an_answer_that_fails_only_on_the_long_cost_case_fails(tmp_path, capsys):
    # Correct on the short drawn and standard cases; a deadlock from 101 elements on.
    code = ('import numpy as np\n\nfrom syncsgd.collectives import allreduce as ring\n\n\n'
            'def allreduce(buf, comm):\n    rank, size = comm.Get_rank(), comm.Get_size()\n'
            '    if buf.size > 100:\n        comm.Send(buf, (rank + 1) % size)\n'
            '    ring(buf, comm)\n')  # fmt: skip
    got, out, _ = grade(capsys, answer(tmp_path, "long", code))
    assert got == 1 and "correct: 30 drawn" in out
    assert "FAIL ring-allreduce: deadlock: every rank waits for another" in out
    assert "the cost case (not shrunk):\n    P = 3, n = 480, float64" in out
    assert "PASS" not in out and "not bandwidth-optimal" not in out


def test_without_hypothesis_lab_check_is_one_line(tmp_path, monkeypatch, capsys):
    from syncsgd.apps import lab

    monkeypatch.setattr(lab, "_hypothesis_installed", lambda: False)
    assert main(["lab", "check", answer(tmp_path, "ring", RING), *FAST]) == 1
    assert capsys.readouterr().err == ("syncsgd: error: lab check needs hypothesis: pip install "
                                       "hypothesis (or 'syncsgd[test-tools]')\n")
