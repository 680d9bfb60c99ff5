"""FOCUS importance of masked tokens: see ``reference`` for the contract."""

from pallas_kernels.focus_importance.api import focus_importance

__all__ = ["focus_importance"]
