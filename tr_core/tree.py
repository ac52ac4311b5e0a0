"""Draft-tree templates and the buffers derived from them.

A template is a set of nodes, each named by its *index path* from the root: ``(0,)`` is the root's rank-0
child (the most likely next token in the root's adjacency-matrix row), ``(0, 2)`` is the rank-2 child of that node,
and so on. Templates are written compactly as a *branching map* ``{parent path: number of children}``: a node with
``c`` children expands its top ``c`` ranks. For example

    {"": 2, "0": 1}   ->  paths (0,), (1,), (0, 0)

The shipped templates are data, one file each: ``assets/trees/<name>.json`` holds ``{"about": ..., "branching":
{...}}`` (``BUILTIN_TEMPLATES`` names them; ``load_template`` reads them, and any other file of that format).

``build_tree`` turns a template, once, into the tensors the decoder needs (nodes in BFS order, root = node 0):

    parents   (n,)      parent node index, -1 for the root
    ranks     (n,)      rank of the node in its parent's matrix row (0 for the root)
    depth     (n,)      0 for the root
    mask      (n, n)    bool, mask[i, j] = node j is node i or one of its ancestors
    paths     (L, D+1)  node indices of each root-to-leaf path, padded with -1
    levels    list of (start, stop) node ranges, one per depth >= 1
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

import torch

from .assets import TREES_DIR

Path_ = tuple[int, ...]


class TreeTemplateError(ValueError):
    """A tree template that cannot be used, with the reason."""


# The templates shipped in assets/trees/<name>.json, in the order they are offered: the paper's 81-node tree, then
# smaller ones for machines where verifying 81 tokens costs much more than one decoding step.
BUILTIN_TEMPLATES: tuple[str, ...] = ("paper", "medium", "small", "tiny", "chain4")


def _parse_key(key: str) -> Path_:
    """``"012"`` -> ``(0, 1, 2)``; ranks above 9 are written with dots: ``"0.11"`` -> ``(0, 11)``."""
    if key == "":
        return ()
    parts = key.split(".") if "." in key else list(key)
    try:
        return tuple(int(p) for p in parts)
    except ValueError:
        raise TreeTemplateError(f"bad node key {key!r}: expected digits such as '01' or '0.11'") from None


def paths_from_branching(branching: dict[str, int]) -> list[Path_]:
    """Expand a branching map into index paths, e.g. ``{"": 2, "0": 1}`` -> ``[(0,), (1,), (0, 0)]``."""
    if "" not in branching:
        raise TreeTemplateError("branching map has no entry for the root (key '')")
    paths: list[Path_] = []
    for key, count in branching.items():
        parent = _parse_key(key)
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise TreeTemplateError(f"node {key!r}: child count must be a non-negative integer, got {count!r}")
        paths.extend(parent + (r,) for r in range(count))
    return paths


@dataclass(frozen=True)
class TreeBuffers:
    """A template turned into tensors (CPU, int64/bool); see the module docstring for shapes."""

    name: str
    node_paths: tuple[Path_, ...]  # BFS order, root = ()
    parents: torch.Tensor
    ranks: torch.Tensor
    depth: torch.Tensor
    mask: torch.Tensor
    paths: torch.Tensor
    levels: tuple[tuple[int, int], ...]
    # where each node's token comes from, for events and figures: () = every draft node from the adjacency matrix
    # by a template; else one name per node (root included), e.g. "matrix", "best-first", "context"
    sources: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        """Number of nodes including the root."""
        return len(self.node_paths)

    @property
    def max_depth(self) -> int:
        return len(self.levels)

    @cached_property
    def path_lists(self) -> tuple[tuple[int, ...], ...]:
        """``paths`` as Python tuples without the padding: every root-to-leaf path's node indices, root first."""
        return tuple(tuple(i for i in row if i >= 0) for row in self.paths.tolist())

    @cached_property
    def max_rank(self) -> int:
        return int(self.ranks.max()) if self.size > 1 else -1

    @cached_property
    def parent_list(self) -> list[int]:
        """``parents`` as a Python list (read by every step's event, and by the matrix's retrieval on CPU)."""
        return self.parents.tolist()

    @cached_property
    def rank_list(self) -> list[int]:
        return self.ranks.tolist()

    @cached_property
    def _copies(self) -> dict[str, "TreeBuffers"]:
        return {}

    def on(self, device: torch.device | str) -> "TreeBuffers":
        """This tree with its tensors on ``device``: itself where they are there, else a copy made once per device
        and kept (a template's steps on a GPU then copy no tree). Its lists (``parent_list``, ...) stay the host's.

        >>> tree = build_tree([(0,)])
        >>> tree.on("cpu") is tree, tree.on("meta") is tree.on("meta"), tree.on("meta").parents.device.type
        (True, True, 'meta')
        """
        device = torch.device(device)
        if self.parents.device.type == device.type and device.index in (None, self.parents.device.index):
            return self
        if str(device) not in self._copies:
            self._copies[str(device)] = self.to(device)
        return self._copies[str(device)]

    def to(self, device: torch.device | str) -> "TreeBuffers":
        return TreeBuffers(
            self.name, self.node_paths, self.parents.to(device), self.ranks.to(device), self.depth.to(device),
            self.mask.to(device), self.paths.to(device), self.levels, self.sources,
        )


