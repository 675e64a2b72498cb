"""The α-β-γ cost model: formulas by hand and against the schedules; crossovers; fit."""

from __future__ import annotations

import argparse
import json
import math
import os
import re

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from syncsgd.apps import costmodel
from syncsgd.apps.costmodel import ALGORITHMS, Cost, Params, Sample, cost, predict

DEFAULTS = Params(2e-6, 1 / 12.5e9, 1e-10)


# -- formulas -------------------------------------------------------------------------------------

HAND = {  # (algorithm, P): (a, b, c) worked out on paper
    ("ring", 1): (0, 0, 0),
    ("ring", 4): (6, 1.5, 0.75),
    ("ring", 5): (8, 1.6, 0.8),
    ("naive", 4): (6, 6, 3),
    ("naive", 1): (0, 0, 0),
    ("recursive-doubling", 1): (0, 0, 0),
    ("recursive-doubling", 8): (3, 3, 3),
    ("recursive-doubling", 6): (2 + 2, 2 + 2, 2 + 1),  # L = 2, fold and unfold
    ("rabenseifner", 8): (6, 1.75, 0.875),
    ("rabenseifner", 6): (4 + 2, 1.5 + 2, 0.75 + 1),
    ("rabenseifner", 2): (2, 1, 0.5),
    # binary tree, heap order: reduce rounds + broadcast rounds along the critical paths
    ("tree", 1): (0, 0, 0),
    ("tree", 2): (1 + 1, 1 + 1, 1),
    ("tree", 3): (2 + 2, 2 + 2, 2),
    ("tree", 4): (3 + 2, 3 + 2, 3),  # rank 0 waits for rank 1, which waits for rank 3
    ("tree", 7): (4 + 4, 4 + 4, 4),
}


@pytest.mark.parametrize(("algorithm", "ranks"), sorted(HAND))
def test_coefficients_match_hand_computed_values(algorithm, ranks):
    assert cost(algorithm, ranks) == pytest.approx(Cost(*HAND[algorithm, ranks]), rel=1e-15)


def test_predicted_seconds_by_hand():
    # ring, 8 ranks, 1 MiB, 2 us / 12.5 GB/s / 10 GB/s:
    # 14 * 2e-6 + 1.75 * 2**20 / 12.5e9 + 0.875 * 2**20 * 1e-10
    expected = 28e-6 + 1.75 * 1048576 / 12.5e9 + 0.875 * 1048576 * 1e-10
    assert predict("ring", 8, 1 << 20, DEFAULTS) == pytest.approx(expected, rel=1e-14)
    assert predict("ring", 8, 1 << 20, DEFAULTS) == pytest.approx(266.55e-6, rel=1e-4)
    # recursive doubling on 1024 ranks, 8 bytes: 10 * (2e-6 + 8 * 8e-11 + 8 * 1e-10)
    assert predict("recursive-doubling", 1024, 8, DEFAULTS) == pytest.approx(
        10 * (2e-6 + 8 * 8e-11 + 8e-10), rel=1e-14
    )


def test_tree_rounds_of_a_large_tree():
    # P = 1024: rank 1023 hangs alone below rank 511; the rightmost path 0, 2, 6, ..., 1022 has
    # depth 9 and costs two broadcast rounds per level.
    assert costmodel.tree_rounds(1024) == (19, 18)
    assert costmodel.tree_rounds(1023) == (18, 18)  # a complete tree of depth 9: 2 per level


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4"])
def test_bad_rank_counts(bad):
    with pytest.raises(ValueError, match="number of ranks"):
        cost("ring", bad)


def test_unknown_algorithm():
    with pytest.raises(ValueError, match="unknown algorithm 'butterfly'"):
        cost("butterfly", 4)


