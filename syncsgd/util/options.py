"""Command-line options declared once: flag, help with its default, value type, group and check."""

from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any, cast

from syncsgd.util.argtypes import nonnegative_float, positive_int, rank_list
from syncsgd.util.figures import FORMATS, figure_path, require_matplotlib
from syncsgd.util.files import check_paths, check_suffix

Check = Callable[[str, Any], "str | None"]  # (flag, value) -> what is wrong, or None if fine

GROUPS = ("ranks", "data and model", "optimization", "evaluation", "reproducibility", "output")


@dataclasses.dataclass(frozen=True)
class Option:
    """One command-line option: how argparse reads it and, for a config field, what it means."""

    flag: str  # "" for a config field: "--" and the field's name with dashes (--no-x for x=True)
    help: str
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # for add_argument
    group: str = ""  # one of GROUPS
    fingerprint: bool = True  # whether it determines the trajectory (part of the fingerprint)
    verify: bool = True  # whether `syncsgd verify` takes it too
    check: Check | None = None  # the check of a value given in Python, not on the command line
    role: str | None = None  # for a path: one of ROLES (what the command does with it)
    about: str = ""  # the help without its default, for a subcommand that changes the default

    def add(self, parser: Any, **overrides: Any) -> argparse.Action:
        """Declare this option to a parser or argument group; `overrides` replace its arguments."""
        arguments: dict[str, Any] = {"help": self.help, **self.kwargs, **overrides}
        action = parser.add_argument(self.flag, **arguments)
        return action if self.role is None else path_role(action, self.role)

    def changed(self, default: Any, shown: str | None = None) -> dict[str, Any]:
        """The `add` overrides that give this option another default, its help saying which."""
        told = f"default: {shown}" if shown is not None else f"default {show(default)}"
        return {"default": default, "help": f"{self.about or self.help} ({told})"}

    def error(self, value: Any) -> str | None:
        """Why `value` is not a valid value of this option, or None if it is."""
        return None if self.check is None else self.check(self.flag, value)


def option(
    default: Any,
    help: str,
    *,
    group: str,
    type: Callable[[str], Any] | None = None,
    choices: Sequence[str] | None = None,
    list_choices: bool = False,
    check: Check | None = None,
    metavar: str | None = None,
    shown: str | None = None,
    fingerprint: bool = True,
    verify: bool = True,
    role: str | None = None,
) -> Any:
    """A dataclass field that is also a command-line option; `shown`: how help shows the default."""
    assert group in GROUPS, group
    assert shown is not None or default is not None, "say what a None default means"
    kwargs: dict[str, Any] = {"default": default}
    if isinstance(default, bool):
        kwargs["action"] = "store_false" if default else "store_true"
    for name, value in (("type", type), ("choices", choices), ("metavar", metavar)):
        if value is not None:
            kwargs[name] = value
    if choices is not None and check is None:
        check = one_of(choices, listed=list_choices, optional=default is None)
    told = f"default: {shown}" if shown is not None else f"default {show(default)}"
    declared = Option("", f"{help} ({told})", kwargs, group,
                      fingerprint, verify, check, role, help)  # fmt: skip
    return dataclasses.field(default=default, metadata={"option": declared})


def option_from(cls: type, name: str) -> Any:
    """A new dataclass field declaring the option of field `name` of dataclass `cls` as it is."""
    [declared] = [field for field in dataclasses.fields(cls) if field.name == name]
    return dataclasses.field(default=declared.default, metadata=declared.metadata)


def show(default: Any) -> str:
    """A default value as the help text shows it."""
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, tuple):
        return ",".join(map(str, default)) or '""'
    if isinstance(default, float):
        return f"{default:g}"
    return str(default)


_DECLARED: dict[type, tuple[tuple[str, Option], ...]] = {}


def options_of(cls: type) -> tuple[tuple[str, Option], ...]:
    """(field name, its option) for every field of dataclass `cls` declared with `option`."""
    if cls not in _DECLARED:
        _DECLARED[cls] = tuple(_declared(cls))
    return _DECLARED[cls]


def _declared(cls: type) -> Iterator[tuple[str, Option]]:
    for field in dataclasses.fields(cls):
        found = field.metadata.get("option")
        if found is not None:
            negated = found.kwargs.get("action") == "store_false"
            flag = found.flag or "--" + ("no-" if negated else "") + field.name.replace("_", "-")
            kwargs = {**found.kwargs, "dest": field.name}
            yield field.name, dataclasses.replace(found, flag=flag, kwargs=kwargs)


