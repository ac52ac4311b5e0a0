"""The verification engine: one loop for plain decoding, Prompt Lookup and Token Recycling.

The KV cache always holds every token but the last one, the *root*. Each step:
1. the drafter proposes a draft tree whose node 0 is the root;
2. one forward pass verifies the whole tree on top of the cache, with a 4D additive mask in which each node sees
   the context, its ancestors and itself, and position ids = context length + depth;
3. the longest root-to-leaf path whose tokens equal the model's choice at their parent is accepted, plus the
   bonus token (the model's choice after the path's last node). The choice is greedy (argmax), or, with a
   ``Sampling`` above temperature 0, the Gumbel-max sample of the position (``sampling.py``): the same rule on
   perturbed logits, so every method's sampled output equals plain sampling's, token for token;
4. the cache keeps only the accepted path; the drafter learns from the step (each node's top-k next tokens, and
   the forward's time, from which a tree budget learns step times);
5. an event is yielded. The bonus token becomes the next root.

In code: ``prefill`` (the prompt into the cache), ``verify_step`` (steps 1-4), ``stop_rule`` (EOS, budget, context),
``step_event`` (step 5's event), and ``decode``, the loop over them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
from transformers import DynamicCache, PreTrainedModel

from .drafters import Drafter, Outcome
from .events import Rates, RowUpdate, StepEvent
from .sampling import Sampler, Sampling, draft_probabilities
from .speed import (
    OutputHead,
    body,
    cache_dtype,
    feed,
    grouped_query_attention_in_sdpa,
    keep_accepted_path,
    new_cache,
    window,
    window_room,
)
from .text import TokenText
from .tree import TreeBuffers, chain_tree, cut_depth


@dataclass
class DecodeResult:
    """A finished decoding, collected from its events."""

    token_ids: list[int]
    text: str
    steps: int
    elapsed_s: float
    stop_reason: str | None
    events: list[StepEvent] = field(default_factory=list)

    @property
    def rates(self) -> Rates:
        return Rates(len(self.token_ids), self.steps, self.elapsed_s)


def accept(tokens: torch.Tensor, predicted: torch.Tensor, tree: TreeBuffers) -> torch.Tensor:
    """Node indices of the accepted path, root first: the longest root-to-leaf path whose every node's token equals
    the model's choice at its parent (greedy or sampled) (the first such path in the template's leaf order on a tie).

    ``tokens``, ``predicted``: (n,); returns (a + 1,) where a = accepted draft tokens.
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


CHUNK = 64  # top_k: ids per chunk of the first pass
DIRECT = 4096  # top_k: rows this long or shorter go straight to torch.topk


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(logits, k, dim=-1)`` for rows (n, V) over a large vocabulary, in a fraction of its time on CPU:
    the same values, best first; among equal values the ids may be other equal-valued ids.

    The ids are split into chunks of ``CHUNK`` consecutive ids, and only the ``k`` chunks with the largest maxima are
    searched (plus the last ``V % CHUNK`` ids). Every value above the k-th largest ``v`` is found: a chunk holding
    one has a maximum above ``v``, and fewer than ``k`` chunks do, so it is among the ``k`` taken; and the ``k``
    chunks taken hold ``k`` distinct values of at least ``v`` (their maxima). One pass over the logits (the chunks'
    maxima) instead of topk's partial sort of every row.

    >>> values, ids = top_k(torch.arange(50000.).flip(0)[None], 3)
    >>> values, ids
    (tensor([[49999., 49998., 49997.]]), tensor([[0, 1, 2]]))
    """
    n, vocab = logits.shape
    m = vocab // CHUNK
    if vocab <= DIRECT or k > m or logits.stride(-1) != 1:
        return torch.topk(logits, k, dim=-1)
    maxima = logits[:, :m * CHUNK].view(n, m, CHUNK).amax(dim=-1)  # (n, m): chunk c's maximum
    chunks = top_k(maxima, k).indices  # (n, k), recursively for a very large vocabulary
    ids = (chunks[:, :, None] * CHUNK + torch.arange(CHUNK, device=logits.device)).view(n, k * CHUNK)
    if vocab % CHUNK:
        ids = torch.cat([ids, torch.arange(m * CHUNK, vocab, device=logits.device).expand(n, -1)], dim=1)
    values, picked = torch.topk(logits.gather(1, ids), k, dim=-1)
    return torch.return_types.topk((values, ids.gather(1, picked)))


def greedy_and_top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The greedy choice of every row, exactly as ``argmax`` makes it, and the row's ``k`` best token ids (n, k),
    best first, from one ``topk`` (None for ``k`` = 0). A drafter that learns from every node's top-k so needs no
    second pass over the vocabulary for the greedy choice.

    ``argmax`` takes the lowest id among equal maxima, while ``topk`` promises no order among equal values, so rows
    whose two best logits are equal take their greedy choice from ``argmax``.
    """
    if k < 2:
        predicted = logits.argmax(dim=-1)
        return predicted, (predicted[:, None] if k == 1 else None)
    values, top = top_k(logits, k)
    predicted = top[:, 0].clone()
    ties = values[:, 0] == values[:, 1]
    if bool(ties.any()):
        predicted[ties] = logits[ties].argmax(dim=-1)
    return predicted, top