def simulate(algorithm: str, ranks: int, length: int, params: Params, itemsize: int = 8) -> float:
    """The time of `syncsgd.collectives.schedule` steps, each message α + bytes·β, each add bytes·γ.

    A step starts when the rank's previous step ends; each of its messages moves once both the
    sender's and the receiver's steps have started (full duplex: a Sendrecv's two messages move
    at once); the step ends when its messages have moved and the data received is added.
    """
    from syncsgd import collectives

    plans = [collectives.schedule(algorithm, length, ranks, rank) for rank in range(ranks)]
    sends: dict[tuple[int, int], list[int]] = {}  # (source, dest) -> source's step indices
    recvs: dict[tuple[int, int], list[int]] = {}
    for rank, plan in enumerate(plans):
        for index, step in enumerate(plan):
            if step.send_to >= 0:
                sends.setdefault((rank, step.send_to), []).append(index)
            if step.recv_from >= 0:
                recvs.setdefault((step.recv_from, rank), []).append(index)
    messages = []  # (source, source step, dest, dest step, bytes): k-th send meets k-th receive
    for pair, indices in sends.items():
        assert len(indices) == len(recvs[pair])
        for sent, received in zip(indices, recvs[pair], strict=True):
            step = plans[pair[0]][sent]
            nbytes = (step.send.stop - step.send.start) * itemsize
            messages.append((pair[0], sent, pair[1], received, nbytes))
    end = [[0.0] * len(plan) for plan in plans]
    for _ in range(10_000):  # the least fixed point of the max-plus equations
        start = [[row[i - 1] if i else 0.0 for i in range(len(row))] for row in end]
        moved = [[0.0] * len(plan) for plan in plans]
        for source, sent, dest, received, nbytes in messages:
            done = max(start[source][sent], start[dest][received]) + params.alpha
            done += nbytes * params.beta
            moved[source][sent] = max(moved[source][sent], done)
            moved[dest][received] = max(moved[dest][received], done)
        new = [
            [
                moved[r][i]
                + (
                    (step.recv.stop - step.recv.start) * itemsize * params.gamma
                    if step.combine != collectives.COPY
                    else 0.0
                )
                for i, step in enumerate(plan)
            ]
            for r, plan in enumerate(plans)
        ]
        if new == end:
            return max((max(row, default=0.0) for row in end), default=0.0)
        end = new
    raise AssertionError("the simulation did not settle")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16])
def test_formulas_agree_with_the_implemented_schedules(algorithm, ranks):
    length = 720720  # divisible by 1..16: every chunk of every algorithm has the same size
    nbytes = length * 8
    for params in (Params(1, 0, 0), Params(0, 1, 0), Params(0, 0, 1), Params(1, 1e-6, 3e-6)):
        expected = cost(algorithm, ranks).seconds(nbytes, params)
        assert simulate(algorithm, ranks, length, params) == pytest.approx(expected, rel=1e-12)


# -- crossovers -----------------------------------------------------------------------------------


def test_crossover_by_hand():
    # P = 2: recursive doubling alpha + n(beta + gamma), ring 2 alpha + n(beta + gamma/2);
    # equal at n = 2 alpha / gamma = 40000 bytes, above which the ring (and Rabenseifner, the
    # same line at P = 2) wins.
    found = costmodel.crossovers(2, DEFAULTS)
    assert {(c.faster, c.slower) for c in found} == {
        ("ring", "recursive-doubling"),
        ("rabenseifner", "recursive-doubling"),
    }
    assert all(c.nbytes == pytest.approx(40000, rel=1e-12) for c in found)
    regions = costmodel.best_by_size(2, DEFAULTS)
    assert [(r.algorithms, r.stop) for r in regions] == [
        (("recursive-doubling",), pytest.approx(40000, rel=1e-12)),
        (("ring", "rabenseifner"), None),
    ]


