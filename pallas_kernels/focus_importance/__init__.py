"""FOCUS importance of masked tokens: see ``reference`` for the contract."""

from pallas_kernels.focus_importance.api import focus_importance, focus_importance_sharded

__all__ = ["focus_importance", "focus_importance_sharded"]
