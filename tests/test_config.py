"""TrainConfig's declarations: the parser, the config and the fingerprint agree field by field."""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import pytest

from syncsgd import TrainConfig, train
from syncsgd.cli import TrainOutputs, build_parser, config_from_options, main
from syncsgd.training.config import fingerprint
from syncsgd.util.options import GROUPS, options_of

FIELDS = [field.name for field in dataclasses.fields(TrainConfig)]
NOT_FINGERPRINTED = {"steps", "epochs", "init", "checkpoint", "checkpoint_every", "resume",
                     "bucket_bytes", "algorithm", "skip_nonfinite", "eval_every", "target_loss",
                     "target_accuracy", "noise_scale", "timeout", "overlap",
                     "zero_stage", "ranks_per_node",
                     "inter_algorithm"}  # fmt: skip  (a checkpoint resumes at any stage)
NOT_VERIFIED = {"checkpoint", "checkpoint_every", "resume", "skip_nonfinite", "ranks_per_node",
                "inter_algorithm"}  # fmt: skip


def subparser(*names: str) -> argparse.ArgumentParser:
    """The parser of the subcommand `names` (e.g. "bench", "step")."""
    parser = build_parser()
    for name in names:
        [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = commands.choices[name]
    return parser


def actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {action.dest: action for action in parser._actions if action.dest != "help"}


def test_every_field_is_declared_once_with_its_flag_default_and_group():
    declared = dict(options_of(TrainConfig))
    assert list(declared) == FIELDS  # a field without a declaration would be missing here
    train_actions, verify_actions = actions(subparser("train")), actions(subparser("verify"))
    for field in dataclasses.fields(TrainConfig):
        option = declared[field.name]
        assert option.group in GROUPS
        action = train_actions[field.name]
        assert action.option_strings == [option.flag]
        assert action.default == field.default
        assert (field.name in verify_actions) == (field.name not in NOT_VERIFIED)
        assert option.verify == (field.name not in NOT_VERIFIED)


def test_the_optimizer_options_are_sgds_declarations():
    """--momentum, --nesterov and --weight-decay: declared in syncsgd/nn/optim/sgd.py, taken as
    they are, and --optimizer offers what the registry holds."""
    from syncsgd.nn.optim import OPTIMIZERS, SGDOptions

    declared = dict(options_of(TrainConfig))
    for name, option in options_of(SGDOptions):
        assert declared[name] == option
    assert subparser("train")._option_string_actions["--optimizer"].choices == tuple(OPTIMIZERS)
    assert TrainConfig().optimizer == "sgd"


def test_the_fingerprint_leaves_out_the_fields_declared_so():
    left_out = {name for name, option in options_of(TrainConfig) if not option.fingerprint}
    assert left_out == NOT_FINGERPRINTED


def test_fingerprint_digest_is_unchanged():
    """Checkpoints written before must still resume: the digest is pinned."""
    X = np.arange(12, dtype=np.float64).reshape(4, 3) / 7
    y = np.array([0, 1, 1, 0])
    assert fingerprint(TrainConfig(), X, y, 100) == (
        "b5da9c9fb236cc7c80422ab38ff6f22f982ea0fdaef46cefcce7cb76bdb1072d"
    )
    config = TrainConfig(samples=120, features=6, hidden=(5,), batch_size=20, steps=6,
                         momentum=0.9, nesterov=True, schedule="cosine", warmup_steps=2,
                         clip_norm=1.5, pitfall="local-clip", holdout=0.25, eval_every=2,
                         exact=True, shuffle=False, dtype="float32", seed=7)  # fmt: skip
    assert fingerprint(config, X, y, 6) == (
        "f1255059a9ee43d74e25337392a3ad8a95f79feb51a4749c39922cacc92dc543"
    )
    # Options that do not determine the trajectory leave it alone.
    other = dataclasses.replace(config, steps=None, epochs=3, algorithm="tree", bucket_bytes=0,
                                target_loss=0.5, noise_scale=True)  # fmt: skip
    assert fingerprint(other, X, y, 6) == fingerprint(config, X, y, 6)


def test_the_parsed_defaults_are_the_config_defaults():
    parser = build_parser()
    assert config_from_options(parser.parse_args(["train"])) == TrainConfig()
    assert config_from_options(parser.parse_args(["verify"])) == TrainConfig()


def test_every_flag_is_read_into_its_field():
    argv = ["train", "--data", "synthetic-regression", "--samples", "50", "--features", "3",
            "--classes", "2", "--hidden", "7,5", "--activation", "tanh", "--loss", "mse",
            "--batch-size", "10", "--epochs", "2", "--lr", "0.5", "--momentum", "0.5",
            "--nesterov", "--weight-decay", "0.01", "--clip-norm", "2", "--schedule", "warmup",
            "--warmup-steps", "3", "--lr-scaling", "sqrt", "--base-batch", "5", "--seed", "4",
            "--no-shuffle", "--dtype", "float32", "--bucket-bytes", "0",
            "--algorithm", "tree", "--timeout", "7", "--exact", "--pitfall", "mean-of-means",
            "--checkpoint", "d",
            "--checkpoint-every", "2", "--resume", "r", "--skip-nonfinite", "--holdout", "0.2",
            "--eval-every", "1", "--target-loss", "0.1", "--noise-scale",
            "--precision", "bf16", "--loss-scale", "64", "--scale-window", "7",
            "--bn-eps", "0.001", "--bn-momentum", "0.2", "--overlap",
            "--batchnorm", "sync", "--accumulate", "3"]  # fmt: skip
    config = config_from_options(build_parser().parse_args(argv))
    assert config == TrainConfig(
        data="synthetic-regression", samples=50, features=3, classes=2, hidden=(7, 5),
        activation="tanh", loss="mse", batch_size=10, epochs=2, lr=0.5, momentum=0.5,
        nesterov=True, weight_decay=0.01, clip_norm=2.0, schedule="warmup", warmup_steps=3,
        lr_scaling="sqrt", base_batch=5, seed=4, shuffle=False, dtype="float32",
        bucket_bytes=0, algorithm="tree", exact=True, pitfall="mean-of-means", checkpoint="d",
        checkpoint_every=2, resume="r", skip_nonfinite=True, holdout=0.2, eval_every=1,
        target_loss=0.1, noise_scale=True, precision="bf16",
        loss_scale="64", scale_window=7, timeout=7.0, bn_eps=0.001, bn_momentum=0.2,
        overlap=True, batchnorm="sync", accumulate=3,
    )  # fmt: skip
    changed = {f.name for f in dataclasses.fields(TrainConfig)
               if getattr(config, f.name) != f.default}  # fmt: skip
    changed |= {"betas", "eps", "trust_coefficient"}  # not sgd's: read in tests/test_adam.py
    # --target-accuracy: xent only; --epochs instead of --steps; --allreduce-dtype: not with
    # --exact; --optimizer: sgd is the only one yet; --model, --input-shape: not with --hidden;
    # --labels: with IDX --data only (tests/test_image_data.py); --context: with token data only
    # (tests/test_transformer.py); --init: not with --resume (below); --zero-stage: with
    # --algorithm ring and no pitfall of the replicated step (tests/test_sharded.py);
    # --ranks-per-node, --inter-algorithm: with --algorithm hierarchical (below)
    assert changed == set(FIELDS) - {"steps", "target_accuracy", "allreduce_dtype", "optimizer",
                                     "model", "input_shape", "labels", "context",
                                     "init", "zero_stage", "ranks_per_node",
                                     "inter_algorithm"}  # fmt: skip
    nodes = ["train", "--algorithm", "hierarchical", "--ranks-per-node", "4",
             "--inter-algorithm", "rabenseifner"]  # fmt: skip
    assert config_from_options(build_parser().parse_args(nodes)) == TrainConfig(
        algorithm="hierarchical", ranks_per_node=4, inter_algorithm="rabenseifner")
    init = config_from_options(build_parser().parse_args(["train", "--init", "a.npz"]))
    assert init == TrainConfig(init="a.npz")


def test_the_model_flags_are_read_into_their_fields():
    argv = ["train", "--model", "conv(2, 3) relu flatten dense", "--input-shape", "1,4,4",
            "--features", "16"]  # fmt: skip
    config = config_from_options(build_parser().parse_args(argv))
    assert (config.model, config.input_shape) == ("conv(2, 3) relu flatten dense", (1, 4, 4))


def test_outputs_are_declared_once_too():
    train_actions = actions(subparser("train"))
    for name, option in options_of(TrainOutputs):
        assert option.group == "output" and not option.verify
        assert train_actions[name].option_strings == [option.flag]
        # verify's --json is its own: the table it prints, not a run's summary
        assert name not in actions(subparser("verify")) or name == "json"


@pytest.mark.parametrize("command", [["train"], ["verify"]])
def test_every_flag_shows_its_default(command):
    for action in actions(subparser(*command)).values():
        assert "default" in (action.help or ""), action.option_strings


@pytest.mark.parametrize(
    "argv",
    [
        ["--samples", "0"],
        ["--features", "x"],
        ["--classes", "-1"],
        ["--hidden", "64,x"],
        ["--hidden", "0"],
        ["--hidden", "64,"],
        ["--batch-size", "1.5"],
        ["--steps", "-1"],
        ["--lr", "nan"],
        ["--lr", "0"],
        ["--momentum", "-1"],
        ["--momentum", "1"],
        ["--weight-decay", "-1"],
        ["--optimizer", "rmsprop"],
        ["--clip-norm", "inf"],
        ["--activation", "sigmoid"],
        ["--schedule", "noam2"],
        ["--seed", "-1"],
        ["--bucket-bytes", "-1"],
        ["--algorithm", "ringg"],
        ["--pitfall", "none"],
        ["--holdout", "1"],
        ["--holdout", "-0.1"],
        ["--eval-every", "x"],
        ["--target-loss", "nan"],
        ["--checkpoint-every", "0"],
        ["--ranks", "0"],
        ["--backend", "tcp"],
        ["--dtype", "float16"],
    ],  # fmt: skip
    ids=" ".join,
)
def test_bad_values_exit_2_in_one_line(capsys, argv):
    with pytest.raises(SystemExit) as stop:
        main(["train", *argv])
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("syncsgd train: error: argument "), lines
    assert argv[0] in lines[0]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"samples": 0}, "--samples must be >= 1, got 0"),
        ({"batch_size": -2}, "--batch-size must be >= 1, got -2"),
        ({"base_batch": 0}, "--base-batch must be >= 1, got 0"),
        ({"steps": -1}, "--steps must be >= 0, got -1"),
        ({"classes": 0}, "--classes must be >= 1, got 0"),
        ({"seed": -1}, "--seed must be >= 0, got -1"),
        ({"dtype": "float16"}, "unknown --dtype 'float16'"),
        ({"activation": "gelu"}, "unknown --activation 'gelu'"),
        ({"loss": "hinge"}, "unknown --loss 'hinge'"),
        ({"hidden": (4, 0)}, "--hidden sizes must be >= 1: (4, 0)"),
        ({"momentum": 2.0}, "--momentum must be in [0, 1), got 2.0"),
        ({"nesterov": True}, "--nesterov needs --momentum > 0"),
        ({"weight_decay": -0.5}, "--weight-decay must be >= 0, got -0.5"),
        ({"optimizer": "rmsprop"}, "unknown --optimizer 'rmsprop': choose one of sgd, adam, "),
        ({"bucket_bytes": -1}, "--bucket-bytes must be >= 0, got -1"),
        ({"algorithm": "x"}, "unknown --algorithm 'x': choose one of ring, "),
        ({"pitfall": "x"}, "unknown --pitfall 'x': choose one of mean-of-means, "),
        ({"checkpoint_every": 0}, "--checkpoint-every must be >= 1, got 0"),
        ({"holdout": 1.0}, "--holdout must be in [0, 1), got 1.0"),
        ({"eval_every": -1}, "--eval-every must be >= 0, got -1"),
        ({"data": "imagenet"}, "unknown --data 'imagenet': use one of synthetic-classification"),
        ({"steps": 5, "epochs": 2}, "give --steps or --epochs, not both"),
        ({"pitfall": "local-clip"}, "--pitfall local-clip needs --clip-norm"),
        ({"checkpoint_every": 5}, "--checkpoint-every needs --checkpoint DIR"),
        ({"eval_every": 5}, "--eval-every and --target-loss/--target-accuracy need --holdout"),
        ({"target_accuracy": 0.9}, "--eval-every and --target-loss/--target-accuracy need"),
        (
            {"target_accuracy": 0.9, "holdout": 0.2, "loss": "mse"},
            "--target-accuracy needs --loss xent",
        ),
    ],  # fmt: skip
)
def test_the_python_api_gets_the_same_checks(options, message):
    with pytest.raises(ValueError) as error:
        TrainConfig(**options)
    assert str(error.value).startswith(message)


