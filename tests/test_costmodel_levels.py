"""The two-level cost model against the schedules it describes, and on the command line."""

from __future__ import annotations

import json

import pytest

from syncsgd.apps import costmodel_levels as levels
from syncsgd.apps.costmodel import Params, cost
from syncsgd.apps.demo_core import schedule_rounds
from syncsgd.cli import main
from syncsgd.collectives import Hierarchical, schedule

FAST, SLOW = Params(1e-6, 1e-10, 1e-10), Params(3e-4, 8e-9, 1e-10)


def layout(nodes: int, per_node: int, inter: str) -> Hierarchical:
    return Hierarchical(tuple(tuple(range(n * per_node, (n + 1) * per_node))
                              for n in range(nodes)), inter)  # fmt: skip


@pytest.mark.parametrize("inter", levels.INTER_ALGORITHMS)
@pytest.mark.parametrize(("nodes", "per_node"), [(2, 2), (3, 2), (2, 4), (4, 3), (5, 1)])
def test_the_alpha_terms_are_the_schedules_rounds(inter, nodes, per_node):
    size, spec = nodes * per_node, layout(nodes, per_node, inter)
    rounds = schedule_rounds([schedule(spec, 120, size, rank) for rank in range(size)])
    longest = max((r[-1] + 1 for r in rounds if r), default=0)
    assert longest == levels.intra_cost(per_node).a + cost(inter, nodes).a


