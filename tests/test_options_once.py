"""A train option is declared once, as a field of TrainConfig: `syncsgd train`, `verify`,
`bench step` and `study batch-size` all take it, build their TrainConfig with it, and their ranks
agree on it at start-up under mpiexec.

The seam: every parser and every config of those subcommands reads the module attribute
`syncsgd.training.config.TrainConfig` when it is built (`add_train_options`, `config_of`), so a
subclass with one more field, put there, is what a new option in TrainConfig would be.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from syncsgd.apps import study
from syncsgd.apps.bench import step
from syncsgd.cli import build_parser, config_from_options, settings_mismatch, settings_of
from syncsgd.training import config
from syncsgd.util.argtypes import positive_int
from syncsgd.util.options import option, options_of

FLAG = "--pour-over"
COMMANDS = {  # each subcommand that trains: its words, and the options its tests need
    "train": (["train"], []),
    "verify": (["verify"], []),
    "bench step": (["bench", "step"], []),
    "study": (["study", "batch-size"], ["--quick"]),
}


@pytest.fixture
def extended(monkeypatch: pytest.MonkeyPatch) -> type:
    """TrainConfig with one more option, --pour-over N, declared as every train option is."""
    declared = option(7, "a train option that the test adds", group="optimization",
                      type=positive_int)  # fmt: skip
    cls = dataclasses.make_dataclass("TrainConfig", [("pour_over", "int", declared)],
                                     bases=(config.TrainConfig,), frozen=True)  # fmt: skip
    monkeypatch.setattr(config, "TrainConfig", cls)
    return cls


def subparser(words: list[str]) -> argparse.ArgumentParser:
    parser = build_parser()
    for word in words:
        [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = commands.choices[word]
    return parser


def built_config(name: str, options: argparse.Namespace) -> config.TrainConfig:
    """The TrainConfig that subcommand `name` builds from its parsed options."""
    if name == "bench step":
        return step.train_config(options, 8)
    if name == "study":
        return study.workload(study.resolve(options))
    return config_from_options(options)


@pytest.mark.parametrize("name", COMMANDS)
def test_a_new_train_option_is_an_option_of_every_subcommand_that_trains(extended, name):
    words, needed = COMMANDS[name]
    action = subparser(words)._option_string_actions.get(FLAG)
    assert action is not None, f"{name} does not take {FLAG}"
    assert (action.dest, action.default, action.type) == ("pour_over", 7, positive_int)
    assert action.help == "a train option that the test adds (default 7)"

    options = build_parser().parse_args([*words, *needed, FLAG, "3"])
    built = built_config(name, options)
    assert type(built) is extended and built.pour_over == 3
    default = built_config(name, build_parser().parse_args([*words, *needed]))
    assert default.pour_over == 7


@pytest.mark.parametrize("name", COMMANDS)
def test_the_ranks_agree_on_a_new_train_option_at_start_up(extended, name):
    words, needed = COMMANDS[name]
    ours = settings_of(build_parser().parse_args([*words, *needed, FLAG, "3"]))
    theirs = settings_of(build_parser().parse_args([*words, *needed, FLAG, "4"]))
    assert ours[FLAG] == "3" and theirs[FLAG] == "4"
    assert f"{FLAG} 3 on rank 0, 4 on rank 1" in (settings_mismatch([ours, theirs]) or "")


@pytest.mark.parametrize(("words", "module"), [(["bench", "step"], step),
                                               (["study", "batch-size"], study)])  # fmt: skip
def test_every_train_option_is_taken_as_train_declares_it_or_excluded(words, module):
    """No hand-declared copy: a train option here has train's flag, type, choices and help; its
    default is train's unless the subcommand says otherwise (step.CHANGES, study.PRESET)."""
    taken = subparser(words)._option_string_actions
    train = subparser(["train"])._option_string_actions
    changed = set(getattr(module, "CHANGES", {})) | set(getattr(module, "PRESET", ()))
    for name, declared in options_of(config.TrainConfig):
        if name in module.NOT_TAKEN:
            assert module.NOT_TAKEN[name], f"{declared.flag}: say why it is not taken"
            assert taken.get(declared.flag) is None or taken[declared.flag].dest != name or (
                name in ("overlap", "bucket_bytes"))  # bench step's own, of the same names
            continue
        ours, theirs = taken[declared.flag], train[declared.flag]
        assert (ours.dest, ours.choices, ours.metavar) == (theirs.dest, theirs.choices,
                                                          theirs.metavar)  # fmt: skip
        if name not in changed:
            assert (ours.default, ours.type, ours.help) == (theirs.default, theirs.type,
                                                            theirs.help)  # fmt: skip


def test_bench_steps_own_overlap_and_buckets_do_not_reach_its_training_runs():
    """bench step's --overlap and --bucket-bytes name its --overlap section, not train's."""
    options = build_parser().parse_args(["bench", "step", "--overlap", "--bucket-bytes", "64"])
    built = step.train_config(options, 8)
    assert (built.overlap, built.bucket_bytes) == (False, None)


def test_a_train_option_that_the_bare_loop_does_not_follow_skips_the_overhead_check():
    options = build_parser().parse_args(["bench", "step", "--momentum", "0.9"])
    assert step.unlike_bare_loop(step.train_config(options, 8)) == ["--momentum"]
    assert step.unlike_bare_loop(step.train_config(build_parser().parse_args(
        ["bench", "step", "--lr", "0.5", "--seed", "3"]), 8)) == []  # fmt: skip
