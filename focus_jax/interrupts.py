"""Host flags a running decode round reads after every step, so the host can end it early.

A round is one call of a compiled ``lax.while_loop`` (:func:`focus_jax.decoding.decode_round`);
the host cannot reach into it once it runs. A round compiled with
``DecodeSettings.interruptible`` asks the host, in its loop condition, whether its
:class:`Interrupt` is set (``jax.experimental.io_callback``: 0.04 ms per step on an H200,
docs/serving.md), and ends after the current step if so. A server sets it when a request
arrives that a free slot could take, so the arrival is admitted at the next step boundary
instead of when the round would have ended.

The compiled round names its interrupt by a run-time channel number (one program serves every
engine); this module maps channel numbers to flags.
"""

from __future__ import annotations

import itertools
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jaxtyping import Array, Bool, Int

_FLAGS: dict[int, threading.Event] = {}
_CHANNELS = itertools.count(1)
NO_CHANNEL = 0
"""The channel of rounds that have no interrupt: never set."""


class Interrupt:
    """A flag that ends the decode round running with its :attr:`channel` after the current
    step. Thread-safe; setting it while no round runs ends the next round after one step."""

    def __init__(self) -> None:
        self.channel = next(_CHANNELS)
        self._event = threading.Event()
        _FLAGS[self.channel] = self._event
        weakref.finalize(self, _FLAGS.pop, self.channel, None)

    def set(self) -> None:
        self._event.set()

    def clear(self) -> None:
        self._event.clear()

    def is_set(self) -> bool:
        return self._event.is_set()


def _is_set(channel: np.ndarray) -> np.ndarray:
    flag = _FLAGS.get(int(channel))
    return np.asarray(flag is not None and flag.is_set())


def requested(channel: Int[Array, ""]) -> Bool[Array, ""]:
    """Inside a traced round: whether the interrupt of ``channel`` is set now (asks the host)."""
    return io_callback(_is_set, jax.ShapeDtypeStruct((), jnp.bool_), channel, ordered=False)
