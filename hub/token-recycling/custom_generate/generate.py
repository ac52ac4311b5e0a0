"""Token Recycling (arXiv 2408.08696), training-free speculative decoding, as a transformers ``custom_generate``:

    model.generate(**inputs, custom_generate="<the folder that holds this one>", max_new_tokens=64, method="tr")

(with the flag transformers asks for before it runs a folder's code: see the folder's README.md)

It runs ``tr_core.hf.token_recycling`` (its docstring: what it keeps exact and what it refuses), so the project's
``tr_core`` package must be importable: its repository on the Python path."""

from transformers import GenerationMixin


def generate(model, **kwargs):
    """What ``generate`` runs for this folder: its own preparation of the inputs, then Token Recycling's loop."""
    try:
        from tr_core.hf import token_recycling
    except ImportError as e:
        raise ImportError("Token Recycling's custom_generate needs the project's tr_core package: put its repository "
                          "on the Python path (PYTHONPATH)") from e
    return GenerationMixin.generate(model, custom_generate=token_recycling, **kwargs)
