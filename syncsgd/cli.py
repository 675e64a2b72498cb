"""The `syncsgd` command line: one console script, one subcommand per job."""

from __future__ import annotations

import os
import signal
import sys

_RANK_VARIABLES = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")


def _exit_at_once(signum: int, frame: object) -> None:
    """A signal while the command is still importing: one line (once per job), its status."""
    if all(os.environ.get(name, "0") in ("", "0") for name in _RANK_VARIABLES):
        os.write(2, b"syncsgd: interrupted\n")
    os._exit(128 + signum)  # nothing is written yet: nothing to undo


if __name__ == "__main__" or os.path.basename(sys.argv[0]) == "syncsgd":  # the command itself
    for _signum in (signal.SIGINT, signal.SIGTERM):  # before the imports below take their time
        signal.signal(_signum, _exit_at_once)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import io  # noqa: E402
import re  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable, Iterator, Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

from syncsgd.util.argtypes import positive_float  # noqa: E402
from syncsgd.util.figures import figure_path  # noqa: E402
from syncsgd.util.lines import print_line  # noqa: E402
from syncsgd.util.options import (  # noqa: E402
    BACKEND,
    DEBUG,
    GROUPS,
    JSON,
    RANK_COUNTS,
    RANKS,
    add_options,
    check_declared_paths,
    option,
)
from syncsgd.util.signals import handling  # noqa: E402

OUTPUT = "output"


class UniformError(ValueError):
    """An error that every rank raised alike, before any communication: reported once, by rank 0."""

    uniform = True


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad option in one line (no usage dump) and exits with status 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # A value that starts with '-' and a digit (-1,4 or -1e-3) is a value, not an unknown
        # option: its option's type then names what is wrong with it.
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> None:  # type: ignore[override]
        text = f"{message} (see --help)"
        if job_size() > 1:  # the other ranks may be waiting to start: tell them, print once
            text = agreed_text(text)
            if launcher_rank() != 0:
                self.exit(2)
        self.exit(2, f"{self.prog}: error: {text}\n")


def agreed_text(error: str | None) -> str:
    """Under MPI: the one line every rank agrees on (naming the rank if not every rank had it)."""
    try:
        from syncsgd.training.run import agree

        agree(mpi_world_within(STARTUP_TIMEOUT), error)
    except ValueError as exc:  # the agreed error
        return str(exc)
    except (ImportError, RuntimeError):  # no mpi4py: nothing to agree with
        pass
    return error or ""


def job_size() -> int:
    """The number of processes the MPI launcher started (1 when not launched by MPI)."""
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 1


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand."""
    parser = _Parser(
        prog="syncsgd",
        description="A reference simulator of synchronous data-parallel SGD "
        "with a hand-written ring allreduce.",
    )
    DEBUG.add(parser)
    parser.add_argument("--version", action="version", version=f"syncsgd {_version()}")
    commands = _subcommands(parser, "command", "COMMAND")
    train = _command(
        commands, "train", run_train,
        "synchronous data-parallel SGD on P ranks (threads, or MPI under mpiexec)",
        "Train a network - an MLP of --hidden widths, or any --model spec: conv nets, "
        "GPTs - by synchronous data-parallel SGD; the result equals serial large-batch SGD "
        "for any number of ranks.",
    )  # fmt: skip
    add_train_arguments(train)
    train.set_defaults(mpi=True)  # under mpiexec, every rank takes part
    check = _command(
        commands, "verify", run_verify,
        "train on P = 1, 2, 3, ... ranks and compare each with serial SGD",
        "Train the same model on several numbers of thread ranks and compare the final "
        "parameters with the serial run: max |Δθ|, ULPs, bitwise, SHA-256, first step that "
        "differs. Exit status 1 if a run that should match does not.",
    )  # fmt: skip
    add_verify_arguments(check)
    _add_apps(commands)
    return parser


def _version() -> str:
    """The installed package's version (the source tree's when it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("syncsgd")
    except PackageNotFoundError:
        return "(not installed)"