def test_ring_overtakes_rabenseifner_only_when_p_is_not_a_power_of_two():
    assert not any(
        {c.faster, c.slower} == {"ring", "rabenseifner"} for c in costmodel.crossovers(8, DEFAULTS)
    )
    # P = 6: Rabenseifner 6 alpha + n(3.5 beta + 1.75 gamma),
    # ring 10 alpha + n(5/3 beta + 5/6 gamma)
    (found,) = [
        c
        for c in costmodel.crossovers(6, DEFAULTS)
        if {c.faster, c.slower} == {"ring", "rabenseifner"}
    ]
    per_byte = (3.5 - 5 / 3) * DEFAULTS.beta + (1.75 - 5 / 6) * DEFAULTS.gamma
    assert (found.faster, found.nbytes) == ("ring", pytest.approx(4 * 2e-6 / per_byte, rel=1e-12))


positive = st.floats(1e-12, 1e-3, allow_nan=False)


@given(
    ranks=st.integers(1, 2000),
    params=st.builds(Params, positive, positive, positive),
    algorithms=st.lists(st.sampled_from(ALGORITHMS), min_size=1, max_size=5, unique=True),
)
def test_fastest_by_size_agrees_with_brute_force(ranks, params, algorithms):
    regions = costmodel.best_by_size(ranks, params, algorithms)
    assert regions[0].start == 0 and regions[-1].stop is None
    for before, after in zip(regions, regions[1:], strict=False):
        assert before.stop == after.start and before.stop > before.start
        assert before.algorithms != after.algorithms
    for region in regions:
        top = region.stop if region.stop is not None else max(region.start * 4, 1e12)
        for nbytes in (region.start + (top - region.start) * f for f in (0.01, 0.5, 0.99)):
            times = {name: predict(name, ranks, nbytes, params) for name in algorithms}
            fastest = min(times.values())
            for name in region.algorithms:
                assert times[name] <= fastest * (1 + 1e-9)
    for crossing in costmodel.crossovers(ranks, params, algorithms):
        below, above = crossing.nbytes * 0.999, crossing.nbytes * 1.001
        faster, slower = crossing.faster, crossing.slower
        assert predict(faster, ranks, above, params) < predict(slower, ranks, above, params)
        assert predict(faster, ranks, below, params) > predict(slower, ranks, below, params)


# -- fitting --------------------------------------------------------------------------------------

SIZES = [8 << k for k in range(0, 24, 2)]  # 8 B .. 32 MiB


def sweep(params: Params, ranks: int, algorithms=("ring",), noise=0.0, seed=0) -> dict:
    """A `syncsgd bench allreduce --json` document made from the model, times times (1 + noise)."""
    rng = np.random.default_rng(seed)
    rows = []
    for nbytes in SIZES:
        for algorithm in (*algorithms, "mpi"):
            model = "ring" if algorithm == "mpi" else algorithm
            seconds = predict(model, ranks, nbytes, params) * (1 + noise * rng.standard_normal())
            rows.append({"size_bytes": nbytes, "algorithm": algorithm, "time_us": seconds * 1e6})
    return {"benchmark": "allreduce", "backend": "mpi", "ranks": ranks, "rows": rows}


def write(tmp_path, document, name="bench.json"):
    path = tmp_path / name
    path.write_text(json.dumps(document))
    return str(path)


TRUE = Params(30e-6, 4e-10, 2.5e-10)


def test_fit_recovers_all_three_from_ring_and_recursive_doubling_rows(tmp_path):
    path = write(tmp_path, sweep(TRUE, 4, ("ring", "recursive-doubling")))
    ranks, samples = costmodel.load_sweep(path, ["ring", "recursive-doubling"])
    assert ranks == 4 and len(samples) == 2 * len(SIZES)  # the "mpi" rows are left out
    fit = costmodel.fit(samples, ranks)
    assert fit.fitted == ("alpha", "beta", "gamma") and fit.held == () and not fit.note
    assert fit.params == pytest.approx(TRUE, rel=1e-9)
    assert fit.r_squared == pytest.approx(1, abs=1e-12)
    assert max(abs(row.relative_error) for row in fit.rows) < 1e-9


