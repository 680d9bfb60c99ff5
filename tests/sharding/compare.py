"""Run in a fresh process with 8 forced CPU devices: sharded generate equals single-device.

    XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_allow_excess_precision=false" \
        python tests/sharding/compare.py MODE...
Prints one JSON line per mode and mesh (FOCUS on every mesh, the other modes on data=2, model=4):
whether the tokens are equal, and how the cache and a weight are spread over the devices after
the run.

Without the second flag XLA may keep a bfloat16 intermediate in float32 (it drops a convert to
bfloat16 and back), and where it does depends on how the program is built: on the CPU the step
inside ``shard_map`` rounds the q/k-norm's scaled output to bfloat16 before RoPE, the same step
on one device does not. FOCUS selects by a threshold on importance, so that one rounding changes
the tokens of the bundled bfloat16 model (:func:`compare_bundled`). With the flag, every program
rounds where the code says, and a sharded step must compute exactly what the single-device one
does.
"""

import collections
import contextlib
import json
import os
import re
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax

jax.config.update("jax_default_matmul_precision", "highest")

from focus_jax import Engine, GenerationConfig, encode_prompt, generate, load, quant  # noqa: E402
from focus_jax.cli import BUNDLED_MODEL, DEMO_PROMPTS  # noqa: E402
from focus_jax.config import MoEConfig  # noqa: E402
from focus_jax.engine import SamplingParams, run_to_completion  # noqa: E402
from focus_jax.sharding import make_mesh  # noqa: E402
from focus_jax.testing import random_prompts, tiny_model  # noqa: E402


def main() -> None:
    assert len(jax.devices()) == 8, jax.devices()
    assert "--xla_allow_excess_precision=false" in os.environ.get("XLA_FLAGS", ""), __doc__
    for mode in sys.argv[1:]:
        # FOCUS on every mesh: its step holds everything the other modes' do (the delayed
        # cache's processed-token compaction, the whole block of baseline's) and more (the
        # eviction's sharded importance kernel, the retained compaction). The other modes on
        # the mesh that splits both data and model.
        with timed(mode):
            compare(mode, meshes=MESHES if mode == "focus" else ((2, 4),))
    # Sampling: every data shard draws with the keys of the rows' global positions.
    with timed("sampled"):
        compare("focus", temperature=0.8, meshes=((8, 1),))
    for name, part in (("bundled_focus_equal", compare_bundled), ("experts", compare_experts),
                       ("paged", compare_paged)):
        with timed(name):
            print(json.dumps({name: part()}), flush=True)


@contextlib.contextmanager
def timed(name: str):
    """Each part's seconds on stderr (the test's cost is in the compiles of these parts)."""
    start = time.perf_counter()
    yield
    print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def compare_experts() -> list[dict[str, object]]:
    """A LLaDA2-style mixture of experts (groups, expert bias, a shared expert, a dense first
    layer) on meshes with an expert axis: the same tokens as on one device, baseline and focus,
    and each device holding its share of the experts; with int8 experts on the mesh of all
    three axes."""
    moe = MoEConfig(num_experts=16, experts_per_token=4, expert_size=32, dense_layers=(0,),
                    scores="sigmoid", routed_scaling_factor=2.5, num_groups=4, groups_per_token=2,
                    expert_bias=True, shared_expert_size=32)
    model = tiny_model(seed=1, scale=4.0, model_type="llada2_moe", moe=moe,
                       partial_rotary_factor=0.5)
    prompts = random_prompts(8, 128, 2, 14, seed=32)
    rows = []
    for mode in ("focus",):  # the baseline's programs are a subset of focus's
        config = GenerationConfig(mode=mode, block_size=4, threshold=0.04, alpha=1.0,
                                  max_new_tokens=8, stop_token_ids=(), max_batch=8,
                                  bucket_ladder=LADDER)
        single = [r.token_ids for r in generate(model, prompts, config)]
        int8 = quant.quantize(model, "int8")
        single_int8 = [r.token_ids for r in generate(int8, prompts, config)]
        # The step's region is manual over data and expert where both split; model is left to
        # the partitioner (with the experts' width in a shard_map of its own) or absent.
        runs = [((2, 4, 1), model, single), ((1, 4, 2), model, single),
                ((2, 2, 2), model, single), ((2, 2, 2), int8, single_int8)]
        for (data, expert, parallel), weights, want in runs:
            engine = Engine(weights, config, slots=8, cache_len=32,
                            mesh=make_mesh(data, parallel, expert=expert))
            ids = [engine.add_request(p) for p in prompts]
            results = run_to_completion(engine)
            gate_up = engine.model.params["moe"]["gate_up_proj"]
            gate_up = (gate_up["qvalue"] if weights is int8 else gate_up)[...]
            rows.append({"mode": mode, "mesh": [data, expert, parallel],
                         "weights": "int8" if weights is int8 else "float32",
                         "equal": [results[i].token_ids for i in ids] == want,
                         "gate_up_shard_shape": list(gate_up.addressable_shards[0].data.shape)})
    return rows


