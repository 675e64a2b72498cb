"""--overlap: the buckets' allreduces on a communication thread during the backward pass give the
parameters of the step without it, bitwise, for every P, backend, dtype and mode; a failure on
the communication thread ends every rank, in one message, without a hang."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from conftest import requires_mpi, run_mpiexec
from hypothesis import given, settings
from hypothesis import strategies as st

from syncsgd import cli, train
from syncsgd.comm import threads as threads_module
from syncsgd.comm.threads import run_threads
from syncsgd.training import overlap

SMALL = {"samples": 200, "features": 7, "batch_size": 30, "steps": 4, "momentum": 0.9, "seed": 3}


def both(**options) -> tuple[object, object]:
    """The run without --overlap and with it, on the same options."""
    return train(**{**SMALL, **options}), train(**{**SMALL, **options, "overlap": True})


def assert_same(plain, overlapped) -> None:
    """Bitwise the same parameters and losses."""
    assert overlapped.params.tobytes() == plain.params.tobytes()
    assert np.array_equal(np.array(overlapped.losses), np.array(plain.losses), equal_nan=True)


@settings(max_examples=12)
@given(
    ranks=st.integers(2, 4),  # one rank has nothing to overlap: it runs the plain step
    hidden=st.lists(st.integers(1, 9), min_size=0, max_size=3).map(tuple),
    buckets=st.sampled_from([None, 0, 1, 64, 200, 1 << 20]),  # one for all .. one per tensor
    dtype=st.sampled_from(["float64", "float32"]),
    exact=st.booleans(),
    loss=st.sampled_from(["xent", "mse"]),
)
def test_overlap_is_bitwise_the_step_without_it(ranks, hidden, buckets, dtype, exact, loss):
    plain, overlapped = both(ranks=ranks, hidden=hidden, bucket_bytes=buckets, dtype=dtype,
                             exact=exact, loss=loss)  # fmt: skip
    assert_same(plain, overlapped)


def assert_same_with_batchnorm(plain, overlapped) -> None:
    """Bitwise the same parameters, losses and BatchNorm running statistics."""
    assert_same(plain, overlapped)
    assert overlapped.running.tobytes() == plain.running.tobytes()


@settings(max_examples=10, deadline=None)
@given(
    ranks=st.integers(2, 4),  # one rank has nothing to overlap: it runs the plain step
    hidden=st.lists(st.integers(1, 7), min_size=1, max_size=3).map(tuple),
    buckets=st.sampled_from([None, 0, 1, 40, 200]),  # one for all .. one per tensor
    batchnorm=st.sampled_from(["sync", "local"]),
    dtype=st.sampled_from(["float64", "float32"]),
    exact=st.booleans(),
)
def test_overlap_with_batchnorm_is_bitwise_the_step_without_it(ranks, hidden, buckets,
                                                                batchnorm, dtype, exact):
    plain, overlapped = both(ranks=ranks, hidden=hidden, bucket_bytes=buckets,
                             batchnorm=batchnorm, dtype=dtype, exact=exact)  # fmt: skip
    assert_same_with_batchnorm(plain, overlapped)


def test_one_bucket_per_layer_keeps_gamma_and_beta_with_their_layer():
    from syncsgd.nn.mlp import mlp
    from syncsgd.training.step import bucket_slices

    model = mlp((7, 6, 5, 3), batchnorm="sync")  # dense batchnorm relu dense batchnorm relu dense
    buckets = bucket_slices(model, np.zeros(model.n_params + 6), 0)
    offsets = {name: offset for name, _, offset in model.layout()}
    assert [b.start for b in buckets] == [offsets["W0"], offsets["W1"], offsets["W2"]]
    assert overlap.ready_layers(model, buckets) == [0, 3, 6]  # the dense layers' positions


@pytest.mark.parametrize("options", [
    {"noise_scale": True, "bucket_bytes": 0, "batchnorm": "sync"},  # the riders' bucket held
    {"allreduce_dtype": "bfloat16", "bucket_bytes": 0, "batchnorm": "sync"},
    {"pitfall": "mean-of-means", "bucket_bytes": 0, "batchnorm": "sync"},  # the whole sum
    {"algorithm": "mpi", "bucket_bytes": 0, "batchnorm": "sync"},
    {"exact": True, "algorithm": "tree", "bucket_bytes": 40, "batchnorm": "local"},
])  # fmt: skip
def test_overlap_with_batchnorm_riders_casts_and_pitfalls(options):
    plain, overlapped = both(ranks=3, hidden=(6, 5), **options)
    assert_same_with_batchnorm(plain, overlapped)


@pytest.mark.parametrize("options", [
    {"noise_scale": True, "bucket_bytes": 0},  # a rider that reads the whole local gradient
    {"allreduce_dtype": "bfloat16", "bucket_bytes": 0},  # cast per bucket
    {"pitfall": "mean-of-means", "batch_size": 30, "bucket_bytes": 0},  # the whole sum first
    {"precision": "bf16", "bucket_bytes": 0},  # narrow passes, layer by layer
    {"precision": "fp16", "exact": True, "bucket_bytes": 0},  # loss scaling's rider, exact
    {"precision": "fp16", "bucket_bytes": 100},  # narrow passes, loss scaling's rider
    {"pitfall": "fp32-allreduce", "bucket_bytes": 0},  # a variant's allreduce per bucket
    {"algorithm": "mpi", "bucket_bytes": 100},
])  # fmt: skip
def test_overlap_with_riders_casts_pitfalls_and_formats(options):
    plain, overlapped = both(ranks=3, hidden=(6, 5), **options)
    assert_same(plain, overlapped)
    if options.get("noise_scale"):
        assert overlapped.noise_scales == plain.noise_scales


def test_a_stop_request_on_one_rank_stops_every_rank_after_the_same_step(monkeypatch):
    from syncsgd.comm.watchdog import current
    from syncsgd.training import hooks

    def fill_(self, slots, grad_sum, shard_size):  # rank 1 alone asks to stop, at step 2
        asked = threading.current_thread().name == "syncsgd-rank-1" and current().during == 2
        slots[0] = 1 if asked else 0

    monkeypatch.setattr(hooks.StopRequest, "fill_", fill_)
    plain, overlapped = both(ranks=3, hidden=(6, 5), bucket_bytes=0, steps=6)
    assert plain.stopped_after == overlapped.stopped_after == 3
    assert_same(plain, overlapped)


def test_the_step_ends_its_communication_thread():
    train(**SMALL, ranks=3, overlap=True, bucket_bytes=0)
    assert not [t for t in threading.enumerate() if t.name.startswith("syncsgd-comm-")]


def test_a_duplicate_never_matches_the_original_messages():
    def ranks(comm):
        dup = comm.Dup()
        if comm.Get_rank() == 0:
            first = comm.Isend(np.array([1.0]), dest=1, tag=5)
            dup.Send(np.array([2.0]), dest=1, tag=5)
            first.Wait()
            return None
        got = np.zeros(2)
        dup.Recv(got[:1], source=0, tag=5)  # one context would match the earlier message
        comm.Recv(got[1:], source=0, tag=5)
        return got.tolist()

    assert run_threads(2, ranks)[1] == [2.0, 1.0]


def test_a_duplicate_exchanges_and_allreduces_in_its_own_contexts():
    from syncsgd.collectives import allreduce

    def ranks(comm):
        dup, rank = comm.Dup(), comm.Get_rank()
        early = comm.Isend(np.array([-1.0]), dest=1 - rank, tag=5)
        got = np.zeros(1)
        dup.Sendrecv(np.array([float(rank)]), 1 - rank, 5, got, 1 - rank, 5)
        late = np.zeros(1)
        comm.Recv(late, source=1 - rank, tag=5)
        early.Wait()
        total = allreduce(np.arange(5.0) * (rank + 1), dup, "ring")
        return got[0], late[0], total.tolist()

    assert run_threads(2, ranks) == [(1.0, -1.0, [0, 3, 6, 9, 12]),
                                     (0.0, -1.0, [0, 3, 6, 9, 12])]  # fmt: skip


FAILING = textwrap.dedent("""
    import sys
    from syncsgd import cli
    from syncsgd.training import overlap

    original = overlap.Overlap.reduce_bucket_
    calls = {}  # per rank: thread ranks share this module

    def reduce_bucket_(self, index):
        rank = self.comm.Get_rank()
        calls[rank] = calls.get(rank, 0) + 1
        if rank == 1 and calls[rank] == 5:  # the second step's second bucket
            raise RuntimeError("the network went away")
        return original(self, index)

    overlap.Overlap.reduce_bucket_ = reduce_bucket_
    sys.exit(cli.main(sys.argv[1:]))
