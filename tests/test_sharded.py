"""--zero-stage 1, 2, 3: the sharded steps give the replicated step's bits, and refuse what they
cannot."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from conftest import requires_mpi, run_mpiexec
from hypothesis import given, settings
from hypothesis import strategies as st

from syncsgd import train
from syncsgd.cli import main
from syncsgd.collectives.schedules import chunk_bounds
from syncsgd.comm.threads import run_threads
from syncsgd.training.sharded import REDUCE_SCATTER, owned_slices

MLP = dict(samples=40, features=5, hidden=(6, 4), classes=3, steps=3, seed=4)  # 73 parameters
CONV = dict(model="conv(2, 3, pad=1) batchnorm relu maxpool(2) flatten dense", samples=24,
            features=16, input_shape=(1, 4, 4), classes=3, batchnorm="sync", steps=2, seed=5)
GPT = dict(data="numbers-to-words", model="gpt(layers=1,d=8,heads=2)", context=6, samples=24,
           steps=2, seed=6, optimizer="adamw", lr=0.01)  # fmt: skip
UPDATES = [dict(momentum=0.9), dict(optimizer="adam", lr=0.01), dict(optimizer="adamw", lr=0.01),
           dict(momentum=0.9, nesterov=True, weight_decay=1e-3)]  # fmt: skip


def digest(result) -> str:
    """SHA-256 of a run's final parameters (and BatchNorm's running statistics)."""
    running = b"" if result.running is None else np.asarray(result.running).tobytes()
    return hashlib.sha256(np.asarray(result.params).tobytes() + running).hexdigest()


def both_stages(ranks: int, stage: int = 1, **options) -> tuple[str, str]:
    """The digests of stage 0 and a sharded stage of the same run on `ranks` thread ranks."""
    return tuple(digest(train(ranks=ranks, backend="threads", zero_stage=zero_stage, **options))
                 for zero_stage in (0, stage))  # type: ignore[return-value]


@settings(max_examples=16)
@given(ranks=st.integers(1, 9), stage=st.integers(1, 3), update=st.sampled_from(UPDATES),
       batch=st.integers(1, 13), exact=st.booleans(), overlap=st.booleans(),
       buckets=st.sampled_from([None, 0, 96, 1]), accumulate=st.integers(1, 3),
       precision=st.sampled_from(["fp32", "bf16", "fp16"]))  # fmt: skip
def test_every_stage_is_bitwise_stage_0_for_any_p(ranks, stage, update, batch, exact, overlap,
                                                  buckets, accumulate, precision):  # fmt: skip
    # P > B and P up to 9 on 73 parameters: ranks with empty shards or empty blocks included;
    # K at most the largest shard (more is refused); 1-byte buckets: a bucket per tensor
    accumulate = min(accumulate, -(-batch // ranks))
    options = dict(MLP, **update, batch_size=batch, exact=exact, overlap=overlap,
                   bucket_bytes=buckets, accumulate=accumulate, precision=precision)
    replicated, sharded = both_stages(ranks, stage, **options)
    assert sharded == replicated
    if exact:  # and exact mode's bits are those of one rank, at every stage
        assert sharded == both_stages(1, stage, **options)[1]


@pytest.mark.parametrize("ranks", [1, 2, 3, 5])
@pytest.mark.parametrize("update", [dict(clip_norm=0.3, optimizer="adamw", lr=0.01),
                                    dict(optimizer="lamb", lr=0.01, bucket_bytes=96),
                                    dict(optimizer="lars", momentum=0.9, clip_norm=0.3)])
def test_norms_over_every_shard_clip_and_scale_as_the_whole_gradients(ranks, update):
    # a global norm to clip by, LAMB's and LARS's trust ratio per tensor (a tensor may span the
    # blocks of several ranks); exact mode: the squares summed exactly and rounded once, so one
    # SHA-256 at every P and stage; float mode: the parts' sums, within the float tolerance
    options = dict(MLP, batch_size=10, **update)
    exact = {digest(train(ranks=P, backend="threads", zero_stage=stage, exact=True, **options))
             for P, stage in ((ranks, 0), (ranks, 1), (ranks, 2), (ranks, 3), (1, 3))}
    assert len(exact) == 1
    replicated = train(ranks=ranks, backend="threads", **options)
    for stage in (1, 2, 3):
        sharded = train(ranks=ranks, backend="threads", zero_stage=stage, **options)
        assert np.max(np.abs(sharded.params - replicated.params)) <= 1e-12


def test_the_exact_square_sum_is_the_rational_sum_rounded_once_however_split():
    from fractions import Fraction

    from syncsgd.nn.exact import SQUARE_LIMBS, add_square_limbs_, exact_square_sum, limbs_value

    rng = np.random.default_rng(3)
    for _ in range(40):
        scale = 10.0 ** int(rng.integers(-160, 140))  # squares from subnormal to huge
        values = rng.standard_normal(int(rng.integers(0, 200))) * scale
        squares = [Fraction(float(np.float64(v) * np.float64(v))) for v in values]
        expected = float(sum(squares, Fraction(0)))
        assert exact_square_sum(values) == expected
        limbs = np.zeros(SQUARE_LIMBS, np.int64)  # in pieces, in another order: the same bits
        for part in np.array_split(values, int(rng.integers(1, 9)))[::-1]:
            add_square_limbs_(part, limbs)
        assert limbs_value(limbs) == expected
    assert exact_square_sum(np.array([5e-324, 1e-160, 1.3e154])) == float(
        Fraction(5e-324 * 5e-324) + Fraction(1e-160 * 1e-160) + Fraction(1.3e154 * 1.3e154))


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize(("net", "ranks"), [(CONV, 3), (GPT, 2)])
def test_every_stage_of_a_conv_net_and_a_gpt_is_bitwise_stage_0(net, ranks, stage):
    # a bucket per layer: stage 2 writes each layer's sums into its bucket's buffer, stage 3
    # gathers each layer's parameters (BatchNorm's statistics summed over the ranks between)
    options = dict(net, batch_size=6, bucket_bytes=0)
    replicated, sharded = both_stages(ranks, stage, **options)
    assert sharded == replicated
    exact = both_stages(ranks, stage, **options, exact=True)
    assert exact[0] == exact[1] == both_stages(1, stage, **options, exact=True)[1]


def test_each_rank_owns_the_block_the_reduce_scatter_completes_on_it():
    from syncsgd.collectives.executor import execute

    length, buckets = 29, [slice(0, 12), slice(12, 29)]

    def rank_main(comm):
        values = np.arange(length, dtype=np.float64) * (comm.Get_rank() + 1)
        for bucket in buckets:
            execute(REDUCE_SCATTER, values[bucket], comm)
        return owned_slices(buckets, 25, comm.Get_rank(), comm.Get_size()), values

    size = 3
    results = run_threads(size, rank_main)
    total = np.arange(length) * sum(range(1, size + 1))  # closed form: sum of (r + 1) * i
    covered = np.zeros(25, int)
    for owned, values in results:
        for part in owned:
            assert np.array_equal(values[part], total[part])
            covered[part] += 1
    assert (covered == 1).all()  # every parameter owned once; the riders (25..28) by none
    bounds = chunk_bounds(12, size)  # rank r owns block (r + 1) % P of each bucket
    assert results[0][0][0] == slice(bounds[1], bounds[2])


def test_the_json_and_the_summary_are_the_replicated_runs(tmp_path):
    outputs = []
    for stage in (0, 1):
        path = tmp_path / f"stage{stage}.json"
        assert main(["train", "--ranks", "3", "--samples", "40", "--features", "5", "--hidden",
                     "6", "--batch-size", "8", "--steps", "3", "--zero-stage", str(stage),
                     "--exact", "--json", str(path)]) == 0  # fmt: skip
        outputs.append(path.read_text())
    import json

    replicated, sharded = (json.loads(text) for text in outputs)
    assert sharded["final_loss"] == replicated["final_loss"]
    assert sharded["losses"] == replicated["losses"]


@pytest.mark.parametrize(("options", "line"), [
    (["--zero-stage", "4"], "--zero-stage must be one of 0, 1, 2, 3"),
    (["--zero-stage", "1", "--algorithm", "tree"], "needs --algorithm ring, not tree"),
    (["--zero-stage", "1", "--pitfall", "mean-of-means"], "changes a seam of the replicated"),
])  # fmt: skip
def test_what_the_sharded_step_cannot_do_is_one_line(options, line, capsys):
    assert main(["train", "--steps", "1", *options]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert line in err and len(err.strip().splitlines()) == 1


@requires_mpi
@pytest.mark.parametrize(("ranks", "stage", "overlap"), [
    pytest.param(3, 1, [], marks=pytest.mark.mpi_once),  # stage 3 and 2 with --overlap prove
    pytest.param(2, 2, [], marks=pytest.mark.mpi_once),  # the same under each library
    (3, 3, []), (3, 2, ["--overlap"])])  # fmt: skip
def test_every_stage_under_mpiexec_is_bitwise_the_thread_ranks(tmp_path, ranks, stage, overlap):
    options = ["--samples", "40", "--features", "5", "--hidden", "6,4", "--classes", "3",
               "--steps", "3", "--seed", "4", "--optimizer", "adamw", "--lr", "0.01",
               "--batch-size", "7", "--bucket-bytes", "0"]  # fmt: skip
    threads = train(ranks=ranks, backend="threads", samples=40, features=5, hidden=(6, 4),
                    classes=3, steps=3, seed=4, optimizer="adamw", lr=0.01, batch_size=7,
                    bucket_bytes=0)  # fmt: skip
    ours = tmp_path / "ours.npz"
    done = run_mpiexec(ranks, ["-m", "syncsgd.cli", "train", *options, "--zero-stage", str(stage),
                               *overlap, "--save", str(ours)])  # fmt: skip
    assert done.returncode == 0, done.stderr
    expected = threads.arrays()
    with np.load(ours) as saved:
        assert all(saved[name].tobytes() == expected[name].tobytes() for name in expected)


@pytest.mark.parametrize("exact", [False, True])
def test_a_sharded_checkpoint_resumes_at_another_p_and_stage_as_the_run_that_never_stopped(
        exact, tmp_path):  # fmt: skip
    options = dict(MLP, batch_size=10, optimizer="adamw", lr=0.01, exact=exact, bucket_bytes=0)
    whole = digest(train(ranks=3, backend="threads", **{**options, "steps": 4}))
    train(ranks=3, backend="threads", zero_stage=3, checkpoint=str(tmp_path),
          **{**options, "steps": 2})  # each rank's blocks, and a manifest
    # float mode sums by P: the same P at another stage; exact mode: any P, any stage
    resumed = [(3, 0), (3, 1), (3, 2)] + ([(2, 1), (5, 3), (1, 2)] if exact else [])
    for ranks, stage in resumed:
        again = train(ranks=ranks, backend="threads", zero_stage=stage, resume=str(tmp_path),
                      **{**options, "steps": 4})  # fmt: skip
        assert digest(again) == whole, (ranks, stage)


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_the_bytes_sent_per_step_are_the_rings_at_both_stages(ranks):
    # the ring sends 2(P - 1) of the P blocks of the buffer (the gradient and the riders' slots);
    # stage 1 the same two halves, then its agreement (the riders, a flag, a sum of squares)
    from syncsgd.collectives.executor import sent_bytes

    options = dict(MLP, hidden=(40,), batch_size=12)  # 363 parameters: too long for a short ring
    replicated = train(ranks=ranks, backend="threads", **options)
    sharded = train(ranks=ranks, backend="threads", zero_stage=1, **options)
    length = replicated.model.n_params + 6  # float64: 8 bytes an element
    blocks = np.diff(chunk_bounds(length, ranks))
    # rank 0 sends every block but block 1 in the reduce-scatter, but block 2 % P in the allgather
    rank0 = 8 * (2 * blocks.sum() - blocks[1] - blocks[2 % ranks])
    assert replicated.bytes_sent_per_step == rank0
    # The agreement's 8 elements: on 2 ranks a short ring, the buffer sent whole (and a byte).
    agreed = np.diff(chunk_bounds(6 + 2, ranks))
    agreement = 8 * (2 * agreed.sum() - agreed[1] - agreed[2 % ranks]) if ranks > 2 else 65
    assert agreement == sent_bytes("ring", 6 + 2, 8, ranks, 0)
    assert sharded.bytes_sent_per_step == rank0 + agreement


@pytest.mark.parametrize(("pitfall", "options"), [
    ("shard-local-clip", dict(clip_norm=0.05)),
    ("shard-local-trust-ratio", dict(optimizer="lamb", lr=0.01)),
    ("shard-local-overflow", dict(precision="fp16")),
])  # fmt: skip
@pytest.mark.parametrize("stage", [1, 3])
def test_each_sharded_pitfall_breaks_what_it_should(pitfall, options, stage):
    base = dict(MLP, batch_size=12, zero_stage=stage, steps=6, bucket_bytes=0, **options)
    correct = train(ranks=3, backend="threads", **base)
    broken = train(ranks=3, backend="threads", pitfall=pitfall, **base)
    assert np.max(np.abs(broken.params - correct.params)) > 1e-6
    one = dict(base, samples=40)  # on one rank the one shard is the whole gradient: no harm
    assert digest(train(ranks=1, backend="threads", pitfall=pitfall, **one)) == digest(
        train(ranks=1, backend="threads", **one))


def test_a_sharded_pitfall_needs_the_sharded_step(capsys):
    assert main(["train", "--steps", "1", "--pitfall", "shard-local-overflow"]) == 1
    assert "needs --zero-stage 1, 2 or 3" in capsys.readouterr().err


@pytest.mark.parametrize("stage", [2, 3])
def test_the_bytes_sent_per_step_are_the_halves_and_stage_3s_gathers(stage):
    # stage 2 sends what stage 1 sends; stage 3 no allgather after the update, but each pass's
    # gathers of the buckets its layers read: forward and again backward, but for the buckets
    # still held when the backward pass begins (the top layer's)
    from syncsgd.collectives.executor import sent_bytes
    from syncsgd.training.sharded import ALLGATHER
    from syncsgd.training.windows import layer_buckets

    options = dict(MLP, batch_size=12, bucket_bytes=0, steps=2)
    first = train(ranks=3, backend="threads", zero_stage=1, **options)
    sharded = train(ranks=3, backend="threads", zero_stage=stage, **options)
    if stage == 2:
        assert sharded.bytes_sent_per_step == first.bytes_sent_per_step
        return
    model = first.model
    buckets = [(b.start, b.stop) for b in _buckets(model)]  # one per dense layer
    assert len(buckets) == 3 and buckets[-1][1] == model.n_params + 6  # riders with the last
    per_layer = [layer for layer in layer_buckets(model, _buckets(model)) if layer]
    gathers = [*range(len(buckets)), *range(len(buckets) - 2, -1, -1)]  # the top one is held
    assert [index for layer in per_layer for index in layer] == list(range(len(buckets)))

    def sent(collective, length):
        return sent_bytes(collective, length, 8, 3, 0)

    halves = sum(sent(ALLGATHER, stop - start) for start, stop in buckets)
    gathered = sum(sent(ALLGATHER, buckets[i][1] - buckets[i][0]) for i in gathers)
    assert sharded.bytes_sent_per_step == first.bytes_sent_per_step - halves + gathered


def _buckets(model):
    """The per-layer buckets of `model`'s communication buffer (6 riders' slots)."""
    from syncsgd.training.step import bucket_slices

    return bucket_slices(model, np.zeros(model.n_params + 6), 0)


def test_the_memory_of_each_stage_is_zeros_table():
    # Adam in float32 on 4 ranks, a bucket per layer: parameters, gradient and the optimizer's
    # two moments at 4 bytes an element are Ψ(4 + 4 + 8/4) at stage 1, Ψ(4 + 4/4 + 8/4) at
    # stage 2 and 16Ψ/4 at stage 3, plus the buffers of the buckets under way (the largest
    # layer's, at most) and a few bytes (Adam's step count, the riders)
    options = dict(model=" ".join(["dense(32) relu"] * 11 + ["dense"]), samples=64,
                   features=32, classes=4, batch_size=16, steps=1, optimizer="adam", lr=0.01,
                   dtype="float32", bucket_bytes=0, measure_memory=True)  # fmt: skip
    held = {stage: train(ranks=4, backend="threads", zero_stage=stage, **options)
            for stage in (1, 2, 3)}  # fmt: skip
    n = held[1].model.n_params
    largest = 32 * 32 + 32  # a hidden layer's tensors: its bucket
    expected = {1: n * (4 + 4 + 8 / 4), 2: n * (4 + 4 / 4 + 8 / 4) + 4 * largest,
                3: 16 * n / 4 + 2 * 4 * largest}  # fmt: skip
    for stage, result in held.items():
        total = sum(result.memory_bytes[category]
                    for category in ("parameters", "gradients", "optimizer_state"))
        assert abs(total - expected[stage]) <= 0.1 * expected[stage], (stage, total, expected)
    assert held[3].memory_bytes["parameters"] < 0.4 * 4 * n  # its blocks and one layer's
    assert held[2].memory_bytes["gradients"] < 0.4 * 4 * n


def test_the_noise_scale_takes_the_norm_over_every_shard():
    options = dict(samples=256, features=8, hidden=(16,), batch_size=32, steps=20, seed=4,
                   noise_scale=True)  # fmt: skip
    replicated = train(ranks=3, backend="threads", **options).noise_scale
    sharded = train(ranks=3, backend="threads", zero_stage=1, **options).noise_scale
    assert replicated is not None and sharded is not None
    assert abs(sharded - replicated) <= 1e-12 * replicated


def test_each_rank_holds_the_optimizer_state_of_its_blocks_alone():
    # Adam in float32 on 4 ranks: two moments of 4 bytes an element, Ψ of them at stage 0 and
    # the largest rank's blocks (about Ψ/4) at stage 1, as measured (training/memory.py)
    options = dict(samples=64, features=16, hidden=(24,), classes=3, batch_size=16, steps=1,
                   optimizer="adam", lr=0.01, dtype="float32", measure_memory=True)  # fmt: skip
    replicated = train(ranks=4, backend="threads", **options)
    sharded = train(ranks=4, backend="threads", zero_stage=1, **options)
    n = replicated.model.n_params
    assert replicated.memory_bytes["optimizer_state"] == 8 * n
    assert abs(sharded.memory_bytes["optimizer_state"] - 8 * n / 4) <= 0.1 * 8 * n / 4
    for kept in ("parameters", "gradients"):  # stage 1 keeps the whole of both
        assert sharded.memory_bytes[kept] == replicated.memory_bytes[kept]
    assert replicated.memory_bytes["parameters"] == 4 * n


def test_a_verify_grid_over_the_stages_has_one_sha256_in_exact_mode(tmp_path):
    report = tmp_path / "grid.json"
    assert main(["verify", "--exact", "--zero-stages", "0,1", "--optimizers", "sgd,adamw",
                 "--ranks", "1,2,3,5", "--samples", "64", "--features", "6", "--hidden", "5",
                 "--batch-size", "12", "--steps", "3", "--json", str(report)]) == 0  # fmt: skip
    import json

    runs = json.loads(report.read_text())["runs"]
    assert {run["zero_stage"] for run in runs} == {0, 1} and len(runs) == 16
    for optimizer in ("sgd", "adamw"):  # one SHA-256 per network and update, every P and stage
        assert len({run["sha256"] for run in runs if run["optimizer"] == optimizer}) == 1


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("buckets", [None, 1])
def test_more_ranks_than_parameters_at_every_stage(stage, buckets):
    # dense on 1 feature to 2 classes: 4 parameters (and 6 riders' slots) over 7 ranks, most of
    # whom own no parameter; a bucket per tensor (buckets of 2 elements) too
    options = dict(model="dense", features=1, classes=2, samples=21, batch_size=9, steps=3,
                   seed=2, optimizer="adam", lr=0.05, bucket_bytes=buckets)  # fmt: skip
    assert train(ranks=1, backend="threads", **options).model.n_params == 4
    replicated, sharded = both_stages(7, stage, **options)
    assert sharded == replicated
    exact = both_stages(7, stage, **options, exact=True)
    assert exact[0] == exact[1] == both_stages(1, stage, **options, exact=True)[1]


def test_stage_3_gathers_a_layer_before_its_pass_and_prefetches_the_next():
    # four dense layers, a bucket each: a pass gathers each layer's bucket as it reads it, and
    # with --overlap under MPI starts the next layer's (the way the passes go) while it computes
    from syncsgd.nn.network import build
    from syncsgd.training.windows import PlacedParams

    model = build("dense(3) dense(3) dense(3) dense", (2,), 2, "xent", np.float64)
    done: list[tuple[str, int]] = []
    placed = PlacedParams(model, _buckets(model), np.dtype(np.float64),
                          lambda index, out: done.append(("gather", index)), prefetch=True)
    assert placed.buffers.count == 2  # a layer's bucket and the next one's
    placed.start_ = lambda index, out: done.append(("start", index))
    placed.wait_ = lambda: done.append(("wait", -1))
    for layer in (0, 1, 2, 3, 3, 3, 2, 2, 1, 1, 0):  # forward, then backward (above, then own)
        placed.ready_(layer)
    assert done == [("gather", 0), ("start", 1), ("wait", -1), ("start", 2), ("wait", -1),
                    ("start", 3), ("wait", -1),  # backward finds the top two buffers held
                    ("start", 1), ("wait", -1), ("start", 0), ("wait", -1)]  # fmt: skip
    placed.forget_()  # after the update: every bucket gathered afresh
    placed.ready_(0)
    assert done[-2:] == [("gather", 0), ("start", 1)]


@requires_mpi
def test_stage_3_with_overlap_under_mpiexec_prefetches_and_keeps_the_bits(tmp_path):
    options = ["--model", "conv(2,3,pad=1) batchnorm relu maxpool(2) flatten dense(5) relu dense",
               "--input-shape", "1,4,4", "--features", "16", "--samples", "48", "--classes", "3",
               "--batchnorm", "sync", "--batch-size", "12", "--steps", "3", "--optimizer",
               "adamw", "--lr", "0.01", "--bucket-bytes", "0", "--exact"]  # fmt: skip
    ours, theirs = tmp_path / "mpi.npz", tmp_path / "threads.npz"
    done = run_mpiexec(3, ["-m", "syncsgd.cli", "train", *options, "--zero-stage", "3",
                           "--overlap", "--save", str(ours)])  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert main(["train", "--ranks", "2", *options, "--save", str(theirs)]) == 0
    with np.load(ours) as sharded, np.load(theirs) as replicated:
        assert all(sharded[name].tobytes() == replicated[name].tobytes() for name in replicated)


def test_bench_step_reports_what_a_stage_sends(tmp_path):
    report = tmp_path / "step.json"
    assert main(["bench", "step", "--ranks", "2", "--zero-stage", "3", "--features", "5",
                 "--hidden", "6,4", "--classes", "3", "--samples", "64",
                 "--per-rank-batch", "8", "--scaling", "weak", "--steps", "2", "--repeats", "1",
                 "--warmup", "1", "--cli-runs", "0", "--no-overhead",
                 "--json", str(report)]) == 0  # fmt: skip
    import json

    (row,) = json.loads(report.read_text())["scaling"]
    trained = train(ranks=2, backend="threads", zero_stage=3, features=5, hidden=(6, 4),
                    classes=3, samples=64, batch_size=16, steps=2)  # fmt: skip
    assert row["bytes_sent_per_step"] == trained.bytes_sent_per_step > 0