def build_tree(paths: list[Path_] | dict[str, int], name: str = "custom") -> TreeBuffers:
    """Validate a template (index paths or a branching map) and build its buffers.

    >>> t = build_tree({"": 2, "0": 1})
    >>> t.parents.tolist(), t.depth.tolist(), t.paths.tolist()
    ([-1, 0, 0, 1], [0, 1, 1, 2], [[0, 2, -1], [0, 1, 3]])
    """
    if isinstance(paths, dict):
        paths = paths_from_branching(paths)
    node_set: set[Path_] = set()
    for p in paths:
        if not isinstance(p, (tuple, list)) or len(p) == 0:
            raise TreeTemplateError(f"node {p!r}: a node is a non-empty sequence of ranks")
        if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in p):
            raise TreeTemplateError(f"node {p!r}: ranks must be non-negative integers")
        p = tuple(p)
        if p in node_set:
            raise TreeTemplateError(f"node {p!r} appears twice")
        node_set.add(p)
    for p in node_set:
        if len(p) > 1 and p[:-1] not in node_set:
            raise TreeTemplateError(f"node {p!r} has no parent {p[:-1]!r} in the template")

    order = [()] + sorted(node_set, key=lambda p: (len(p), p))  # BFS: by depth, then lexicographic
    index = {p: i for i, p in enumerate(order)}
    n = len(order)
    parents = torch.tensor([-1] + [index[p[:-1]] for p in order[1:]], dtype=torch.long)
    ranks = torch.tensor([0] + [p[-1] for p in order[1:]], dtype=torch.long)
    depth = torch.tensor([len(p) for p in order], dtype=torch.long)

    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(order):
        for d in range(len(p) + 1):
            mask[i, index[p[:d]]] = True

    leaves = [p for p in order if not any(q[:-1] == p for q in node_set)]
    max_depth = max(len(p) for p in order)
    paths_t = torch.full((len(leaves), max_depth + 1), -1, dtype=torch.long)
    for row, leaf in enumerate(leaves):
        for d in range(len(leaf) + 1):
            paths_t[row, d] = index[leaf[:d]]

    levels = []
    for d in range(1, max_depth + 1):
        members = (depth == d).nonzero().flatten()
        levels.append((int(members[0]), int(members[-1]) + 1))
    return TreeBuffers(name, tuple(order), parents, ranks, depth, mask, paths_t, tuple(levels))


