"""docs/reference.md, generated from the declarations: every subcommand's options as its --help
gives them, the layers, presets, losses and optimizers, and the fields of `train --json`.

    python -m syncsgd.apps.reference > docs/reference.md     # or: --write (the same file)

tests/test_docs.py regenerates the text and compares it with the committed file.
"""

from __future__ import annotations

import argparse
import html
import inspect
import re
import sys
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference.md"
COMMAND = "python -m syncsgd.apps.reference --write"

# The keys of `train --json` that are not scalar fields of TrainResult (syncsgd/training/result.py,
# `document`), and what each holds.
JSON_EXTRAS = {
    "ranks": "the number of ranks (the world size under MPI)",
    "backend": "`threads` or `mpi`",
    "losses": "the global batch's mean loss before each step",
    "evals": "the held-out evaluations: `{step, loss, accuracy}`, `step` counting the steps done",
    "skipped_steps": "the steps skipped (`--skip-nonfinite`, or by the loss scaler)",
    "params_sha256": "the SHA-256 of the final flat parameter buffer's bytes (verify's SHA-256)",
    "loss_scales": "the loss scale per step (with loss scaling only)",
    "noise_scales": "the running estimate of the noise scale per step (`--noise-scale` only)",
    "null_because": "why a field is null, where the reason is not plain",
}


