"""Where each draft-tree node sits, and what role it played in a step.

Depth runs along x; each root-to-leaf branch gets its own row, so a node shares the row of its rank-0 child and
the paper's 81-node tree (40 leaves) needs 40 rows, never two labels at one place:

    parents [-1, 0, 0, 1, 1]  ->  row 0:  0 ─┬─ 1 ─┬─ 3        x = depth
                                  row 1:     │     └─ 4        y = -row
                                  row 2:     └─ 2

Positions depend on the tree's shape only (``tree_parents``), so every step drawn from one template puts each node
at the same place and an animation reads as one tree whose labels change. The row above row 0 (``BONUS_Y``) is
kept free for the bonus token, which is not a tree node.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import networkx as nx

if TYPE_CHECKING:
    from tr_core.events import StepEvent

BONUS_Y = 1.5  # the lane above the tree where the bonus token is drawn; half a row more keeps it apart
ROLES = ("rejected", "broke", "accepted", "root", "bonus")  # drawing order: later roles on top


@dataclass(frozen=True)
class TreeLayout:
    """Node positions of one tree shape: ``x[i]`` is node i's depth, ``y[i]`` is minus its row."""

    parents: tuple[int, ...]
    x: tuple[float, ...]
    y: tuple[float, ...]
    rows: int

    @property
    def depth(self) -> int:
        return int(max(self.x))


@lru_cache(maxsize=64)
def tree_layout(parents: tuple[int, ...]) -> TreeLayout:
    """Lay out the tree given by ``parents`` (BFS order, ``parents[0] == -1``; siblings in rank order).

    Rows come from a depth-first walk: a node continues its parent's row if it is the parent's first child,
    otherwise it opens the next free row, which lies below everything its elder siblings' subtrees drew.
    """
    graph = nx.DiGraph()
    graph.add_node(0)
    graph.add_edges_from((p, i) for i, p in enumerate(parents) if p >= 0)  # successors keep rank order
    depth = nx.shortest_path_length(graph, 0)
    row = {0: 0}
    rows = 1
    for parent, child in nx.dfs_edges(graph, 0):
        if next(iter(graph.successors(parent))) == child:
            row[child] = row[parent]
        else:
            row[child] = rows
            rows += 1
    n = len(parents)
    return TreeLayout(parents, tuple(float(depth[i]) for i in range(n)), tuple(-float(row[i]) for i in range(n)), rows)


def node_roles(event: StepEvent) -> list[str]:
    """The role of every tree node in this step, e.g. ``["root", "accepted", "broke", "rejected", ...]``.

    ``broke`` marks where acceptance stopped: the children of the last accepted node, drafts the model disagreed
    with (it wanted the bonus token there instead). A step whose last accepted node is a leaf has none.
    """
    roles = ["rejected"] * len(event.tree_tokens)
    last = event.accepted_path[-1]
    for i, p in enumerate(event.tree_parents):
        if p == last:
            roles[i] = "broke"
    for i in event.accepted_path[1:]:
        roles[i] = "accepted"
    roles[0] = "root"
    return roles


def node_sources(event: StepEvent) -> list[str]:
    """Where every tree node came from: ``event.tree_sources``, or for a template's tree (which records none) the
    root and the matrix: ``["root", "matrix", "matrix", ...]``."""
    return list(event.tree_sources) or ["root"] + ["matrix"] * (len(event.tree_tokens) - 1)