def tree_from_parents(parents: list[int], ranks: list[int], name: str = "custom",
                      sources: list[str] | tuple[str, ...] = ()) -> tuple[TreeBuffers, list[int]]:
    """A tree built per step from its nodes' ``parents`` (``parents[0] == -1``, every other parent listed before
    its child) and ``ranks`` (a node's rank in its parent's matrix row, or -1 where it does not come from the
    matrix). Returns the tree in BFS order and ``order``, the input index of each of its nodes (so a caller's tokens
    become ``tokens[order]``). ``node_paths`` are the nodes' rank paths (not unique where ranks are -1).

    >>> tree, order = tree_from_parents([-1, 0, 1, 0], [0, 0, 0, -1], sources=["root", "m", "m", "context"])
    >>> order, tree.parents.tolist(), tree.paths.tolist(), tree.sources
    ([0, 1, 3, 2], [-1, 0, 0, 1], [[0, 2, -1], [0, 1, 3]], ('root', 'm', 'context', 'm'))
    """
    n = len(parents)
    if n == 0 or parents[0] != -1 or len(ranks) != n or (sources and len(sources) != n):
        raise TreeTemplateError("a tree needs parents[0] == -1 and one rank (and source) per node")
    depth = [0] * n
    for i in range(1, n):
        if not 0 <= parents[i] < i:
            raise TreeTemplateError(f"node {i}: its parent {parents[i]} must be listed before it")
        depth[i] = depth[parents[i]] + 1
    order = sorted(range(n), key=lambda i: depth[i])  # stable: BFS by depth, input order within a depth
    place = {old: new for new, old in enumerate(order)}
    new_parents = [-1] + [place[parents[i]] for i in order[1:]]
    rank_paths: list[Path_] = [()] * n
    for new, old in enumerate(order[1:], start=1):
        rank_paths[new] = rank_paths[new_parents[new]] + (ranks[old],)
    # each node's ancestors and itself, as bit sets of node indices (Python ints): no per-node tensor work
    bits = [1] * n
    has_child = [False] * n
    for i in range(1, n):
        bits[i] = bits[new_parents[i]] | (1 << i)
        has_child[new_parents[i]] = True
    mask = torch.tensor([[(b >> j) & 1 for j in range(n)] for b in bits], dtype=torch.bool)
    new_depth = [depth[i] for i in order]
    max_depth = new_depth[-1]
    leaf_paths = []
    for leaf in (i for i in range(n) if not has_child[i]):
        path, node = [], leaf
        while node >= 0:
            path.append(node)
            node = new_parents[node]
        leaf_paths.append(path[::-1] + [-1] * (max_depth + 1 - len(path)))
    levels, start = [], 1
    for d in range(1, max_depth + 1):
        stop = start
        while stop < n and new_depth[stop] == d:
            stop += 1
        levels.append((start, stop))
        start = stop
    tree = TreeBuffers(name, tuple(rank_paths), torch.tensor(new_parents),
                       torch.tensor([0] + [ranks[i] for i in order[1:]]), torch.tensor(new_depth), mask,
                       torch.tensor(leaf_paths, dtype=torch.long), tuple(levels),
                       tuple(sources[i] for i in order) if sources else ())
    return tree, order


def cut_depth(tokens: torch.Tensor, tree: TreeBuffers, max_depth: int,
              why: str = "") -> tuple[torch.Tensor, TreeBuffers]:
    """The draft ``tokens`` (n,) and ``tree`` without their nodes deeper than ``max_depth``: in BFS order those are
    the last nodes, so the rest keep their indices (a prefix of the tree). The cut tree's name says so, and ``why``.

    >>> tree = build_tree([(0,), (1,), (0, 0), (0, 0, 0)], name="t")
    >>> tokens, cut = cut_depth(torch.tensor([7, 8, 9, 10, 11]), tree, 1)
    >>> tokens.tolist(), cut.parents.tolist(), cut.max_depth, cut.name
    ([7, 8, 9], [-1, 0, 0], 1, 't cut at depth 1')
    """
    if tree.max_depth <= max_depth:
        return tokens, tree
    keep = int((tree.depth <= max_depth).sum())
    cut, _ = tree_from_parents(tree.parents[:keep].tolist(), tree.ranks[:keep].tolist(),
                               name=f"{tree.name} cut at depth {max_depth}{' ' + why if why else ''}",
                               sources=tree.sources[:keep])
    return tokens[:keep], cut