""")
ARGS = ["train", "--samples", "200", "--features", "7", "--hidden", "6,5", "--batch-size", "30",
        "--steps", "6", "--overlap", "--bucket-bytes", "0", "--quiet"]  # fmt: skip


@pytest.mark.parametrize("extra", [[], ["--batchnorm", "sync"]])  # sync: its sums queue too
def test_a_failure_on_the_communication_thread_ends_every_thread_rank(tmp_path, extra):
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    done = subprocess.run([sys.executable, str(script), *ARGS, *extra, "--ranks", "3"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.strip() == "syncsgd: error: the network went away"


@pytest.mark.parametrize("options", [{}, {"batchnorm": "sync", "hidden": (4,)}])
def test_a_stuck_communication_thread_times_out(monkeypatch, options):
    from syncsgd.comm.threads import CollectiveTimeout

    original = overlap.Overlap.reduce_bucket_
    released = threading.Event()

    def stuck(self, index):
        if self.comm.Get_rank() == 1:
            released.wait(30)  # never reaches the collective (until the test ends)
        return original(self, index)

    monkeypatch.setattr(overlap.Overlap, "reduce_bucket_", stuck)
    # Rank 1 is stuck through any grace: test_timeout bounds waiting out the 2 s of it.
    monkeypatch.setattr(threads_module, "TIMEOUT_GRACE", 0.1)
    try:
        with pytest.raises(CollectiveTimeout, match="training step 0"):
            train(**SMALL, ranks=2, overlap=True, bucket_bytes=0, timeout=1, **options)
    finally:
        released.set()  # its thread ends: the closed world refuses the allreduce


# -- under a real mpiexec -------------------------------------------------------------------------


def mpi_params(tmp_path, ranks: int, *extra: str) -> bytes:
    """The saved parameters of `syncsgd train` under `mpiexec -n ranks`."""
    saved = tmp_path / f"p{ranks}{len(extra)}.npz"
    args = [a for a in ARGS if a not in ("--overlap", "--quiet")]
    done = run_mpiexec(ranks, ["-m", "syncsgd.cli", *args, "--quiet", *extra, "--save",
                               str(saved)], timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return saved_bytes(saved)


def plain_params(tmp_path, ranks: int, *extra: str) -> bytes:
    """The saved parameters of `syncsgd train` without --overlap: on `ranks` thread ranks for the
    ring, which runs the MPI ranks' sums in their order (test_cli_train), under mpiexec for the
    library's allreduce, whose order only the library knows."""
    if "mpi" in extra:
        return mpi_params(tmp_path, ranks, *extra)
    saved = tmp_path / f"t{ranks}{len(extra)}.npz"
    args = [a for a in ARGS if a not in ("--overlap", "--quiet")]
    assert cli.main([*args, "--quiet", *extra, "--ranks", str(ranks), "--save", str(saved)]) == 0
    return saved_bytes(saved)


