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

In code: ``prefill`` (the prompt into the cache), ``verify_step`` (steps 1-4: the paper's ``verify`` and ``accept``,
``recycling.py``, between the drafter's ``propose`` and ``learn``), ``stop_rule`` (EOS, budget, context),
``step_event`` (step 5's event), and ``decode``, the loop over them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
from transformers import PreTrainedModel

from .backend import Backend, Run, make_backend
from .drafters import Drafter, OnHost, Outcome
from .events import Rates, RowUpdate, StepEvent
from .models import max_positions
from .recycling import accept, verify
from .sampling import Sampler, Sampling, draft_probabilities
from .text import TokenText
from .topk import greedy_and_top_k, top_k
from .tree import TreeBuffers, chain_tree, cut_depth, cut_size


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


def accept_on_device(tokens: torch.Tensor, predicted: torch.Tensor, tree: TreeBuffers) -> torch.Tensor:
    """``accept``'s rule as tensor operations along the template's paths, for a device where each host read costs a
    sync: (2 + m,) holding the accepted draft tokens ``a``, then the best path's node indices (m = max depth + 1,
    padded with -1; its first a + 1 are the accepted path). The first path in leaf order wins a tie, as in
    ``accept`` (``argmax`` returns the first maximum). One read of this (with the tokens) is the step's host copy.

    >>> from tr_core.tree import build_tree
    >>> tree = build_tree([(0,), (1,), (0, 0)])
    >>> accept_on_device(torch.tensor([5, 6, 7, 8]), torch.tensor([6, 8, 0, 3]), tree).tolist()
    [2, 0, 1, 3]
    """
    paths = tree.paths.to(tokens.device)
    if tree.size == 1:
        return torch.cat([paths.new_zeros(1), paths.new_zeros(1)])
    safe = paths.clamp(min=0)
    agree = (tokens[safe[:, 1:]] == predicted[safe[:, :-1]]) & (paths[:, 1:] >= 0)
    accepted = agree.long().cumprod(dim=1).sum(dim=1)  # (P,): the draft tokens each path keeps
    best = accepted.argmax()
    return torch.cat([accepted[best, None], paths[best]])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def prefill(run: Run, ids: torch.Tensor, drafter: Drafter) -> None:
    """Run ``ids`` (p,), the prompt but its last token (the first root), into the ``run``'s cache. The prefill needs
    no logits, unless the drafter learns from the prompt (``needs.prefill``): then it learns from one row per
    distinct prompt token, at its last occurrence (an ``Outcome`` without a path), in chunks of 256."""
    if ids.numel() == 0:
        return
    hidden = run.prefill(ids)
    if drafter.needs.prefill:
        # what overwriting row after row in sequence order would leave, for the output layer and top-k of fewer
        # positions, in chunks to bound the peak
        last = _last_occurrences(ids)
        for i in range(0, last.numel(), 256):
            logits = run.head(hidden[last[i:i + 256]])
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
    token_list: list[int] = field(default_factory=list)  # ``tokens``, ``predicted`` and ``path`` as read to the host
    predicted_list: list[int] = field(default_factory=list)
    path_list: list[int] = field(default_factory=list)


def choose(logits: torch.Tensor, k: int, sampler: Sampler | None, positions: torch.Tensor, tokens: torch.Tensor,
           tree: TreeBuffers, whole: torch.Tensor | None = None,
           no_read: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, list[float] | torch.Tensor]:
    """The model's choice after every node (n,), each node's ``k`` best next tokens by the raw logits (n, k) for the
    drafter (None for ``k`` = 0), and, in a sampled step, each node's probability at its parent (else []).
    ``logits`` (n, V); ``positions`` (n,): the absolute position of the token chosen after each node. Without a
    ``sampler`` the choice is greedy, exactly ``greedy_and_top_k``'s. ``whole``: the pass's logits at its fixed
    shape (R, V), of which ``logits`` are the first n rows (the torch backend): a sampled step's reductions
    (softmax totals, top-p sums) then run over all R rows, so how a device splits them never depends on n.
    ``no_read``: nothing is read to the host here (``positions`` must be the host's); a sampled step's draft
    probabilities come back as a tensor, for the step's one read."""
    if sampler is None:
        return *greedy_and_top_k(logits, k, no_read), []
    top = top_k(logits, k).indices if k else None
    processed = sampler.sampling.processed(logits if whole is None else whole)
    probs = draft_probabilities(processed, tokens, tree.parents, every_row=whole is not None, read=not no_read)
    return sampler.choose(logits, positions, processed[:logits.shape[0]]), top, probs


def read_to_host(*tensors: torch.Tensor | None) -> list[list]:
    """The one deliberate read from the device a step makes (the torch backend): ``tensors`` flattened into one
    copy, then split back into Python lists (None stays None). Integers come back as ints; where a float tensor is
    among them the copy is float64, which holds every token id exactly, and the integers are turned back.

    >>> read_to_host(torch.tensor([3, 4]), None, torch.tensor([[0.5, 1.0]]))
    [[3, 4], None, [0.5, 1.0]]
    """
    present = [t.flatten() for t in tensors if t is not None]
    floats = any(t.is_floating_point() for t in present)
    flat = torch.cat([t.double() if floats else t.long() for t in present]).tolist() if present else []
    out, at = [], 0
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        part = flat[at:at + t.numel()]
        at += t.numel()
        out.append(part if t.is_floating_point() or not floats else [int(v) for v in part])
    return out


class StepClock:
    """The verifier's time in a step: on CUDA two events recorded on the stream (no wait), read once the step's one
    read has waited for the device anyway; elsewhere the host's clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self._events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.cuda:
            self._events[0].record()
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self._events[1].record()
        self._t1 = time.perf_counter()

    def ms(self) -> float:
        """After the step's read: the milliseconds between ``start`` and ``stop`` on the device."""
        return self._events[0].elapsed_time(self._events[1]) if self.cuda else (self._t1 - self._t0) * 1e3


def verify_step(run: Run, context: torch.Tensor, drafter: Drafter, max_pos: int | None,
                sampler: Sampler | None = None) -> Step:
    """Draft, verify the draft in one forward pass, accept, keep the accepted path in the ``run``'s cache, and let
    the drafter learn. ``context`` (L,): the sequence so far, on the host, of which the cache holds all but the last
    token (the root). ``sampler``: how tokens are chosen (None: greedy). On a run whose tensors live on a device
    (``run.resident``: the torch backend), ``resident_step`` does it with one read.
    """
    if getattr(run, "resident", False):
        return resident_step(run, context, drafter, max_pos, sampler)
    started = time.perf_counter()
    device, past_len = context.device, context.numel() - 1
    draft = drafter.propose(context)
    tokens, tree = _fit(run, draft.tokens, draft.tree, past_len, max_pos)
    if tree.parents.device != device:
        tree = tree.to(device)
    positions = past_len + tree.depth.to(device)
    _sync(device)
    t1 = time.perf_counter()
    logits = verify(run, tokens, tree, past_len)
    predicted, top, draft_probs = choose(logits, drafter.needs.top_k, sampler, positions + 1, tokens, tree,
                                         getattr(run, "logits", None))
    _sync(device)
    t2 = time.perf_counter()

    if device.type == "cpu":
        path = accept(tokens, predicted, tree)
        token_list, predicted_list, path_list = tokens.tolist(), predicted.tolist(), path.tolist()
    else:  # one copy to the host a step: the accepted path with the draft and the choices
        n = tokens.numel()
        host = torch.cat([accept_on_device(tokens, predicted, tree), tokens, predicted]).tolist()
        accepted, best = host[0], host[1:-2 * n]
        token_list, predicted_list, path_list = host[-2 * n:-n], host[-n:], best[:accepted + 1]
        path = torch.tensor(path_list, dtype=torch.long, device=device)
    bonus = predicted_list[path_list[-1]]
    forward_ms = (t2 - t1) * 1e3
    rows = drafter.learn(Outcome(tokens, path, top, logits, forward_ms, whole=tree.size == draft.tree.size))
    run.keep(past_len, tree.size, path)
    new_tokens = [token_list[i] for i in path_list[1:]] + [bonus]
    return Step(tokens, tree, predicted, path, bonus, new_tokens, rows, started, forward_ms, draft.budget,
                draft.estimates, draft_probs, token_list, predicted_list)


def _fit(run: Run, tokens: torch.Tensor, tree: TreeBuffers, past_len: int,
         max_pos: int | None) -> tuple[torch.Tensor, TreeBuffers]:
    """The draft cut to what the step has room for: the context's end, the run's window, its rows."""
    if max_pos is not None and past_len + tree.max_depth >= max_pos:
        tokens, tree = tokens[:1], chain_tree(0)  # no room for a draft near the end of the context
    room = run.room(past_len)
    if room is not None and tree.max_depth > room[0]:
        tokens, tree = cut_depth(tokens, tree, *room)
    if run.max_nodes is not None and tree.size > run.max_nodes:
        tokens, tree = cut_size(tokens, tree, run.max_nodes, "(the rows of a pass on this backend)")
    return tokens, tree


def resident_step(run: Run, context: torch.Tensor, drafter: Drafter, max_pos: int | None,
                  sampler: Sampler | None = None) -> Step:
    """``verify_step`` where the model, the cache, the logits and the drafter's matrix live on a device: the choice,
    the acceptance and the matrix's update stay there, and one read (``read_to_host``) brings back what the host
    needs (the accepted path, the draft and the choices, each node's top-k, the rows the drafter peeks at, a sampled
    step's draft probabilities). The draft comes from the host's ``context`` (the root and the n-gram matches need
    no read); on CUDA the verifier's time is taken by events (``StepClock``). The trees stay the host's, their
    tensors copied once per device (``TreeBuffers.on``)."""
    started = time.perf_counter()
    device, past_len = run.device, context.numel() - 1
    draft = drafter.propose(context)
    tokens, tree = _fit(run, draft.tokens, draft.tree, past_len, max_pos)
    tokens = tokens.to(device)
    on_device = tree.on(device)
    clock = StepClock(device)
    clock.start()
    logits = verify(run, tokens, on_device, past_len)
    k = drafter.needs.top_k
    positions = past_len + 1 + tree.depth  # on the host: the sampler's noise is looked up by position
    predicted, top, probs = choose(logits, k, sampler, positions, tokens, on_device, getattr(run, "logits", None),
                                   no_read=True)
    probs = probs if isinstance(probs, torch.Tensor) else None
    packed = accept_on_device(tokens, predicted, on_device)
    peek = getattr(drafter, "peek", None)  # (a drafter written to the Protocol before peek: nothing to peek at)
    peeked = peek(tokens) if peek is not None else None
    clock.stop()
    host_packed, token_list, predicted_list, top_flat, peeked_flat, draft_probs = read_to_host(
        packed, tokens, predicted, top, peeked, probs)
    forward_ms = clock.ms()
    accepted = host_packed[0]
    path_list = host_packed[1:accepted + 2]
    path = packed[1:accepted + 2]
    host = OnHost(token_list, path_list, None if top is None else _rows(top_flat, k),
                  None if peeked is None else _rows(peeked_flat, peeked.shape[-1]))
    rows = drafter.learn(Outcome(tokens, path, top, logits, forward_ms, whole=tree.size == draft.tree.size,
                                 host=host))
    run.keep(past_len, tree.size, path)
    bonus = predicted_list[path_list[-1]]
    new_tokens = [token_list[i] for i in path_list[1:]] + [bonus]
    return Step(tokens, tree, predicted, path, bonus, new_tokens, rows, started, forward_ms, draft.budget,
                draft.estimates, draft_probs or [], token_list, predicted_list, path_list)


def _rows(flat: list, width: int) -> list[list]:
    return [flat[i:i + width] for i in range(0, len(flat), width)]


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
    tree_tokens = step.token_list or step.tokens.tolist()
    return StepEvent(
        step=index,
        method=method,
        tree_name=step.tree.name,
        tree_tokens=tree_tokens,
        tree_parents=list(step.tree.parent_list),
        tree_ranks=list(step.tree.rank_list),
        tree_sources=list(step.tree.sources),
        tree_text=text.pieces(tree_tokens) if text else [""] * len(tree_tokens),
        predicted=step.predicted_list or step.predicted.tolist(),
        accepted_path=step.path_list or step.path.tolist(),
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
           head=None, sampling: Sampling | None = None,
           backend: Backend | None = None) -> Iterator[StepEvent]:
    """Decoding of ``prompt_ids`` with ``drafter``'s drafts, one ``StepEvent`` per forward pass: greedy, or sampled
    by ``sampling`` (None or temperature 0: greedy), the output the same as plain decoding's either way.

    Stops exactly at the first EOS (included in the output) or after ``max_new_tokens`` tokens, or when the model's
    context is full. ``text`` turns ids into strings for the events (empty strings without it). ``backend`` computes
    the passes (``tr_core.backend``; None: ``make_backend``'s choice for the model's device, with ``head``, the
    native backend's output layer made once per model by a caller that decodes many prompts).
    """
    max_pos = _check(model, prompt_ids, max_new_tokens)
    if backend is None:
        backend = make_backend(model, "auto", head=head)
    length = len(prompt_ids)
    seq = torch.empty(length + max_new_tokens, dtype=torch.long)  # on the host: drafting reads it for free
    seq[:length] = torch.tensor(prompt_ids, dtype=torch.long)
    state = backend.start(length, max_new_tokens)
    sampler = None if sampling is None or sampling.is_greedy else Sampler(sampling)
    how = (sampling or Sampling()).describe()
    started = time.perf_counter()
    prefill(state, seq[:length - 1], drafter)  # the cache holds all but the root

    steps, generated, stop_reason = 0, 0, None
    while stop_reason is None:
        step = verify_step(state, seq[:length], drafter, max_pos, sampler)
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
        keep_events: bool = True, head=None, sampling: Sampling | None = None,
        backend: Backend | None = None) -> DecodeResult:
    """Decode to the end and collect the result (with every event, unless ``keep_events`` is False)."""
    events, ids, pieces, last = [], [], [], None
    for last in decode(model, prompt_ids, drafter, max_new_tokens, eos_ids, text, head, sampling, backend):
        ids.extend(last.new_tokens)
        pieces.append(last.new_text)
        if keep_events:
            events.append(last)
    return DecodeResult(ids, "".join(pieces), last.total_steps, last.elapsed_s, last.stop_reason, events)
