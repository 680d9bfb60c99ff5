"""FOCUS importance and selection in plain NumPy, one sequence at a time, straight from
SPEC_FOCUS section 6 (lists of masked slots, explicit loops; nothing shared with focus_jax)."""

from __future__ import annotations

import math

import numpy as np


def importance(q: np.ndarray, k: np.ndarray, masked: np.ndarray) -> np.ndarray:
    """``q [B, H, D]``, ``k [B, KVH, D]``, ``masked [B]`` -> incoming attention ``[B]``."""
    b, h, d = q.shape
    group = h // k.shape[1]
    m = [i for i in range(b) if masked[i]]
    out = np.zeros(b, np.float64)
    for head in range(h):
        for i in m:
            s = [float(np.dot(q[i, head].astype(np.float64), k[j, head // group].astype(np.float64)))
                 / math.sqrt(d) for j in m]
            pooled = [max([s[j]] + ([s[j - 1]] if j > 0 else []) + ([s[j + 1]] if j + 1 < len(m) else []))
                      for j in range(len(m))]
            e = np.exp(np.array(pooled) - max(pooled))
            for j, p in zip(m, e / e.sum(), strict=True):
                out[j] += p
    return out


def select_retained(delta: np.ndarray, masked: np.ndarray, progress: int, avg: float,
                    alpha: float) -> np.ndarray:
    """The retained masked slots ``[B]`` (spec 6.3-6.7)."""
    b = len(delta)
    m = [i for i in range(b) if masked[i]]
    retained = np.zeros(b, bool)
    if not m:
        return retained
    budget = min(len(m), max(1, math.ceil(np.float32(alpha) * np.float32(max(avg, 1.0)))))
    if len(m) <= budget:
        retained[m] = True
        return retained
    d = delta[m].astype(np.float32)
    mean = np.float32(d.sum(dtype=np.float32) / np.float32(len(m)))
    std = np.sqrt(np.float32(np.square(d - mean).sum(dtype=np.float32) / np.float32(len(m))))
    candidates = [j for j in range(len(m)) if d[j] >= mean + std]
    if len(candidates) >= budget:
        chosen = set(candidates)
    else:
        chosen = set(sorted(range(len(m)), key=lambda j: (-d[j], j))[:budget])
    adjacent = {j for j in range(len(m) - 1)
                if j not in chosen and j + 1 in chosen and m[j + 1] == m[j] + 1}
    chosen |= adjacent
    if not chosen:
        chosen = set(range(len(m)))
    rightmost = max(m[j] for j in chosen)
    chosen |= {j for j in range(len(m)) if progress < m[j] < rightmost}
    retained[[m[j] for j in chosen]] = True
    return retained
