"""The jax-triton attention kernel in Triton's CPU interpreter, against the jnp reference.

No GPU needed: ``TRITON_INTERPRET=1`` runs the kernels on the CPU with PyTorch tensors. Needs
``triton`` and ``torch`` (a CPU build is enough) beside jax; neither is in this project's
environment, so run it from one that has them:

    python -m venv /tmp/tri && /tmp/tri/bin/pip install triton torch jax==0.11.2 jaxtyping
    /tmp/tri/bin/python scripts/check_triton_in_interpreter.py

It checks the kernel on a small GQA case with a slot of every kind (rows and no rows, short and
full caches) and padding rows.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax.numpy as jnp
import numpy as np
import torch
import triton

from pallas_kernels.ragged_attention import reference, triton_gpu


def main() -> None:
    rng = np.random.default_rng(0)
    layers, slots, positions, kv_heads, d, heads, block = 2, 4, 64, 2, 32, 4, 8
    k, v = (rng.standard_normal((layers, slots, positions, kv_heads, d)).astype(np.float32)
            for _ in range(2))
    keep = rng.random(slots * block) < 0.4
    keep[:block] = True  # slot 0: every row
    order = np.concatenate([np.nonzero(keep)[0], np.nonzero(~keep)[0]]).astype(np.int32)
    n = int(keep.sum()) + 3  # padding rows past the count
    rows, valid = order[:n], np.arange(n) < keep.sum()
    q = rng.standard_normal((n, heads, d)).astype(np.float32)
    kv_len = np.array([40, 64, 17, 1], np.int32)
    layer, block_n = 1, 16
    want = np.asarray(reference.ragged_attention(*map(jnp.asarray, (q, rows, valid, k, v)), layer,
                                                 jnp.asarray(kv_len), block_size=block))
    group, layout, block_m = reference.gpu_layout(
        *map(jnp.asarray, (q, rows, valid, k, v)), block, reference.BLOCK_M)

    def tensor(a) -> torch.Tensor:
        return torch.from_numpy(np.array(a))

    operands = [tensor(a) for a in (q, k, v, np.zeros((slots, 1), np.int32),
                                    np.asarray(layout.first_row, np.int32),
                                    np.asarray(layout.row_count, np.int32), kv_len, [layer])]
    sizes = dict(PAGED=False, PAGES=slots, PAGE=positions, WIDTH=1, KV_HEADS=kv_heads,
                 GROUP=group, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, SCALE=d ** -0.5,
                 PRECISION="ieee")
    tiles = triton.cdiv(block * group, block_m)
    out = torch.zeros((n, heads, d))
    triton_gpu._kernel[(tiles, kv_heads, slots)](*operands, out, **sizes)
    error = np.abs(out.numpy()[valid] - want[valid]).max()
    print(f"max |error| {error:.2e}")
    assert error < 1e-5, error


if __name__ == "__main__":
    main()
