"""The Adam family (adam, adamw, lamb, lars): against the plain-NumPy oracle and torch.optim,
bitwise for any P in exact mode, checkpoint and resume, and the one-line refusals."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import replace

import numpy as np
import pytest
from conftest import run_in_process
from oracle import serial_sgd

from syncsgd import TrainConfig, train
from syncsgd.nn.optim import (
    LAMB,
    LARS,
    SGD,
    Adam,
    AdamW,
    OptimConfig,
    make_optimizer,
)
from syncsgd.training.loop import prepare

TINY = TrainConfig(samples=90, features=5, hidden=(6, 4), batch_size=30, steps=5, seed=2,
                   lr=0.01)  # fmt: skip

FAMILY = ["adam", "adamw", "lamb", "lars"]

# (optimizer, options): each optimizer alone, with weight decay, clipping and schedules
CASES = [
    ("adam", {}),
    ("adam", {"weight_decay": 0.05, "betas": (0.8, 0.99), "eps": 1e-6}),
    ("adam", {"clip_norm": 0.05, "schedule": "noam", "warmup_steps": 2, "lr": 0.5}),
    ("adamw", {}),  # PyTorch's default weight decay 0.01
    ("adamw", {"weight_decay": 0.1, "clip_norm": 0.05, "schedule": "cosine", "warmup_steps": 2}),
    ("lamb", {}),
    ("lamb", {"weight_decay": 0.01, "schedule": "warmup", "warmup_steps": 3, "clip_norm": 0.05}),
    ("lars", {"lr": 1.0}),
    ("lars", {"lr": 2.0, "momentum": 0.9, "weight_decay": 1e-3, "trust_coefficient": 0.01}),
    ("lars", {"lr": 20.0, "momentum": 0.5, "schedule": "noam", "warmup_steps": 2,
              "clip_norm": 0.05}),
]  # fmt: skip


def case_id(case) -> str:
    name, options = case
    return " ".join([name, *(f"{key}={value}" for key, value in options.items())])


def max_relative_difference(ours: dict, theirs: dict) -> float:
    """max |ours - theirs| over all parameters, relative to max(1, max |theirs|)."""
    scale = max(1.0, max(float(np.abs(v).max(initial=0)) for v in theirs.values()))
    return max(float(np.abs(ours[k] - theirs[k]).max(initial=0)) for k in theirs) / scale


def oracle_for(config: TrainConfig) -> tuple[dict, list[float]]:
    """The serial oracle on the same data, first parameters and options as `config`."""
    run = prepare(config)
    init = run.model.to_arrays(run.model.init_params(config.seed))
    decay = config.weight_decay
    if decay is None:  # the optimizer's default
        decay = 0.01 if config.optimizer == "adamw" else 0.0
    return serial_sgd(
        run.X, run.y, init, hidden_activation=config.activation, loss=config.loss,
        steps=run.steps, batch_size=config.batch_size, seed=config.seed, shuffle=config.shuffle,
        lr=config.lr, momentum=config.momentum, weight_decay=decay, clip_norm=config.clip_norm,
        schedule=config.schedule, warmup_steps=config.warmup_steps, lr_scaling=config.lr_scaling,
        base_batch=config.base_batch, noam_dim=run.optim.noam_dim, dtype=np.dtype(config.dtype),
        optimizer=config.optimizer, betas=config.betas, eps=config.eps,
        trust_coefficient=config.trust_coefficient,
    )  # fmt: skip


def configured(name: str, options: dict, **more) -> TrainConfig:
    return TrainConfig(**{**TINY.__dict__, "optimizer": name, **options, **more})


# --- against the oracle, and bitwise for any P in exact mode ------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[case_id(case) for case in CASES])
def test_each_optimizer_matches_the_oracle_on_1_and_3_ranks(case):
    config = configured(*case)
    theirs, their_losses = oracle_for(config)
    for ranks in (1, 3):
        result = train(config, ranks=ranks)
        ours = result.arrays()
        assert max_relative_difference(ours, theirs) <= 1e-12, ranks
        np.testing.assert_allclose(result.losses, their_losses, rtol=1e-12, atol=0)


@pytest.mark.parametrize("case", CASES[1::2], ids=[case_id(case) for case in CASES[1::2]])
def test_exact_mode_is_bitwise_for_p_1_2_3(case):
    config = configured(*case, exact=True)
    first = train(config, ranks=1)
    for ranks in (2, 3):
        other = train(config, ranks=ranks)
        assert other.params.tobytes() == first.params.tobytes(), ranks
        assert other.losses == first.losses


def test_float32_runs_close_to_the_oracle():
    config = configured("adamw", {"weight_decay": 0.1}, dtype="float32")
    theirs, _ = oracle_for(config)
    assert max_relative_difference(train(config, ranks=2).arrays(), theirs) <= 1e-5


# --- against torch.optim ------------------------------------------------------------------------

SHAPES = [(4, 3), (3,), (3, 2), (2,)]


@pytest.mark.parametrize(
    ("ours", "name", "options"),
    [
        (Adam, "Adam", {}),
        (Adam, "Adam", {"weight_decay": 0.1, "betas": (0.5, 0.9), "eps": 1e-3}),
        (AdamW, "AdamW", {}),
        (AdamW, "AdamW", {"weight_decay": 0.3, "betas": (0.6, 0.95), "eps": 1e-4}),
    ],
)
def test_adam_and_adamw_equal_torch_optim(ours, name, options):
    torch = pytest.importorskip("torch", reason="PyTorch is the reference of Adam and AdamW")
    rng = np.random.default_rng(7)
    layout, offset = [], 0
    for index, shape in enumerate(SHAPES):
        layout.append((f"t{index}", shape, offset))
        offset += int(np.prod(shape))
    start = rng.standard_normal(offset)
    lr = 0.05
    tensors = [torch.tensor(start[o : o + int(np.prod(s))].reshape(s).copy(), requires_grad=True)
               for _, s, o in layout]  # fmt: skip
    reference = getattr(torch.optim, name)(tensors, lr=lr, **options)
    optimizer = ours(OptimConfig(lr=lr), offset, np.float64, ours.Options(**options), layout)
    params = start.copy()
    for step in range(6):
        grad = rng.standard_normal(offset) * 10.0 ** rng.integers(-6, 1, size=offset)
        grad[step] = 0.0  # a zero gradient: its v stays small, ε decides
        for tensor, (_, shape, o) in zip(tensors, layout, strict=True):
            tensor.grad = torch.tensor(grad[o : o + int(np.prod(shape))].reshape(shape).copy())
        reference.step()
        optimizer.step_(params, grad.copy(), step)
        theirs = np.concatenate([tensor.detach().numpy().ravel() for tensor in tensors])
        np.testing.assert_allclose(params, theirs, rtol=1e-12, atol=1e-15)
    state = optimizer.state_arrays()
    their_state = [reference.state[tensor] for tensor in tensors]
    assert int(state["step"]) == int(their_state[0]["step"]) == 6
    for key in ("exp_avg", "exp_avg_sq"):
        theirs = np.concatenate([s[key].numpy().ravel() for s in their_state])
        np.testing.assert_allclose(state[key], theirs, rtol=1e-12, atol=0)


# --- the per-tensor optimizers ------------------------------------------------------------------


def test_lamb_and_lars_scale_each_tensor_by_its_own_norms():
    layout = [("a", (2,), 0), ("b", (2,), 2)]
    grad = np.array([1.0, 0.0, 0.0, 0.0])  # tensor b: zero gradient
    params = np.array([3.0, 4.0, 0.0, 0.0])  # tensor b: zero parameters
    lars = LARS(OptimConfig(lr=1.0), 4, np.float64, LARS.Options(trust_coefficient=0.5), layout)
    lars.step_(params, grad.copy(), 0)
    # a: local rate 0.5 * 5 / 1 = 2.5; b: both norms 0, rate 1, and its gradient is 0
    assert params.tolist() == [3.0 - 2.5, 4.0, 0.0, 0.0]
    params = np.array([3.0, 4.0, 0.0, 0.0])
    lamb = LAMB(OptimConfig(lr=0.1), 4, np.float64, None, layout)
    lamb.step_(params, np.array([1.0, -1.0, 2.0, 0.0]), 0)
    # first step: Adam's direction is sign(g) (up to ε); a: ratio 5 / √2; b: θ = 0, ratio 1
    np.testing.assert_allclose(params, [3 - 0.5 / 2**0.5, 4 + 0.5 / 2**0.5, -0.1, 0.0],
                               rtol=1e-7)  # fmt: skip


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_local_trust_ratios_are_serial_on_one_rank_and_not_on_three(name):
    """The mean of per-rank ratios is not the ratio of the mean; on one rank they are one."""
    config = configured(name, {"lr": 0.5} if name == "lars" else {})
    serial = train(config, ranks=1).params
    pitfall = replace(config, pitfall="local-trust-ratio")
    np.testing.assert_array_equal(train(pitfall, ranks=1).params, serial)
    assert np.abs(train(config, ranks=3).params - serial).max() <= 1e-12
    assert np.abs(train(pitfall, ranks=3).params - serial).max() > 1e-6


def test_a_layout_must_tile_the_buffer():
    with pytest.raises(ValueError, match="covers 3 of 4"):
        LAMB(OptimConfig(), 4, np.float64, None, [("a", (3,), 0)])
    with pytest.raises(ValueError, match="does not follow"):
        LARS(OptimConfig(), 4, np.float64, None, [("a", (2,), 0), ("b", (2,), 1)])


def test_sgd_ignores_the_layout_and_stays_bitwise():
    rng = np.random.default_rng(3)
    start, grads = rng.standard_normal(10), rng.standard_normal((3, 10))
    results = []
    for layout in (None, [("a", (4,), 0), ("b", (6,), 4)]):
        sgd = make_optimizer("sgd", OptimConfig(lr=0.1), 10, np.float64,
                             TrainConfig(momentum=0.9, weight_decay=0.01), layout)  # fmt: skip
        assert isinstance(sgd, SGD)
        params = start.copy()
        for step, grad in enumerate(grads):
            sgd.step_(params, grad.copy(), step)
        results.append(params.tobytes())
    assert results[0] == results[1]


@pytest.mark.parametrize("name", FAMILY)
def test_state_arrays_round_trip(name):
    config = TrainConfig(optimizer=name, momentum=0.9 if name == "lars" else 0.0)
    made = [make_optimizer(name, OptimConfig(lr=0.01), 6, np.float64, config) for _ in range(2)]
    rng = np.random.default_rng(0)
    params = [rng.standard_normal(6)] * 2
    params = [p.copy() for p in params]
    grads = rng.standard_normal((4, 6))
    for step in range(2):
        made[0].step_(params[0], grads[step].copy(), step)
    made[1].load_state_arrays(made[0].state_arrays())
    params[1][:] = params[0]
    for step in range(2, 4):
        for optimizer, values in zip(made, params, strict=True):
            optimizer.step_(values, grads[step].copy(), step)
    assert params[0].tobytes() == params[1].tobytes()
    if name != "lars":
        assert sorted(made[0].state_arrays()) == ["exp_avg", "exp_avg_sq", "step"]
        with pytest.raises(ValueError, match="'step'"):
            made[1].load_state_arrays({})


# --- checkpoint and resume ----------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILY)
def test_resume_is_bitwise_the_uninterrupted_run(tmp_path, name):
    config = configured(name, {"steps": 6, "momentum": 0.9 if name == "lars" else 0.0,
                               "lr": 1.0 if name == "lars" else 0.01})  # fmt: skip
    whole = train(config, ranks=2, checkpoint=str(tmp_path / "a"), checkpoint_every=3)
    os.makedirs(tmp_path / "b")
    checkpoint = "ckpt-00000003.npz"
    shutil.copy(tmp_path / "a" / checkpoint, tmp_path / "b" / checkpoint)
    with np.load(tmp_path / "b" / checkpoint) as saved:
        kept = sorted(key for key in saved.files if key.startswith("optimizer."))
    expected = ["velocity"] if name == "lars" else ["exp_avg", "exp_avg_sq", "step"]
    assert kept == [f"optimizer.{key}" for key in expected]
    resumed = train(config, ranks=2, resume=str(tmp_path / "b"))
    assert resumed.params.tobytes() == whole.params.tobytes()
    assert resumed.losses == whole.losses[3:]


def test_a_checkpoint_of_another_optimizer_does_not_resume(tmp_path):
    train(configured("adam", {"steps": 2}), ranks=1, checkpoint=str(tmp_path))
    with pytest.raises(ValueError, match="different run"):
        train(configured("adamw", {"steps": 4}), ranks=1, resume=str(tmp_path))


# --- refusals, in one line naming the flag ------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"optimizer": "adam", "betas": (1.5, 0.9)}, "--betas must be two numbers B1,B2 in [0, 1)"),
        ({"optimizer": "adam", "betas": (0.9,)}, "--betas"),
        ({"optimizer": "lamb", "eps": 0.0}, "--eps must be > 0"),
        ({"optimizer": "adam", "nesterov": True, "momentum": 0.9}, "--momentum does not apply"),
        ({"optimizer": "adamw", "nesterov": True}, "--nesterov does not apply to --optimizer"),
        ({"optimizer": "lars", "nesterov": True}, "--nesterov does not apply"),
        ({"optimizer": "sgd", "betas": (0.5, 0.5)}, "--betas does not apply"),
        ({"optimizer": "adam", "trust_coefficient": 0.1}, "--trust-coefficient does not apply"),
        ({"optimizer": "lars", "trust_coefficient": -1.0}, "--trust-coefficient must be > 0"),
        ({"optimizer": "adamw", "weight_decay": -0.1}, "--weight-decay must be >= 0"),
        ({"optimizer": "rmsprop"}, "unknown --optimizer 'rmsprop': choose one of sgd, adam,"),
        ({"pitfall": "local-trust-ratio"}, "--pitfall local-trust-ratio needs --optimizer lamb"),
    ],
)
def test_refusals_name_their_flag(options, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        TrainConfig(**options)


def test_the_defaults_are_pytorchs():
    assert TrainConfig().weight_decay is None
    sgd = make_optimizer("sgd", OptimConfig(), 1, "float64", TrainConfig())
    assert sgd.options.weight_decay == 0.0
    for name, decay in (("adam", 0.0), ("adamw", 0.01), ("lamb", 0.0), ("lars", 0.0)):
        options = make_optimizer(name, OptimConfig(), 1, "float64",
                                 TrainConfig(optimizer=name)).options  # fmt: skip
        assert options.weight_decay == decay
    assert Adam.Options().betas == (0.9, 0.999) and Adam.Options().eps == 1e-8
    assert LARS.Options().trust_coefficient == 0.001


def syncsgd_cli(*args: str) -> subprocess.CompletedProcess:
    """`syncsgd args` by the console script's main in this process (tests/test_cli_train.py runs
    it in fresh ones)."""
    return run_in_process(list(args))


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--optimizer", "adam", "--betas", "1.5,0.9"], "--betas"),
        (["--optimizer", "adam", "--nesterov"], "--nesterov does not apply to --optimizer adam"),
        (["--optimizer", "lamb", "--eps", "0"], "--eps"),
    ],
)
def test_the_cli_refuses_in_one_line(args, needle):
    done = syncsgd_cli("train", "--steps", "1", "--samples", "60", *args, "--quiet")
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0
    assert len(lines) == 1 and needle in lines[0], done.stderr
    assert "Traceback" not in done.stderr


def test_the_cli_trains_with_adamw(tmp_path):
    done = syncsgd_cli("train", "--ranks", "2", "--samples", "60", "--features", "4", "--hidden",
                       "5", "--batch-size", "20", "--steps", "3", "--optimizer", "adamw",
                       "--betas", "0.8,0.99", "--eps", "1e-7", "--lr", "0.01", "--quiet",
                       "--save", str(tmp_path / "p.npz"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    config = TrainConfig(samples=60, features=4, hidden=(5,), batch_size=20, steps=3,
                         optimizer="adamw", betas=(0.8, 0.99), eps=1e-7, lr=0.01)  # fmt: skip
    with np.load(tmp_path / "p.npz") as saved:
        assert saved["W0"].tobytes() == train(config, ranks=2).arrays()["W0"].tobytes()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--optimizer", "adam", "--betas", "0.8,0.99", "--eps", "1e-6", "--weight-decay", "0.1"],
         {"optimizer": "adam", "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1}),
        (["--optimizer", "lars", "--trust-coefficient", "0.02", "--momentum", "0.9"],
         {"optimizer": "lars", "trust_coefficient": 0.02, "momentum": 0.9}),
    ],
)  # fmt: skip
def test_the_flags_are_read_into_their_fields(argv, expected):
    from syncsgd.cli import build_parser, config_from_options

    config = config_from_options(build_parser().parse_args(["train", *argv]))
    assert config == TrainConfig(**expected)
