"""`syncsgd cluster`: MPI across emulated nodes gives the single-host bits, leaves nothing behind.

The emulated cluster needs root, `ip netns` and `tc`; elsewhere these tests are skipped. Every
test that drives mpiexec is marked `mpi`; the longer runs across nodes are marked `cluster` too.
CI runs them all under MPICH, and under Open MPI all but the `cluster` ones, of which one.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import mpiexec_path

from syncsgd import TrainConfig, train
from syncsgd.apps import cluster, cluster_net
from syncsgd.cli import build_parser

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "mpi_collectives_check.py")
SMALL = ["--samples", "120", "--features", "6", "--hidden", "5", "--batch-size", "20",
         "--steps", "6", "--momentum", "0.9"]  # fmt: skip
SMALL_CONFIG = TrainConfig(samples=120, features=6, hidden=(5,), batch_size=20, steps=6,
                           momentum=0.9)  # fmt: skip
# P = 4 as 2 nodes of 2 ranks: shared memory within a node, the emulated link between them.
SHAPES = [(2, 1), (3, 1), (2, 2)]


def _why_not() -> str | None:
    """Why the emulated cluster cannot run here, or None."""
    why = cluster_net.unsupported()
    if why is None and subprocess.run(["ip", "netns", "list"], capture_output=True).returncode:
        why = "`ip netns` does not work here"
    if why is None and mpiexec_path() is None:
        why = "needs mpiexec"
    return why


_skip_without_cluster = pytest.mark.skipif(_why_not() is not None, reason=f"{_why_not()}")


def requires_cluster(test: Callable) -> Callable:
    """Mark a test that drives mpiexec on emulated nodes: marked `mpi`, skipped where it can't."""
    return pytest.mark.mpi(_skip_without_cluster(test))


def run_cluster(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`syncsgd cluster ARGS`, driving the mpiexec the other MPI tests use."""
    command = [sys.executable, "-m", "syncsgd.cli", "cluster", "--mpiexec", str(mpiexec_path()),
               *args]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def network_state() -> set[str]:
    """Namespaces, links and qdiscs of the machine's own namespace, for before/after checks."""
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    qdiscs = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True).stdout
    names = {n for n in cluster_net.namespaces() if n.startswith(cluster_net.PREFIX)}
    # other agents' links may come and go: keep only names that a cluster could have made
    ours = {line.split(":")[1] for line in links.splitlines()
            if "syncsgd" in line or " br0" in line}  # fmt: skip
    return names | ours | {q for q in qdiscs.splitlines() if "tbf" in q}


def left_behind(before: set[str]) -> set[str]:
    """What a cluster made that is still there (other clusters may come and go meanwhile)."""
    return network_state() - before


def test_link_rates_parse():
    assert cluster_net.parse_rate("1gbit") == 10**9
    assert cluster_net.parse_rate("100mbit") == 10**8
    assert cluster_net.parse_rate("2.5Gbit") == 25 * 10**8
    assert cluster.link_rate("none") is None
    for bad in ("fast", "1bit", "10tbit"):
        with pytest.raises(ValueError):
            cluster_net.parse_rate(bad)


def test_without_root_it_says_so_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(cluster_net.os, "geteuid", lambda: 1000)
    options = build_parser().parse_args(["cluster", "--nodes", "2", "--", "true"])
    assert cluster.main(options) == 1
    err = capsys.readouterr().err
    assert err == "syncsgd cluster: needs root (network namespaces and tc)\n"


@requires_cluster
def test_exit_status_and_teardown_on_success_failure_and_timeout():
    before = network_state()
    assert run_cluster("--nodes", "2", "--", "true").returncode == 0
    assert run_cluster("--nodes", "3", "--", "sh", "-c", "exit 7").returncode == 7
    done = run_cluster("--nodes", "2", "--timeout", "2", "--", "sleep", "60")
    assert done.returncode == 124 and "--timeout 2 s" in done.stderr
    assert not left_behind(before)


@requires_cluster
def test_ctrl_c_tears_everything_down():
    before = network_state()
    command = [sys.executable, "-m", "syncsgd.cli", "cluster", "--nodes", "2", "--mpiexec",
               str(mpiexec_path()), "--", "sleep", "60"]  # fmt: skip
    default_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    job = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    deadline = time.monotonic() + 30
    while not left_behind(before) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # the launcher has started
    job.send_signal(signal.SIGINT)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 130, err
    assert not left_behind(before)


