"""The torch backend (``tr_core.backend``'s seam): stock torch operations at fixed shapes on any device.

``TorchBackend(model, rows)`` runs every pass of a run over ``rows`` query rows and a fixed number of key slots
(``rows.py``), so that every method's tokens equal plain decoding's by construction; on CUDA each pass is one
captured graph (``graph.py``). ``timing.rows_curve`` measures t(R) for it where it runs.
"""

from .backend import TILE, OutputLayer, TorchBackend, default_rows, round_up, supports

__all__ = ["TILE", "OutputLayer", "TorchBackend", "default_rows", "round_up", "supports"]
