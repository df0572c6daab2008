"""NC during training (SPEC section 2b): ``from ncanalyze.training import NeuralCollapseCallback``.

The callback lives in ``ncanalyze.store.runs.callback``; it is loaded (with transformers and torch) on first use, so that
importing this module stays light.
"""
from __future__ import annotations

__all__ = ["NeuralCollapseCallback"]


def __getattr__(name: str):
    if name == "NeuralCollapseCallback":
        from ncanalyze.store.runs.callback import (
            NeuralCollapseCallback,  # transformers and torch, on first use only
        )

        return NeuralCollapseCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
