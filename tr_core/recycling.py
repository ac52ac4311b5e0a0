"""Token Recycling (Luo et al., 2024, arXiv 2408.08696), the paper's method, top to bottom.

The model's forward passes rank every next token at every position they compute; plain decoding keeps one and
throws the rest away. Token Recycling keeps them, in an *adjacency matrix* M of shape |V| x k: row t holds the k
tokens the model ranked highest after token t, the last time t went through a forward pass. From M it guesses the
next tokens, and verifies its guesses all at once. A step of decoding is four verbs:

    tokens = retrieve(M, root, tree)             # 1. the draft: a tree of guesses read from M, from the last token
    logits = verify(run, tokens, tree, past)     # 2. one forward pass over the whole tree (tree attention)
    path = accept(tokens, predicted, tree)       # 3. the longest path the model agrees with, plus its bonus token
    update(M, tokens, top, path)                 # 4. M's rows of every tree token <- that node's new top-k

1. **Retrieve.** The tree's shape is a fixed template (``tree.py``; the paper's has 80 draft nodes, wide near the
   root and narrow deep down). Its root is the last token of the context; a node at rank r under a parent holding
   token t gets ``M[t, r]``, the r-th best token after t. A breadth-first walk fills the template, one gather per
   depth level.
2. **Verify.** One forward pass over the tree on top of the cached context, each node seeing the context, its
   ancestors and itself (the tree attention mask), at position context length + depth. The backend does it
   (``tr_core/backend.py``); the model's choice at each node (argmax, or the seeded sample) is ``predicted``.
3. **Accept.** A node is right when its token is what the model chose at its parent. The longest run of right
   nodes from the root is kept, and the model's own choice after its last node comes free: the *bonus token*. So a
   step gives at least one token (plain decoding's) and at most the tree's depth + 1.
4. **Update.** Every tree node's output ranks the next tokens after it anew: the rows of all its tokens, accepted
   or not, are overwritten with their nodes' top k. A token at several nodes keeps the row of its last occurrence,
   one on the accepted path that of the path (its real context).

**Hot start.** M is small (49,152 x 8 int32 for the embedded model: 1.5 MB) and is kept across requests: each
request starts from what the ones before taught it. A matrix saved after decoding a set of prompts starts the first
request of a process warm (``AdjacencyMatrix.save`` / ``load``; the engine's ``shipped_matrix_path``); a *cold*
start is all zeros, and its first drafts are guesses of token 0.

The loop that runs the verbs for every method, plain decoding's included, is ``decoding.py`` (``verify_step``);
the drafter that holds M and the template is ``drafters.RecyclingDrafter``; M's storage is ``matrix.py``.
Extensions beside the paper, each in its own place: the choice and acceptance kept on a device with one read a step
(``decoding.resident_step``, ``accept_on_device``), a tree sized each step by measured step times
(``drafters.AdaptiveRecyclingDrafter``, ``budget.py``), trees grown best-first from M's probabilities and branches
copied from the context (``beyond/``).
"""

from __future__ import annotations

import numpy as np
import torch

from .tree import TreeBuffers


def retrieve(rows: torch.Tensor, root: int, tree: TreeBuffers, host: bool | None = None) -> torch.Tensor:
    """The draft: a token for every node of ``tree`` (breadth-first order, ``tokens[0] = root``), read from the
    matrix's ``rows`` (|V|, k): node i gets ``rows[tokens[parent[i]], rank[i]]``, one gather per depth level.
    Returns (tree.size,) int64 on the rows' device. ``host``: whether to read the rows as host memory (None: where
    they are on the CPU); elsewhere tensor operations only, nothing read back.

    >>> from tr_core.tree import build_tree
    >>> M = torch.tensor([[0, 0], [2, 3], [3, 1], [1, 2]], dtype=torch.int32)  # after 1: 2 then 3; after 2: 3 ...
    >>> retrieve(M, 1, build_tree([(0,), (1,), (0, 0)])).tolist()  # root 1; its best two; the best after 2
    [1, 2, 3, 3]
    """
    # in host memory numpy's indexing of a few dozen ids costs ~1 us where torch's costs ~10
    if rows.device.type == "cpu" if host is None else host:
        table, parents, ranks = rows.numpy(), tree.parent_list, tree.rank_list
        found = np.empty(tree.size, dtype=np.int64)
        found[0] = root
        for start, stop in tree.levels:
            found[start:stop] = table[found[parents[start:stop]], ranks[start:stop]]
        return torch.from_numpy(found)
    tree = tree.on(rows.device)
    tokens = torch.empty(tree.size, dtype=torch.long, device=rows.device)
    tokens[0] = root
    flat, k = rows.view(-1), rows.shape[1]
    for start, stop in tree.levels:
        tokens[start:stop] = flat[tokens[tree.parents[start:stop]] * k + tree.ranks[start:stop]]
    return tokens