def compare_paged() -> list[dict[str, object]]:
    """A paged KV cache with prefix caching on a model=4 mesh (the pool's KV heads split, the
    paged attention through its sharded entry point) and on a data=2, model=4 mesh (each data
    shard holding the pages of its own slots, half the pool): the tokens of one device, and
    each device's part of the pool ``[layers, pages / data, B, KVH / 4, D]``."""
    model = tiny_model(seed=0, scale=4.0, num_heads=8, num_kv_heads=8, head_dim=8)
    system = list(range(20, 28))  # two blocks every prompt begins with: cached after the first
    prompts = [[*system, *p] for p in random_prompts(8, 128, 2, 10, seed=33)]
    config = GenerationConfig(mode="focus", block_size=4, threshold=0.04, alpha=1.0,
                              max_new_tokens=8, stop_token_ids=(), max_batch=4,
                              bucket_ladder=LADDER, kv_cache="paged", kv_pages=20,
                              prefix_caching=True)
    single = [r.token_ids for r in generate(model, prompts, config)]
    rows = []
    for data in (1, 2):
        engine = Engine(model, config, slots=4, cache_len=32, mesh=make_mesh(data, 4))
        ids = [engine.add_request(p) for p in prompts]
        results = run_to_completion(engine)
        rows.append({"data": data, "equal": [results[i].token_ids for i in ids] == single,
                     "pool_shard_shape": list(engine.state.cache.k.addressable_shards[0].data.shape),
                     "prefix_hit_tokens": engine.stats.cached_prompt_tokens})
    return rows


def data_parallel_collectives(engine: Engine) -> dict[str, int]:
    """Collectives in the compiled decode round of ``engine``, on an 8-way data mesh (each shard
    steps its own slots, so the step itself needs none). The engine that ran the round: its
    program, not another compile (a later engine of the same settings compiles it again once
    the round has left ``compilation.PROGRAMS``)."""
    text = engine.lower_round().compile().as_text()
    ops = re.findall(r"\b(all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)"
                     r"(?:-start)?\(", text)
    return dict(collections.Counter(ops))


LADDER = (0.5, 1.0)
"""Two compaction buckets: a round switches between them, as with any ladder, and compiles half
the branches of three (most of this file's time is compiling)."""

MESHES = ((8, 1), (1, 8), (2, 4))
"""(data, model): all data, all model, both."""


def compare_config(mode: str, temperature: float = 0.0) -> GenerationConfig:
    return GenerationConfig(mode=mode, block_size=4, threshold=0.04, alpha=1.0, max_new_tokens=8,
                            stop_token_ids=(), max_batch=8, bucket_ladder=LADDER,
                            temperature=temperature)


def compare(mode: str, temperature: float = 0.0,
            meshes: tuple[tuple[int, int], ...] = MESHES) -> None:
    # Eight query and KV heads, so that the model axis can take all 8 devices.
    model = tiny_model(seed=0, scale=4.0, num_heads=8, num_kv_heads=8, head_dim=8)
    prompts = random_prompts(8, 128, 2, 14, seed=31)
    config = compare_config(mode, temperature)
    single = [r.token_ids for r in generate(model, prompts, config)]
    for data, parallel in meshes:
        # Greedy FOCUS on the mesh of both axes runs the server's interruptible round (a host
        # callback in the round's loop): a set interrupt ends rounds after one step, and the
        # tokens are unchanged. (Its own program: the plain round is the other meshes' and
        # modes'; one compile fewer than both rounds on this mesh.)
        interrupted = mode == "focus" and not temperature and (data, parallel) == (2, 4)
        engine = Engine(model, config.replace(interruptible_rounds=interrupted), slots=8,
                        cache_len=32, mesh=make_mesh(data, parallel))
        ids = [engine.add_request(p, SamplingParams.from_config(config, seed=config.seed + i))
               for i, p in enumerate(prompts)]
        steps, results = interrupted_rounds(engine) if interrupted else (None, {})
        results |= run_to_completion(engine)
        equal = [results[i].token_ids for i in ids] == single
        if interrupted:
            print(json.dumps({"interrupted": {"steps": steps, "equal": equal}}), flush=True)
        if mode == "focus" and not temperature and (data, parallel) == (8, 1):
            print(json.dumps({"collectives": data_parallel_collectives(engine)}), flush=True)
        gate = engine.model.params["layers"]["mlp"]["gate_up_proj"]
        print(json.dumps({
            "mode": mode + ("-sampled" if temperature else ""), "mesh": [data, parallel],
            "equal": equal,
            # After the run, the cache and the weights are still spread over the devices.
            "cache_shards": len({s.device for s in engine.state.cache.k.addressable_shards
                                 if s.data.size}),
            "cache_shard_shape": list(engine.state.cache.k.addressable_shards[0].data.shape),
            "gate_shard_shape": list(gate[...].addressable_shards[0].data.shape),
        }), flush=True)


def interrupted_rounds(engine: Engine) -> tuple[list[int], dict]:
    """Three rounds with the round's interrupt set: the steps each ran, and the results of the
    requests they finished."""
    engine.round_interrupt.set()
    steps, finished = [], {}
    for _ in range(3):
        before = engine.stats.steps
        finished |= {out.request_id: out.result() for out in engine.step() if out.finished}
        steps.append(engine.stats.steps - before)
    engine.round_interrupt.clear()
    return steps, finished


def compare_bundled() -> bool:
    """The bundled bfloat16 model, FOCUS mode, one slot per data shard of a data=2 mesh: the
    same tokens as on one device? (The float32 tiny model has no rounding to bfloat16 that a
    program could skip.)"""
    model = load(BUNDLED_MODEL)
    config = GenerationConfig(mode="focus", bucket_ladder=(0.5, 1.0), max_new_tokens=32)
    tokens = []
    for mesh in (None, make_mesh(2, 1)):
        engine = Engine(model, config, slots=2, cache_len=128, mesh=mesh)
        ids = [engine.add_request(encode_prompt(model, p)) for p in DEMO_PROMPTS]
        results = run_to_completion(engine)
        tokens.append([results[i].token_ids for i in ids])
    return tokens[0] == tokens[1]


if __name__ == "__main__":
    main()
