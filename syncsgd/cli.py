"""The `syncsgd` command line: one console script, one subcommand per job."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence

from syncsgd.util.argtypes import (
    finite_float,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
    rank_list,
)
from syncsgd.util.files import check_writable


class UniformError(ValueError):
    """An error that every rank raised alike, before any communication: reported once, by rank 0."""


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

    train = commands.add_parser(
        "train", help="synchronous data-parallel SGD on P ranks (threads, or MPI under mpiexec)",
        description="Train an MLP by synchronous data-parallel SGD; the result equals serial "
        "large-batch SGD for any number of ranks.",
    )  # fmt: skip
    add_train_arguments(train)
    train.set_defaults(run=run_train)

    check = commands.add_parser(
        "verify", help="train on P = 1, 2, 3, ... ranks and compare each with serial SGD",
        description="Train the same model on several numbers of thread ranks and compare the "
        "final parameters with the serial run: max |Δθ|, ULPs, bitwise, SHA-256, first step "
        "that differs. Exit status 1 if a run that should match does not.",
    )  # fmt: skip
    check.add_argument(
        "--ranks",
        type=rank_list,
        default=[1, 2, 3, 4, 8],
        help="numbers of ranks to compare, e.g. 1,2,3,4,8 (the default)",
    )
    check.add_argument(
        "--tolerance",
        type=positive_float,
        default=None,
        help="relative tolerance in float mode (default 1e-9 float64, 1e-4 float32)",
    )
    check.add_argument("--json", metavar="PATH", help="write the table as JSON")
    add_train_arguments(check, single_run=False)
    check.set_defaults(run=run_verify)

    from syncsgd.apps import costmodel, demo

    for module, name, summary in (
        (demo, "ring-demo", "watch every step of a ring (or another) allreduce on small integers"),
        (costmodel, "model", "the α-β-γ cost model of the allreduce algorithms; --fit a sweep"),
    ):
        first_line = (module.__doc__ or "").split("\n")[0]
        sub = commands.add_parser(name, help=summary, description=first_line)
        module.add_arguments(sub)
        sub.set_defaults(run=module.main)

    from syncsgd.apps import study

    studies = commands.add_parser("study", help="studies of the workload (batch size)")
    kinds = studies.add_subparsers(dest="study", metavar="STUDY", parser_class=_Parser)
    kinds.required = True
    batch_size = kinds.add_parser(
        "batch-size", help="steps to a target against the batch size; gradient noise scale",
        description=(study.__doc__ or "").split("\n\n")[0].replace("\n", " "),
    )  # fmt: skip
    study.add_arguments(batch_size)
    batch_size.set_defaults(run=study.main)

    bench = commands.add_parser("bench", help="benchmarks (OSU / nccl-tests style)")
    benchmarks = bench.add_subparsers(dest="benchmark", metavar="BENCHMARK", parser_class=_Parser)
    benchmarks.required = True
    from syncsgd.apps.bench import allreduce, step

    for module, name, summary in (
        (allreduce, "allreduce", "ring vs the library's Allreduce, 8 B to 64 MiB"),
        (step, "step", "training-step time split into compute, allreduce and update, P = 1..N"),
    ):
        first_line = (module.__doc__ or "").split("\n")[0]  # no docstrings under python -OO
        sub = benchmarks.add_parser(name, help=summary, description=first_line)
        module.add_arguments(sub)
        sub.set_defaults(run=module.main)
    return parser


def add_train_arguments(parser: argparse.ArgumentParser, *, single_run: bool = True) -> None:
    """The options of `syncsgd train` (SPEC §7); every one has a default.

    `single_run=False` (verify) leaves out the choice of ranks and backend, and the outputs.
    """
    from syncsgd.collectives import ALGORITHMS
    from syncsgd.nn.optim import LR_SCALINGS, SCHEDULES
    from syncsgd.training.config import DATA_SOURCES, TrainConfig
    from syncsgd.training.pitfalls import PITFALLS

    d = TrainConfig()
    run = parser.add_argument_group("ranks")
    if single_run:
        add_rank_arguments(run)
    run.add_argument(
        "--algorithm",
        choices=ALGORITHMS,
        default="ring",
        help="the allreduce algorithm (default ring)",
    )
    run.add_argument(
        "--bucket-bytes",
        type=nonnegative_int,
        default=None,
        help="allreduce buckets of about this many bytes; 0: one per layer "
        "(default: one fused allreduce)",
    )
    source = parser.add_argument_group("data and model")
    source.add_argument(
        "--data",
        default=d.data,
        metavar="NAME|PATH",
        help=f"{' | '.join(DATA_SOURCES)} | file.npz (X, y) | file.csv "
        f"(last column the target) (default {d.data})",
    )
    source.add_argument(
        "--samples",
        type=positive_int,
        default=d.samples,
        help=f"synthetic samples (default {d.samples})",
    )
    source.add_argument(
        "--features",
        type=positive_int,
        default=d.features,
        help=f"synthetic features (default {d.features})",
    )
    source.add_argument(
        "--classes",
        type=positive_int,
        default=None,
        help="classes (xent) or outputs (mse) of synthetic data (default 4 / 1)",
    )
    source.add_argument(
        "--hidden",
        default=",".join(map(str, d.hidden)),
        help='hidden layer widths, e.g. 64,64; "" for linear/softmax regression (default 64,64)',
    )
    source.add_argument("--activation", choices=("relu", "tanh"), default=d.activation)
    source.add_argument("--loss", choices=("xent", "mse"), default=d.loss)
    source.add_argument("--dtype", choices=("float64", "float32"), default=d.dtype)
    source.add_argument("--init", metavar="PATH", help="start from W0, b0, ... in this .npz")
    source.add_argument("--seed", type=nonnegative_int, default=d.seed)
    source.add_argument(
        "--no-shuffle",
        dest="shuffle",
        action="store_false",
        help="visit the samples in order every epoch",
    )
    opt = parser.add_argument_group("optimization")
    opt.add_argument(
        "--batch-size",
        type=positive_int,
        default=d.batch_size,
        help=f"global batch size, split over the ranks (default {d.batch_size})",
    )
    length = opt.add_mutually_exclusive_group()
    length.add_argument("--steps", type=positive_int, help="steps to take (default 100)")
    length.add_argument("--epochs", type=positive_int, help="epochs to take instead of --steps")
    opt.add_argument("--lr", type=positive_float, default=d.lr, help=f"(default {d.lr})")
    opt.add_argument("--momentum", type=nonnegative_float, default=d.momentum)
    opt.add_argument("--nesterov", action="store_true")
    opt.add_argument("--weight-decay", type=nonnegative_float, default=d.weight_decay)
    opt.add_argument(
        "--clip-norm",
        type=positive_float,
        default=None,
        help="clip the allreduced gradient to this global L2 norm",
    )
    opt.add_argument("--schedule", choices=SCHEDULES, default=d.schedule)
    opt.add_argument("--warmup-steps", type=nonnegative_int, default=d.warmup_steps)
    opt.add_argument(
        "--lr-scaling",
        choices=LR_SCALINGS,
        default=d.lr_scaling,
        help="scale --lr by B/base (linear) or sqrt(B/base) (default none)",
    )
    opt.add_argument(
        "--base-batch",
        type=positive_int,
        default=d.base_batch,
        help=f"the batch size --lr was tuned for (default {d.base_batch})",
    )
    held = parser.add_argument_group("evaluation")
    held.add_argument(
        "--holdout",
        type=nonnegative_float,
        default=0.0,
        help="fraction of the samples held out for evaluation (default 0)",
    )
    held.add_argument(
        "--eval-every",
        type=nonnegative_int,
        default=0,
        metavar="K",
        help="evaluate on the held-out samples every K steps (default: never)",
    )
    held.add_argument(
        "--target-loss",
        type=finite_float,
        default=None,
        help="stop once the held-out loss is at most this",
    )
    held.add_argument(
        "--target-accuracy",
        type=finite_float,
        default=None,
        help="stop once the held-out accuracy is at least this",
    )
    held.add_argument(
        "--noise-scale",
        action="store_true",
        help="estimate the gradient noise scale B_simple (needs 2+ ranks)",
    )
    repro = parser.add_argument_group("reproducibility")
    repro.add_argument(
        "--exact", action="store_true", help="bitwise the same parameters for every number of ranks"
    )
    repro.add_argument(
        "--pitfall",
        choices=PITFALLS,
        default=None,
        help="deliberately do what real systems get wrong (see syncsgd.training.pitfalls)",
    )
    if not single_run:
        return
    repro.add_argument("--checkpoint", metavar="DIR", help="write checkpoints to DIR")
    repro.add_argument(
        "--checkpoint-every",
        type=positive_int,
        metavar="K",
        help="a checkpoint every K steps (default: after the last step only)",
    )
    repro.add_argument("--resume", metavar="DIR", help="resume from DIR's latest checkpoint")
    repro.add_argument(
        "--skip-nonfinite",
        action="store_true",
        help="skip a step whose loss or gradient is not finite instead of stopping",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--save", metavar="PATH", help="write the final parameters (.npz)")
    out.add_argument("--log", metavar="PATH", help="write one JSON line per step")
    out.add_argument(
        "--timeline",
        metavar="PATH",
        help="write a Chrome trace (chrome://tracing, Perfetto): one row per rank",
    )
    out.add_argument("--quiet", action="store_true", help="print nothing but errors")  # fmt: skip


def add_rank_arguments(group: argparse._ArgumentGroup) -> None:
    """--ranks and --backend, as train and the benchmarks take them."""
    group.add_argument(
        "--ranks",
        type=positive_int,
        default=None,
        help="thread ranks (default 2); under mpiexec the world size is used",
    )
    group.add_argument(
        "--backend",
        choices=("auto", "threads", "mpi"),
        default="auto",
        help="auto: MPI under mpiexec/srun, threads otherwise (default auto)",
    )


def config_from_options(options: argparse.Namespace):  # -> TrainConfig (imported lazily)
    """The TrainConfig that the parsed options of train or verify describe."""
    from syncsgd.nn.mlp import parse_hidden
    from syncsgd.training.config import TrainConfig

    return TrainConfig(
        data=options.data, samples=options.samples, features=options.features,
        classes=options.classes, hidden=parse_hidden(options.hidden),
        activation=options.activation, loss=options.loss, batch_size=options.batch_size,
        steps=options.steps, epochs=options.epochs, lr=options.lr, momentum=options.momentum,
        nesterov=options.nesterov, weight_decay=options.weight_decay,
        clip_norm=options.clip_norm, schedule=options.schedule,
        warmup_steps=options.warmup_steps, lr_scaling=options.lr_scaling,
        base_batch=options.base_batch, seed=options.seed, shuffle=options.shuffle,
        dtype=options.dtype, init=options.init, bucket_bytes=options.bucket_bytes,
        algorithm=options.algorithm, exact=options.exact, pitfall=options.pitfall,
        checkpoint=getattr(options, "checkpoint", None),
        checkpoint_every=getattr(options, "checkpoint_every", None),
        resume=getattr(options, "resume", None),
        skip_nonfinite=getattr(options, "skip_nonfinite", False), holdout=options.holdout,
        eval_every=options.eval_every, target_loss=options.target_loss,
        target_accuracy=options.target_accuracy, noise_scale=options.noise_scale,
    )  # fmt: skip


def run_verify(options: argparse.Namespace) -> int:
    """`syncsgd verify`: the table of SPEC §6."""
    from syncsgd.apps import verify

    return verify.main(config_from_options(options), options.ranks, options.tolerance,
                       options.json)  # fmt: skip


def run_train(options: argparse.Namespace) -> int:
    """`syncsgd train`: build the configuration, load the data, train on every rank."""
    from syncsgd.comm.world import launch, resolve_backend
    from syncsgd.training.loop import prepare, train_rank

    try:
        for path in (options.save, options.log, options.timeline):
            if path is not None:
                check_writable(path)
        config = config_from_options(options)
        backend = resolve_backend(options.backend)
        problem = prepare(config)
    except ValueError as exc:
        raise UniformError(str(exc)) from exc  # every rank fails here alike
    ranks = options.ranks if options.ranks is not None or backend == "mpi" else 2
    with graceful_stop():
        [result, *_] = launch(
            train_rank, problem, backend=backend, ranks=ranks, log_path=options.log,
            save_path=options.save, timeline_path=options.timeline, quiet=options.quiet,
        )  # fmt: skip
    if result.stopped_after is not None:  # every rank stopped after the same step
        if launcher_rank() == 0:
            where = f"; checkpoint written to {config.checkpoint}" if config.checkpoint else ""
            print(f"syncsgd: interrupted after step {result.stopped_after}{where}", file=sys.stderr)
        return 130
    return 0


@contextlib.contextmanager
def graceful_stop() -> Iterator[None]:
    """First Ctrl-C or SIGTERM: every rank finishes its step, then all stop. Second: stop now."""
    from syncsgd.training.loop import stop_requested

    def request_stop(signum: int, frame: object) -> None:
        if stop_requested.is_set():
            raise KeyboardInterrupt
        stop_requested.set()
        if launcher_rank() == 0:
            print("syncsgd: stopping after this step (again to stop at once)", file=sys.stderr)

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stop_requested.clear()


def launcher_rank() -> int:
    """This process's rank as the MPI launcher announced it (0 when not launched by MPI)."""
    for name in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `syncsgd` console script."""
    options = build_parser().parse_args(argv)
    try:
        return options.run(options)
    except BrokenPipeError:  # `syncsgd ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("syncsgd: interrupted", file=sys.stderr)
        _abort_mpi_job()
        return 130
    except (ValueError, OSError, RuntimeError) as exc:
        if options.debug:
            raise
        uniform = isinstance(exc, UniformError)  # raised alike on every rank: say it once
        if not uniform or launcher_rank() == 0:
            rank = getattr(exc, "__notes__", None)
            where = f" {rank[-1]}" if rank and os.environ.get("SYNCSGD_VERBOSE_ERRORS") else ""
            print(f"syncsgd: error: {exc}{where}", file=sys.stderr)
        if not uniform:
            _abort_mpi_job()
        return 1


def _abort_mpi_job() -> None:
    """Under MPI with several ranks, end the whole job so that no rank waits forever for this."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        world = mpi.COMM_WORLD
        if world.Get_size() > 1:
            sys.stderr.flush()
            time.sleep(0.2)  # let the launcher forward our error line before it kills the job
            world.Abort(1)


if __name__ == "__main__":
    sys.exit(main())