@pytest.mark.parametrize(("nodes", "per_node"), [(2, 2), (3, 4), (4, 2)])
def test_the_bytes_over_a_nodes_link_are_the_inter_node_rings_on_its_chunks(nodes, per_node):
    size, length = nodes * per_node, 55440
    spec = layout(nodes, per_node, "ring")
    for node in range(nodes):  # what the node's ranks send over its link: the model's n·b
        across = sum(step.send.stop - step.send.start
                     for rank in range(node * per_node, (node + 1) * per_node)
                     for step in schedule(spec, length, size, rank)
                     if step.send_to // per_node != node)  # fmt: skip
        assert across == pytest.approx(cost("ring", nodes).b * length)


def test_predictions_by_hand():
    # 2 nodes x 2 ranks, 1 MB: inside 2(1)α + 1·nβ + nγ/2; between (ring on N=2, n/2 bytes on
    # each of the node's 2 ranks, over one link): 2α + 2·(n/2)β + (n/2)γ/2; the flat ring on 4:
    # 6(α + nβ/4) + 3nγ/4 at the slow link.
    n = 1e6
    two = (2 * FAST.alpha + n * FAST.beta + n * FAST.gamma / 2
           + 2 * SLOW.alpha + n * SLOW.beta + n / 2 * SLOW.gamma / 2)  # fmt: skip
    flat = 6 * SLOW.alpha + 6 * n / 4 * SLOW.beta + 3 * n / 4 * SLOW.gamma
    assert levels.hierarchical_seconds(2, 2, n, FAST, SLOW) == pytest.approx(two)
    assert levels.flat_ring_seconds(2, 2, n, FAST, SLOW) == pytest.approx(flat)
    assert levels.flat_ring_seconds(1, 4, n, FAST, SLOW) == pytest.approx(
        levels.hierarchical_seconds(1, 4, n, FAST, SLOW))  # one node: the same ring


def test_crossover_is_where_the_lines_meet():
    # A slow link with no latency but a dearer node-local latency: the flat ring wins small.
    inside, between = Params(1e-3, 1e-10, 0.0), Params(0.0, 1e-8, 0.0)
    where = levels.crossover(2, 4, inside, between, "ring")
    assert where is not None and where > 0
    assert levels.hierarchical_seconds(2, 4, where, inside, between) == pytest.approx(
        levels.flat_ring_seconds(2, 4, where, inside, between))
    assert levels.crossover(2, 4, FAST, SLOW, "ring") == 0.0


def test_model_prints_and_writes_the_two_level_table(tmp_path, capsys):
    path = tmp_path / "m.json"
    argv = ["model", "--ranks", "4", "--sizes", "8,1M", "--nodes", "2,4", "--ranks-per-node",
            "2", "--inter-alpha", "3e-4", "--inter-beta", "8e-9", "--json", str(path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "# two levels: N nodes x 2 ranks, ring between nodes" in out
    assert "# 4 x 2: the two-level allreduce beats the flat ring" in out
    rows = json.loads(path.read_text())["two_level"]["rows"]
    assert [(r["nodes"], r["size_bytes"]) for r in rows] == [(2, 8), (2, 1 << 20), (4, 8),
                                                             (4, 1 << 20)]  # fmt: skip
    assert main(["model", "--inter-beta", "1e-9"]) != 0
    assert "give --nodes N too" in capsys.readouterr().err


def ring_sweep(path, ranks: int, params: Params, sizes=(1 << 10, 1 << 14, 1 << 18, 1 << 22)):
    """A `bench allreduce --json` file whose ring rows follow the model exactly."""
    rows = [{"algorithm": "ring", "size_bytes": n, "time_us": cost("ring", ranks).seconds(n, params)
             * 1e6} for n in sizes]  # fmt: skip
    path.write_text(json.dumps({"benchmark": "allreduce", "ranks": ranks, "rows": rows}))
    return str(path)


def test_model_fits_alpha_and_beta_inside_and_between_nodes_to_their_sweeps(tmp_path, capsys):
    inside, between = Params(2e-5, 3e-10, 1e-10), Params(4e-4, 8e-9, 1e-10)
    intra = ring_sweep(tmp_path / "intra.json", 2, inside)  # one node of 2 ranks
    inter = ring_sweep(tmp_path / "inter.json", 2, between)  # 2 nodes of 1 rank
    path = tmp_path / "m.json"
    assert main(["model", "--ranks", "4", "--sizes", "1M", "--gamma", "1e-10", "--nodes", "2",
                 "--ranks-per-node", "2", "--intra-fit", intra, "--inter-fit", inter,
                 "--json", str(path)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "# inside a node: fitted to the ring's 4 rows of" in out
    assert "# between nodes: fitted to the ring's 4 rows of" in out
    two = json.loads(path.read_text())["two_level"]
    for where, params in (("intra", inside), ("inter", between)):
        assert two[where]["alpha"] == pytest.approx(params.alpha, rel=1e-6)
        assert two[where]["beta"] == pytest.approx(params.beta, rel=1e-6)
        assert two["fits"][where]["held"] == ["gamma"]
    # A given α stays as given; the fit finds β with it held.
    assert main(["model", "--ranks", "4", "--sizes", "1M", "--gamma", "1e-10", "--nodes", "2",
                 "--intra-fit", intra, "--intra-alpha", "1e-5", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["two_level"]["intra"]["alpha"] == 1e-5


def two_level_sweep(path, nodes: int, per_node: int, inside: Params, between: Params,
                    slower: dict[int, float]) -> str:  # fmt: skip
    """A ring,hierarchical sweep on N x R ranks: the model's times, the ring's times times
    `slower` at some sizes."""
    rows = []
    for n in (1 << 10, 1 << 14, 1 << 18, 1 << 22):
        flat = levels.flat_ring_seconds(nodes, per_node, n, inside, between) * slower.get(n, 1.0)
        two = levels.hierarchical_seconds(nodes, per_node, n, inside, between)
        rows += [{"algorithm": "ring", "size_bytes": n, "time_us": flat * 1e6},
                 {"algorithm": "hierarchical", "size_bytes": n, "time_us": two * 1e6,
                  "iter_min_us": two * 0.9e6}]  # fmt: skip
    path.write_text(json.dumps({"benchmark": "allreduce", "ranks": nodes * per_node,
                                "rows": rows}))  # fmt: skip
    return str(path)


def test_a_measured_sweep_is_set_beside_the_predictions_with_both_crossovers(tmp_path, capsys):
    # The flat ring measured 4x faster than predicted at 1 and 16 KiB: the two-level allreduce
    # then wins from 256 KiB, where the model says it wins at every size.
    measured = two_level_sweep(tmp_path / "cl.json", 2, 2, FAST, SLOW,
                               {1 << 10: 0.25, 1 << 14: 0.25})  # fmt: skip
    path, png = tmp_path / "m.json", tmp_path / "levels.png"
    argv = ["model", "--ranks", "4", "--sizes", "1M", "--nodes", "2", "--ranks-per-node", "2",
            "--intra-alpha", str(FAST.alpha), "--intra-beta", str(FAST.beta), "--inter-alpha",
            str(SLOW.alpha), "--inter-beta", str(SLOW.beta), "--gamma", str(SLOW.gamma),
            "--measured", measured, "--json", str(path)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert ("# the two-level allreduce beats the flat ring from 256 KiB (medians); predicted: at "
            "every size of the sweep") in out  # fmt: skip
    found = json.loads(path.read_text())["measured"]
    assert (found["crossover_measured_bytes"], found["crossover_predicted_bytes"]) == (
        1 << 18, 1 << 10)
    for row in found["rows"]:
        assert row["hierarchical_measured_s"] == pytest.approx(row["hierarchical_predicted_s"])
        assert row["hierarchical_least_s"] == pytest.approx(0.9 * row["hierarchical_measured_s"])
        assert row["flat_ring_least_s"] == row["flat_ring_measured_s"]  # no statistics: the median
    assert main(["model", "--nodes", "2", "--ranks-per-node", "3", "--measured", measured]) != 0
    assert "measured on 4 ranks: not nodes of --ranks-per-node 3" in capsys.readouterr().err
    assert main(["model", "--nodes", "2", "--levels-png", str(png)]) != 0
    assert "give --measured BENCH_JSON too" in capsys.readouterr().err
    assert main(["model", "--measured", measured]) != 0
    assert "give --nodes N too" in capsys.readouterr().err


def test_the_levels_figure_is_a_legible_slide(tmp_path):
    pytest.importorskip("matplotlib")
    from syncsgd.util import figures

    table = [{"size_bytes": n, "flat_ring_measured_s": 2e-3, "flat_ring_least_s": 1e-3,
              "hierarchical_measured_s": 1e-3, "hierarchical_least_s": 5e-4}
             for n in (1 << 10, 1 << 20)]  # fmt: skip
    figure = levels.levels_figure(table, 2, 2, FAST, SLOW, "ring")
    assert figures.slide_scale(figure) == pytest.approx(1.0, abs=1e-3)
    assert figures.legibility(figure) == []
    levels.draw_levels(str(tmp_path / "l.png"), table, 2, 2, FAST, SLOW, "ring")
    assert (tmp_path / "l.png").stat().st_size > 0


@pytest.mark.parametrize(("nodes", "per_node"), [(2, 2), (3, 4), (4, 1)])
def test_the_shared_measurement_stands_for_r_flows_over_one_link(nodes, per_node):
    # The inter-node ring measured with all R rings at once takes R times the link's time per
    # byte when they share it fairly: then the two forms of the model agree.
    n = 3e6
    shared = SLOW._replace(beta=per_node * SLOW.beta)
    assert levels.hierarchical_seconds(nodes, per_node, n, FAST, SLOW, shared=shared) == (
        pytest.approx(levels.hierarchical_seconds(nodes, per_node, n, FAST, SLOW)))
    # With a measured sharing, the inter-node phase is that ring on n/R bytes, nothing more.
    measured = Params(2e-3, 1.7e-8, 1e-10)
    assert levels.hierarchical_seconds(nodes, per_node, n, FAST, SLOW, shared=measured) == (
        pytest.approx(levels.intra_cost(per_node).seconds(n, FAST)
                      + cost("ring", nodes).seconds(n / per_node, measured)))  # fmt: skip


def test_model_fits_the_shared_sweep_and_predicts_with_it(tmp_path, capsys):
    inside, between, shared = (Params(2e-5, 3e-10, 1e-10), Params(4e-4, 8e-9, 1e-10),
                               Params(1e-3, 1.5e-8, 1e-10))  # fmt: skip
    intra = ring_sweep(tmp_path / "intra.json", 2, inside)
    link = ring_sweep(tmp_path / "link.json", 2, between)
    together = ring_sweep(tmp_path / "shared.json", 2, shared)
    path = tmp_path / "m.json"
    assert main(["model", "--ranks", "4", "--sizes", "1M", "--gamma", "1e-10", "--nodes", "2",
                 "--ranks-per-node", "2", "--intra-fit", intra, "--inter-fit", link,
                 "--shared-fit", together, "--json", str(path)]) == 0  # fmt: skip
    assert "# between nodes, R rings at once: fitted to the ring's 4 rows of" in (
        capsys.readouterr().out)
    two = json.loads(path.read_text())["two_level"]
    assert two["shared"]["alpha"] == pytest.approx(shared.alpha, rel=1e-6)
    assert two["shared"]["beta"] == pytest.approx(shared.beta, rel=1e-6)
    (row,) = two["rows"]
    assert row["hierarchical_s"] == pytest.approx(
        levels.hierarchical_seconds(2, 2, 1 << 20, inside, between, shared=shared))
    assert row["flat_ring_s"] == pytest.approx(levels.flat_ring_seconds(2, 2, 1 << 20, inside,
                                                                        between))  # fmt: skip
    assert main(["model", "--shared-fit", together]) != 0
    assert "give --nodes N too" in capsys.readouterr().err


def test_a_flat_ring_step_lasts_as_long_as_its_slowest_hop():
    # Inside a node dearer per message (ranks waiting for cores), between nodes dearer per byte:
    # small buffers wait on the hops inside the nodes, large ones on the links.
    inside, between = Params(3e-3, 1e-9, 1e-10), Params(8e-4, 9e-9, 1e-10)
    ring = cost("ring", 4)
    for n in (1e3, 1e5, 1e7):
        steps = [hop.alpha + n / 4 * hop.beta for hop in (inside, between)]
        assert levels.flat_ring_seconds(2, 2, n, inside, between) == pytest.approx(
            ring.a * max(steps) + ring.c * n * between.gamma)
    # One rank per node: no hop inside a node.
    assert levels.flat_ring_seconds(4, 1, 1e3, inside, between) == pytest.approx(
        cost("ring", 4).seconds(1e3, between))


@pytest.mark.parametrize("inter", ["ring", "tree"])
@pytest.mark.parametrize(("nodes", "per_node"), [(2, 2), (3, 2), (2, 3)])
@pytest.mark.parametrize("alpha_inside", [1e-6, 1e-3, 5e-3])
def test_the_crossover_is_where_the_hierarchical_allreduce_wins_from_on(nodes, per_node, inter,
                                                                       alpha_inside):  # fmt: skip
    inside, between = Params(alpha_inside, 1e-9, 1e-10), Params(8e-4, 9e-9, 1e-10)
    where = levels.crossover(nodes, per_node, inside, between, inter)
    sizes = [x * 1.01 for x in (2.0 ** k for k in range(40))]
    wins = [levels.hierarchical_seconds(nodes, per_node, x, inside, between, inter)
            < levels.flat_ring_seconds(nodes, per_node, x, inside, between) for x in sizes]
    if where is None:
        assert not wins[-1]
    else:
        assert all(win for x, win in zip(sizes, wins, strict=True) if x > where)
        assert where == 0 or not all(wins)
