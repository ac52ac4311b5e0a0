"""Token Recycling in transformers' own ``generate`` (``tr_core.hf``, issue 55): on the embedded model the
callable's tokens are this project's plain decoding's, greedy and sampled; streamers get every token; stopping
criteria and several EOS ids cut where plain decoding would; what it cannot do exactly is refused by name; the
matrix is carried between calls; the Hub-ready folder runs with ``trust_remote_code``."""

from __future__ import annotations

import copy
import threading
from pathlib import Path

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

from tr_core.decoding import run
from tr_core.drafters import PlainDrafter
from tr_core.hf import Recycler, recycler_of, token_recycling
from tr_core.sampling import Sampling

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "List the planets of the solar system, then name the largest."
NEW = 32


@pytest.fixture(scope="module")
def model_and_inputs(embedded):
    model, tokenizer = embedded
    model = copy.deepcopy(model)  # the engine puts its kernels into the model it is given: not the shared one
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    return model, tokenizer, inputs


def plain(model, ids: list[int], new: int, sampling=None) -> list[int]:
    engine = recycler_of(model).engine()
    return run(model, ids, PlainDrafter(), new, engine.eos_ids, head=engine.head, sampling=sampling,
               backend=engine.backend).token_ids


def test_greedy_and_sampled_generate_give_plain_decodings_tokens(model_and_inputs):
    model, tokenizer, inputs = model_and_inputs
    prompt = inputs["input_ids"][0].tolist()
    greedy = plain(model, prompt, NEW)
    for method in ("tr", "tr-context", "pld"):
        out = model.generate(**inputs, custom_generate=token_recycling, max_new_tokens=NEW, method=method)
        assert out[0, :len(prompt)].tolist() == prompt and out[0, len(prompt):].tolist() == greedy, method
    sampled = plain(model, prompt, NEW, Sampling(temperature=0.8, top_p=0.9, sample_top_k=40, seed=7))
    got = model.generate(**inputs, custom_generate=token_recycling, max_new_tokens=NEW, do_sample=True,
                         temperature=0.8, top_p=0.9, top_k=40, seed=7, return_dict_in_generate=True)
    assert type(got).__name__ == "GenerateDecoderOnlyOutput" and got.sequences[0, len(prompt):].tolist() == sampled
    torch.manual_seed(11)  # no seed given: one drawn from torch's generator, so manual_seed repeats a run
    first = model.generate(**inputs, custom_generate=token_recycling, max_new_tokens=12, do_sample=True)
    torch.manual_seed(11)
    assert torch.equal(first, model.generate(**inputs, custom_generate=token_recycling, max_new_tokens=12,
                                             do_sample=True))


def test_a_text_iterator_streamer_receives_every_new_token(model_and_inputs):
    model, tokenizer, inputs = model_and_inputs
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("out", model.generate(
        **inputs, custom_generate=token_recycling, max_new_tokens=NEW, streamer=streamer)))
    worker.start()
    streamed = "".join(streamer)
    worker.join()
    new = result["out"][0, inputs["input_ids"].shape[1]:]
    assert streamed == tokenizer.decode(new, skip_special_tokens=True) and len(new) > 4


class AfterToken(StoppingCriteria):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_stopping_criteria_and_several_eos_ids_cut_where_plain_decoding_would(model_and_inputs):
    model, _, inputs = model_and_inputs
    prompt = inputs["input_ids"][0].tolist()
    greedy = plain(model, prompt, NEW)
    stop_at = greedy[9]
    cut = greedy[:greedy.index(stop_at) + 1]
    by_criterion = model.generate(**inputs, custom_generate=token_recycling, max_new_tokens=NEW,
                                  stopping_criteria=StoppingCriteriaList([AfterToken(stop_at)]))
    assert by_criterion[0, len(prompt):].tolist() == cut
    by_eos = model.generate(**inputs, custom_generate=token_recycling, max_new_tokens=NEW,
                            eos_token_id=[stop_at, 2])
    assert by_eos[0, len(prompt):].tolist() == cut
    assert model.generate(**inputs, custom_generate=token_recycling, max_new_tokens=5).shape[1] == len(prompt) + 5


@pytest.mark.parametrize("asked, named", [
    ({"input_ids": "two rows"}, "a batch of 2 rows"),
    ({"num_beams": 2}, "beam search"),
    ({"num_return_sequences": 2, "do_sample": True}, "several sequences a prompt"),
    ({"output_scores": True, "return_dict_in_generate": True}, "output_scores=True"),
    ({"repetition_penalty": 1.3}, "the logits processor RepetitionPenaltyLogitsProcessor"),
    ({"method": "beam"}, "unknown method 'beam'"),
])
def test_what_it_cannot_do_exactly_is_refused_by_name(model_and_inputs, asked, named):
    model, _, inputs = model_and_inputs
    call = dict(inputs)
    if asked.get("input_ids") == "two rows":
        asked = {k: inputs[k].repeat(2, 1) for k in ("input_ids", "attention_mask")}
    with pytest.raises(ValueError, match=named):
        model.generate(**(call | asked), custom_generate=token_recycling, max_new_tokens=4)