def test_fit_with_noise_is_close_and_reports_r_squared(tmp_path):
    path = write(tmp_path, sweep(TRUE, 4, ("ring", "recursive-doubling"), noise=0.02))
    fit = costmodel.fit(*reversed(costmodel.load_sweep(path, ["ring", "recursive-doubling"])))
    assert fit.params.alpha == pytest.approx(TRUE.alpha, rel=0.05)
    assert fit.params.beta == pytest.approx(TRUE.beta, rel=0.1)
    assert fit.params.gamma == pytest.approx(TRUE.gamma, rel=0.2)
    assert 0.99 < fit.r_squared < 1
    measured = np.array([row.measured for row in fit.rows])
    predicted = np.array([row.predicted for row in fit.rows])
    r_squared = 1 - np.sum((predicted - measured) ** 2) / np.sum((measured - measured.mean()) ** 2)
    assert fit.r_squared == pytest.approx(r_squared, rel=1e-12)


def test_ring_rows_alone_fix_alpha_and_two_beta_plus_gamma(tmp_path):
    path = write(tmp_path, sweep(TRUE, 8))
    fit = costmodel.fit(*reversed(costmodel.load_sweep(path)))
    assert fit.held == ("gamma",) and "2*beta + gamma" in fit.note
    assert fit.params.gamma == costmodel.DEFAULT_GAMMA
    assert fit.params.alpha == pytest.approx(TRUE.alpha, rel=1e-9)
    combined = 2 * fit.params.beta + fit.params.gamma
    assert combined == pytest.approx(2 * TRUE.beta + TRUE.gamma, rel=1e-9)
    # the ring's prediction on any P depends on 2 beta + gamma only
    assert predict("ring", 1024, 1 << 26, fit.params) == pytest.approx(
        predict("ring", 1024, 1 << 26, TRUE), rel=1e-9
    )


def test_given_parameters_are_held(tmp_path):
    path = write(tmp_path, sweep(TRUE, 4))
    fit = costmodel.fit(*reversed(costmodel.load_sweep(path)), held={"gamma": TRUE.gamma})
    assert fit.held == ("gamma",) and not fit.note
    assert fit.params == pytest.approx(TRUE, rel=1e-9)


def test_fit_never_goes_negative():
    # Times that fall with size would need beta < 0: it stays at 0, alpha takes the mean level.
    samples = [Sample("ring", n, t) for n, t in [(8, 10e-6), (1 << 20, 9e-6), (1 << 24, 8e-6)]]
    fit = costmodel.fit(samples, 2, held={"gamma": 0.0})
    assert fit.params.beta == 0 and fit.params.alpha > 0


@given(
    st.lists(
        st.tuples(st.sampled_from(["ring", "recursive-doubling"]),
                  st.sampled_from(SIZES), st.floats(1e-6, 1e-1)),
        min_size=3,
        max_size=12,
    ).filter(lambda rows: len({(a, n) for a, n, _ in rows}) >= 3)
)  # fmt: skip
def test_fit_matches_scipy_nnls(rows):
    optimize = pytest.importorskip("scipy.optimize")
    samples = [Sample(a, n, t) for a, n, t in rows]
    design = np.array([[c.a, c.b * s.nbytes, c.c * s.nbytes] for s in samples
                       for c in [cost(s.algorithm, 3)]])  # fmt: skip
    measured = np.array([s.seconds for s in samples])
    weighted = design / measured[:, None]
    if np.linalg.matrix_rank(weighted / np.linalg.norm(weighted, axis=0), tol=1e-9) < 3:
        return  # beta and gamma not separable: covered by the held-gamma tests
    fit = costmodel.fit(samples, 3)
    assert fit.fitted == ("alpha", "beta", "gamma")
    scale = np.linalg.norm(weighted, axis=0)  # scipy on the scaled problem, as well conditioned
    reference, _ = optimize.nnls(weighted / scale, np.ones(len(samples)))
    ours = np.linalg.norm(weighted @ np.array(fit.params) - 1)
    theirs = np.linalg.norm(weighted @ (reference / scale) - 1)
    assert ours <= theirs * (1 + 1e-6) + 1e-12