# How a subcommand changes one option it takes from a dataclass: a new default (its help then
# shows it: "shown", how), new add_argument arguments ("help", "type", ...), or the argument
# group to put it in ("group": e.g. a mutually exclusive group of the subcommand's).
Change = Mapping[str, Any]


def add_options(
    parser: argparse.ArgumentParser,
    cls: type,
    groups: dict[str, Any],
    keep: Callable[[Option], bool] = lambda option: True,
    *,
    exclude: Collection[str] = (),
    changes: Mapping[str, Change] | None = None,
) -> None:
    """Declare every option of dataclass `cls` but the fields `exclude` names (and those `keep`
    drops), each in its group of `groups` (made on first use); `changes`: per field, what the
    subcommand declares differently (see Change)."""
    changes = changes or {}
    names = {name for name, _ in options_of(cls)}
    unknown = sorted((set(exclude) | set(changes)) - names)
    assert not unknown, f"not options of {cls.__name__}: {unknown}"
    assert not set(exclude) & set(changes), "an excluded option is not declared: no change"
    for name, declared in options_of(cls):
        if name in exclude or not keep(declared):
            continue
        change = dict(changes.get(name, {}))
        group = change.pop("group", None)
        if group is None:
            if declared.group not in groups:
                groups[declared.group] = parser.add_argument_group(declared.group)
            group = groups[declared.group]
        declared.add(group, **_overrides(declared, change))


def _overrides(declared: Option, change: dict[str, Any]) -> dict[str, Any]:
    """The add_argument arguments of a Change: a new default comes with help that shows it."""
    shown = change.pop("shown", None)
    if "default" in change and "help" not in change:
        return {**change, **declared.changed(change["default"], shown)}
    assert shown is None, "shown: how the help shows a changed default"
    return change


def from_options(cls: type, options: argparse.Namespace, **values: Any) -> Any:
    """An instance of dataclass `cls` from parsed options, `values` replacing theirs; fields the
    parser lacks keep their defaults."""
    given = vars(options)
    taken = {name: given[name] for name, _ in options_of(cls) if name in given}
    return cls(**{**taken, **values})


def errors(instance: Any) -> Iterator[str]:
    """What is wrong with each field of a dataclass instance, field by field: its type, then
    its check (a value of the wrong type given in Python gets one clear line too)."""
    annotations = {field.name: field.type for field in dataclasses.fields(instance)}
    for name, declared in options_of(type(instance)):
        value = getattr(instance, name)
        error = type_error(declared.flag, value, str(annotations[name])) or declared.error(value)
        if error is not None:
            yield error


# The annotations of option fields, and what a value of each must be.
_KINDS: dict[str, tuple[tuple[type, ...], str]] = {
    "int": ((numbers.Integral,), "an integer"),
    "float": ((numbers.Real,), "a number"),
    "str": ((str,), "a string"),
    "bool": ((bool,), "True or False"),
    "None": ((type(None),), "None"),
    "tuple[int, ...]": ((tuple, list), "a tuple of integers"),
}


def type_error(flag: str, value: Any, annotation: str) -> str | None:
    """Why `value` does not have the annotated type (e.g. 'int | None'), or None if it has."""
    kinds = [kind.strip() for kind in annotation.split("|")]
    if any(kind not in _KINDS for kind in kinds):
        return None  # a type this check does not know
    for kind in kinds:
        if _is_kind(value, kind):
            if kind == "float" and not math.isfinite(value):
                return f"{flag} must be a finite number, got {value!r}"
            return None
    wanted = " or ".join(_KINDS[kind][1] for kind in kinds)
    return f"{flag} must be {wanted}, not {value!r}"


def _is_kind(value: Any, kind: str) -> bool:
    """Whether `value` is of the annotated `kind` (a bool is not a number here)."""
    types, _ = _KINDS[kind]
    if not isinstance(value, types) or (kind in ("int", "float") and isinstance(value, bool)):
        return False
    if kind == "tuple[int, ...]":
        return all(_is_kind(item, "int") for item in cast(Sequence[Any], value))
    return True


def at_least(low: int) -> Check:
    """The check of a number >= `low` (None passes: it means the option was not given)."""

    def check(flag: str, value: Any) -> str | None:
        return None if value is None or value >= low else f"{flag} must be >= {low}, got {value}"

    return check


def one_of(choices: Sequence[str], *, listed: bool = False, optional: bool = False) -> Check:
    """The check of a value among `choices` (`listed`: error names them; `optional`: None too)."""

    def check(flag: str, value: Any) -> str | None:
        if value in choices or (optional and value is None):
            return None
        among = f": choose one of {', '.join(choices)}" if listed else ""
        return f"unknown {flag} {value!r}{among}"

    return check


