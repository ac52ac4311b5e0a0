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


# --- probabilities kept beside the ids (tr-dynamic) -------------------------------------------------------------------

def test_a_matrix_keeps_no_probabilities_unless_asked():
    m = AdjacencyMatrix(10, 3)
    assert m.probs is None
    m.update(torch.tensor([2]), torch.tensor([[7, 8, 9]]))
    # given probabilities, it keeps them from then on: rows written before are unknown (NaN), never written 0
    m.update(torch.tensor([1]), torch.tensor([[4, 0, 5]]), probs=torch.tensor([[0.5, 0.2, 0.1]]))
    assert m.probs is not None and m.probs[1].tolist() == pytest.approx([0.5, 0.2, 0.1], rel=1e-3)
    assert m.probs[2].isnan().all() and not m.probs[3].any()
    m = AdjacencyMatrix(10, 3)
    kept = AdjacencyMatrix(10, 3, keep_probs=True)
    assert kept.probs.dtype == torch.float16 and kept.probs.shape == (10, 3) and not kept.probs.any()
    assert kept.nbytes == 10 * 3 * (4 + 2)


def test_update_writes_probabilities_by_the_same_priority_rule_as_ids():
    m = AdjacencyMatrix(vocab_size=6, k=2, keep_probs=True)
    tokens = torch.tensor([3, 5, 3])
    top = torch.tensor([[2, 3], [0, 4], [5, 4]])
    probs = torch.tensor([[0.5, 0.25], [0.75, 0.125], [0.375, 0.25]])
    m.update(tokens, top, priority=torch.tensor([0, 1]), probs=probs)
    assert m.rows[3].tolist() == [2, 3] and m.probs[3].tolist() == [0.5, 0.25]  # the root's, on the accepted path
    assert m.probs[5].tolist() == [0.75, 0.125] and m.probs[0].tolist() == [0.0, 0.0]
    m.update(tokens, top, probs=probs)
    assert m.rows[3].tolist() == [5, 4] and m.probs[3].tolist() == [0.375, 0.25]  # the last occurrence
    m.update(torch.tensor([1]), torch.tensor([[4, 0, 5]]), probs=torch.tensor([[0.5, 0.25, 0.125]]))
    assert m.probs[1].tolist() == [0.5, 0.25]  # the first k of a longer top
    # ids written without probabilities: that row's probabilities become unknown
    m.update(torch.tensor([5]), torch.tensor([[1, 2]]))
    assert m.probs[5].isnan().all() and m.rows[5].tolist() == [1, 2]


def test_the_prior_is_the_running_mean_of_the_probabilities_written():
    m = AdjacencyMatrix(8, k=2, keep_probs=True)
    assert m.prior() == [0.5, 0.25]  # nothing written yet: the default prior
    m.update(torch.tensor([1, 2]), torch.tensor([[2, 3], [4, 5]]), probs=torch.tensor([[0.8, 0.1], [0.5, 0.2]]))
    # (0.5 + 0.8 + 0.5) / 3, (0.25 + 0.1 + 0.2) / 3: the default counts as one row
    assert m.prior() == pytest.approx([0.6, 0.55 / 3])


def test_seed_writes_the_softmax_probabilities_of_the_top_k():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 20, generator=g) * 3
    ids = torch.tensor([4, 7, 9])
    m = AdjacencyMatrix(20, 4, keep_probs=True)
    top = logits.topk(4, dim=-1).indices
    m.seed(ids, top, torch.softmax(logits, dim=-1).gather(1, top))
    want = torch.softmax(logits, dim=-1).topk(4, dim=-1)
    assert torch.equal(m.rows[ids], want.indices.to(torch.int32))
    assert torch.allclose(m.probs[ids].float(), want.values, rtol=1e-3, atol=1e-4)
    assert m.prob_count == 3
    with pytest.raises(ValueError, match="keeps probabilities"):
        m.seed(ids, top)
    plain = AdjacencyMatrix(20, 4)
    plain.seed(ids, top)
    assert torch.equal(plain.rows, m.rows) and plain.probs is None


def test_probabilities_round_trip_through_save_and_load(tmp_path):
    g = torch.Generator().manual_seed(1)
    m = AdjacencyMatrix(50, 4, keep_probs=True)
    m.update(torch.arange(1, 30), torch.randint(1, 50, (29, 4), generator=g), probs=torch.rand(29, 4, generator=g))
    m.update(torch.tensor([40]), torch.tensor([[1, 2, 3, 4]]))  # written without probabilities: unknown
    path = tmp_path / "m.safetensors"
    m.save(path)
    back = AdjacencyMatrix.load(path, vocab_size=50, k=4)
    assert torch.equal(back.rows, m.rows)
    assert torch.equal(back.probs.isnan(), m.probs.isnan()) and back.probs[40].isnan().all()
    assert torch.equal(back.probs.nan_to_num(), m.probs.nan_to_num())
    # restarted from the known rows, as stored (float16)
    assert back.prob_count == 29 and back.prior() == pytest.approx(m.prior(), abs=1e-3)
    smaller = AdjacencyMatrix.load(path, k=2)
    assert torch.equal(smaller.probs.nan_to_num(), m.probs[:, :2].nan_to_num())


def test_a_file_without_probabilities_loads_and_turns_them_on_as_unknown(tmp_path):
    old = AdjacencyMatrix(10, 3)
    old.rows[4] = torch.tensor([7, 2, 9], dtype=torch.int32)
    path = tmp_path / "old.safetensors"
    old.save(path)
    m = AdjacencyMatrix.load(path)
    assert m.probs is None and torch.equal(m.rows, old.rows)
    assert m.with_probs() is m and m.with_probs().probs is m.probs  # in place, once
    assert m.probs[4].isnan().all()  # written: unknown, read as the prior
    assert not m.probs[torch.arange(10) != 4].any()  # never written: probability 0
    assert m.prior() == [0.5, 0.25, 0.125]


def test_clone_copies_the_probabilities():
    m = AdjacencyMatrix(6, 2, keep_probs=True)
    m.update(torch.tensor([1]), torch.tensor([[2, 3]]), probs=torch.tensor([[0.5, 0.25]]))
    c = m.clone()
    c.update(torch.tensor([1]), torch.tensor([[4, 5]]), probs=torch.tensor([[0.75, 0.125]]))
    assert m.probs[1].tolist() == [0.5, 0.25] and c.probs[1].tolist() == [0.75, 0.125]
    assert m.prob_count == 1 and c.prob_count == 2
    assert AdjacencyMatrix(6, 2).clone().probs is None
