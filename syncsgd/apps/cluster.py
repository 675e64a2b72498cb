"""Run an MPI command on N emulated nodes: network namespaces on a bridge, links shaped by tc.

`syncsgd cluster --nodes 2 --link 1gbit -- syncsgd bench allreduce --json b.json` makes two
namespaces joined by a bridge (in a third), shapes each node's link to 1 Gbit/s both ways by a
token bucket, runs the command as one MPI job of N*K ranks (K per node) with the installed
launcher, returns its exit status and deletes every namespace, link and qdisc afterwards - also
on Ctrl-C, on failure and when --timeout ends the job. Needs root and Linux.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator

from syncsgd.apps import cluster_launch, cluster_levels, cluster_net
from syncsgd.util.argtypes import positive_float, positive_int
from syncsgd.util.figures import figure_path
from syncsgd.util.options import reads, writes, writes_into
from syncsgd.util.signals import handling

GRACE = 5.0  # seconds between asking the launcher to stop and killing it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `syncsgd cluster`."""
    parser.add_argument("--nodes", type=positive_int, default=2, help="emulated hosts (2)")
    parser.add_argument("--ranks-per-node", type=positive_int, default=1,
                        help="MPI ranks on each node; they share memory (1)")  # fmt: skip
    parser.add_argument("--link", type=link_rate, default="1gbit",
                        help="each node's link rate, both ways, e.g. 100mbit, 10gbit, or "
                        "'none' for unshaped veths (1gbit)")  # fmt: skip
    reads(parser.add_argument("--mpiexec", metavar="PATH",
                              help="the launcher: MPICH's hydra or Open MPI's mpirun (default: "
                              "the mpiexec next to this Python, else the first on PATH)"))
    parser.add_argument("--timeout", type=positive_float, metavar="SECONDS",
                        help="end the job after this long: exit status 124 (default none)")
    parser.add_argument("--cleanup", action="store_true",
                        help="only delete the namespaces of killed clusters' processes")
    writes_into(parser.add_argument(
        "--levels", metavar="DIR",
        help="instead of a COMMAND: measure, in one job, the ring inside the nodes and between "
        "them (alone and R at once) beside the flat ring and the hierarchical allreduce, into "
        "DIR, and print `syncsgd model`'s two-level prediction beside the measurement; after --, "
        "--min-bytes, --max-bytes, --batches (16K, 8M, 7)"))  # fmt: skip
    writes(parser.add_argument("--levels-png", metavar="PATH", type=figure_path,
                               help="--levels: the measured and predicted times as a slide "
                               "(.png, .svg or .pdf)"))  # fmt: skip
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                        help="the MPI program and its arguments")  # fmt: skip


def link_rate(text: str) -> int | None:
    """--link: a rate like 1gbit, or none."""
    if text.strip().lower() == "none":
        return None
    try:
        return cluster_net.parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(options: argparse.Namespace) -> int:
    """`syncsgd cluster`: make the nodes, run the job, tear down; COMMAND's exit status."""
    why = cluster_net.unsupported()
    if why:
        print(f"syncsgd cluster: {why}", file=sys.stderr)
        return 1
    if options.cleanup:
        stale = cluster_net.stale()
        cluster_net.teardown(stale)
        print(f"syncsgd cluster: deleted {len(stale)} stale namespace(s)", file=sys.stderr)
        return 0
    argv = list(options.command)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if options.levels_png and not options.levels:
        raise ValueError("--levels-png draws the --levels measurement: give --levels DIR too")
    if options.levels:
        argv = levels_command(options, argv)
    if not argv:
        raise ValueError("no command: syncsgd cluster [options] -- COMMAND...")
    argv[0] = shutil.which(argv[0]) or argv[0]  # the nodes get our PATH, but be explicit
    mpiexec = cluster_launch.find_mpiexec(options.mpiexec)
    kind = cluster_launch.flavour(mpiexec)
    with _stop_on_signals(), tempfile.TemporaryDirectory(prefix="syncsgd-cluster-") as tmp:
        with cluster_net.emulated(options.nodes, options.link) as cluster:
            script = cluster_launch.write_enter_script(cluster, os.path.join(tmp, "enter"))
            launch = cluster_launch.command(kind, mpiexec, cluster, options.ranks_per_node,
                                            script, argv)  # fmt: skip
            env = {**os.environ, **cluster_launch.environment(kind)}
            print(f"syncsgd cluster: {describe(cluster, options.ranks_per_node, kind)}",
                  file=sys.stderr, flush=True)  # fmt: skip
            # The launcher starts in node 0: no address of the emulated network on the machine.
            entered = ["ip", "netns", "exec", cluster.nodes[0].namespace, *launch]
            load = os.getloadavg()[0]
            status = supervise(entered, env, options.timeout)
    if options.levels:
        print(f"syncsgd cluster: load average {load:.1f} before the job, "
              f"{os.getloadavg()[0]:.1f} after", file=sys.stderr, flush=True)  # fmt: skip
        return status or compare_levels(options)
    return status