def verify(run, tokens: torch.Tensor, tree: TreeBuffers, past_len: int) -> torch.Tensor:
    """One forward pass over the draft ``tokens`` (n,) laid out as ``tree``, on top of ``past_len`` cached positions:
    every node's logits (n, V). ``run`` is the backend's (``backend.Run``): the native CPU kernels or the torch
    backend's fixed shapes compute it; each node attends the cache, its ancestors and itself."""
    return run.verify(tokens, tree, past_len)


def accept(tokens: torch.Tensor, predicted: torch.Tensor, tree: TreeBuffers) -> torch.Tensor:
    """Node indices of the accepted path, root first: the longest root-to-leaf path whose every node's token equals
    the model's choice at its parent (greedy or sampled) (the first such path in the template's leaf order on a tie).
    ``predicted[path[-1]]`` is the bonus token.

    ``tokens``, ``predicted``: (n,); returns (a + 1,) where a = accepted draft tokens.

    >>> from tr_core.tree import build_tree
    >>> accept(torch.tensor([5, 6, 7, 8]), torch.tensor([6, 8, 0, 3]), build_tree([(0,), (1,), (0, 0)])).tolist()
    [0, 1, 3]
    """
    if tree.size == 1:
        return tree.paths.new_zeros(1)
    # over Python lists: a tree of a few nodes is checked in microseconds, where tensor ops cost ~10 us each
    toks, pred = tokens.tolist(), predicted.tolist()
    best, best_len = (0,), 0
    for path in tree.path_lists:
        n = 1
        while n < len(path) and toks[path[n]] == pred[path[n - 1]]:
            n += 1
        if n > best_len:  # strictly longer: the first path in leaf order wins a tie
            best, best_len = path, n
    return torch.tensor(best[:best_len], dtype=torch.long, device=tree.paths.device)


def winners(tokens: list[int], priority: list[int] | None = None) -> dict[int, int]:
    """Each distinct token's node whose row ``update`` writes: its last occurrence, or its last occurrence among the
    nodes of ``priority`` (the accepted path), which are written last. In order of first occurrence.

    >>> winners([5, 6, 5, 6]), winners([5, 6, 5, 6], priority=[0, 1])
    ({5: 2, 6: 3}, {5: 0, 6: 1})
    """
    winner = {t: i for i, t in enumerate(tokens)}
    for i in priority or ():
        winner[tokens[i]] = i
    return winner


def update(rows: torch.Tensor, tokens: list[int], top: torch.Tensor, priority: list[int] | None = None,
           host: bool | None = None) -> tuple[list[int], list[int]]:
    """Overwrite the matrix's ``rows`` (|V|, k) of the tree's ``tokens`` with ``top`` (n, >= k), each node's best
    next tokens, best first: every node's row, accepted or not; a token at several nodes gets the row of its last
    occurrence, one on ``priority`` (the accepted path) the path's (``winners``). Returns the ids written and the
    node each took its row from. ``host`` as in ``retrieve``.

    >>> M = torch.zeros(4, 2, dtype=torch.int32)
    >>> update(M, [1, 2, 1], torch.tensor([[2, 3], [3, 0], [0, 2]]), priority=[0])
    ([1, 2], [0, 1])
    >>> M.tolist()
    [[0, 0], [2, 3], [3, 0], [0, 0]]
    """
    winner = winners(tokens, priority)
    ids, nodes = list(winner), list(winner.values())
    write_rows(rows, ids, top[:, :rows.shape[1]].to(rows.dtype), nodes, host)
    return ids, nodes


def write_rows(table: torch.Tensor, ids: list[int], values: torch.Tensor, nodes: list[int],
               host: bool | None = None) -> None:
    """``table[ids[i]] = values[nodes[i]]`` for distinct ``ids``: one write each, in no particular order (``host`` as
    in ``retrieve``)."""
    if table.device.type == "cpu" if host is None else host:
        table.numpy()[ids] = values.numpy()[nodes]
    else:
        table[torch.tensor(ids, device=table.device)] = values[torch.tensor(nodes, device=table.device)]