def _add_apps(commands: argparse._SubParsersAction) -> None:
    """The subcommands that the modules of syncsgd.apps implement."""
    from syncsgd.apps import cluster, costmodel_parts, demo, lab, study
    from syncsgd.apps.bench import allreduce, collective, step

    for module, name, summary in (
        (demo, "ring-demo", "watch every step of a ring (or another) allreduce on small integers"),
        (costmodel_parts, "model", "the α-β-γ cost model of the collectives; --fit a sweep"),
        (cluster, "cluster", "run an MPI command on N emulated nodes with shaped links (root)"),
        (lab, "lab", "students write a collective (lab new), syncsgd grades it (lab check)"),
    ):
        module.add_arguments(_command(commands, name, module.main, summary, _first_line(module)))
    studies = commands.add_parser("study", help="studies of the workload (batch size)")
    DEBUG.add(studies, default=argparse.SUPPRESS)  # `syncsgd study --debug batch-size` too
    batch_size = _command(
        _subcommands(studies, "study", "STUDY"), "batch-size", study.main,
        "steps to a target against the batch size; gradient noise scale",
        (study.__doc__ or "").split("\n\n")[0].replace("\n", " "),
    )  # fmt: skip
    study.add_arguments(batch_size)
    bench = commands.add_parser("bench", help="benchmarks (OSU / nccl-tests style)")
    DEBUG.add(bench, default=argparse.SUPPRESS)
    benchmarks = _subcommands(bench, "benchmark", "BENCHMARK")
    for module, name, summary in (
        (allreduce, "allreduce", "ring vs the library's Allreduce, 8 B to 64 MiB"),
        (collective, "collective", "broadcast, reduce, allgather, ... vs the library's own"),
        (step, "step", "training-step time split into compute, allreduce and update, P = 1..N"),
    ):
        sub = _command(benchmarks, name, module.main, summary, _first_line(module))
        sub.set_defaults(mpi=True)  # under mpiexec, every rank takes part
        module.add_arguments(sub)


def _first_line(module: object) -> str:
    """The first line of a module's docstring (none under python -OO)."""
    return (getattr(module, "__doc__", None) or "").split("\n")[0]


def _subcommands(parser: argparse.ArgumentParser, dest: str, metavar: str) -> Any:
    """The required subcommands of `parser`."""
    commands = parser.add_subparsers(dest=dest, metavar=metavar, parser_class=_Parser)
    commands.required = True
    return commands


def _command(
    commands: Any, name: str, run: Callable[[argparse.Namespace], int], summary: str, about: str
) -> argparse.ArgumentParser:
    """A subcommand that runs `run`; it takes --debug too (after its name)."""
    sub: argparse.ArgumentParser = commands.add_parser(name, help=summary, description=about)
    DEBUG.add(sub, default=argparse.SUPPRESS)  # unset unless given: `syncsgd --debug` still counts
    sub.set_defaults(run=run, command_parser=sub)  # its declared paths and settings: start_up
    return sub


def output(default: Any, help: str, **declared: Any) -> Any:
    """An output of train: not part of the fingerprint, not taken by verify; a path is written."""
    shown = "none" if default is None else None
    role = "writes" if default is None else None
    return option(default, help, group=OUTPUT, shown=shown, fingerprint=False, verify=False,
                  role=role, **declared)  # fmt: skip


