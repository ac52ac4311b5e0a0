import pytest
import torch

from tr_core.matrix import AdjacencyMatrix
from tr_core.tree import build_tree


def test_retrieval_from_a_hand_filled_matrix():
    m = AdjacencyMatrix(vocab_size=10, k=3)
    m.rows[4] = torch.tensor([7, 2, 9], dtype=torch.int32)
    m.rows[7] = torch.tensor([1, 5, 3], dtype=torch.int32)
    m.rows[2] = torch.tensor([8, 6, 0], dtype=torch.int32)
    m.rows[1] = torch.tensor([3, 3, 3], dtype=torch.int32)
    tree = build_tree({"": 2, "0": 2, "1": 1, "00": 1})
    # BFS: root, (0) (1), (0,0) (0,1) (1,0), (0,0,0)
    assert m.retrieve(4, tree).tolist() == [4, 7, 2, 1, 5, 8, 3]


def test_update_overwrites_rows_with_topk_and_accepted_path_wins():
    m = AdjacencyMatrix(vocab_size=6, k=2)
    tokens = torch.tensor([3, 5, 3])  # token 3 occurs twice: node 0 (root) and node 2
    top = torch.tensor([[2, 3], [0, 4], [5, 4]])  # each node's best next tokens, best first
    m.update(tokens, top, priority=torch.tensor([0, 1]))
    assert m.rows[5].tolist() == [0, 4]
    assert m.rows[3].tolist() == [2, 3]  # from the root (on the accepted path), not from node 2
    m.update(tokens, top)
    assert m.rows[3].tolist() == [5, 4]  # without priority the last occurrence wins


def test_update_keeps_the_first_k_of_a_longer_top_and_refuses_a_shorter_one():
    m = AdjacencyMatrix(vocab_size=6, k=2)
    m.update(torch.tensor([1]), torch.tensor([[4, 0, 5]]))
    assert m.rows[1].tolist() == [4, 0]
    with pytest.raises(ValueError, match="k=2"):
        m.update(torch.tensor([1]), torch.tensor([[4]]))


def test_save_load_round_trip_and_size(tmp_path):
    m = AdjacencyMatrix(49_152, 8)
    assert m.nbytes < 2 * 1024 * 1024  # the embedded model's matrix stays under 2 MB
    m.rows.random_(0, 49_152)
    path = tmp_path / "m.safetensors"
    m.save(path, {"model": "test"})
    back = AdjacencyMatrix.load(path, vocab_size=49_152, k=8)
    assert torch.equal(back.rows, m.rows)
    smaller = AdjacencyMatrix.load(path, k=4)
    assert torch.equal(smaller.rows, m.rows[:, :4])


def test_load_mismatch_is_a_clear_error(tmp_path):
    path = tmp_path / "m.safetensors"
    AdjacencyMatrix(100, 4).save(path)
    for kwargs, why in [({"vocab_size": 50}, "vocabulary of 100"), ({"k": 8}, "k=4")]:
        try:
            AdjacencyMatrix.load(path, **kwargs)
        except ValueError as e:
            assert why in str(e)
        else:
            raise AssertionError("mismatch not detected")
    (tmp_path / "junk").write_bytes(b"not a matrix")
    try:
        AdjacencyMatrix.load(tmp_path / "junk")
    except ValueError as e:
        assert "cannot load adjacency matrix" in str(e)
    else:
        raise AssertionError("junk file accepted")