def test_the_python_api_keeps_its_types():
    config = TrainConfig(hidden=(32,), classes=None, pitfall=None, clip_norm=None)
    assert config.hidden == (32,) and config.classes is None and config.steps is None
    assert TrainConfig(hidden=()).hidden == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.lr = 1.0  # type: ignore[misc]


def test_the_checks_run_when_the_config_is_built_not_per_step(monkeypatch):
    built = []
    check = TrainConfig.__post_init__
    monkeypatch.setattr(TrainConfig, "__post_init__", lambda self: built.append(check(self)))
    train(ranks=2, steps=12, samples=96, features=4, hidden=(3,), batch_size=8)
    assert 1 <= len(built) <= 2  # TrainConfig() and the one with the options; not one per step


@pytest.mark.parametrize("argv", [["--debug", "train"], ["train", "--debug"]])
def test_debug_is_taken_before_or_after_the_subcommand(argv):
    assert build_parser().parse_args(argv).debug is True
    assert build_parser().parse_args(["train"]).debug is False


@pytest.mark.parametrize(
    "command",
    [
        ["train"],
        ["verify"],
        ["ring-demo"],
        ["model"],
        ["study", "batch-size"],
        ["bench", "allreduce"],
        ["bench", "step"],
    ],  # fmt: skip
)
def test_shared_options_have_one_declaration(command):
    """--ranks, --backend, --json and --debug read values alike in every subcommand."""
    taken = actions(subparser(*command))
    assert "debug" in taken
    if "backend" in taken:
        assert taken["backend"].choices == ("auto", "threads", "mpi")
    for flag, value in (("--ranks", "0"), ("--backend", "tcp")):
        if flag[2:] in taken:
            with pytest.raises(SystemExit) as stop:
                main([*command, flag, value])
            assert stop.value.code == 2
    if "json" in taken:
        assert taken["json"].metavar == "PATH"
