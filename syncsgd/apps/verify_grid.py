"""`syncsgd verify` over a grid: every combination of ranks, algorithm, precision, mode,
micro-batches and optimizer, each run compared with the serial run of its own configuration.

    syncsgd verify --ranks 1,2,3,4 --algorithms ring,tree --precisions fp32,bf16 \\
        --modes float,exact --report r.html --json r.json --png r.png

The table is the verify table, one block per configuration (verify.main_grid runs them); --json
holds one record per run, --report a self-contained page with the heatmap (rows:
configurations, columns: P) and --png/--svg/--pdf the heatmap alone (verify_report.py draws
both).
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import shlex
import sys
from dataclasses import asdict, replace
from typing import Any

from syncsgd.collectives import ALGORITHMS
from syncsgd.nn.optim import OPTIMIZERS
from syncsgd.training.config import PRECISIONS, TrainConfig
from syncsgd.util.argtypes import comma_list, nonnegative_int, positive_int
from syncsgd.util.options import writes

MODES = ("float", "exact")
# The grid's lists: (flag, the TrainConfig field each entry sets, its choices or None, metavar)
AXES = (
    ("algorithms", "algorithm", ALGORITHMS, "ring,tree"),
    ("precisions", "precision", PRECISIONS, "fp32,bf16"),
    ("modes", "exact", MODES, "float,exact"),
    ("accumulates", "accumulate", None, "1,4"),
    ("optimizers", "optimizer", tuple(OPTIMIZERS), "sgd,adam"),
    ("zero-stages", "zero_stage", None, "0,1"),
)
FIGURES = ("png", "svg", "pdf")  # --png/--svg/--pdf: the heatmap alone


def choices_list(choices: tuple[str, ...], example: str) -> Any:
    """An argparse type: a comma list whose entries are among `choices`."""

    def parse(text: str) -> list[str]:
        def entry(part: str) -> str:
            if part not in choices:
                raise argparse.ArgumentTypeError(
                    f"{part!r} is not one of {', '.join(choices)}")  # fmt: skip
            return part

        return list(dict.fromkeys(comma_list(text, entry, example)))

    return parse


def add_grid_arguments(parser: argparse.ArgumentParser) -> None:
    """verify's grid lists and report outputs."""
    grid = parser.add_argument_group("grid (each list replaces its one option; every "
                                     "combination runs)")  # fmt: skip
    for flag, field, choices, example in AXES:
        number = nonnegative_int if field == "zero_stage" else positive_int  # stage 0: replicated
        kind = choices_list(choices, example) if choices else (
            lambda text, example=example, number=number: list(dict.fromkeys(
                comma_list(text, number, example))))  # fmt: skip
        single = "--exact" if field == "exact" else f"--{field.replace('_', '-')}"
        grid.add_argument(f"--{flag}", type=kind, default=None, metavar=example.upper(),
                          help=f"comma list, e.g. {example} (default: {single}'s)")  # fmt: skip
    writes(grid.add_argument("--report", metavar="PATH.html", default=None,
                             help="a self-contained page: the heatmap, where each run first "
                             "left serial SGD, the command, the versions and the machine "
                             "(default: none)"), (".html", ".htm"), "an HTML page")  # fmt: skip
    for kind in FIGURES:
        writes(grid.add_argument(f"--{kind}", metavar=f"PATH.{kind}", default=None,
                                 help=f"the heatmap alone, as {kind.upper()} (default: "
                                 "none)"), (f".{kind}",),
               f"{'an' if kind == 'svg' else 'a'} {kind.upper()} figure")  # fmt: skip


def dest(flag: str) -> str:
    """Where argparse keeps a grid list: --zero-stages in zero_stages."""
    return flag.replace("-", "_")


def wants_grid(options: argparse.Namespace) -> bool:
    """Whether verify runs the grid: a list or a report output was given."""
    given = [getattr(options, dest(flag), None) for flag, *_ in AXES]
    outputs = [getattr(options, name, None) for name in ("report", *FIGURES)]
    return any(value is not None for value in given + outputs)


