"""The embedded model (SmolLM2-135M-Instruct, fp32) on Spec-Bench prompts: Token Recycling with the paper tree
against plain greedy decoding."""

import pytest
import torch

from tr_core import (
    AdjacencyMatrix,
    PlainDrafter,
    RecyclingDrafter,
    TokenText,
    encode_prompt,
    eos_token_ids,
    load_template,
    run,
)
from tr_core.spec_bench import load_questions, stratified

NEW_TOKENS = 32
PAPER_TOKENS = 24  # the 81-node tree's steps are the suite's slowest: fewer of them
NEAR_TIE = 1e-3  # fp32 logit gap under which a batched and a one-token forward may pick different argmaxes


@pytest.mark.slow
def test_paper_tree_on_spec_bench_prompts(embedded):
    model, tokenizer = embedded
    questions = [q for q in stratified(load_questions(), 1) if q.category != "summarization"][:4]
    assert len(questions) == 4
    eos = eos_token_ids(model, tokenizer)
    matrix = AdjacencyMatrix(model.get_output_embeddings().weight.shape[0], 8)  # hot start across prompts
    identical, tokens, steps = 0, 0, 0
    for q in questions:
        ids = encode_prompt(tokenizer, q.prompt)
        plain = run(model, ids, PlainDrafter(), PAPER_TOKENS, eos)
        tr = run(model, ids, RecyclingDrafter(matrix, load_template("paper")), PAPER_TOKENS, eos, TokenText(tokenizer))
        identical += tr.token_ids == plain.token_ids
        tokens += len(tr.token_ids)
        steps += tr.steps
        # every accepted draft token and every bonus token is the verifier's argmax at its parent node
        for e in tr.events:
            path = e.accepted_path
            assert all(e.tree_tokens[c] == e.predicted[p] for p, c in zip(path, path[1:]))
            assert e.bonus_token == e.predicted[path[-1]]
        # and, checked independently, each output token is the argmax of a from-scratch forward over the whole
        # sequence, up to fp32 near-ties
        seq = torch.tensor([ids + tr.token_ids])
        with torch.inference_mode():
            logits = model(input_ids=seq).logits[0, len(ids) - 1:-1]
        chosen = logits.gather(1, torch.tensor(tr.token_ids)[:, None])[:, 0]
        gap = logits.max(dim=1).values - chosen
        assert float(gap.max()) < NEAR_TIE, f"question {q.question_id}: a token {float(gap.max()):.2e} below the max"
        assert tr.text == tokenizer.decode(tr.token_ids)
    mat = tokens / steps
    print(f"\nembedded model, paper tree, hot start over {len(questions)} Spec-Bench prompts, {PAPER_TOKENS} tokens: "
          f"mean accepted tokens {mat:.2f}, identical to plain {identical}/{len(questions)}")
    assert identical >= 3
    assert mat > 1.2


@pytest.mark.slow
@pytest.mark.parametrize("prompt", ["Reply with five emoji only: 🚲🌍🎉", "用中文写一首关于自行车的短诗。",
                                    "Translate to Japanese: good morning, friends 🌅"])
def test_an_answer_cut_inside_a_character_shows_no_replacement_character(embedded, prompt):
    """Emoji and CJK characters take several byte tokens: streamed, a character waits for its last byte; cut by the
    token budget (8 and 13 tokens cut these answers inside one), it is left out rather than shown as U+FFFD."""
    model, tokenizer = embedded
    eos, ids = eos_token_ids(model, tokenizer), encode_prompt(tokenizer, prompt)
    longest = run(model, ids, PlainDrafter(), 24, eos, TokenText(tokenizer))
    for n in (8, 13):
        result = run(model, ids, PlainDrafter(), n, eos, TokenText(tokenizer))
        assert "\ufffd" not in result.text and all("\ufffd" not in e.new_text for e in result.events)
        assert longest.text.startswith(result.text), "what is shown is what the longer answer goes on from"
    cut = [n for n in (8, 13) if tokenizer.decode(longest.token_ids[:n]).endswith("\ufffd")]
    assert cut, "the control: at least one of these budgets ends inside a character"
