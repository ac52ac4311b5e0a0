"""How a failed request ends: with one clear sentence on the page and through the API, never a stack trace, and the
app serving the next request.

A value the app refuses (``InputError``), a model that does not load, a tree template that does not build: their
own message. Anything else is a fault of the server: its traceback goes to the server's log, the user gets one line.

    class Handlers:
        @user_errors
        def live(self, prompt, ...): ...      # a generator stays a generator
"""

from __future__ import annotations

import functools
import inspect
import logging

import gradio as gr

from tr_core.models import ModelLoadError
from tr_core.tree import TreeTemplateError

from .inputs import InputError

EXPECTED = (InputError, ModelLoadError, TreeTemplateError)
log = logging.getLogger("token_recycling.app")


def as_user_error(error: Exception) -> gr.Error:
    """The message a user reads for ``error``."""
    if isinstance(error, gr.Error):
        return error
    if isinstance(error, EXPECTED):
        return gr.Error(str(error), print_exception=False)
    log.error("a request failed", exc_info=error)
    return gr.Error(f"The server could not finish this request ({type(error).__name__}). The app keeps serving: "
                    "try again, or with other settings.", print_exception=False)


def user_errors(fn):
    """``fn`` (a function or a generator function) with every exception turned into ``as_user_error``'s message."""
    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def stream(*args, **kwargs):
            try:
                yield from fn(*args, **kwargs)
            except Exception as e:  # GeneratorExit (a closed stream) is not an Exception: it passes through
                raise as_user_error(e) from None
        return stream

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise as_user_error(e) from None
    return call