@dataclass(frozen=True)
class TrainOutputs:
    """What `syncsgd train` writes: the outputs, which do not change the run."""

    save: str | None = output(
        None, "write the final parameters (.npz); with --steps 0 the initial ones", metavar="PATH"
    )
    json: str | None = output(
        None, "write the run's summary as JSON: its figures, losses, evaluations, the "
        "parameters' SHA-256", metavar="PATH",
    )  # fmt: skip
    log: str | None = output(None, "write one JSON line per step", metavar="PATH")
    timeline: str | None = output(
        None, "write a Chrome trace (chrome://tracing, Perfetto): one row per rank", metavar="PATH"
    )
    timeline_png: str | None = output(
        None, "draw the timeline as a Gantt chart, a row per rank, on a slide: .png, .svg or "
        ".pdf", metavar="PATH", type=figure_path,
    )  # fmt: skip
    quiet: bool = output(False, "print nothing but errors (and the digest, with --digest)")
    digest: bool = output(False, "print the SHA-256 of the final parameters' bytes, as verify "
                          "and --json's params_sha256 give it: equal digests, equal bits")


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `syncsgd train`, from the declarations of TrainConfig and TrainOutputs."""
    from syncsgd.training.config import add_train_options

    groups = {name: parser.add_argument_group(name) for name in GROUPS}
    RANKS.add(groups["ranks"])
    BACKEND.add(groups["ranks"])
    add_train_options(parser, groups)
    add_options(parser, TrainOutputs, groups)


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `syncsgd verify`: the train options that verify takes (all but those
    declared verify=False: checkpoints and --skip-nonfinite), and its own."""
    from syncsgd.training.config import add_train_options

    RANK_COUNTS.add(parser, default=[1, 2, 3, 4, 8],
                    help="numbers of ranks to compare, e.g. 1,2,3,4,8 (the default)")  # fmt: skip
    parser.add_argument(
        "--tolerance",
        type=positive_float,
        default=None,
        help="relative tolerance in float mode (default 1e-9 float64, 1e-4 float32; "
        "--precision bf16|fp16: u sqrt(T) / 4 for the format's unit roundoff u over T steps)",
    )
    JSON.add(parser, help="write the table as JSON (default: none)")
    groups = {name: parser.add_argument_group(name) for name in GROUPS if name != "output"}
    add_train_options(parser, groups, keep=lambda declared: declared.verify)
    from syncsgd.apps.verify import allow_all
    from syncsgd.apps.verify_grid import add_grid_arguments

    allow_all(parser)  # --pitfall all: every pitfall, a row each
    add_grid_arguments(parser)  # --algorithms, ..., --report: every combination


def config_from_options(options: argparse.Namespace):  # -> TrainConfig (imported lazily)
    """The TrainConfig that the parsed options of train or verify describe."""
    from syncsgd.training.config import config_of

    return config_of(options)


def run_verify(options: argparse.Namespace) -> int:
    """`syncsgd verify`: the table of max |Δθ|, ULPs and digests against the serial run."""
    from syncsgd.apps import verify

    return verify.run_options(options, config_from_options)


def run_train(options: argparse.Namespace) -> int:
    """`syncsgd train`: build the configuration, load the data, train on every rank."""
    from syncsgd.comm.world import launch, resolve_backend
    from syncsgd.training.loop import prepare, train_rank

    backend = resolve_backend(options.backend)
    error = None
    try:
        config = config_from_options(options)
        ranks_here = job_size() if backend == "mpi" else options.ranks or 2
        if config.noise_scale and ranks_here < 2:  # the API returns None; a command says why
            raise ValueError("--noise-scale needs 2 or more ranks (it compares their gradients)")
        if backend == "mpi" and options.ranks not in (None, ranks_here):
            raise ValueError(f"--ranks {options.ranks} disagrees with the MPI world size "
                             f"{ranks_here} (mpiexec -n decides; leave --ranks out)")  # fmt: skip
        problem = prepare(config, ranks_here if backend == "threads" else 1)
    except (ValueError, OSError, MemoryError) as exc:
        error = one_line(exc)
    if backend == "mpi":  # before any other communication: no rank waits for one that failed
        from syncsgd.comm.world import mpi_world
        from syncsgd.training.run import agree

        agree(mpi_world(), error)
    elif error is not None:
        raise UniformError(error)  # thread ranks: one process, one error
    ranks = options.ranks if options.ranks is not None or backend == "mpi" else 2
    with graceful_stop(), _trace_path(options) as trace:
        [result, *_] = launch(
            train_rank, problem, backend=backend, ranks=ranks, log_path=options.log,
            save_path=options.save, timeline_path=trace, json_path=options.json,
            quiet=options.quiet,
        )  # fmt: skip
        if options.timeline_png and trace and result.stopped_after is None:
            _draw_timeline(trace, options.timeline_png, options.quiet)
    _print_digest(options, result)
    if result.stopped_after is not None:  # every rank stopped after the same step
        if launcher_rank() == 0:
            where = f"; checkpoint written to {config.checkpoint}" if config.checkpoint else ""
            print(f"syncsgd: interrupted after step {result.stopped_after}{where}", file=sys.stderr)
        return 130
    return 0