def saved_bytes(saved) -> bytes:
    """Every array of a saved .npz, in name order, as one byte string."""
    with np.load(saved) as arrays:
        return b"".join(arrays[name].tobytes() for name in sorted(arrays.files))


# Each case launches one job with --overlap and compares it with the run without it, on thread
# ranks (P = 2 with the library's allreduce: a second job). Under the second MPI library CI runs
# the library's allreduce, and the exact ring beside BatchNorm's allreduces (mpi_once: the ring in
# other dtypes, and without BatchNorm, adds nothing that depends on the library). A failure and
# a stuck rank: with BatchNorm sync, the two threads in MPI (mpi_once: the one thread).
ONCE = pytest.mark.mpi_once


@requires_mpi
@pytest.mark.parametrize("ranks, mode", [pytest.param(3, ["--exact"], marks=ONCE),
                                         pytest.param(3, ["--dtype", "float32", "--noise-scale"],
                                                      marks=ONCE),
                                         (2, ["--algorithm", "mpi"])])  # fmt: skip
def test_mpiexec_overlap_is_bitwise_the_step_without_it(tmp_path, ranks, mode):
    assert mpi_params(tmp_path, ranks, *mode, "--overlap") == plain_params(tmp_path, ranks, *mode)


@requires_mpi
@pytest.mark.parametrize("ranks, mode", [(3, ["--batchnorm", "sync", "--exact"]),
                                         pytest.param(3, ["--batchnorm", "local", "--dtype",
                                                          "float32"], marks=ONCE),
                                         (2, ["--batchnorm", "sync", "--algorithm", "mpi"])])