def cell(text: str) -> str:
    """`text` in one cell of a markdown table: one line, its pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def code(text: str) -> str:
    """`text` as inline code in a table cell (empty stays empty): an HTML <code> element, whose
    pipes are entities (a backslash-escaped pipe inside backticks shows its backslash in mkdocs)."""
    if not text:
        return ""
    if "|" not in text:
        return f"`{cell(text)}`"
    escaped = html.escape(" ".join(str(text).split()), quote=False).replace("|", "&#124;")
    return f"<code>{escaped}</code>"


def subcommands(parser: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, Any]]:
    """(command line, parser) of every leaf subcommand under `parser`, in declaration order."""
    found = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not found:
        yield path, parser
        return
    for name, sub in found[0].choices.items():
        yield from subcommands(sub, f"{path} {name}")


def default_text(action: argparse.Action) -> str:
    """The default of an option as Python holds it (what `--help`'s text names in words)."""
    value = action.default
    if action.nargs == 0:  # a flag: off unless given
        return "off"
    if value is argparse.SUPPRESS:
        return ""
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value)) or '""'
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def option_rows(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """One table row: flags, value, default, help (as --help expands it)."""
    formatter = parser._get_formatter()
    flags = ", ".join(action.option_strings) or (action.metavar or action.dest)
    value = ""
    if action.option_strings and action.nargs != 0:
        value = formatter._format_args(action, formatter._get_default_metavar_for_optional(action))
    helped = formatter._expand_help(action) if action.help else ""
    return f"| {code(str(flags))} | {code(value)} | {code(default_text(action))} | {cell(helped)} |"


def command_section(line: str, parser: argparse.ArgumentParser) -> list[str]:
    """The section of one subcommand: its description, then a table per group of options."""
    out = [f"## `{line}`", ""]
    if parser.description:
        out += [cell(parser.description), ""]
    out += [f"Usage: `{line} [options]`; `{line} --help` prints the same options.", ""]
    for group in parser._action_groups:
        shown = [a for a in group._group_actions
                 if a.help is not argparse.SUPPRESS
                 and not isinstance(a, (argparse._HelpAction, argparse._VersionAction))
                 and a.dest != "debug"]  # fmt: skip
        if not shown:
            continue
        title = group.title or "options"
        out += [f"### {title}", "", "| option | value | default value | help |",
                "|---|---|---|---|"]
        out += [option_rows(parser, action) for action in shown]
        out.append("")
    return out


def commands() -> list[str]:
    """Every subcommand's section."""
    from syncsgd.cli import build_parser

    parser = build_parser()
    out = [
        "## Every command",
        "",
        "`syncsgd --debug COMMAND ...` (or `--debug` after any subcommand) shows the traceback "
        "of an error; `syncsgd --version` prints the version.",
        "",
    ]
    for line, _ in subcommands(parser, "syncsgd"):
        out += [f"- [`{line}`](#{anchor(line)})"]
    out.append("")
    for line, sub in subcommands(parser, "syncsgd"):
        out += command_section(line, sub)
    return out


def anchor(line: str) -> str:
    """The anchor mkdocs gives the heading `` `line` ``."""
    return re.sub(r"[^a-z0-9 -]", "", line.lower()).strip().replace(" ", "-")


def layers() -> list[str]:
    """The layer catalogue, the presets and the losses."""
    from syncsgd.nn.losses import registry
    from syncsgd.nn.network import catalogue
    from syncsgd.nn.presets import PRESETS, preset_help

    out = ["## Layers (`--model`)", "",
           "A `--model` spec is layers separated by spaces, each `name` or `name(args)`. "
           "From `syncsgd.nn.network.catalogue()`, one file per layer in `syncsgd/nn/layers/`:",
           "", "| layer | what it computes | file |", "|---|---|---|"]  # fmt: skip
    for entry in catalogue().values():
        out.append(f"| {code(entry.signature)} | {cell(entry.summary)} | "
                   f"`syncsgd/nn/layers/{entry.module}.py` |")  # fmt: skip
    out += ["", "## Presets", "", "From `syncsgd/nn/presets.py`:", "",
            "| preset | layers |", "|---|---|"]  # fmt: skip
    for name, spec in PRESETS.items():
        out.append(f"| `{name}` | {code(spec)} |")
    gpt = preset_help().rsplit("; ", 1)[-1]
    name, _, spec = gpt.partition(" = ")
    out += [f"| {code(name)} | {cell(spec)} |", ""]
    out += ["## Losses (`--loss`)", "", "From `syncsgd.nn.losses.registry()`:", "",
            "| loss | targets | what it computes |", "|---|---|---|"]  # fmt: skip
    for loss in registry().values():
        targets = "integer class labels" if loss.labels else "float target rows"
        out.append(f"| `{loss.kind}` | {targets} | {cell(loss.summary)} |")
    out.append("")
    return out


def optimizers() -> list[str]:
    """The optimizers, their own options, the schedules and the learning-rate scalings."""
    from syncsgd.nn.optim import LR_SCALINGS, OPTIMIZERS, SCHEDULES
    from syncsgd.util.options import options_of

    out = ["## Optimizers (`--optimizer`)", "", "From `syncsgd.nn.optim.OPTIMIZERS`; an option "
           "of another optimizer is refused:", "", "| optimizer | what it does | its options |",
           "|---|---|---|"]  # fmt: skip
    for name, cls in OPTIMIZERS.items():
        summary = (cls.__doc__ or "").strip().split("\n")[0]
        flags = ", ".join(f"`{declared.flag}`" for _, declared in options_of(cls.Options))
        out.append(f"| `{name}` | {cell(summary)} | {flags} |")
    out += ["", f"Schedules (`--schedule`): {', '.join(f'`{s}`' for s in SCHEDULES)}. "
            f"Learning-rate scalings (`--lr-scaling`): "
            f"{', '.join(f'`{s}`' for s in LR_SCALINGS)}.", ""]  # fmt: skip
    return out


def result_comments() -> dict[str, str]:
    """The comment beside each field of TrainResult in its source, by field name."""
    from syncsgd.training.result import TrainResult

    comments = {}
    for line in inspect.getsource(TrainResult).splitlines():
        found = re.match(r"\s+(\w+): [^#=]+(?:=[^#]*)?#\s*(.*)$", line)
        if found:
            comments[found.group(1)] = found.group(2)
    return comments


def json_fields() -> list[str]:
    """The keys of `syncsgd train --json`: TrainResult's scalar fields and the extras."""
    from syncsgd.training.result import SCALARS, TrainResult

    comments = result_comments()
    out = ["## `train --json` fields", "",
           "Every scalar field of `syncsgd.TrainResult` (`syncsgd/training/result.py`), then the "
           "arrays and the digest. A number that is not finite is `null`.", "",
           "| key | type | what it holds |", "|---|---|---|"]  # fmt: skip
    for item in fields(TrainResult):
        kinds = {part.strip() for part in str(item.type).split("|")}
        if kinds <= SCALARS:
            out.append(f"| `{item.name}` | {code(str(item.type))} | "
                       f"{cell(comments.get(item.name, ''))} |")  # fmt: skip
    for key, meaning in JSON_EXTRAS.items():
        out.append(f"| `{key}` | | {cell(meaning)} |")
    out.append("")
    return out


def render() -> str:
    """The whole of docs/reference.md."""
    out = [
        "# Reference",
        "",
        f"<!-- Generated by `{COMMAND}` from the declarations (syncsgd/cli.py, the layers, "
        "presets, losses, optimizers and TrainResult); do not edit by hand. -->",
        "",
        "Generated from the code: the options are those `--help` prints, the layers those "
        "`--model` accepts. Regenerate with `" + COMMAND + "`. The default value is what the "
        "parser holds when an option is not given (`None`: decided later, as the help says; "
        "`off`: a flag).",
        "",
    ]
    out += commands() + layers() + optimizers() + json_fields()
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    """Print the reference, or with --write replace docs/reference.md with it."""
    parser = argparse.ArgumentParser(prog="python -m syncsgd.apps.reference",
                                     description=(__doc__ or "").split("\n\n")[0])  # fmt: skip
    parser.add_argument("--write", action="store_true", help=f"write {REFERENCE.name} in docs/")
    options = parser.parse_args(argv)
    text = render()
    if options.write:
        REFERENCE.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