@lru_cache(maxsize=64)
def chain_tree(length: int) -> TreeBuffers:
    """A root followed by ``length`` nodes in a line (Prompt Lookup's draft; plain decoding is length 0)."""
    return build_tree([(0,) * d for d in range(1, length + 1)], name=f"chain{length}")


def load_template(spec: str | dict | list, search_dirs: tuple[Path, ...] = ()) -> TreeBuffers:
    """A template by built-in name (``assets/trees/<name>.json``), by name of a ``<name>.json`` file in
    ``search_dirs``, by JSON file path, or given directly as a branching map or list of index paths.

    A JSON file holds ``{"branching": {...}}`` or ``{"paths": [[0], [1], [0, 0], ...]}``, and may say what the tree
    is for in ``"about"`` and name it in ``"name"`` (the file's stem otherwise).

    >>> load_template("tiny").node_paths
    ((), (0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 0, 0))
    """
    if isinstance(spec, (dict, list)):
        return build_tree(spec if isinstance(spec, dict) else [tuple(p) for p in spec])
    if spec in BUILTIN_TEMPLATES:
        return _builtin(spec)
    candidates = [Path(d) / f"{spec}.json" for d in search_dirs]
    if spec.endswith(".json"):
        candidates.insert(0, Path(spec))
    for path in candidates:
        if path.is_file():
            return _from_json(path)
    known = sorted(set(BUILTIN_TEMPLATES) | {p.stem for d in search_dirs for p in Path(d).glob("*.json")})
    raise TreeTemplateError(f"unknown tree template {spec!r}; choose one of {', '.join(known)} or a .json file")


@lru_cache(maxsize=None)
def _builtin(name: str, folder: Path = TREES_DIR) -> TreeBuffers:
    path = folder / f"{name}.json"
    if not path.is_file():
        raise TreeTemplateError(f"the built-in tree template {name!r} is missing: no file {path}")
    return _from_json(path)


def _from_json(path: Path) -> TreeBuffers:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TreeTemplateError(f"cannot read tree template {path}: {e}") from None
    if not isinstance(data, dict):
        raise TreeTemplateError(f"{path}: expected a JSON object with 'branching' or 'paths'")
    name = str(data.get("name", path.stem))
    if "branching" in data and isinstance(data["branching"], dict):
        return build_tree(data["branching"], name=name)
    if "paths" in data and isinstance(data["paths"], list):
        return build_tree([tuple(p) if isinstance(p, list) else p for p in data["paths"]], name=name)
    raise TreeTemplateError(f"{path}: expected a JSON object with 'branching' or 'paths'")


def cut_size(tokens: torch.Tensor, tree: TreeBuffers, max_nodes: int,
             why: str = "") -> tuple[torch.Tensor, TreeBuffers]:
    """The draft ``tokens`` (n,) and ``tree`` cut to their first ``max_nodes`` nodes: in BFS order every node's
    parent comes before it, so those are a tree (a prefix of this one). The cut tree's name says so, and ``why``.

    >>> tree = build_tree([(0,), (1,), (0, 0), (0, 0, 0)], name="t")
    >>> tokens, cut = cut_size(torch.tensor([7, 8, 9, 10, 11]), tree, 4)
    >>> tokens.tolist(), cut.parents.tolist(), cut.name
    ([7, 8, 9, 10], [-1, 0, 0, 1], 't cut to 4 nodes')
    """
    if tree.size <= max_nodes:
        return tokens, tree
    cut, _ = tree_from_parents(tree.parents[:max_nodes].tolist(), tree.ranks[:max_nodes].tolist(),
                               name=f"{tree.name} cut to {max_nodes} nodes{' ' + why if why else ''}",
                               sources=tree.sources[:max_nodes])
    return tokens[:max_nodes], cut