def test_fit_needs_two_sizes_and_two_ranks():
    one_size = [Sample("ring", 1024, 1e-5), Sample("ring", 1024, 1.1e-5)]
    with pytest.raises(ValueError, match="at least two different sizes"):
        costmodel.fit(one_size, 2)
    with pytest.raises(ValueError, match="1 rank"):
        costmodel.fit([Sample("ring", 8, 1e-5), Sample("ring", 16, 1e-5)], 1)


# -- the command line -----------------------------------------------------------------------------


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="syncsgd model")
    costmodel.add_arguments(parser)
    return parser.parse_args(argv)


def run(capsys, *argv: str) -> list[str]:
    assert costmodel.main(parse(*argv)) == 0
    return capsys.readouterr().out.splitlines()


def test_table_marks_the_fastest(capsys):
    lines = run(capsys, "--ranks", "2,1024", "--sizes", "8,64M", "--beta", "1/(12.5e9)")
    assert lines[0].startswith("# alpha = 2 us per message, beta = 8e-11 s/B (12.5 GB/s)")
    header = lines[1].split()
    assert header == ["ranks", "size", *ALGORITHMS, "best"]
    table = {(line.split()[0], line.split()[1] + line.split()[2]): line for line in lines[2:6]}
    assert set(table) == {("2", "8B"), ("2", "64MiB"), ("1024", "8B"), ("1024", "64MiB")}
    assert table["1024", "8B"].endswith("recursive-doubling")
    assert table["1024", "64MiB"].endswith("rabenseifner")
    assert table["2", "64MiB"].endswith("ring = rabenseifner")
    assert table["1024", "8B"].count("*") == 1
    assert (
        "# P = 2: fastest: recursive-doubling up to 39.1 KiB | ring = rabenseifner beyond" in lines
    )
    assert "#   ring overtakes recursive-doubling above 39.1 KiB" in lines


def test_fit_and_json_output(tmp_path, capsys):
    bench = write(tmp_path, sweep(TRUE, 4, noise=0.01))
    out = tmp_path / "model.json"
    lines = run(capsys, "--fit", bench, "--ranks", "1024", "--sizes", "1M", "--json", str(out))
    assert lines[0].startswith(f"# fit to {len(SIZES)} ring rows of {bench} (P = 4)")
    (summary,) = [line for line in lines if line.startswith("# R^2 = ")]
    assert 0.99 < float(summary.split()[3].rstrip(";")) <= 1
    assert any("from 64 KiB: max" in line for line in lines)
    document = json.loads(out.read_text())
    assert document["fit"]["ranks"] == 4 and document["fit"]["held"] == ["gamma"]
    assert len(document["fit"]["rows"]) == len(SIZES)
    params = Params(**document["params"])
    assert params == Params(**document["fit"]["params"])
    predictions = {row["algorithm"]: row for row in document["predictions"]}
    assert set(predictions) == set(ALGORITHMS)
    assert predictions["ring"]["seconds"] == pytest.approx(predict("ring", 1024, 1 << 20, params))
    assert [row["algorithm"] for row in document["predictions"] if row["best"]] == ["rabenseifner"]
    assert document["fastest"][-1]["to_bytes"] is None
    assert all(c["ranks"] == 1024 for c in document["crossovers"])


