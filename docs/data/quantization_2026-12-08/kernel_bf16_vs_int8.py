import sys, json, jax, jax.numpy as jnp, numpy as np, qwix
sys.path.insert(0, "scripts")
from tune_grouped_matmul import kernel, seconds
from benchmark_grouped_matmul import operands, routed_group_sizes
for rows in (4096, 16384):
    for k, n in ((2048, 1024), (512, 2048)):
        sizes = routed_group_sizes(rows, 256, 8, np.random.default_rng(rows))
        lhs, rhs, gs = operands(int(sizes.sum()), k, n, sizes, seed=rows)
        f = kernel(None)
        for w in ("bf16", "int8"):
            r = rhs if w == "bf16" else qwix.quantize(rhs, jnp.int8, channelwise_axes=(0, 2))
            s = seconds(f, (lhs, r, gs), 5, 10)
            b = 256 * k * n * (2 if w == "bf16" else 1)
            print(json.dumps(dict(rows=rows, k=k, n=n, w=w, ms=round(1e3 * s, 4), tbps=round(b / s / 1e12, 2), tflops=round(2 * rows * k * n / s / 1e12, 1))), flush=True)