def test_mpiexec_overlap_with_batchnorm_is_bitwise_the_step_without_it(tmp_path, ranks, mode):
    # The saved arrays hold the running statistics too. Sync: BatchNorm's allreduces on the
    # rank's communicator while the buckets travel on the duplicate, from two threads.
    assert mpi_params(tmp_path, ranks, *mode, "--overlap") == plain_params(tmp_path, ranks, *mode)


@requires_mpi
@pytest.mark.parametrize("extra", [pytest.param([], marks=ONCE), ["--batchnorm", "sync"]])
def test_mpiexec_a_failure_on_the_communication_thread_ends_the_job(tmp_path, extra):
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    done = run_mpiexec(2, [str(script), *ARGS, *extra], timeout=120)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.startswith("syncsgd: error")]
    assert lines == ["syncsgd: error: rank 1: the network went away"], done.stderr
    assert "Traceback" not in done.stderr


# -- the timeline, the benchmark and the cost model ----------------------------------------------


def test_the_timeline_has_a_communication_row_with_allreduces_inside_the_compute(tmp_path,
                                                                                 monkeypatch):
    from syncsgd.training.layered import RankGradient
    from syncsgd.training.timeline import COMM_ROW

    layers_ = RankGradient.layers_

    def slow_layers_(self, params, X, sums, top, bottom):  # a backward pass longer than a wake-up
        layers_(self, params, X, sums, top, bottom)
        if bottom > 0:
            time.sleep(0.02)

    monkeypatch.setattr(RankGradient, "layers_", slow_layers_)
    path = tmp_path / "trace.json"
    train(**SMALL, ranks=2, hidden=(40, 30), bucket_bytes=0, overlap=True, timeline=str(path))
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    for rank in (0, 1):
        mine = [e for e in spans if e["tid"] == rank]
        comm = [e for e in spans if e["tid"] == COMM_ROW + rank]
        assert comm and {e["cat"] for e in comm} == {"allreduce"}
        backward = [e for e in mine if e["name"] == "backward"]
        assert len(backward) == SMALL["steps"] and {e["cat"] for e in backward} == {"compute"}
        assert any(b["ts"] <= a["ts"] <= b["ts"] + b["dur"] for b in backward for a in comm)
        # The last bucket, with nothing left to overlap, is summed on the rank's own row after
        # its backward pass.
        last = [e for e in mine if e["cat"] == "allreduce"]
        assert last and not any(b["ts"] < a["ts"] < b["ts"] + b["dur"] for b in backward
                                for a in last)  # fmt: skip
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {"rank 0", "rank 1", "rank 0 communication", "rank 1 communication"}
    pytest.importorskip("matplotlib")
    from syncsgd.training.timeline import draw_gantt

    draw_gantt(events, str(tmp_path / "trace.png"))
    assert (tmp_path / "trace.png").stat().st_size > 0