@given(
    st.lists(
        st.tuples(st.integers(1, 1 << 26), st.floats(1e-6, 1e-1)), min_size=1, max_size=8,
        unique_by=lambda sample: sample[0],
    )
)
@example([(1, 1.0000000000000002e-06), (2, 0.09375), (3, 1e-06), (67, 0.0625)])  # b = -1e-17
def test_best_line_is_no_worse_than_any_other_line(samples):
    nbytes, seconds = (np.array(column, float) for column in zip(*samples, strict=True))
    best = costmodel.best_line(nbytes, seconds)
    assert best.fixed >= 0 and best.per_byte >= 0
    worst = np.max(np.abs((best.fixed + best.per_byte * nbytes - seconds) / seconds))
    assert worst == pytest.approx(best.worst, rel=1e-6, abs=1e-9)  # it reports its own error
    # An independent search that the optimum must not lose to: flat lines through each point,
    # lines through two points (when a, b >= 0), and random lines.
    rng = np.random.default_rng(0)
    candidates = [(s, 0.0) for s in seconds] + [
        (rng.uniform(0, seconds.max()), rng.uniform(0, seconds.max() / nbytes.min()))
        for _ in range(500)
    ]
    for i in range(len(samples)):
        for j in range(len(samples)):
            if nbytes[j] > nbytes[i] and seconds[j] >= seconds[i]:
                slope = (seconds[j] - seconds[i]) / (nbytes[j] - nbytes[i])
                fixed = seconds[i] - slope * nbytes[i]
                if fixed >= 0:
                    candidates.append((fixed, slope))
    for fixed, slope in candidates:
        error = np.max(np.abs((fixed + slope * nbytes - seconds) / seconds))
        assert best.worst <= error * (1 + 1e-6) + 1e-9  # the solver's tolerance
        if len(samples) <= 2 and slope >= 0 and fixed >= 0 and error < 1e-12:
            assert best.worst < 1e-6  # a line through the points exists: it is found