def configurations(config: TrainConfig, options: argparse.Namespace) -> list[TrainConfig]:
    """Every combination of the lists (a missing list: the one option's value), in order;
    ValueError naming the first combination the options refuse."""
    axes = []
    for flag, field, _, _ in AXES:
        values = getattr(options, dest(flag), None)
        if values is None:
            values = [mode_of(config)] if field == "exact" else [getattr(config, field)]
        if field == "exact":
            values = [value == "exact" for value in values]
        axes.append([(field, value) for value in values])
    configs = []
    for combination in itertools.product(*axes):
        try:
            configs.append(replace(config, **dict(combination)))
        except ValueError as exc:
            named = label(replace_unchecked(config, dict(combination)))
            raise ValueError(f"{named}: {exc}") from None
    return configs


def replace_unchecked(config: TrainConfig, fields: dict[str, Any]) -> dict[str, Any]:
    """The grid fields of `config` with `fields` set, for naming a refused combination."""
    return {**{field: getattr(config, field) for _, field, _, _ in AXES}, **fields}


def mode_of(config: TrainConfig | dict[str, Any]) -> str:
    """float or exact (of a configuration, its fields, or a run's record)."""
    if isinstance(config, dict) and "mode" in config:
        return str(config["mode"])
    exact = config["exact"] if isinstance(config, dict) else config.exact
    return "exact" if exact else "float"


def label(config: TrainConfig | dict[str, Any]) -> str:
    """A configuration's row name: algorithm, precision, mode, K, optimizer (and the ZeRO
    stage, when sharded)."""
    fields = config if isinstance(config, dict) else asdict(config)
    stage = f" ZeRO-{fields['zero_stage']}" if fields.get("zero_stage") else ""
    return (f"{fields['algorithm']} {fields['precision']} {mode_of(fields)} "
            f"K={fields['accumulate']} {fields['optimizer']}{stage}")  # fmt: skip


def record(config: TrainConfig, row: Any, tolerance: float) -> dict[str, Any]:
    """One run of the grid as the JSON and the report hold it (None where a field is n/a)."""
    return {
        "ranks": row.ranks, "algorithm": config.algorithm, "precision": config.precision,
        "mode": mode_of(config), "accumulate": config.accumulate,
        "optimizer": config.optimizer, "zero_stage": config.zero_stage,
        "bitwise": row.bitwise_equal, "max_ulp": row.max_ulps,
        "rel_diff": row.relative_diff, "sha256": row.sha256,
        "first_diff_step": row.first_difference, "first_diff_param": row.first_parameter,
        "max_abs_diff": row.max_abs_diff, "sign_flips": row.sign_flips,
        "tolerance": None if config.exact else tolerance, "matches": row.matches,
    }  # fmt: skip


def versions() -> dict[str, str | None]:
    """syncsgd's, NumPy's, Numba's; the MPI library: none, the ranks are threads."""
    import numba
    import numpy as np

    return {"syncsgd": syncsgd_version(), "numpy": np.__version__, "numba": numba.__version__,
            "python": platform.python_version(),
            "mpi": None}  # verify runs thread ranks: no MPI library takes part  # fmt: skip


def syncsgd_version() -> str:
    """The installed package's version (the source tree's when it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("syncsgd")
    except PackageNotFoundError:
        from syncsgd import __version__

        return __version__


def machine() -> dict[str, Any]:
    """The CPU, its cores, the operating system."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info
                        if line.startswith("model name")), cpu)  # fmt: skip
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {"cpu": cpu, "cores": os.cpu_count(), "usable_cores": usable,
            "system": platform.platform(), "architecture": platform.machine()}  # fmt: skip


def command_line(options: argparse.Namespace) -> str:
    """The command as typed: syncsgd and its arguments."""
    return shlex.join(["syncsgd", *getattr(options, "argv", sys.argv[1:])])


def check_outputs(options: argparse.Namespace) -> None:
    """Every output writable and distinct, before any run (ValueError otherwise)."""
    from syncsgd.util.files import check_paths

    check_paths(writes={f"--{name}": getattr(options, name, None)
                        for name in ("json", "report", *FIGURES)})  # fmt: skip
