"""Every `syncsgd ...` command in the shell blocks of README.md and docs/*.md is parsed by the real
parser, and run here unless tests/test_tutorial.py runs it (the tutorial's and the instructor's
`$ ` lines) or EXCLUDED says why not. A run gets the arguments OVERRIDES lists appended (argparse
keeps the last value of an option), and must exit with the status its comment announces
("exit status 1"), else 0. The commands of one run share a directory, in document order, so that
`model --fit sweep.json` reads the sweep the README's `bench allreduce` wrote. The first command
of each subcommand, and every mpiexec one, runs in a fresh Python; the others by syncsgd's main
in this process."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest
from conftest import mpiexec_command, mpiexec_path, run_in_process
from doc_commands import Documented, every_command
from test_tutorial import INSTRUCTOR, TUTORIAL, tutorial_commands

from syncsgd.apps import cluster_levels
from syncsgd.cli import build_parser

# Appended to a command when the test runs it: a shorter run of the same command.
OVERRIDES = {
    "syncsgd train --ranks 4": "--steps 5",
    "syncsgd verify --ranks 1,2,3,5,8 --exact --steps 20": "--steps 5",
    "mpiexec -n 2 syncsgd bench allreduce --max-bytes 1M --json sweep.json":
        "--max-bytes 64K --batches 3",
    'syncsgd model --memory --model "gpt(layers=2,d=128,heads=4)" --data numbers-to-words '
    "--context 8 --samples 16 --batch-size 4 --dtype float32 --optimizer adamw --precision bf16 "
    "--bucket-bytes 0 --png memory.png --measured": "--measured 1,2",
}  # fmt: skip

LONG = "a measured run the page quotes ({}); parsed only, to keep these tests under a minute"
MPI_MANY = "{} MPI processes on a 2-core machine; tests/{}"
ROOT = "needs root and Linux network namespaces (tests/test_cluster.py runs clusters as root)"

# Documented commands that the tests parse but do not run, and why.
EXCLUDED = {
    "mpiexec -n 4 syncsgd train --steps 200 --save params.npz":
        MPI_MANY.format(4, "test_reproducibility.py runs train under mpiexec"),
    "mpiexec -n 2 syncsgd bench allreduce --json ring.json --csv ring.csv":
        "a sweep to 64 MiB under MPI (minutes); the README's mpiexec bench allreduce runs "
        "here to 64 KiB, tests/test_mpi_launcher.py runs one under mpiexec too",
    "srun -n 64 syncsgd train --batch-size 4096": "needs Slurm and 64 ranks",
    "sudo syncsgd cluster --nodes 4 --link 1gbit -- syncsgd bench allreduce --min-bytes 64K "
    "--max-bytes 16M --json p4.json": ROOT,
    "sudo syncsgd cluster --nodes 2 --link 1gbit -- syncsgd bench allreduce --max-bytes 1M": ROOT,
    "sudo syncsgd cluster --nodes 2 --ranks-per-node 2 --link 1gbit --levels lv --levels-png "
    "levels.png -- --min-bytes 16K --max-bytes 8M --batches 15": ROOT,
    "sudo syncsgd cluster --nodes 2 --link 1gbit -- syncsgd bench allreduce --min-bytes 64K "
    "--max-bytes 16M --batches 7 --json p2.json": ROOT,
    "sudo syncsgd cluster --nodes 4 --link 1gbit -- syncsgd bench allreduce --min-bytes 64K "
    "--max-bytes 16M --batches 7 --json p4.json": ROOT,
    "syncsgd model --fit p2.json --ranks 2 --sizes 64K,1M,16M":
        "reads p2.json, the sweep of the cluster run before it (root)",
    "syncsgd model --fit p2.json --ranks 4,64,1024 --sizes 64K,1M,16M,256M":
        "reads p2.json, the sweep of the cluster run before it (root)",
    # docs/batch-size-study.md
    "syncsgd study batch-size --quick --png study.png --json study.json":
        LONG.format("under a minute; tests/test_study.py runs --quick on fewer samples"),
    'syncsgd study batch-size --model "conv(8, 5, stride=2) relu flatten dense" --data mnist-5k '
    "--holdout 0.2 --target-accuracy 0.9 --batch-sizes 16,64,256 --lrs 0.1,0.2,0.4,0.8 "
    "--max-steps 1500": LONG.format("58 s of CPU time"),
    # docs/benchmarks.md
    "syncsgd bench allreduce --max-bytes 1M": LONG.format("7 s here; the README runs a sweep"),
    "mpiexec -n 2 syncsgd bench allreduce --json a.json --png a.png --check":
        "a sweep to 64 MiB under MPI (minutes), and --check asserts speed bars, which a loaded "
        "machine misses; tests/test_bench_allreduce.py tests the verdict on made-up sweeps",
    "mpiexec -n 2 syncsgd bench allreduce --algorithms ring,recursive-doubling,rabenseifner,tree,"
    "auto": "a sweep to 64 MiB under MPI (minutes); tests/test_bench_algorithms.py tests "
    "--algorithms",
    "mpiexec -n 4 syncsgd bench collective --max-bytes 4M --json parts.json --csv parts.csv":
        MPI_MANY.format(4, "test_collective_parts.py runs every collective under mpiexec"),
    "mpiexec -n 4 syncsgd bench collective --max-bytes 4M --json parts.json":
        MPI_MANY.format(4, "test_collective_parts.py runs every collective under mpiexec"),
    "syncsgd bench collective --ranks 4 --collectives allgather,reduce-scatter":
        LONG.format("a sweep to 64 MiB; the README runs it to 8 KiB"),
    "syncsgd bench step --ranks 1,2,4": LONG.format("7 timed runs per P; the README runs bench "
                                                    "step"),  # fmt: skip
    "mpiexec -n 2 syncsgd bench step": "the full benchmark under MPI (minutes); "
    "tests/test_bench_step.py runs a small one under mpiexec -n 2",
    "syncsgd bench step --ranks 1,2 --model simple-cnn --input-shape 1,28,28 --dtype float32":
        LONG.format("a 3.3M-parameter CNN; tests/test_bench_step.py times a --model"),
    # docs/cost-model.md: its figure commands draw slides (seconds each)
    "syncsgd model --ranks 8,64 --sizes 1M,64M --collectives --scaling why-ring.png":
        LONG.format("a slide; tests/test_costmodel_parts.py draws it"),
    # docs/ring-demo.md
    "syncsgd ring-demo --ranks 5 --length 10 --algorithm rabenseifner --png rabenseifner.png":
        LONG.format("a slide; tests/test_slides.py draws them"),
    "syncsgd ring-demo --ranks 8 --length 16 --html ring.html --frames slides/":
        LONG.format("17 slides, 7 s here; tests/test_slides.py and test_demo_html.py draw them"),
    # docs/train.md
    "syncsgd train --data digits --model 'conv(8, 3, pad=1) batchnorm relu maxpool(2) flatten "
    "dense' --ranks 4 --batch-size 64 --steps 200 --lr 0.05 --momentum 0.9 --holdout 0.2 "
    "--eval-every 50": LONG.format("the tutorial runs it with 100 steps"),
    "syncsgd train --data digits --model 'conv(8, 3, pad=1) batchnorm relu maxpool(2) flatten "
    "dense' --ranks 32 --batchnorm local --batch-size 64 --steps 200 --lr 0.05 --momentum 0.9 "
    "--holdout 0.2 --eval-every 50": LONG.format("12 s here"),
    'syncsgd train --model "dense(64) relu dense(64) relu dense" --ranks 4':
        LONG.format("5 s here; tests/test_layers.py trains drawn specs"),
    'syncsgd train --model "conv(4, 3, pad=1) relu maxpool(2) flatten dense" --features 64 '
    "--input-shape 1,8,8": LONG.format("the README runs it with --steps 20"),
    'syncsgd train --model "dense(32) batchnorm relu dense" --steps 0 --save start.npz':
        LONG.format("5 s here; tests/test_train_outputs.py saves --steps 0"),
    'syncsgd verify --ranks 1,2,3,5 --exact --model "dense(16) tanh dense(16) relu dense"':
        LONG.format("the README runs it with --steps 20"),
    'syncsgd train --model "gpt(layers=2,d=32,heads=4)" --data numbers-to-words --optimizer adam '
    "--schedule noam --warmup-steps 50 --lr 1 --precision fp16 --clip-norm 1.0 --steps 300":
        LONG.format("ten minutes"),
    'syncsgd verify --model "gpt(layers=2,d=32,heads=4)" --data numbers-to-words --ranks 1,2,4 '
    "--exact --optimizer adamw --lr 0.003 --batch-size 32 --steps 10":
        LONG.format("a minute; tests/test_transformer.py runs exact mode"),
    'syncsgd bench step --ranks 1,2 --model "gpt(layers=2,d=32,heads=4)" --data numbers-to-words '
    "--scaling strong --global-batch 32 --no-overhead --cli-runs 0": LONG.format("a minute"),
    'syncsgd study batch-size --model "gpt(layers=1,d=16,heads=2)" --data numbers-to-words '
    "--context 16 --samples 1024 --holdout 0.25 --target-loss 2.0 --batch-sizes 8,32,128 "
    "--lrs 1,3,10 --max-steps 1000": LONG.format("16 s"),
    # docs/verify.md
    "syncsgd verify --ranks 1,2,3,4,8": LONG.format("the README runs it with --steps 20"),
    "syncsgd verify --ranks 1,2,3,5,8 --exact": LONG.format("the README runs it with --steps 20"),
    "syncsgd verify --pitfall all": LONG.format("the instructor's guide runs it with --steps 30"),
    "syncsgd verify --ranks 1,1024 --exact --steps 3 --batch-size 2048":
        LONG.format("69 to 86 s; tests/test_comm_scale.py runs 512 thread ranks"),
    "syncsgd verify --ranks 1,2,3,4 --algorithms ring,tree --precisions fp32,bf16 --modes "
    "float,exact --report r.html --json r.json --png docs/verify-grid.png":
        LONG.format("42 s, 32 runs; tests/test_verify_grid.py runs grids"),
}  # fmt: skip

# The commands tests/test_tutorial.py runs: every `$ ` line of these two documents.
BY_THE_TUTORIAL_TEST = {"docs/tutorial.md": TUTORIAL, "docs/instructor.md": INSTRUCTOR}


def by_the_tutorial_test() -> set[tuple[str, ...]]:
    """The argument vectors of the commands tests/test_tutorial.py runs."""
    return {tuple(shlex.split(command)) for path in BY_THE_TUTORIAL_TEST.values()
            for command, _ in tutorial_commands(path)}  # fmt: skip


def documented() -> list[Documented]:
    """Every documented command that tests/test_tutorial.py does not run, each once."""
    seen: dict[str, Documented] = {}
    tutorial = by_the_tutorial_test()
    for command in every_command():
        if command.document not in BY_THE_TUTORIAL_TEST and tuple(command.argv) not in tutorial:
            seen.setdefault(command.text, command)
    return list(seen.values())


def to_run() -> list[Documented]:
    return [command for command in documented() if command.text not in EXCLUDED]


def subcommand(command: Documented) -> tuple[str, ...]:
    """The subcommand a command runs: train, ring-demo, ...; bench step, lab new, ..."""
    arguments = command.arguments
    return tuple(arguments[:2] if arguments[0] in ("bench", "study", "lab") else arguments[:1])


def in_fresh_processes() -> set[str]:
    """The commands run in a fresh Python: under mpiexec, and the first of each subcommand; the
    others run by syncsgd's main in the test's own process (the same parser, checks and run)."""
    first: dict[tuple[str, ...], str] = {}
    for command in to_run():
        first.setdefault(subcommand(command), command.text)
    mpi = {command.text for command in to_run() if command.launcher}
    return set(first.values()) | mpi


def test_the_documents_have_commands():
    documents = {command.document for command in every_command()}
    assert {"README.md", "docs/train.md", "docs/verify.md", "docs/benchmarks.md"} <= documents
    assert len(to_run()) >= 15


def test_the_tutorial_test_runs_every_command_of_its_pages():
    for document, path in BY_THE_TUTORIAL_TEST.items():
        prompted = {" ".join(command.split()) for command, _ in tutorial_commands(path)}
        written = {command.text for command in every_command() if command.document == document}
        assert written <= prompted, f"{document}: write these as `$ ` lines: {written - prompted}"


def test_every_exclusion_and_override_names_a_documented_command():
    texts = {command.text for command in documented()}
    assert set(EXCLUDED) <= texts, f"stale EXCLUDED entries: {set(EXCLUDED) - texts}"
    assert set(OVERRIDES) <= texts - set(EXCLUDED), set(OVERRIDES) - texts


def parse(arguments: list[str]) -> None:
    """Parse syncsgd's arguments with the real parser (failing the test on an error)."""
    try:
        build_parser().parse_args(arguments)
    except SystemExit as exc:
        pytest.fail(f"syncsgd {shlex.join(arguments)}: the parser refuses it ({exc.code})")