@requires_cluster
@pytest.mark.cluster
@pytest.mark.timeout(300)
# Training, one job per case: exact mode on 3 nodes (every ring step crosses a link), the float
# ring on 2 x 2 (links and shared memory mixed); the messages of either mode take the same links
# and shared memory, so the other pairings (and 2 nodes of 1 rank) add no path.
@pytest.mark.parametrize(("nodes", "per_node", "exact"), [(3, 1, True), (2, 2, False)])
def test_training_across_nodes_is_bitwise_the_single_host_run(tmp_path, nodes, per_node, exact):
    saved = tmp_path / "params.npz"
    done = run_cluster("--nodes", str(nodes), "--ranks-per-node", str(per_node), "--",
                       sys.executable, "-m", "syncsgd.cli", "train", *SMALL,
                       *(["--exact"] if exact else []), "--save", str(saved), "--quiet",
                       timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    if exact:  # what verify compares with: the serial run
        expected = train(SMALL_CONFIG, ranks=1, exact=True).arrays()
    else:  # the same ring on one host
        expected = train(SMALL_CONFIG, ranks=nodes * per_node).arrays()
    with np.load(saved) as got:
        for name in expected:
            assert got[name].tobytes() == expected[name].tobytes(), name


@requires_cluster
@pytest.mark.cluster
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("nodes", "per_node"), SHAPES)
def test_every_collective_passes_its_checks_across_nodes(nodes, per_node):
    done = run_cluster("--nodes", str(nodes), "--ranks-per-node", str(per_node), "--",
                       sys.executable, WORKER, timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"ok: {nodes * per_node} ranks" in done.stdout


LOOP = """
import time, numpy as np
from mpi4py import MPI
from syncsgd.collectives.api import allreduce
buf = np.ones(1 << 16)
while True:
    allreduce(buf, MPI.COMM_WORLD, "ring")
"""


@requires_cluster
@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_a_node_whose_link_is_cut_ends_the_job_within_a_minute(tmp_path):
    # No collective times out: the ranks would wait for the lost node forever, so the cluster's
    # own --timeout is the watchdog that ends the job.
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    before = network_state()
    command = [sys.executable, "-m", "syncsgd.cli", "cluster", "--nodes", "2", "--timeout", "10",
               "--mpiexec", str(mpiexec_path()), "--", sys.executable, str(script)]  # fmt: skip
    start = time.monotonic()
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    node = _wait_for_namespace("-n1", before)
    time.sleep(4.0)  # the ranks are in their loop
    assert job.poll() is None  # the cut comes before the watchdog's 10 s
    subprocess.run(["ip", "netns", "exec", node, "ip", "link", "set", "eth0", "down"], check=True)
    _, err = job.communicate(timeout=90)
    assert job.returncode != 0, err
    assert time.monotonic() - start < 60
    assert not left_behind(before)


def _wait_for_namespace(suffix: str, existing: set[str]) -> str:
    """The name of the new namespace ending in `suffix`, once it exists."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = [n for n in cluster_net.namespaces() if n.endswith(suffix) and n not in existing]
        if found:
            return found[0]
        time.sleep(0.2)
    pytest.fail("the cluster's namespaces did not appear")


def test_levels_refuses_bad_sweep_options_and_one_node(tmp_path):
    from syncsgd.apps import cluster_levels

    assert cluster_levels.sweep_arguments(["--min-bytes", "64K", "--batches", "3"])
    for bad in (["--warmup", "3"], ["--min-bytes", "8M", "--max-bytes", "1M"], ["--batches", "0"],
                ["--min-bytes", "lots"]):  # fmt: skip
        with pytest.raises(ValueError, match="--levels: "):
            cluster_levels.sweep_arguments(bad)
    options = build_parser().parse_args(["cluster", "--nodes", "1", "--levels", str(tmp_path)])
    with pytest.raises(ValueError, match="--levels needs --nodes 2 or more"):
        cluster.levels_command(options, [])


@requires_cluster
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_levels_measures_fits_and_sets_the_prediction_beside_the_measurement(tmp_path):
    before = network_state()
    into, png = tmp_path / "levels", tmp_path / "levels.png"
    done = run_cluster("--nodes", "2", "--ranks-per-node", "2", "--link", "1gbit", "--levels",
                       str(into), "--levels-png", str(png), "--", "--min-bytes", "256K",
                       "--max-bytes", "512K", "--batches", "2", timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "# between nodes: fitted to the ring's 2 rows of" in done.stdout
    assert "R rings at once" not in done.stdout  # predicted from the link's fit, sharing counted
    assert "# measured (" in done.stdout and png.stat().st_size > 0
    assert "load average" in done.stderr
    for name, ranks in (("intra", 2), ("shared", 2), ("link", 2), ("measured", 4)):
        document = json.loads((into / f"{name}.json").read_text())
        assert document["ranks"] == ranks, name
        assert [row["size_bytes"] for row in document["rows"]][:2] == (
            [256 << 10, 256 << 10] if name == "measured" else [256 << 10, 512 << 10])
    model = json.loads((into / "model.json").read_text())
    assert [row["size_bytes"] for row in model["measured"]["rows"]] == [256 << 10, 512 << 10]
    assert left_behind(before) == set()