def levels_command(options: argparse.Namespace, given: list[str]) -> list[str]:
    """The MPI program that measures the levels into --levels DIR (made if missing)."""
    if options.nodes < 2:
        raise ValueError("--levels needs --nodes 2 or more: one node has no link between nodes")
    cluster_levels.sweep_arguments(given)
    directory = os.path.abspath(options.levels)
    os.makedirs(directory, exist_ok=True)
    return [sys.executable, "-m", "syncsgd.apps.cluster_levels", directory, *given]


def compare_levels(options: argparse.Namespace) -> int:
    """`syncsgd model`: the levels fitted, the two-level prediction beside the measurement."""
    from syncsgd.apps import costmodel_parts

    where = {name: os.path.join(options.levels, f"{name}.json")
             for name in ("intra", "link", "measured", "model")}  # fmt: skip
    per_node = options.ranks_per_node
    argv = ["model", "--ranks", str(options.nodes * per_node), "--sizes", "1M", "--algorithms",
            "ring", "--nodes", str(options.nodes), "--ranks-per-node", str(per_node),
            *(["--intra-fit", where["intra"]] if per_node > 1 else []),
            "--inter-fit", where["link"],
            "--measured", where["measured"], "--json", where["model"],
            *(["--levels-png", options.levels_png] if options.levels_png else [])]  # fmt: skip
    print(f"syncsgd cluster: {' '.join(['syncsgd', *argv])}", file=sys.stderr, flush=True)
    parser = argparse.ArgumentParser(prog="syncsgd model")
    costmodel_parts.add_arguments(parser)
    return costmodel_parts.main(parser.parse_args(argv[1:]))


def describe(cluster: cluster_net.Cluster, per_node: int, kind: str) -> str:
    """One line: the nodes, ranks, link rate and launcher."""
    bits = cluster.rate_bits
    rate = "unshaped" if bits is None else f"{bits / 1e6:g} Mbit/s"
    launcher = {"mpich": "MPICH (hydra)", "openmpi": "Open MPI"}[kind]
    first, last = cluster.nodes[0].address, cluster.nodes[-1].address
    return (f"{len(cluster.nodes)} nodes x {per_node} rank(s), links {rate}, {launcher}, "
            f"{first}..{last}")  # fmt: skip


def supervise(command: list[str], env: dict[str, str], timeout: float | None) -> int:
    """Run the launcher in its own process group; stop it on a signal or after `timeout`."""
    job = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        return job.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"syncsgd cluster: the job ran longer than --timeout {timeout:g} s; ending it",
              file=sys.stderr, flush=True)  # fmt: skip
        stop(job)
        return 124
    except BaseException:
        stop(job)
        raise


def stop(job: subprocess.Popen) -> None:
    """Ask the launcher's process group to stop (SIGINT), then kill it after GRACE seconds."""
    for sig, wait in ((signal.SIGINT, GRACE), (signal.SIGKILL, GRACE)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, sig)
        try:
            job.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP unwind like Ctrl-C, so that the namespaces are deleted."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    with handling((signal.SIGTERM, signal.SIGHUP), interrupt):
        yield