def test_the_fit_reports_what_no_fit_could_beat(tmp_path, capsys):
    # Times that double their cost per byte at 4 MiB, as a cache does: no line can follow them.
    rows = [
        {"size_bytes": n, "algorithm": "ring", "time_us": 10 + n * (1e-4 if n < 4 << 20 else 2e-4)}
        for n in [64 << k for k in range(10, 21)]
    ]
    bench = write(tmp_path, {"ranks": 2, "rows": rows})
    out = tmp_path / "model.json"
    lines = run(capsys, "--fit", bench, "--gamma", "0", "--json", str(out))
    (floor_line,) = [line for line in lines if "no alpha-beta-gamma fit can do better" in line]
    floor = json.loads(out.read_text())["fit"]["best_possible_max_error_from_64KiB"]["ring"]
    assert 0.15 < floor < 0.5 and f"{floor:.1%}" in floor_line
    fitted = json.loads(out.read_text())["fit"]["max_relative_error_from_64KiB"]
    assert fitted >= floor - 1e-9  # the least-squares fit cannot beat the best line either
    straight = write(tmp_path, sweep(TRUE, 2), "straight.json")
    run(capsys, "--fit", straight, "--json", str(out))
    assert json.loads(out.read_text())["fit"]["best_possible_max_error_from_64KiB"]["ring"] < 1e-6


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ranks", "0"], "must be positive"),
        (["--ranks", "two"], "not an integer"),
        (["--sizes", "0"], "sizes must be positive"),
        (["--sizes", "1X"], "not a size in bytes"),
        (["--alpha=-1e-6"], "must be a finite number >= 0"),
        (["--beta", "nan"], "must be a finite number >= 0"),
        (["--gamma", "1/0"], "not a number"),
        (["--algorithms", "ring,butterfly"], "unknown algorithm butterfly"),
    ],
)
def test_bad_options_get_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(*argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_quantities():
    assert costmodel.parse_quantity("1/(12.5e9)") == 1 / 12.5e9
    assert costmodel.parse_quantity("1/12.5e9") == 1 / 12.5e9
    assert costmodel.parse_quantity("2e-6") == 2e-6
    with pytest.raises(argparse.ArgumentTypeError):
        costmodel.parse_quantity("1/2/3")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        ("{not json", "is not JSON"),
        ("[1, 2]", "no rows"),
        ('{"ranks": 2, "rows": []}', "no rows of ring"),
        ('{"ranks": 0, "rows": []}', "'ranks' must be an integer from 1 to 2**31"),
        ('{"ranks": 2, "rows": [{"algorithm": "ring"}]}', "row 0 lacks"),
        ('{"ranks": 2, "rows": [{"algorithm": "ring", "size_bytes": 8, "time_us": -1}]}',
         "row 0 has time_us -1"),
        ('{"ranks": 2, "rows": [{"algorithm": "mpi", "size_bytes": 8, "time_us": 1}]}',
         "(it has: mpi)"),
        ('{"ranks": 1, "rows": [{"algorithm": "ring", "size_bytes": 8, "time_us": 1}]}',
         "sweep on 1 rank cannot be fitted"),
    ],
)  # fmt: skip
def test_bad_sweep_files(tmp_path, content, message):
    path = tmp_path / "bench.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=None) as error:
        costmodel.main(parse("--fit", str(path)))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_json_into_a_missing_directory_fails_first(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        costmodel.main(parse("--json", str(tmp_path / "nowhere" / "model.json")))


def test_formatting():
    assert costmodel.format_bytes(40000) == "39.1 KiB"
    assert costmodel.format_bytes(8) == "8 B"
    assert costmodel.format_seconds(266.55e-6) == "267 us"
    assert costmodel.format_seconds(0) == "0 s"
    assert math.isclose(costmodel.DEFAULT_BETA, 8e-11)


def test_fit_reads_a_real_bench_sweep(tmp_path, capsys):
    from syncsgd.cli import main as cli_main

    bench = tmp_path / "bench.json"
    quick = ["--batches", "2", "--batch-seconds", "0.001", "--warmup", "1", "--max-iters", "3"]
    argv = ["bench", "allreduce", "--ranks", "2", "--max-bytes", "4K", "--json", str(bench)]
    assert cli_main([*argv, *quick]) == 0
    capsys.readouterr()
    lines = run(capsys, "--fit", str(bench), "--ranks", "2", "--sizes", "8")
    assert lines[0].startswith(f"# fit to 10 ring rows of {bench} (P = 2)")  # 8 B .. 4 KiB
    measured = json.loads(bench.read_text())["rows"]
    rows = [line.split() for line in lines if line.lstrip().startswith("ring ")]
    assert len(rows) == 10
    for row, original in zip(rows, [r for r in measured if r["algorithm"] == "ring"], strict=True):
        assert costmodel.format_bytes(original["size_bytes"]) == " ".join(row[1:3])
        assert costmodel.format_seconds(original["time_us"] * 1e-6) == " ".join(row[3:5])


# -- the lecture figure and the warning of a poor fit ---------------------------------------------


def test_a_poor_fit_warns_before_it_predicts(tmp_path, capsys):
    # Times that do not grow with the size at all, scattered: no α-β-γ line explains them.
    rng = np.random.default_rng(1)
    rows = [{"size_bytes": n, "algorithm": "ring", "time_us": float(t)}
            for n, t in zip(SIZES, rng.uniform(50, 500, len(SIZES)), strict=True)]  # fmt: skip
    bench = write(tmp_path, {"benchmark": "allreduce", "ranks": 2, "rows": rows})
    out = tmp_path / "model.json"
    lines = run(capsys, "--fit", bench, "--ranks", "2,1024", "--json", str(out))
    warning = " ".join(line[2:] for line in lines if line.startswith("# "))
    assert "WARNING: R^2 = " in warning and "for P = 1024 (measured at P = 2)" in warning
    assert "WARNING" in json.loads(out.read_text())["fit"]["warning"]
    good = write(tmp_path, sweep(TRUE, 4, noise=0.01), "good.json")
    assert not any("WARNING" in line for line in run(capsys, "--fit", good, "--ranks", "1024"))


def test_png_is_the_lecture_figure(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "model.png"
    lines = run(capsys, "--ranks", "4,1024", "--png", str(png))
    assert lines[-1] == f"wrote {png}" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bench = write(tmp_path, sweep(TRUE, 4, noise=0.01))
    fitted = tmp_path / "fit.png"
    run(capsys, "--fit", bench, "--ranks", "4,1024", "--png", str(fitted))
    assert fitted.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "fit.png", "model.png"]


def brute_force_tree_rounds(ranks: int) -> tuple[int, int]:
    """The tree's critical paths rank by rank, as the definition reads (O(P))."""
    done = [0] * ranks
    for rank in reversed(range(ranks)):
        for child in (2 * rank + 1, 2 * rank + 2):
            if child < ranks:
                done[rank] = max(done[rank], done[child]) + 1
    arrive = [0] * ranks
    for rank in range(ranks):
        for turn, child in enumerate((2 * rank + 1, 2 * rank + 2), start=1):
            if child < ranks:
                arrive[child] = arrive[rank] + turn
    return done[0], max(arrive)


def test_tree_rounds_match_the_definition_and_take_no_time_at_a_billion_ranks():
    assert [costmodel.tree_rounds(p) for p in range(1, 700)] == [
        brute_force_tree_rounds(p) for p in range(1, 700)
    ]
    assert costmodel.tree_rounds(10**9) == (58, 57)  # log-time: a billion ranks answer at once


def test_a_sweep_that_is_not_a_regular_file_is_refused_not_read(tmp_path):
    fifo = tmp_path / "sweep.json"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        costmodel.load_sweep(str(fifo))


# -- the step of a --model network ----------------------------------------------------------------


def test_the_step_of_a_conv_spec_counts_its_products(tmp_path, capsys):
    # conv(4, 3) on 2x5x5: 3x3 positions x 2·3·3 patch x 4 channels = 648 multiply-adds a sample;
    # the dense after flatten: 36 in x 3 out = 108. Backward: both twice, less the conv's input.
    out = tmp_path / "model.json"
    lines = run(capsys, "--model", "conv(4, 3) relu maxpool(1) flatten dense", "--input-shape",
                "2,5,5", "--classes", "3", "--ranks", "2", "--shard", "10", "--flops", "1e6",
                "--gamma", "0", "--json", str(out))  # fmt: skip
    assert any("756 multiply-adds per sample forward, 864 backward" in line for line in lines)
    rows = json.loads(out.read_text())["overlap"]
    assert [row["buckets"] for row in rows][:1] == [2]  # one per layer with parameters
    for row in rows:
        assert row["compute_s"] == pytest.approx(10 * (756 + 864) / 1e6)


def test_a_preset_and_the_mlp_flag_agree_with_the_same_network(capsys):
    mlp = costmodel.overlap_table(costmodel.step_network(parse("--overlap", "64,32,10")), 8,
                                  1e9, 8, [4], Params(2e-6, 1e-10, 1e-10))  # fmt: skip
    spec = costmodel.step_network(parse("--model", "dense(32) relu dense", "--input-shape", "64"))
    assert costmodel.overlap_table(spec, 8, 1e9, 8, [4], Params(2e-6, 1e-10, 1e-10)) == mlp
    lenet = costmodel.step_network(parse("--model", "lenet5", "--input-shape", "1,28,28"))
    assert lenet.step_multiply_adds()[0] == 416_520  # LeNet-5's 0.42 M multiply-adds


@pytest.mark.parametrize("argv, message", [
    (["--model", "conv(4, 3) flatten dense"], "--model needs --input-shape"),
    (["--input-shape", "1,8,8"], "--input-shape is the shape of --model's input"),
    (["--model", "dense", "--input-shape", "4", "--overlap", "4,2"], "give one"),
    (["--model", "conv(4, 9) flatten dense", "--input-shape", "1,8,8"], "conv(4, 9)"),
])  # fmt: skip
def test_a_bad_model_gets_one_line(argv, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        costmodel.main(parse(*argv))


def test_a_bad_spec_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        parse("--model", "conv(4, 3) blur")
    assert "blur" in capsys.readouterr().err