@pytest.mark.parametrize("command", every_command(), ids=lambda c: f"{c.document}:{c.text[:50]}")
def test_every_documented_command_parses(command, capsys):
    parse(command.arguments)
    if command.arguments[0] == "cluster":  # and the command it runs on the nodes
        inner = command.arguments[command.arguments.index("--") + 1 :]
        if "--levels" in command.arguments:  # no command: the level sweep's own options
            cluster_levels.sweep_arguments(inner)
        else:
            parse(inner[inner.index("syncsgd") + 1 :])
    capsys.readouterr()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """One directory for every run, in document order: later commands read earlier outputs."""
    return tmp_path_factory.mktemp("doc-commands")


def _marks(command: Documented) -> list:
    if command.launcher[:1] != ["mpiexec"]:
        return []
    # mpi_once: tests/test_mpi_launcher.py and test_bench_allreduce.py run bench allreduce under
    # mpiexec -n 2 under each library
    return [pytest.mark.mpi, pytest.mark.mpi_once,
            pytest.mark.skipif(mpiexec_path() is None, reason="needs mpiexec")]  # fmt: skip


FRESH = in_fresh_processes()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "command", [pytest.param(c, marks=_marks(c), id=c.text[:70]) for c in to_run()]
)
def test_documented_command_runs(command, workdir):
    arguments = command.arguments + shlex.split(OVERRIDES.get(command.text, ""))
    if "--fit" in arguments and not (workdir / arguments[arguments.index("--fit") + 1]).exists():
        pytest.skip("the sweep it fits was not written (its mpiexec run did not run)")
    if command.text in FRESH:
        argv = [sys.executable, "-m", "syncsgd.cli", *arguments]
        if command.launcher:
            assert command.launcher[:2] == ["mpiexec", "-n"], command.launcher
            argv = mpiexec_command(int(command.launcher[2])) + argv
        done = subprocess.run(argv, cwd=workdir, capture_output=True, text=True, timeout=240,
                              env={**os.environ, "MPLBACKEND": "Agg"})  # fmt: skip
    else:
        done = run_in_process(arguments, workdir)
    assert done.returncode == command.status, f"{command.text}\n{done.stdout}\n{done.stderr}"
    assert "Traceback" not in done.stderr
