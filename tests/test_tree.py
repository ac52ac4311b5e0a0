import json

import pytest
import torch

from tr_core.assets import TREES_DIR
from tr_core.matrix import AdjacencyMatrix
from tr_core.tree import BUILTIN_TEMPLATES, TreeTemplateError, _builtin, build_tree, chain_tree, load_template


def test_four_node_template_by_hand():
    # root -> a (rank 0) -> c (rank 0); root -> b (rank 1)
    t = build_tree({"": 2, "0": 1})
    assert t.node_paths == ((), (0,), (1,), (0, 0))
    assert t.parents.tolist() == [-1, 0, 0, 1]
    assert t.ranks.tolist() == [0, 0, 1, 0]
    assert t.depth.tolist() == [0, 1, 1, 2]
    assert t.mask.int().tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 0, 1, 0],
        [1, 1, 0, 1],
    ]
    assert t.paths.tolist() == [[0, 2, -1], [0, 1, 3]]
    assert t.levels == ((1, 3), (3, 4))


def test_paths_and_branching_give_the_same_tree():
    a = build_tree({"": 2, "0": 1})
    b = build_tree([(1,), (0, 0), (0,)])
    assert a.parents.tolist() == b.parents.tolist() and torch.equal(a.mask, b.mask)


def test_paper_tree_shape():
    t = load_template("paper")
    assert t.size == 81
    assert [stop - start for start, stop in t.levels] == [8, 21, 25, 15, 8, 3]
    deepest = [p for p in t.node_paths if len(p) == t.max_depth]
    assert (0,) * 6 in deepest  # the rank-0 branch is the deepest
    # the mask is the ancestor relation implied by parents
    for i in range(t.size):
        ancestors, j = {i}, i
        while t.parents[j] >= 0:
            j = int(t.parents[j])
            ancestors.add(j)
        assert set(t.mask[i].nonzero().flatten().tolist()) == ancestors
    # every node lies on some root-to-leaf path, and paths follow parents
    on_paths = set(t.paths[t.paths >= 0].tolist())
    assert on_paths == set(range(t.size))
    for row in t.paths.tolist():
        nodes = [n for n in row if n >= 0]
        assert all(int(t.parents[c]) == p for p, c in zip(nodes, nodes[1:]))


@pytest.mark.parametrize("name", sorted(BUILTIN_TEMPLATES))
def test_builtin_templates_are_valid(name):
    t = load_template(name)
    assert t.size == len(set(t.node_paths))
    assert t.max_rank < 8
    assert t.name == name


def test_builtin_templates_are_the_shipped_files():
    for name in BUILTIN_TEMPLATES:
        data = json.loads((TREES_DIR / f"{name}.json").read_text())
        assert set(data) == {"about", "branching"} and data["about"]
        assert load_template(name).node_paths == build_tree(data["branching"]).node_paths
    assert [load_template(n).size for n in BUILTIN_TEMPLATES] == [81, 34, 13, 7, 5]  # offered largest first


def test_a_missing_builtin_file_is_a_clear_error(tmp_path):
    with pytest.raises(TreeTemplateError, match="built-in tree template 'paper' is missing"):
        _builtin("paper", tmp_path)


def test_chain_tree():
    assert chain_tree(0).size == 1 and chain_tree(0).paths.tolist() == [[0]]
    assert chain_tree(3).parents.tolist() == [-1, 0, 1, 2]


@pytest.mark.parametrize("bad, why", [
    ({"0": 1}, "no entry for the root"),
    ([(0,), (0, 0), (1, 0)], "has no parent"),
    ([(0,), (0,)], "appears twice"),
    ([(0,), (-1,)], "non-negative"),
    ([()], "non-empty"),
    ({"": 2, "x": 1}, "bad node key"),
    ({"": -1}, "non-negative integer"),
])
def test_invalid_templates_are_rejected(bad, why):
    with pytest.raises(TreeTemplateError, match=why):
        build_tree(bad)


def test_unknown_template_name_lists_the_choices():
    with pytest.raises(TreeTemplateError, match="paper"):
        load_template("no-such-tree")


def test_rank_beyond_k_is_rejected():
    with pytest.raises(ValueError, match="k=4"):
        AdjacencyMatrix(16, k=4).retrieve(0, load_template("paper"))


def test_template_from_json_file(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"name": "mine", "paths": [[0], [1], [0, 0]]}))
    t = load_template("mine", search_dirs=(tmp_path,))
    assert t.name == "mine" and t.parents.tolist() == [-1, 0, 0, 1]
    (tmp_path / "wide.json").write_text(json.dumps({"about": "two guesses", "branching": {"": 2}}))
    assert load_template("wide", search_dirs=(tmp_path,)).node_paths == ((), (0,), (1,))
    assert load_template(str(path)).size == 4
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(TreeTemplateError, match="cannot read"):
        load_template(str(tmp_path / "broken.json"))