def test_the_matrix_is_carried_between_calls_and_saved_and_loaded(model_and_inputs, tmp_path):
    model, _, inputs = model_and_inputs
    shipped = Recycler(model)
    shipped.engine()  # a new recycler starts from the embedded model's shipped hot start
    assert shipped.matrix.rows.any()
    held = Recycler(model)
    model.generate(**inputs, custom_generate=token_recycling, max_new_tokens=NEW, recycler=held)
    assert not torch.equal(held.matrix.rows, shipped.matrix.rows)  # the call taught the recycler's matrix
    kept = held.matrix
    model.generate(**inputs, custom_generate=token_recycling, max_new_tokens=NEW, recycler=held, tree="small")
    assert held.matrix is kept and held.engine("small").matrix is kept  # another tree, the same matrix, carried
    held.save(tmp_path / "m.safetensors")
    again = Recycler.load(model, tmp_path / "m.safetensors")
    assert torch.equal(again.matrix.rows, held.matrix.rows)
    with pytest.raises(ValueError, match="no matrix yet"):
        Recycler(model).save(tmp_path / "none.safetensors")


def test_the_hub_ready_folder_runs_with_trust_remote_code(model_and_inputs):
    model, _, inputs = model_and_inputs
    folder = ROOT / "hub" / "token-recycling"
    assert (folder / "custom_generate" / "generate.py").is_file()
    assert (folder / "custom_generate" / "requirements.txt").is_file()
    by_folder = model.generate(**inputs, custom_generate=str(folder), trust_remote_code=True, max_new_tokens=NEW,
                               method="tr-context")
    by_callable = model.generate(**inputs, custom_generate=token_recycling, max_new_tokens=NEW)
    assert torch.equal(by_folder, by_callable)


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_other_families_through_generate_give_plain_decodings_tokens(arch):
    # issue 55: any causal LM AutoModelForCausalLM loads (Llama above; Qwen2 and GPT-2 here, tiny and random)
    from conftest import VOCAB, tiny_model

    model = tiny_model(arch, dtype=torch.float32)
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    ids = torch.cat([ids, ids[:, :6]], dim=1)  # a repeat: drafts that get accepted
    held = Recycler(model)
    engine = held.engine("small")
    for sampling in (None, Sampling(temperature=0.9, seed=4)):
        reference = run(model, ids[0].tolist(), PlainDrafter(), 20, head=engine.head, sampling=sampling,
                        backend=engine.backend).token_ids
        extra = {} if sampling is None else {"do_sample": True, "temperature": 0.9, "top_k": 0, "seed": 4}
        for method in ("tr", "pld"):
            out = model.generate(ids, attention_mask=torch.ones_like(ids), custom_generate=token_recycling,
                                 max_new_tokens=20, recycler=held, tree="small", method=method, eos_token_id=None,
                                 pad_token_id=0, **extra)
            assert out[0, ids.shape[1]:].tolist() == reference, (arch, method, sampling)


def test_on_the_torch_backend_the_models_own_generate_is_left_as_it_was():
    # a GPU's path, here on the CPU: the torch backend makes its attention the model's during a call only (its
    # fallback outside a run has no mask function: a padded batch in the model's own generate would attend wrongly),
    # so the model's own generate gives the same tokens after Token Recycling ran on it as before
    from conftest import VOCAB, tiny_model

    model = tiny_model("llama", dtype=torch.float32)
    own = model.config._attn_implementation
    ids = torch.randint(3, VOCAB, (1, 14), generator=torch.Generator().manual_seed(2))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=16, pad_token_id=0, eos_token_id=None)
    before = model.generate(ids, do_sample=False, **kwargs)
    held = Recycler(model, backend="torch")
    ours = model.generate(ids, custom_generate=token_recycling, recycler=held, tree="small", **kwargs)
    assert held.engine("small").backend.name == "torch" and torch.equal(ours, before)
    assert model.config._attn_implementation == own and held.attention == (own, "tr_fixed_rows")
    assert torch.equal(model.generate(ids, do_sample=False, **kwargs), before)


def test_a_warper_the_caller_passes_is_read_from_the_warper(model_and_inputs):
    from transformers import LogitsProcessorList, TopKLogitsWarper

    model, _, inputs = model_and_inputs
    prompt = inputs["input_ids"][0].tolist()
    sampled = plain(model, prompt, 16, Sampling(temperature=1.0, sample_top_k=10, seed=5))
    got = model.generate(**inputs, custom_generate=token_recycling, max_new_tokens=16, do_sample=True, seed=5,
                         top_k=None, logits_processor=LogitsProcessorList([TopKLogitsWarper(10)]))
    assert got[0, len(prompt):].tolist() == sampled
    with pytest.raises(ValueError, match="TopKLogitsWarper exactly .* a second time"):
        model.generate(**inputs, custom_generate=token_recycling, max_new_tokens=4, do_sample=True, top_k=20,
                       logits_processor=LogitsProcessorList([TopKLogitsWarper(10)]))
