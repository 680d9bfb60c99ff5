"""The paged KV cache: the same keys, values and attention as the contiguous layout through the
cache interface, the same tokens through the engine, admission by free pages."""

import jax.numpy as jnp
import numpy as np
import pytest

from focus_jax import GenerationConfig, generate
from focus_jax.cache import ContiguousCache, PagedCache, assign_pages
from focus_jax.compilation import count_compilations
from focus_jax.engine import Engine, RequestError, SamplingParams, run_to_completion
from focus_jax.testing import random_prompts, tiny_config, tiny_model
from tests.test_kernels import GPU_MARKS
from tests.test_moe_decoding import QWEN3_MOE

THRESHOLD = 0.04
LADDER = (0.25, 1.0)


def test_paged_writes_and_attention_equal_the_contiguous_cache_with_pages_in_any_order():
    """Slots hold their pages out of order, one page is listed by two slots (a shared prefix
    both write with the same values), and table entries past a slot's length are holes; every
    write and the attention over the compacted rows read back as in the contiguous cache."""
    cfg = tiny_config()
    slots, block, positions = 3, 4, 16
    rng = np.random.default_rng(0)
    contiguous = ContiguousCache.create(cfg, slots, positions)
    paged = PagedCache.create(cfg, slots, positions, block, pages=10)
    hole = 10  # no page
    # Slot 2's third entry lies past its length and names no page either: it is never read.
    table = np.asarray([[7, 2, 9, 4], [7, 0, hole, hole], [5, 1, 99, 3]], np.int32)
    paged = assign_pages(paged, jnp.asarray([0, 1, 2, 3]), jnp.asarray([*table, table[0]]))
    kv_shape = (cfg.num_layers, slots, 12, cfg.num_kv_heads, cfg.head_dim)
    k, v = (jnp.asarray(rng.normal(size=kv_shape), jnp.float32) for _ in range(2))
    k, v = k.at[:, 1, :4].set(k[:, 0, :4]), v.at[:, 1, :4].set(v[:, 0, :4])  # the shared page
    prompt = jnp.asarray([12, 7, 4])
    slot = jnp.asarray([0, 1, 2])
    start = jnp.zeros_like(slot)
    contiguous = contiguous.write_prefix(slot, start, prompt, k, v)
    paged = paged.write_prefix(slot, start, prompt, k, v)
    # A step's rows: the active blocks, some rows padding (slot 3 is out of range: dropped).
    rows = jnp.asarray([0, 1, 4, 5, 6, 8, 9, 0])
    valid = jnp.asarray([True, True, True, True, True, True, True, False])
    row_slot = jnp.where(valid, rows // block, slots)
    position = jnp.asarray([12, 13, 4, 5, 6, 4, 5, 0])
    new_k, new_v = (jnp.asarray(rng.normal(size=(8, cfg.num_kv_heads, cfg.head_dim)), jnp.float32)
                    for _ in range(2))
    for layer in range(cfg.num_layers):
        contiguous = contiguous.write(layer, row_slot, position, new_k, new_v)
        paged = paged.write(layer, row_slot, position, new_k, new_v)
    kv_len = jnp.asarray([14, 7, 6])
    q = jnp.asarray(rng.normal(size=(8, cfg.num_heads, cfg.head_dim)), jnp.float32)
    for layer in range(cfg.num_layers):
        want = contiguous.attend(q, rows, valid, layer, kv_len, block_size=block, impl="xla",
                                 mesh=None)
        got = paged.attend(q, rows, valid, layer, kv_len, block_size=block, impl="xla", mesh=None)
        np.testing.assert_array_equal(np.asarray(got)[valid], np.asarray(want)[valid])
    # Every written position reads back through the page table, and as a prefix of whole blocks.
    for s in range(slots):
        for p in range(int(kv_len[s])):
            page = table[s, p // block]
            np.testing.assert_array_equal(paged.k[:, page, p % block], contiguous.k[:, s, p])
    for want, got in zip(contiguous.read_prefix(slot, 4), paged.read_prefix(slot, 4), strict=True):
        np.testing.assert_array_equal(got, want)


# Every mode, both block sizes, both kinds of model, in three engines' worth of compiles.
PAGED_CASES = [("baseline", 4, "dense"), ("delayed", 8, "moe"), ("focus", 8, "dense")]


@pytest.fixture(scope="module")
def models(model):
    return {"dense": model, "moe": tiny_model(seed=0, scale=4.0, model_type="qwen3_moe",
                                              moe=QWEN3_MOE)}


@pytest.mark.parametrize(("mode", "block", "kind"), PAGED_CASES)
def test_paged_decoding_equals_contiguous_token_for_token(models, mode, block, kind):
    """Prompts of different lengths through two slots and a pool of pages for a little more than
    one request's worst case: requests wait for pages, finish, and new ones take their pages;
    the tokens and step counts are those of the contiguous cache."""
    model = models[kind]
    prompts = [*random_prompts(4, 128, 2, 3 * block - 1, seed=block),
               random_prompts(1, 128, 2 * block, 2 * block, seed=7)[0]]
    config = GenerationConfig(mode=mode, block_size=block, threshold=THRESHOLD,
                              bucket_ladder=LADDER, max_new_tokens=3 * block, max_batch=2,
                              max_cache_len=8 * block, stop_token_ids=())
    want = generate(model, prompts, config)
    pages = 8  # the longest request's worst case (6 blocks) and a little
    engine = Engine(model, config.replace(kv_cache="paged", kv_pages=pages))
    ids = [engine.add_request(p) for p in prompts]
    results, held, waited_for_pages = {}, {}, False
    while engine.has_unfinished():
        results |= {out.request_id: out.result() for out in engine.step() if out.finished}
        held |= {r.rid: r.pages for r in engine.scheduler.running.values()}
        waited_for_pages |= engine.num_waiting > 0 and engine.num_running < 2
    assert [results[i].token_ids for i in ids] == [r.token_ids for r in want]
    assert [results[i].stats.decoded_per_step for i in ids] == [
        r.stats.decoded_per_step for r in want]
    assert waited_for_pages
    taken = [p for pages in held.values() for p in pages]
    assert set(taken) == set(range(pages)) and len(taken) > pages  # pages were reused
    assert engine.scheduler.pool.available == pages  # every page back


def test_a_request_the_pool_can_never_hold_is_refused_and_one_that_fits_waits(model):
    """Admission reserves a request's worst case; it takes the pages of its prompt, its active
    block and the blocks a round can reach, the others as it goes on."""
    config = GenerationConfig(mode="focus", block_size=4, threshold=THRESHOLD, bucket_ladder=LADDER,
                              max_new_tokens=8, kv_cache="paged", kv_pages=10, stop_token_ids=(),
                              steps_per_round=2)
    engine = Engine(model, config, slots=2, cache_len=64)
    with pytest.raises(RequestError, match=r"needs 12 pages of 4 positions, but the KV cache's "
                                           r"pool has 10"):
        engine.add_request(list(range(10, 47)))  # 37 + 8 tokens: 12 blocks
    first = engine.add_request(list(range(10, 14)), SamplingParams(max_new_tokens=28))  # 8 blocks
    second = engine.add_request(list(range(10, 14)))  # 3 blocks: waits for the first's pages
    engine.step()
    assert engine.num_running == 1 and engine.num_waiting == 1
    [running] = engine.scheduler.running.values()
    pool = engine.scheduler.pool
    # Its prompt's block, its active block and the two a round of two steps can commit.
    assert len(running.pages) == 4 and running.reserved == 4
    assert pool.held == 4 and pool.reserved == 4 and pool.available == 2
    results = run_to_completion(engine)
    assert set(results) == {first, second} and pool.available == 10 and pool.reserved == 0


def test_a_cached_prefix_gives_the_same_tokens_and_only_the_uncached_blocks_are_prefilled(model):
    """Requests that begin with the same three-block system prompt share its pages: each later
    one prefills only its own blocks (none at all for the system prompt alone), and every
    request's greedy tokens are those it gets without the cache. The warm-up compiled the
    prefills after a cached prefix too: serving compiles nothing."""
    block = 4
    system = random_prompts(1, 128, 3 * block, 3 * block, seed=50)[0]
    questions = random_prompts(4, 128, 1, 2 * block + 3, seed=51)
    prompts = [system + questions[0], *(system + q for q in questions[1:]), system]
    config = GenerationConfig(mode="focus", block_size=block, threshold=THRESHOLD,
                              bucket_ladder=LADDER, max_new_tokens=2 * block, stop_token_ids=(),
                              max_batch=2, max_cache_len=16 * block)
    want = [r.token_ids for r in generate(model, prompts, config)]
    engine = Engine(model, config.replace(kv_cache="paged", prefix_caching=True))
    engine.warmup(prompt_lengths=[len(p) for p in prompts])
    with count_compilations() as compiled:
        first = engine.add_request(prompts[0])
        engine.step()  # prefilled: its prompt blocks are in the prefix table from now on
        rest = [engine.add_request(p) for p in prompts[1:]]
        results = run_to_completion(engine)
    assert [results[i].token_ids for i in [first, *rest]] == want
    assert compiled.programs == 0
    stats = engine.stats
    assert [results[i].stats.cached_prompt_tokens for i in rest] == [3 * block] * len(rest)
    assert stats.prompt_tokens == sum(map(len, prompts))
    assert stats.cached_prompt_tokens == 3 * block * len(rest)
    assert stats.prefilled_tokens == sum(len(p) // block * block for p in prompts) - 3 * block * len(rest)
    assert stats.prefix_hit_rate == stats.cached_prompt_tokens / stats.prompt_tokens
    pool = engine.scheduler.pool
    assert pool.held == 0 and pool.available == pool.total and pool.cached >= 3


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_prompts_longer_than_a_chunk_are_prefilled_alone_in_chunks_with_the_same_tokens(
        model, kv_cache):
    """A prompt longer than ``prefill_chunk`` is prefilled alone, a chunk at a time, each chunk
    attending to those before it (on the paged cache after a cached prefix too): the tokens are
    those of the whole prefill, no whole prefill is longer than a chunk, and the warm-up
    (prompt lengths unknown) compiled every program the chunks need."""
    block, chunk = 4, 8
    system = random_prompts(1, 128, 3 * block, 3 * block, seed=60)[0]
    prompts = [system + p for p in random_prompts(4, 128, 1, 5 * block, seed=61)]
    prompts += [*random_prompts(2, 128, chunk + 1, 7 * block + 2, seed=62),
                *random_prompts(2, 128, 2, chunk, seed=63)]
    config = GenerationConfig(mode="focus", block_size=block, threshold=THRESHOLD,
                              bucket_ladder=LADDER, max_new_tokens=2 * block, stop_token_ids=(),
                              max_batch=3, max_cache_len=12 * block, kv_cache=kv_cache,
                              prefix_caching=kv_cache == "paged")
    want = [r.token_ids for r in generate(model, prompts, config)]
    engine = Engine(model, config, prefill_chunk=chunk)
    engine.warmup()
    whole, chunks = [], []
    runner = engine.runner
    run_whole, run_chunk = runner._prefill, runner._prefix_prefill
    runner._prefill = lambda *args: whole.append(args[2].shape[1]) or run_whole(*args)
    runner._prefix_prefill = lambda *args, computed: (
        chunks.append(computed) or run_chunk(*args, computed=computed))
    with count_compilations() as compiled:
        first = engine.add_request(prompts[0])
        engine.step()  # its prompt blocks are cached from now on (paged)
        ids = [first, *(engine.add_request(p) for p in prompts[1:])]
        results = run_to_completion(engine)
    assert [results[i].token_ids for i in ids] == want
    assert compiled.programs == 0
    assert whole and max(whole) <= chunk and max(chunks) == chunk
    assert any(len(p) > chunk for p in prompts) and all(c <= chunk for c in chunks)
    if kv_cache == "paged":
        assert engine.stats.cached_prompt_tokens > 0


def test_unheld_cached_pages_are_reclaimed_least_recently_released_first_and_held_ones_never():
    from focus_jax.cache.pages import PagePool, block_hashes

    pool = PagePool(6)
    a, b, c = (block_hashes([i] * 8, 4) for i in (1, 2, 3))  # two blocks each
    pages_a, pages_b, pages_c = pool.take(2), pool.take(2), pool.take(2)
    for pages, hashes in ((pages_a, a), (pages_b, b), (pages_c, c)):
        assert pool.register(pages, hashes) == 2
    pool.release(pages_b)
    pool.release(pages_a)  # b is the least recently released, then a; c stays held
    assert pool.available == 4 and pool.match(a) == pages_a
    assert pool.take(2) == pages_b  # b's pages are reclaimed first, and leave the table
    assert pool.match(b) == [] and pool.match(a) == pages_a
    shared = pool.match(a)
    assert not pool.can_take(1, shared)  # holding a's pages leaves nothing to reclaim
    assert pool.take(0, shared) == pages_a and pool.available == 0
    with pytest.raises(RuntimeError, match="1 pages wanted, 0 available"):
        pool.take(1)
    pool.check()


@pytest.mark.parametrize("shards", [1, 2])
def test_random_add_abort_finish_keeps_the_page_pool_consistent(shards):
    """Requests from a few shared system prompts are added, admitted, take pages as their
    blocks come, are aborted (waiting or running) and finish in random order: a request's pages
    and reservation make its worst case, a page is held twice only as a registered prompt block
    at the same position of prompts with the same blocks up to it, and every page is available
    again at the end. Over two data shards every page a slot holds is one of its shard's."""
    import random

    from focus_jax.cache.pages import PagePool, ShardedPool
    from focus_jax.engine.params import SamplingParams as Params
    from focus_jax.engine.scheduler import Request, Scheduler

    block, rng = 4, random.Random(0)
    pool = PagePool(40) if shards == 1 else ShardedPool.split(40, shards)
    each = 40 // shards
    scheduler = Scheduler(slots=4, cache_len=64, block_size=block, pool=pool, prefix_caching=True)
    systems = [[rng.randrange(10, 128) for _ in range(rng.randrange(0, 13))] for _ in range(3)]
    rid, shared = 0, 0
    for _ in range(400):
        action = rng.random()
        if action < 0.4:
            prompt = rng.choice(systems) + [rng.randrange(10, 128) for _ in range(rng.randrange(1, 9))]
            scheduler.add(Request(rid, prompt, Params(max_new_tokens=rng.randrange(1, 20))))
            rid += 1
        elif action < 0.6:
            for request in scheduler.admit()[0]:
                scheduler.register_prompt(request)
        elif action < 0.65 and scheduler.running:  # a request's blocks come: pages taken
            request = rng.choice(list(scheduler.running.values()))
            request.history += block * rng.randrange(0, 3)
            scheduler.extend_pages(steps=rng.randrange(1, 4))
        elif action < 0.75 and (scheduler.waiting or scheduler.running):
            victim = rng.choice([*scheduler.waiting, *scheduler.running.values()])
            scheduler.abort(victim.rid)
            for request in scheduler.take_aborted():
                scheduler.finish(request)
        elif scheduler.running:
            scheduler.finish(rng.choice(list(scheduler.running.values())))
        pool.check()
        owners: dict[int, list[tuple[Request, int]]] = {}
        assert pool.reserved == sum(r.reserved for r in scheduler.running.values())
        for request in scheduler.running.values():
            assert len(set(request.pages)) == len(request.pages)
            shard = scheduler.shard(request.slot)
            assert all(shard * each <= page < (shard + 1) * each for page in request.pages)
            assert len(request.pages) + request.reserved == scheduler.positions_needed(
                len(request.prompt), request.max_new_tokens) // block
            for index, page in enumerate(request.pages):
                owners.setdefault(page, []).append((request, index))
        for held in owners.values():
            if len(held) > 1:  # a shared prompt block: same position, same blocks up to it
                shared += 1
                (first, index), *others = held
                assert all(i == index and r.block_hashes[index] == first.block_hashes[index]
                           for r, i in others)
                assert index < len(first.block_hashes)
    for request in list(scheduler.running.values()):
        scheduler.finish(request)
    pool.check()
    assert pool.held == 0 and pool.reserved == 0 and pool.available == pool.total
    assert rid > 100 and shared > 50


def test_a_request_goes_to_the_data_shard_that_holds_its_prefix():
    """Two data shards of 8 pages, two slots each: a request sharing a cached system prompt
    goes to the shard that caches it, though the other has more pages available; one sharing
    nothing goes to the shard with the most pages available; a request no shard can hold is
    refused with the per-shard size."""
    from focus_jax.cache.pages import ShardedPool
    from focus_jax.engine.params import SamplingParams as Params
    from focus_jax.engine.scheduler import Request, Scheduler

    block = 4
    pool = ShardedPool.split(16, shards=2)
    scheduler = Scheduler(slots=4, cache_len=64, block_size=block, pool=pool, prefix_caching=True)
    system = list(range(10, 18))  # two blocks
    scheduler.add(Request(0, [*system, 40, 41], Params(max_new_tokens=4)))
    [first] = scheduler.admit()[0]
    scheduler.register_prompt(first)
    assert first.slot == 0 and first.pages == [0, 1, 2]  # shard 0 had as many pages as 1
    scheduler.add(Request(1, [*system, 50], Params(max_new_tokens=4)))
    scheduler.add(Request(2, [60, 61, 62], Params(max_new_tokens=4)))
    admitted = {r.rid: r for r in scheduler.admit()[0]}
    assert admitted[1].slot == 1 and admitted[1].pages[:2] == [0, 1]  # the cached blocks
    assert admitted[1].cached_blocks == 2
    assert scheduler.shard(admitted[2].slot) == 1 and set(admitted[2].pages) <= set(range(8, 16))
    with pytest.raises(RequestError, match="needs 9 pages of 4 positions, but the KV cache's "
                                           "pool has 8 per data shard"):
        scheduler.add(Request(3, list(range(10, 40)), Params(max_new_tokens=6)))


def test_pages_and_prefix_hits_reach_the_stats_line_and_the_servers_metrics():
    from types import SimpleNamespace

    pytest.importorskip("prometheus_client")
    from focus_jax.cache.pages import PagePool
    from focus_jax.cli import format_stats
    from focus_jax.engine import RequestStats, RunStats
    from focus_jax.serve.metrics import ServerMetrics

    stats = RunStats(prompt_tokens=40, cached_prompt_tokens=30, prefilled_tokens=8, kv_pages=64,
                     kv_pages_peak=20)
    line = format_stats(stats, num_layers=4).splitlines()[-1]
    assert line == ("prompt tokens 40, 30 from the prefix cache (hit rate 75.0%), 8 prefilled; "
                    "KV pages: at most 20 used of 64 (44 free then)")
    pool = PagePool(64)
    pool.take(5)
    engine = SimpleNamespace(num_waiting=0, num_running=1, engine=SimpleNamespace(
        slots=4, stats=stats, scheduler=SimpleNamespace(pool=pool)))
    metrics = ServerMetrics(engine)
    out = SimpleNamespace(prompt_tokens=40, stats=RequestStats(cached_prompt_tokens=32))
    metrics.finished("stop", out, completion_tokens=3, latency=1.0)
    text = metrics.exposition().decode()
    for sample in ("focus_jax_kv_pages_used 5.0", "focus_jax_kv_pages_total 64.0",
                   "focus_jax_prefix_cache_hit_tokens_total 32.0",
                   "focus_jax_prompt_tokens_total 40.0"):
        assert sample + "\n" in text


@pytest.mark.parametrize("where", ["tpu_kernel_in_the_interpreter", "one_device_mesh",
                                   pytest.param("triton_kernel_on_the_gpu", marks=GPU_MARKS)])
def test_paged_decoding_with_a_kernel_or_on_a_mesh_equals_the_xla_path(model, where):
    """The decode step through the paged TPU kernel (in the Pallas interpreter) or the Triton
    kernel (on an NVIDIA GPU), and through the sharded entry point with the state placed on a
    mesh, gives the XLA reference's tokens."""
    from focus_jax.sharding import make_mesh

    prompts = random_prompts(3, 128, 2, 12, seed=3)
    config = GenerationConfig(mode="focus", block_size=4, threshold=0.04, alpha=1.0,
                              max_new_tokens=8, stop_token_ids=(), bucket_ladder=(0.5, 1.0),
                              kv_cache="paged")
    xla = [r.token_ids for r in generate(model, prompts, config.replace(kernels="xla"))]
    if where == "one_device_mesh":
        other = generate(model, prompts, config, mesh=make_mesh(1, 1))
    else:
        kernels = "triton" if where == "triton_kernel_on_the_gpu" else "pallas_tpu_interpret"
        other = generate(model, prompts, config.replace(kernels=kernels))
    assert [r.token_ids for r in other] == xla


def test_benchmark_workloads_with_long_prompts_or_a_shared_system_prompt(monkeypatch):
    """Benchmarks (a) and (b) of the paged cache: a seeded fraction of long prompts among the
    usual lengths; every load-client prompt beginning with the same system prompt."""
    from pathlib import Path

    from focus_jax import bench
    from focus_jax.config import ModelConfig
    from focus_jax.serve.load import Workload

    plain = bench.prompt_lengths(200, seed=1)
    mixed = bench.prompt_lengths(200, seed=1, long=(0.05, 4096, 8192))
    changed = [i for i, (a, b) in enumerate(zip(plain, mixed, strict=True)) if a != b]
    assert len(changed) == 10 and all(4096 <= mixed[i] <= 8192 for i in changed)
    assert max(plain) <= bench.PROMPT_MAX
    monkeypatch.setattr(ModelConfig, "from_file", classmethod(lambda cls, path: tiny_config()))
    prompts = Workload(num_requests=4, shared_prefix=16, prompt_format="ids").prompts(Path("."))
    own = Workload(num_requests=4, prompt_format="ids").prompts(Path("."))
    assert all(p[:16] == prompts[0][:16] and p[16:] == q for p, q in zip(prompts, own, strict=True))


def test_the_pool_is_sized_by_pages_memory_or_what_the_weights_leave(model):
    from focus_jax import sharding
    from focus_jax.config import ConfigError
    from focus_jax.engine.runner import KV_MEMORY_FRACTION, pool_pages
    from tests.test_checkpoints import _Device

    cfg = model.config
    page = 2 * cfg.num_layers * 4 * cfg.num_kv_heads * cfg.head_dim * 4  # block 4, float32
    assert PagedCache.page_bytes(cfg, 4) == page
    weights = sharding.bytes_per_device(model.params, None)
    config = GenerationConfig(kv_cache="paged")

    def pages(devices, **options) -> int:
        return pool_pages(model, config.replace(**options), 4, 8, 64, devices, None)

    assert pages([_Device(None)], kv_pages=7) == 7
    assert pages([_Device(None)], kv_cache_memory=10 * page + 5) == 10
    assert pages([_Device(None)]) == 8 * 16  # no memory report: the contiguous cache's worth
    free = 100 * page
    assert pages([_Device(weights + free + 3000, in_use=3000)]) == int(KV_MEMORY_FRACTION * free) // page
    with pytest.raises(ConfigError, match="holds no page"):
        pages([_Device(weights + page, in_use=0)])