def tree_mask(tree: TreeBuffers, past_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive 4D mask (1, 1, n, past_len + n): 0 where a node may attend, the dtype's minimum elsewhere."""
    n = tree.size
    mask = torch.zeros(1, 1, n, past_len + n, dtype=dtype, device=device)
    mask[0, 0, :, past_len:].masked_fill_(~tree.mask.to(device), torch.finfo(dtype).min)
    return mask


def tree_attention(base: torch.nn.Module, tree: TreeBuffers, past_len: int, dtype: torch.dtype,
                   device: torch.device) -> dict:
    """The keyword that tells ``base`` (``body``'s forward) which positions each of a step's rows sees: none for a
    chain (causal); for the windowed attention of the lean forward, ``visible``, the tree's own (n, n) mask; else
    ``attention_mask``, the additive 4D mask over the cache and the tree (``tree_mask``; its size grows with the
    context: ~80 x 1,000 floats filled a step for the paper's tree at 900 cached tokens)."""
    if _is_chain(tree):
        return {}
    if window(base) is not None:
        return {"visible": tree.mask.to(device)}
    return {"attention_mask": tree_mask(tree, past_len, dtype, device)}


def _is_chain(tree: TreeBuffers) -> bool:
    return tree.size == tree.max_depth + 1


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def max_positions(model: PreTrainedModel) -> int | None:
    config = model.config
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _check(model: PreTrainedModel, prompt_ids: list[int], max_new_tokens: int) -> int | None:
    """Raise a clear ValueError for inputs ``decode`` cannot take; return the model's context length (None: none)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    max_pos = max_positions(model)
    if max_pos is not None and len(prompt_ids) >= max_pos:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens; this model takes at most {max_pos - 1}")
    return max_pos


def _last_occurrences(ids: torch.Tensor) -> torch.Tensor:
    """Positions of the last occurrence of each distinct value, ascending: ``[5, 3, 5, 7] -> [1, 2, 3]``."""
    n = ids.numel()
    uniq, inverse = torch.unique(ids, return_inverse=True)
    last = torch.full((uniq.numel(),), -1, dtype=torch.long, device=ids.device)
    last.scatter_reduce_(0, inverse, torch.arange(n, device=ids.device), reduce="amax")
    return last.sort().values


def prefill(base: torch.nn.Module, head: OutputHead, cache: DynamicCache, ids: torch.Tensor,
            drafter: Drafter) -> None:
    """Run ``ids`` (p,), the prompt but its last token (the first root), into ``cache``. The prefill needs no
    logits, unless the drafter learns from the prompt (``needs.prefill``): then it learns from one row per distinct
    prompt token, at its last occurrence (an ``Outcome`` without a path), in chunks of 256."""
    if ids.numel() == 0:
        return
    hidden = feed(base, ids, cache)
    if drafter.needs.prefill:
        # what overwriting row after row in sequence order would leave, for the output layer and top-k of fewer
        # positions, in chunks to bound the peak
        last = _last_occurrences(ids)
        for i in range(0, last.numel(), 256):
            logits = head(hidden[last[i:i + 256]])
            top = top_k(logits, drafter.needs.top_k).indices if drafter.needs.top_k else None
            drafter.learn(Outcome(ids[last[i:i + 256]], None, top, logits))


@dataclass
class Step:
    """One verification step, before the stop rule: the draft ``tokens`` (n,) and ``tree``, the model's choice
    (greedy, or sampled) after every node ``predicted`` (n,), the accepted ``path`` (a + 1,) of node indices, the
    ``bonus`` token, ``new_tokens`` (the accepted draft tokens then the bonus token: a + 1 ids), the matrix ``rows``
    the drafter rewrote; ``started`` (``time.perf_counter()`` when the step began) and ``forward_ms`` (the verifier's
    work: the forward pass, the output layer and the choice over the vocabulary, ``choose``, as
    ``calibrate.measure_forward_ms`` times t(N)); ``budget`` and ``budget_estimates``, what the draft said of its
    tree budget; ``draft_probs``, in a sampled step, each node's probability under its parent's processed
    distribution."""

    tokens: torch.Tensor
    tree: TreeBuffers
    predicted: torch.Tensor
    path: torch.Tensor
    bonus: int
    new_tokens: list[int]
    rows: list[RowUpdate]
    started: float
    forward_ms: float
    budget: int | None = None
    budget_estimates: dict = field(default_factory=dict)
    draft_probs: list[float] = field(default_factory=list)


def choose(logits: torch.Tensor, k: int, sampler: Sampler | None, positions: torch.Tensor, tokens: torch.Tensor,
           tree: TreeBuffers) -> tuple[torch.Tensor, torch.Tensor | None, list[float]]:
    """The model's choice after every node (n,), each node's ``k`` best next tokens by the raw logits (n, k) for the
    drafter (None for ``k`` = 0), and, in a sampled step, each node's probability at its parent (else []).
    ``logits`` (n, V); ``positions`` (n,): the absolute position of the token chosen after each node. Without a
    ``sampler`` the choice is greedy, exactly ``greedy_and_top_k``'s."""
    if sampler is None:
        return *greedy_and_top_k(logits, k), []
    top = top_k(logits, k).indices if k else None
    processed = sampler.sampling.processed(logits)
    return sampler.choose(logits, positions, processed), top, draft_probabilities(processed, tokens, tree.parents)


def verify_step(base: torch.nn.Module, head: OutputHead, cache: DynamicCache, context: torch.Tensor,
                drafter: Drafter, dtype: torch.dtype, max_pos: int | None, sampler: Sampler | None = None) -> Step:
    """Draft, verify the draft in one forward pass, accept, keep the accepted path in ``cache``, and let the
    drafter learn. ``context`` (L,): the sequence so far, of which ``cache`` holds all but the last token (the root).
    ``sampler``: how tokens are chosen (None: greedy).
    """
    started = time.perf_counter()
    device, past_len = context.device, context.numel() - 1
    draft = drafter.propose(context)
    tokens, tree = draft.tokens, draft.tree
    if max_pos is not None and past_len + tree.max_depth >= max_pos:
        tokens, tree = tokens[:1], chain_tree(0)  # no room for a draft near the end of the context
    if window(base) is not None and tree.max_depth > window_room(past_len):
        # the step's rows must lie in one attention window (attention.py): the draft is cut at its end
        tokens, tree = cut_depth(tokens, tree, window_room(past_len), "at an attention window's end")
    if tree.parents.device != device:
        tree = tree.to(device)
    positions = (past_len + tree.depth.to(device))[None]
    seen = tree_attention(base, tree, past_len, dtype, device)
    _sync(device)
    t1 = time.perf_counter()
    hidden = base(input_ids=tokens[None], position_ids=positions, cache=cache, use_cache=True,
                  **seen).last_hidden_state[0]
    logits = head(hidden)
    predicted, top, draft_probs = choose(logits, drafter.needs.top_k, sampler, positions[0] + 1, tokens, tree)
    _sync(device)
    t2 = time.perf_counter()

    path = accept(tokens, predicted, tree)
    bonus = int(predicted[path[-1]])
    forward_ms = (t2 - t1) * 1e3
    rows = drafter.learn(Outcome(tokens, path, top, logits, forward_ms, whole=tree.size == draft.tree.size))
    keep_accepted_path(cache, past_len, tree.size, path)
    new_tokens = tokens[path[1:]].tolist() + [bonus]
    return Step(tokens, tree, predicted, path, bonus, new_tokens, rows, started, forward_ms, draft.budget,
                draft.estimates, draft_probs)


def stop_rule(new: list[int], budget: int, eos_ids: set[int] | frozenset[int], length: int,
              max_pos: int | None) -> tuple[list[int], str | None]:
    """A step's ``new`` tokens cut at the first EOS (kept) or at the ``budget`` of tokens left, and why decoding
    stops after them: "eos", "max_new_tokens", "context_full" (the sequence of ``length`` tokens before the step,
    with the new ones, fills the model's ``max_pos`` positions), or None to go on.

    >>> stop_rule([5, 2, 9], 8, {2}, 20, None)
    ([5, 2], 'eos')
    >>> stop_rule([5, 2, 9], 2, {9}, 20, None)
    ([5, 2], 'max_new_tokens')
    >>> stop_rule([5, 6], 8, set(), 62, 64)
    ([5, 6], 'context_full')
    >>> stop_rule([5, 6], 8, set(), 20, 64)
    ([5, 6], None)
    """
    for i, tok in enumerate(new[:budget]):
        if tok in eos_ids:
            return new[: i + 1], "eos"
    new = new[:budget]
    if len(new) == budget:
        return new, "max_new_tokens"
    if max_pos is not None and length + len(new) >= max_pos:
        return new, "context_full"
    return new, None


def step_event(step: Step, index: int, method: str, new: list[int], stop_reason: str | None, total_tokens: int,
               text: TokenText | None, sampling: str = "greedy") -> StepEvent:
    """The plain-data event of verification step number ``index`` (from 0) that added ``new`` tokens. ``text`` turns
    ids into strings (empty strings without it); it is appended to, so each step's event is built once, in order.
    ``sampling``: how the step chose (``Sampling.describe``).
    The caller fills in ``overhead_ms`` and ``elapsed_s``, which count this function's time too."""
    new_text = text.append(new, final=stop_reason is not None) if text else ""
    tree_tokens = step.tokens.tolist()
    return StepEvent(
        step=index,
        method=method,
        tree_name=step.tree.name,
        tree_tokens=tree_tokens,
        tree_parents=list(step.tree.parent_list),
        tree_ranks=list(step.tree.rank_list),
        tree_sources=list(step.tree.sources),
        tree_text=text.pieces(tree_tokens) if text else [""] * len(tree_tokens),
        predicted=step.predicted.tolist(),
        accepted_path=step.path.tolist(),
        bonus_token=step.bonus,
        new_tokens=new,
        new_text=new_text,
        rows_updated=step.rows,
        forward_ms=step.forward_ms,
        budget=step.budget,
        budget_estimates=step.budget_estimates,
        sampling=sampling,
        draft_probs=step.draft_probs,
        total_tokens=total_tokens,
        total_steps=index + 1,
        finished=stop_reason is not None,
        stop_reason=stop_reason,
    )


@torch.inference_mode()
def decode(model: PreTrainedModel, prompt_ids: list[int], drafter: Drafter, max_new_tokens: int,
           eos_ids: set[int] | frozenset[int] = frozenset(), text: TokenText | None = None,
           head: OutputHead | None = None, sampling: Sampling | None = None) -> Iterator[StepEvent]:
    """Decoding of ``prompt_ids`` with ``drafter``'s drafts, one ``StepEvent`` per forward pass: greedy, or sampled
    by ``sampling`` (None or temperature 0: greedy), the output the same as plain decoding's either way.

    Stops exactly at the first EOS (included in the output) or after ``max_new_tokens`` tokens, or when the model's
    context is full. ``text`` turns ids into strings for the events (empty strings without it). ``head`` is the
    output layer (made once per model by the caller that decodes many prompts; see ``kernels.OutputHead``).
    """
    max_pos = _check(model, prompt_ids, max_new_tokens)
    device, dtype = model.device, model.dtype
    if device.type == "cpu":
        grouped_query_attention_in_sdpa()  # tree steps attend to the cache without copying it (kernels.py)
    base, head = body(model), head or OutputHead(model)
    length = len(prompt_ids)
    seq = torch.empty(length + max_new_tokens, dtype=torch.long, device=device)
    seq[:length] = torch.tensor(prompt_ids, dtype=torch.long)
    # room for the whole output and a large tree, so that the cache never copies itself while decoding
    cache = new_cache(model.config, length + max_new_tokens + 128, cache_dtype(base, dtype), device)
    sampler = None if sampling is None or sampling.is_greedy else Sampler(sampling)
    how = (sampling or Sampling()).describe()
    started = time.perf_counter()
    prefill(base, head, cache, seq[:length - 1], drafter)  # the cache holds all but the root

    steps, generated, stop_reason = 0, 0, None
    while stop_reason is None:
        step = verify_step(base, head, cache, seq[:length], drafter, dtype, max_pos, sampler)
        new, stop_reason = stop_rule(step.new_tokens, max_new_tokens - generated, eos_ids, length, max_pos)
        seq[length:length + len(new)] = torch.tensor(new, dtype=torch.long)
        length, generated = length + len(new), generated + len(new)
        event = step_event(step, steps, drafter.name, new, stop_reason, generated, text, how)
        steps += 1
        done = time.perf_counter()
        event.overhead_ms = (done - step.started) * 1e3 - step.forward_ms  # the step's host work: draft, accept, ...
        event.elapsed_s = done - started
        yield event


def run(model: PreTrainedModel, prompt_ids: list[int], drafter: Drafter, max_new_tokens: int,
        eos_ids: set[int] | frozenset[int] = frozenset(), text: TokenText | None = None,
        keep_events: bool = True, head: OutputHead | None = None, sampling: Sampling | None = None) -> DecodeResult:
    """Decode to the end and collect the result (with every event, unless ``keep_events`` is False)."""
    events, ids, pieces, last = [], [], [], None
    for last in decode(model, prompt_ids, drafter, max_new_tokens, eos_ids, text, head, sampling):
        ids.extend(last.new_tokens)
        pieces.append(last.new_text)
        if keep_events:
            events.append(last)
    return DecodeResult(ids, "".join(pieces), last.total_steps, last.elapsed_s, last.stop_reason, events)