def test_bench_step_reports_the_share_of_communication_hidden(tmp_path, capsys):
    from syncsgd.cli import main

    out = tmp_path / "step.json"
    argv = ["bench", "step", "--ranks", "1,2", "--scaling", "weak", "--overlap", "--no-overhead",
            "--cli-runs", "0", "--repeats", "2", "--steps", "3", "--warmup", "1", "--samples",
            "256", "--features", "16", "--hidden", "16,16", "--per-rank-batch", "16",
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(out.read_text())["overlap"]
    assert [row["ranks"] for row in rows] == [1, 2]
    for row in rows:
        assert row["hidden_share"] <= 1 and row["ratio"] > 0 and row["overlap_step_ms"] > 0
    assert "hidden" in capsys.readouterr().out


def test_the_overlapped_step_of_the_cost_model():
    from syncsgd.apps.costmodel import StepParts, overlapped_step, plain_step

    hidden = StepParts(forward=1.0, backward=10.0, comms=(2.0, 3.0, 4.0), update=0.5)
    assert overlapped_step(hidden) == 1.0 + 10.0 + 2.0 + 0.5  # the backward hides 3 + 4
    assert plain_step(hidden) == 1.0 + 10.0 + 9.0 + 0.5
    exposed = hidden._replace(backward=1.0)
    assert overlapped_step(exposed) == 1.0 + 7.0 + 2.0 + 0.5  # the network is the bottleneck
    assert overlapped_step(hidden._replace(comms=(9.0,))) == plain_step(hidden)  # one bucket


def test_model_names_the_bucket_size_that_minimises_the_step(capsys):
    from syncsgd.apps.costmodel import Params, overlap_table
    from syncsgd.cli import main
    from syncsgd.nn.mlp import mlp

    params = Params(alpha=50e-6, beta=8e-9, gamma=1e-10)
    table = overlap_table(mlp((784, 256, 256, 10)), 64, 1e10, 8, [2], params)
    assert table[0]["bucket_bytes"] == 0 and table[-1]["bucket_bytes"] is None
    assert table[-1]["overlap_s"] == table[-1]["plain_s"]  # one bucket: nothing to hide
    assert all(row["overlap_s"] <= row["plain_s"] for row in table)
    assert main(["model", "--overlap", "784,256,256,10", "--ranks", "2", "--alpha", "50e-6",
                 "--beta", "8e-9"]) == 0  # fmt: skip
    best = [line for line in capsys.readouterr().out.splitlines() if line.endswith("<- best")]
    assert len(best) == 1  # one best bucket size per P


@pytest.mark.parametrize("argv, message", [
    (["--overlap", "784"], "layer sizes must be 2 or more integers >= 1"),
    (["--overlap", "7,x"], "layer sizes must be 2 or more integers >= 1"),
])  # fmt: skip
def test_model_refuses_bad_layer_sizes_in_one_line(argv, message):
    done = subprocess.run([sys.executable, "-m", "syncsgd.cli", "model", *argv],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode != 0 and message in done.stderr and "Traceback" not in done.stderr


STUCK = textwrap.dedent("""
    import sys, time
    from syncsgd import cli
    from syncsgd.training import overlap

    original = overlap.Overlap.reduce_bucket_

    def reduce_bucket_(self, index):
        if self.comm.Get_rank() == 1 and self.stepper.doing.during == 2:
            time.sleep(60)  # the communication thread never reaches this bucket's allreduce
        return original(self, index)

    overlap.Overlap.reduce_bucket_ = reduce_bucket_
    sys.exit(cli.main(sys.argv[1:]))
""")


@requires_mpi
@pytest.mark.parametrize("extra", [pytest.param([], marks=ONCE), ["--batchnorm", "sync"]])
def test_mpiexec_the_timeout_covers_the_communication_thread(tmp_path, extra):
    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    done = run_mpiexec(2, [str(script), *ARGS, *extra, "--timeout", "2"], timeout=120)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if "no progress" in line]
    assert len(lines) == 1, done.stderr  # one line for the job
    assert lines[0].startswith(
        "syncsgd: error: collective timeout: no progress for 2 s (--timeout): rank 0 in "
        "ring_allreduce (gather step 0) at training step 2, waiting for rank 1"
    ), done.stderr


@requires_mpi
def test_mpiexec_refuses_overlap_without_thread_multiple(tmp_path):
    script = tmp_path / "serialized.py"
    script.write_text("import sys, mpi4py\nmpi4py.rc.thread_level = 'serialized'\n"
                      "from syncsgd import cli\nsys.exit(cli.main(sys.argv[1:]))\n")  # fmt: skip
    done = run_mpiexec(2, [str(script), *ARGS], timeout=120)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("syncsgd: error")]
    assert errors == ["syncsgd: error: --overlap needs an MPI library initialised with "
                      "MPI_THREAD_MULTIPLE; this one gives less (mpi4py.rc.thread_level?): "
                      "leave out --overlap"], done.stderr  # fmt: skip
    assert "Traceback" not in done.stderr