# -- paths: what each subcommand reads and writes, declared with its option --------------------

# What a command does with the path an option names; `check_paths` checks them all before any
# work, so every option that names a file or directory declares one of these.
ROLES = ("reads", "writes", "writes_into", "checkpoints")


def path_role(action: argparse.Action, role: str,
              suffixes: tuple[str, ...] = (), what: str = "") -> argparse.Action:  # fmt: skip
    """Declare that the option of `action` names a path the command uses as `role`; an output
    in one format declares its `suffixes` (".html",) and `what` it is ("an HTML page"): a name
    ending otherwise is refused before any work (check_declared_paths)."""
    assert role in ROLES, role
    assert not suffixes or role == "writes", "a suffix names the format of a file written"
    action.path_role = role  # type: ignore[attr-defined]
    action.path_suffixes = (tuple(suffixes), what)  # type: ignore[attr-defined]
    return action


def reads(action: argparse.Action) -> argparse.Action:
    """Declare an option that names a file (or directory) the command reads."""
    return path_role(action, "reads")


def writes(action: argparse.Action, suffixes: tuple[str, ...] = (),
           what: str = "") -> argparse.Action:  # fmt: skip
    """Declare an option that names a file the command writes (atomically, replacing it); with
    `suffixes`, a file in one format whose name must end in one of them (path_role)."""
    return path_role(action, "writes", suffixes, what)


def writes_into(action: argparse.Action) -> argparse.Action:
    """Declare an option that names a directory the command writes files into."""
    return path_role(action, "writes_into")


def draws(action: argparse.Action) -> argparse.Action:
    """Declare an option whose output matplotlib draws (figure_path options and outputs named
    .png, .svg or .pdf are known to)."""
    action.draws = True  # type: ignore[attr-defined]
    return action


def drawn(action: argparse.Action) -> bool:
    """Whether matplotlib draws the output of `action`'s option."""
    suffixes = getattr(action, "path_suffixes", ((), ""))[0]
    return (getattr(action, "draws", False) or action.type is figure_path
            or any(suffix.lstrip(".") in FORMATS for suffix in suffixes))  # fmt: skip


def declared_paths(parser: argparse.ArgumentParser,
                   options: argparse.Namespace) -> dict[str, dict[str, str | None]]:  # fmt: skip
    """{role: {flag: path}} for every path option `parser` declares, as `options` give them."""
    found: dict[str, dict[str, str | None]] = {role: {} for role in ROLES}
    for action in parser._actions:
        role = getattr(action, "path_role", None)
        if role is not None:
            found[role][action.option_strings[0]] = getattr(options, action.dest, None)
    return found


def check_declared_paths(parser: argparse.ArgumentParser, options: argparse.Namespace) -> None:
    """Before any work: the paths of every declared option are safe to use (files.check_paths),
    every output in one format is named with its extension, and matplotlib is there to draw
    the figures asked for."""
    check_paths(**declared_paths(parser, options))
    for action in parser._actions:
        suffixes, what = getattr(action, "path_suffixes", ((), ""))
        if suffixes:
            check_suffix(action.option_strings[0], getattr(options, action.dest, None),
                         suffixes, what)  # fmt: skip
    for action in parser._actions:
        if drawn(action) and getattr(options, action.dest, None) is not None:
            try:
                require_matplotlib(action.option_strings[0])
            except RuntimeError as exc:
                raise ValueError(str(exc)) from None


# -- options that several subcommands take, declared once ---------------------------------------

RANKS = Option(
    "--ranks",
    "thread ranks (default 2); under mpiexec the world size is used",
    {"type": positive_int, "default": None},
)
RANK_COUNTS = Option("--ranks", "numbers of ranks, e.g. 1,2,4", {"type": rank_list})
BACKEND = Option(
    "--backend",
    "auto: MPI under mpiexec/srun, threads otherwise (default auto)",
    {"choices": ("auto", "threads", "mpi"), "default": "auto"},
)
JSON = Option("--json", "write the results as JSON (default: none)", {"metavar": "PATH"},
              role="writes")  # fmt: skip
TIMEOUT = Option(
    "--timeout",
    "end the job when a collective makes no progress for SECONDS; 0: never (default 600)",
    {"type": nonnegative_float, "default": 600.0, "metavar": "SECONDS"},
)
DEBUG = Option("--debug", "show tracebacks of errors (default off)", {"action": "store_true"})