def one_line(exc: BaseException) -> str:
    """An error in one line that names the file an OSError is about (not '[Errno 2] ...')."""
    if isinstance(exc, MemoryError):
        return f"out of memory{': ' + str(exc) if str(exc) else ''}"
    if isinstance(exc, OSError) and exc.strerror:
        where = exc.filename if exc.filename is not None else ""
        return f"{where}: {exc.strerror}" if where != "" else exc.strerror
    return str(exc)


@contextlib.contextmanager
def _trace_path(options: argparse.Namespace) -> Iterator[str | None]:
    """Where train writes its Chrome trace: --timeline, or a scratch file for --timeline-png."""
    if options.timeline or not options.timeline_png:
        yield options.timeline
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="syncsgd-trace-") as scratch:
        yield os.path.join(scratch, "trace.json")


def _print_digest(options: argparse.Namespace, result: Any) -> None:
    """--digest: rank 0 prints the SHA-256 of the final parameters (not after an interruption)."""
    if options.digest and result.stopped_after is None and launcher_rank() == 0:
        from syncsgd.training.result import sha256

        print(f"parameters' SHA-256: {sha256(result.params)}")


def _draw_timeline(trace: str, png: str, quiet: bool) -> None:
    """Rank 0 draws the trace it wrote as a Gantt chart."""
    if launcher_rank() != 0:
        return
    from syncsgd.training.timeline import draw_gantt_file

    draw_gantt_file(trace, png, "syncsgd train: compute, allreduce steps, update per rank")
    if not quiet:
        print(f"wrote {png}")


STOP_GRACE = 1.0  # seconds a step may take to end after a stop was requested


@contextlib.contextmanager
def graceful_stop(grace: float = STOP_GRACE) -> Iterator[None]:
    """First Ctrl-C or SIGTERM: every rank finishes its step, then all stop; a step that has not
    ended `grace` seconds later (many micro-batches), or a second signal: stop now."""
    from syncsgd.training.hooks import stop_agreed, stop_requested

    timers: list[threading.Timer] = []

    def stop_now_unless_agreed(signum: int) -> None:
        if not stop_agreed.is_set():
            os.kill(os.getpid(), signum)  # as a second signal (handled in the main thread)

    def request_stop(signum: int, frame: object) -> None:
        if stop_requested.is_set():
            raise KeyboardInterrupt
        stop_requested.set()
        timers.append(threading.Timer(grace, stop_now_unless_agreed, (signum,)))
        timers[-1].daemon = True
        timers[-1].start()
        if launcher_rank() == 0:
            print(f"syncsgd: stopping after this step, or in {grace:g} s if it is not over by then "
                  "(again to stop at once)", file=sys.stderr)  # fmt: skip

    try:
        with handling((signal.SIGINT, signal.SIGTERM), request_stop):
            yield
    finally:
        for timer in timers:
            timer.cancel()
        stop_requested.clear()
        stop_agreed.clear()


def launcher_rank() -> int:
    """This process's rank as the MPI launcher announced it (0 when not launched by MPI)."""
    for name in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM before a command installs its own handlers: stop at once."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stop_at_once(signum: int, frame: object) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def stopping_at_once() -> Iterator[None]:
    """SIGINT and SIGTERM raise Interrupted inside the block (in the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with handling((signal.SIGINT, signal.SIGTERM), _stop_at_once):
        yield


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `syncsgd` console script."""
    try:
        with stopping_at_once():  # from the first line on: a signal is one line, not a traceback
            return _main(argv)
    except KeyboardInterrupt as stop:
        signum = getattr(stop, "signum", signal.SIGINT)
        if launcher_rank() == 0:  # every rank was signalled: one line per job
            print_line("syncsgd: interrupted")
        _abort_mpi_job()
        return 128 + signum


