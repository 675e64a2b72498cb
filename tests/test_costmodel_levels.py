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
