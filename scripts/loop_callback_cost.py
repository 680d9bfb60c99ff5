"""What a host callback in a ``lax.while_loop``'s condition costs per iteration on this device.

    python scripts/loop_callback_cost.py --iterations 64 --work-ms 8 --json out.json

The loop body is a chain of matrix products sized to take about ``--work-ms`` on the device (a
lightly loaded decode step). Variants: the plain condition (``i < n``), and the same condition
also asking the host a question through ``jax.experimental.io_callback`` (a Python function that
reads a flag), the way a round could ask whether a request waits. Each variant is compiled once,
warmed, and timed over ``--repeats`` calls; the median ms per iteration is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=64)
    parser.add_argument("--work-ms", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    size = args.size
    flag = threading.Event()

    def asked() -> np.ndarray:
        return np.asarray(flag.is_set())

    def body(carry):
        x, i = carry
        return jnp.tanh(x @ x) * 0.5, i + 1

    def program(ask: bool, products: int):
        def run(x, n):
            def cond(carry):
                _, i = carry
                go = i < n
                if ask:
                    go &= ~io_callback(asked, jax.ShapeDtypeStruct((), bool), ordered=False)
                return go

            def work(carry):
                for _ in range(products):
                    carry = body(carry)
                return carry[0], carry[1] - products + 1

            return jax.lax.while_loop(cond, work, (x, jnp.int32(0)))

        return jax.jit(run)

    x = jnp.ones((size, size), jnp.bfloat16) * 0.01

    def timed(fn) -> float:
        jax.block_until_ready(fn(x, args.iterations))
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(x, args.iterations))
            times.append((time.perf_counter() - start) * 1e3 / args.iterations)
        return statistics.median(times)

    # Products per iteration for about --work-ms of device work.
    one = timed(program(False, 1))
    products = max(1, round(args.work_ms / one))
    result = {"device": str(jax.devices()[0]), "one_product_ms": one, "products": products,
              "iterations": args.iterations}
    for name, ask in (("plain", False), ("io_callback", True)):
        result[f"{name}_ms_per_iteration"] = timed(program(ask, products))
    result["callback_cost_ms"] = result["io_callback_ms_per_iteration"] - result[
        "plain_ms_per_iteration"]
    # The flag set from another thread ends the loop early: the answer reaches the device.
    flag.set()
    _, ran = program(True, products)(x, args.iterations)
    result["iterations_with_flag_set"] = int(ran)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