def _main(argv: Sequence[str] | None) -> int:
    """Parse, agree on the job, check its paths, run the subcommand; errors as one line."""
    quiet = launcher_rank() != 0 and job_size() > 1  # --help and --version: once per job
    try:
        with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
            options = build_parser().parse_args(argv)
    except SystemExit as done:
        if done.code == 0 and job_size() > 1:  # --help or --version: no rank may wait for this one
            try:
                agree_on_job({"command": "syncsgd --help or --version"}, None)
            except ValueError as exc:
                report(exc, False)
                return 2
        raise
    options.argv = list(sys.argv[1:] if argv is None else argv)  # the command, for reports
    if not options.debug:  # an overflow is reported by the run, in one line, with its step
        warnings.simplefilter("ignore", RuntimeWarning)
    try:
        start_up(options)
        if launcher_rank() != 0 and not getattr(options, "mpi", False):
            return 0  # a command on thread ranks, started by mpiexec: rank 0 runs it, once per job
        if options.debug and launcher_rank() == 0:  # before the run: a wrong core type crashes it
            from syncsgd.nn.blas import describe

            print(f"syncsgd: debug: kernels' BLAS: {describe()}", file=sys.stderr, flush=True)
        return options.run(options)
    except BrokenPipeError:  # `syncsgd ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, OSError, RuntimeError, MemoryError) as exc:
        report(exc, options.debug)
        return 1


# -- before any work: the paths each subcommand declares, and one agreement per MPI job ---------

UNAGREED = ("debug", "quiet")  # settings that change nothing the ranks compute or exchange
STARTUP_TIMEOUT = 600.0  # seconds the ranks wait for each other at start-up, without --timeout


def start_up(options: argparse.Namespace) -> None:
    """Before any work: rank 0 (which writes the outputs) checks every declared path; under
    mpiexec, every rank runs the same subcommand with the same settings, or none runs it."""
    error = None
    if launcher_rank() == 0:
        try:
            check_declared_paths(options.command_parser, options)
            if getattr(options, "data", None) is not None:  # a data set read from an extra's wheel
                from syncsgd.training.data import check_data_extra

                check_data_extra(options.data)
        except (ValueError, OSError) as exc:
            error = one_line(exc)
    if job_size() > 1:
        processes = agree_on_job(settings_of(options), error, getattr(options, "timeout", None))
        if options.debug and launcher_rank() == 0 and processes:  # a launcher names a dead one
            listed = "; ".join(f"rank {rank} {where}" for rank, where in enumerate(processes))
            print_line(f"syncsgd: debug: the ranks' processes: {listed}")  # by its pid
    elif error is not None:
        raise UniformError(error)


def settings_of(options: argparse.Namespace) -> dict[str, str]:
    """The subcommand and the value of each of its options, as text the ranks compare.

    Not the inputs' paths: a file is compared by its contents where it matters (train's
    fingerprint), and a rank that cannot read its copy reports that itself, naming its rank.
    """
    parser: argparse.ArgumentParser = options.command_parser
    settings = {"command": parser.prog}
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        if action.dest not in UNAGREED and getattr(action, "path_role", None) != "reads":
            name = action.option_strings[0] if action.option_strings else action.dest
            settings[name] = shown(getattr(options, action.dest, None))
    return settings


def shown(value: Any) -> str:
    """A parsed option's value as an error message shows it."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return "not given" if value is None else str(value)


def agree_on_job(settings: dict[str, str], error: str | None,
                 timeout: float | None = None) -> list[str]:  # fmt: skip
    """Under MPI: raise the same AgreedError on every rank if any rank has an `error`, or if
    the ranks' `settings` differ (naming the first setting that differs and the ranks).
    A rank that never arrives ends the job after `timeout` seconds (None: the default 600).
    Returns each rank's process, "pid 123 on node" (none without mpi4py)."""
    seconds = STARTUP_TIMEOUT if timeout is None else timeout
    try:
        world = mpi_world_within(seconds)
    except RuntimeError:  # no mpi4py: this process is its own job
        if error is not None:
            raise UniformError(error) from None
        return []
    import socket

    from syncsgd.comm.watchdog import collective_timeout, watching
    from syncsgd.training.run import AgreedError, agree

    with collective_timeout(world, seconds):
        agree(world, error)
        with watching("the start-up agreement (allgather)"):
            everyone = world.allgather((settings, f"pid {os.getpid()} on {socket.gethostname()}"))
    mismatch = settings_mismatch([their_settings for their_settings, _ in everyone])
    if mismatch is not None:
        raise AgreedError(mismatch)
    return [process for _, process in everyone]


INIT_STAGGER = 1.0  # seconds each rank waits beyond the one below it when MPI_Init never ends


def mpi_world_within(seconds: float) -> Any:
    """COMM_WORLD, initialising MPI; if MPI_Init does not finish within `seconds` (a rank that
    never started, or stopped before it: MPI_Init waits for every rank), end this process.

    MPI_Init holds the GIL, so no thread of ours can act meanwhile: a forked child watches it.
    The ranks cannot talk yet: rank r waits `INIT_STAGGER` s longer than rank r - 1, so the
    lowest waiting rank prints the one line and ends, and the launcher ends the others.
    """
    from syncsgd.comm.world import mpi_world

    mpi = sys.modules.get("mpi4py.MPI")
    if not seconds or (mpi is not None and mpi.Is_initialized()) or not hasattr(os, "fork"):
        return mpi_world()
    rank = launcher_rank()
    line = (f"syncsgd: error: rank {rank}: MPI_Init did not finish in {seconds:g} s (--timeout): "
            "a rank did not start, or stopped before it; ending the job\n").encode()
    import select  # before the fork: the child imports nothing

    done, watched = os.pipe()
    with warnings.catch_warnings():  # 3.12+ warns of fork beside threads (BLAS's): see above
        warnings.simplefilter("ignore", DeprecationWarning)
        child = os.fork()
    if child == 0:  # the watcher: only system calls, no locks another thread may have held
        os.close(watched)
        if not select.select([done], [], [], seconds + INIT_STAGGER * rank)[0]:
            os.write(2, line)
            os.kill(os.getppid(), signal.SIGKILL)  # the only signal it cannot be deaf to
        os._exit(0)
    os.close(done)
    try:
        return mpi_world()
    finally:
        os.close(watched)  # the watcher reads the end of the pipe: MPI_Init returned
        os.waitpid(child, 0)


def settings_mismatch(everyone: list[dict[str, str]]) -> str | None:
    """The first setting the ranks differ in, as one line; None if they all agree."""
    names = list(dict.fromkeys(name for settings in everyone for name in settings))
    for name in names:
        values = [settings.get(name, "not taken") for settings in everyone]
        if len(set(values)) == 1:
            continue
        ranks: dict[str, list[str]] = {}
        for rank, value in enumerate(values):
            ranks.setdefault(value, []).append(str(rank))
        where = ", ".join(
            f"{value} on rank{'s' * (len(on) > 1)} {','.join(on)}" for value, on in ranks.items()
        )
        if name == "command":
            return f"the ranks run different commands: {where}; start every rank with the same one"
        return (f"the ranks were started with different options: {name} {where}; start every "
                f"rank with the same command")  # fmt: skip
    return None


def report(exc: BaseException, debug: bool) -> None:
    """One line on stderr (the traceback with --debug); an error of this rank alone ends the job."""
    if debug:
        traceback.print_exc()
    uniform = getattr(exc, "uniform", False)  # known to every rank: say it once
    if not debug and (not uniform or launcher_rank() == 0):
        rank = getattr(exc, "__notes__", None)
        where = f" {rank[-1]}" if rank and os.environ.get("SYNCSGD_VERBOSE_ERRORS") else ""
        alone = f"rank {launcher_rank()}: " if not uniform and job_size() > 1 else ""
        print_line(f"syncsgd: error: {alone}{one_line(exc)}{where}")
    if not uniform:
        _abort_mpi_job()


def _abort_mpi_job() -> None:
    """Under MPI with several ranks, end the whole job so that no rank waits forever for this."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        world = mpi.COMM_WORLD
        if world.Get_size() > 1:
            from syncsgd.comm.watchdog import end_job

            end_job(world)


if __name__ == "__main__":
    sys.exit(main())
