"""`focus-jax serve` on the bundled model: a real server process on 127.0.0.1, the official
`openai` client, and raw HTTP where the wire format itself is checked.

One server is shared by most tests (module fixture); the queue and SIGTERM tests share a second
one, which compiles nothing thanks to a persistent compilation cache the first server fills. No
test sleeps waiting for work: each polls with a deadline, and every loop is bounded.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

# The serve extra (and the openai client): present wherever `make test` installed the project;
# a GPU machine's own Python may lack them (`make test-gpu` collects this file too).
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
text_string_to_metric_families = pytest.importorskip(
    "prometheus_client.parser").text_string_to_metric_families
pytest.importorskip("fastapi")

import focus_jax  # noqa: E402
from focus_jax.cli import BUNDLED_MODEL, main  # noqa: E402
from focus_jax.serve import load  # noqa: E402
from focus_jax.serve.stop import tokens_through  # noqa: E402
from focus_jax.testing import TEST_XLA_FLAGS, xla_flags  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL = "focus-tiny"
KEY = "test-key"
LADDER = (0.5, 1.0)
CONTEXT, SLOTS = 128, 8
MAX_TOKENS = 40  # a block of 32 and part of the next: two chunks per answer
SHORT = 8  # for the many requests of the concurrency test
# A request that stays in its slot for several decode rounds: four blocks, one token per step
# (no token is ever above threshold 1; the unmasking rule then takes the most confident one).
SLOW = {"max_tokens": CONTEXT - 16, "ignore_eos": True, "threshold": 1.0}
PROMPTS = ("Add: 257+468", "Reverse: p a l l a s", "Add: 31+4", "Reverse: m o o n",
           "Ana has 12 apples, gets 9 more, gives away 6 and gets 3 more. How many apples does "
           "Ana have now?", "Add: 990+12", "Reverse: k e y s", "Add: 5+5")
DEADLINE = 120.0


def wait_for(condition: Callable[[], bool], what: str, timeout: float = DEADLINE,
             interval: float = 0.05) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def optimising(flags: str) -> str:
    """``flags`` without the tests' cheap-compile options (TEST_XLA_FLAGS): for a process that
    compiles a few programs and runs them for many requests (the shared server and the second
    one: a third of the CPU time per request, for 1.5 times the compile; the bundled model's
    round on 8 slots, 32 requests of 32 tokens: 11 + 19 CPU s with the test options, 16 + 7
    without)."""
    return " ".join(f for f in flags.split() if f not in TEST_XLA_FLAGS)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`focus-jax serve` in a subprocess, its output in a log file."""

    def __init__(self, log: Path, cache: Path, *options: str, env: dict[str, str] | None = None,
                 optimise: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(cache),
               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
               "JAX_DEFAULT_MATMUL_PRECISION": "highest", **(env or {})}  # as conftest sets it
        if optimise:  # XLA's optimising CPU backend, not the tests' cheap compile
            env["XLA_FLAGS"] = optimising(env.get("XLA_FLAGS", ""))
        command = [sys.executable, "-m", "focus_jax.cli", "serve", "--port", str(self.port),
                   "--bucket-ladder", ",".join(map(str, LADDER)), "--max-model-len", str(CONTEXT),
                   "--max-batch", str(SLOTS), "--api-key", KEY, "--log-level", "warning", *options]
        with log.open("wb") as out:
            self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out,
                                            stderr=subprocess.STDOUT)

    def ready(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"the server exited ({self.process.returncode}):\n{self.tail()}")
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self) -> Server:
        wait_for(self.ready, "the server to answer /health", timeout=300, interval=0.2)
        return self

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=60)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0,
                                  timeout=120)

    def post(self, path: str, body: dict | None = None, **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {KEY}", **kwargs.pop("headers", {})}
        return httpx.post(self.url + path, json=body, headers=headers, timeout=60, **kwargs)

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return sample.value
        raise AssertionError(f"/metrics has no {name}{labels}")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("compilation-cache")


@pytest.fixture(scope="module")
def started(tmp_path_factory, cache):
    """The shared server, started (it warms up while the reference below is computed)."""
    server = Server(tmp_path_factory.mktemp("serve") / "server.log", cache, optimise=True)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def model():
    return focus_jax.load(BUNDLED_MODEL)


def generate(model, max_tokens: int) -> dict[str, focus_jax.Result]:
    """``focus_jax.generate`` on PROMPTS, greedy, with the server's mode, ladder and shapes."""
    config = focus_jax.GenerationConfig(mode="focus", bucket_ladder=LADDER, max_new_tokens=max_tokens,
                                        max_batch=SLOTS, max_cache_len=CONTEXT)
    return dict(zip(PROMPTS, focus_jax.generate(model, list(PROMPTS), config), strict=True))


@pytest.fixture(scope="module")
def reference(started, model):
    return generate(model, MAX_TOKENS)


@pytest.fixture(scope="module")
def short_reference(started, model):
    return generate(model, SHORT)


@pytest.fixture(scope="module")
def server(started, reference) -> Server:
    """The shared server, ready (``reference`` is computed first, while it warms up)."""
    return started.wait_ready()


def chat(content: str = "Add: 1+2", **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}


def test_lists_the_served_model(server):
    models = server.client().models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == CONTEXT
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_greedy_answers_equal_generate(reference, server, model):
    client = server.client()
    for prompt, expected in reference.items():
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS)
        assert answer.choices[0].message.content == expected.text
        assert answer.choices[0].finish_reason == expected.finish_reason
        assert answer.usage.prompt_tokens == len(focus_jax.encode_prompt(model, prompt))
        assert answer.usage.completion_tokens == len(expected.token_ids)
        assert answer.usage.total_tokens == answer.usage.prompt_tokens + len(expected.token_ids)
    # The completions endpoint takes the same prompt as token ids (no chat template applied).
    prompt = PROMPTS[0]
    answer = client.completions.create(model=MODEL, prompt=focus_jax.encode_prompt(model, prompt),
                                       max_tokens=MAX_TOKENS)
    assert answer.choices[0].text == reference[prompt].text


def test_streamed_text_equals_the_answer_a_chunk_per_block(reference, server):
    client = server.client()
    prompt = PROMPTS[0]
    assert len(reference[prompt].token_ids) == MAX_TOKENS
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS,
        stream=True, stream_options={"include_usage": True}))
    content = [c for c in chunks if c.choices]
    assert content[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in content) == reference[prompt].text
    assert len(content) == 2  # one per committed block
    assert content[-1].choices[0].finish_reason == reference[prompt].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert all(c.usage is None for c in content)
    assert len({c.id for c in chunks}) == 1

    raw = client.completions.create(model=MODEL, prompt=f"<|user|>{prompt}<|assistant|>",
                                    max_tokens=MAX_TOKENS, stream=True)
    assert "".join(c.choices[0].text for c in raw) == reference[prompt].text


def test_stop_string_cuts_the_text_before_it(reference, server, model):
    expected = reference[PROMPTS[0]]
    block = model.config.block_size
    first = block - len(focus_jax.encode_prompt(model, PROMPTS[0])) % block  # tokens in block 1
    first_block = model.tokenizer.decode(expected.token_ids[:first], skip_special_tokens=True)
    # A stop string straddling the two blocks, found first there.
    stop = expected.text[len(first_block) - 2:len(first_block) + 2]
    cut = expected.text.find(stop)
    assert cut == len(first_block) - 2
    client = server.client()
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=MAX_TOKENS,
        stop=["never appears", stop])
    assert answer.choices[0].message.content == expected.text[:cut]
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.completion_tokens == tokens_through(model.tokenizer, expected.token_ids,
                                                            cut + len(stop))
    streamed = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=MAX_TOKENS,
        stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected.text[:cut]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_sampling_parameters_reach_the_engine(server):
    client = server.client()

    def sample(seed: int, **extra) -> str:
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Add: 12+34"}], max_tokens=16,
            temperature=1.5, top_p=0.95, seed=seed, extra_body=extra).choices[0].message.content

    assert sample(7) == sample(7)
    assert sample(7, top_k=1, threshold=0.5, alpha=2.0) == sample(8, top_k=1, threshold=0.5,
                                                                  alpha=2.0)  # top-1 = greedy


def test_a_bodys_commit_refresh_becomes_its_requests_and_is_otherwise_the_servers():
    from focus_jax.serve.schemas import RequestBody

    assert RequestBody(commit_refresh=True).sampling_params(8).commit_refresh is True
    assert RequestBody(commit_refresh=False).sampling_params(8).commit_refresh is False
    assert RequestBody().sampling_params(8).commit_refresh is None  # the engine's default


def test_concurrent_clients_each_get_their_own_answer_and_metrics_agree(short_reference, server):
    finished_before = sum(server.metric("focus_jax_requests_total", outcome=o)
                          for o in ("stop", "length"))
    generated_before = server.metric("focus_jax_generated_tokens_total")

    async def client_session(index: int) -> list[tuple[str, str, int, str]]:
        client = server.async_client()
        answers = []
        for turn in range(4):
            prompt = PROMPTS[(index + turn) % len(PROMPTS)]
            messages = [{"role": "user", "content": prompt}]
            if (index + turn) % 2:
                stream = await client.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=SHORT, stream=True,
                    stream_options={"include_usage": True})
                chunks = [c async for c in stream]
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                answers.append((prompt, text, chunks[-1].usage.completion_tokens, chunks[0].id))
            else:
                answer = await client.chat.completions.create(model=MODEL, messages=messages,
                                                              max_tokens=SHORT)
                answers.append((prompt, answer.choices[0].message.content,
                                answer.usage.completion_tokens, answer.id))
        await client.close()
        return answers

    async def all_sessions():
        return await asyncio.wait_for(asyncio.gather(*(client_session(i) for i in range(32))),
                                      DEADLINE)

    answers = [a for session in asyncio.run(all_sessions()) for a in session]
    assert len(answers) == 128 and len({a[3] for a in answers}) == 128
    for prompt, text, tokens, _ in answers:
        assert text == short_reference[prompt].text
        assert tokens == len(short_reference[prompt].token_ids)
    wait_for(lambda: server.metric("focus_jax_running_slots") == 0, "the slots to empty")
    assert server.metric("focus_jax_queue_length") == 0
    finished = sum(server.metric("focus_jax_requests_total", outcome=o) for o in ("stop", "length"))
    assert finished - finished_before == 128
    assert (server.metric("focus_jax_generated_tokens_total") - generated_before
            == sum(a[2] for a in answers))
    assert server.metric("focus_jax_compilations_total") == 0


BAD_REQUESTS = {
    "max_tokens zero": ("/v1/chat/completions", chat(max_tokens=0), 400, "max_tokens"),
    "max_tokens negative": ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400,
                            "max_tokens"),
    "temperature negative": ("/v1/chat/completions", chat(temperature=-0.5), 400, "temperature"),
    "top_p zero": ("/v1/chat/completions", chat(top_p=0), 400, "top_p"),
    "top_p above one": ("/v1/chat/completions", chat(top_p=1.5), 400, "top_p"),
    "commit_refresh a string": ("/v1/chat/completions", chat(commit_refresh="true"), 400,
                                "commit_refresh"),
    "prompt plus max_tokens over the context": ("/v1/chat/completions", chat(max_tokens=CONTEXT),
                                                400, "max_tokens"),
    "prompt over the context": ("/v1/completions", {"prompt": list(range(16, 16 + CONTEXT))}, 400,
                                "prompt"),
    "token id outside the vocabulary": ("/v1/completions", {"prompt": [10**6], "max_tokens": 4},
                                        400, None),
    "missing messages": ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    "empty messages": ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    "unknown role": ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400,
                     "messages"),
    "n above one": ("/v1/chat/completions", chat(n=2), 400, "n"),
    "chat logprobs": ("/v1/chat/completions", chat(logprobs=True), 400, "logprobs"),
    "completion logprobs": ("/v1/completions", {"prompt": "hi", "logprobs": 2}, 400, "logprobs"),
    "unknown model": ("/v1/chat/completions", chat(model="gpt-4o"), 404, "model"),
}


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] and "Traceback" not in response.text
    assert error["param"] == param
    return error


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_request_gets_its_status_and_an_openai_error(server, case):
    path, body, status, param = BAD_REQUESTS[case]
    refused = server.metric("focus_jax_requests_total", outcome="invalid")
    error = assert_openai_error(server.post(path, body), status, param)
    if param in ("n", "logprobs"):
        assert "not supported" in error["message"]
    assert server.metric("focus_jax_requests_total", outcome="invalid") == refused + 1


def test_malformed_body_and_access_errors(server):
    malformed = server.post("/v1/chat/completions", content=b'{"messages": [',
                            headers={"Content-Type": "application/json"})
    assert "not valid JSON" in assert_openai_error(malformed, 400)["message"]
    form = server.post("/v1/completions", content=b'{"prompt": "hi"}',
                       headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert "Content-Type: application/json" in assert_openai_error(form, 400)["message"]
    huge = server.post("/v1/completions", {"prompt": "x" * (2 << 20)})
    assert_openai_error(huge, 413)
    assert_openai_error(httpx.post(server.url + "/v1/chat/completions", json=chat()), 401)
    wrong = httpx.post(server.url + "/v1/chat/completions", json=chat(),
                       headers={"Authorization": "Bearer wrong-key"})
    assert assert_openai_error(wrong, 401)["code"] == "invalid_api_key"
    assert_openai_error(server.post("/v1/nowhere", {}), 404)
    # ... and the server goes on serving.
    answer = server.client().chat.completions.create(model=MODEL, messages=chat()["messages"],
                                                     max_tokens=1)
    assert answer.usage.completion_tokens == 1


def test_dropped_stream_frees_its_slot(server):
    aborted = server.metric("focus_jax_requests_total", outcome="abort")
    body = chat(stream=True, **SLOW)
    with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client, \
            client.stream("POST", server.url + "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert next(response.iter_lines()).startswith("data: ")  # the first block; then hang up
    wait_for(lambda: server.metric("focus_jax_requests_total", outcome="abort") == aborted + 1,
             "the dropped stream to be aborted")
    wait_for(lambda: server.metric("focus_jax_running_slots") == 0, "its slot to be freed")


def test_dropped_request_frees_its_slot(server):
    aborted = server.metric("focus_jax_requests_total", outcome="abort")

    async def drop() -> None:
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}) as client:
            request = asyncio.ensure_future(client.post(
                server.url + "/v1/chat/completions", json=chat(**SLOW), timeout=60))
            deadline = time.monotonic() + DEADLINE
            while server.metric("focus_jax_running_slots") < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert not request.done(), "the request finished before it could be dropped"
            request.cancel()  # closes its connection
            await asyncio.gather(request, return_exceptions=True)

    asyncio.run(drop())
    wait_for(lambda: server.metric("focus_jax_requests_total", outcome="abort") == aborted + 1,
             "the dropped request to be aborted")
    wait_for(lambda: server.metric("focus_jax_running_slots") == 0, "its slot to be freed")


def test_load_client_reports_throughput_and_percentiles(server):
    workload = load.Workload(num_requests=8, rate=40.0, max_tokens=16, seed=3, max_prompt_len=64,
                             prompt_format="ids")
    prompts = workload.prompts(BUNDLED_MODEL)
    report = asyncio.run(load.run(server.url, workload, prompts, api_key=KEY, timeout=60))
    assert report["completed"] == 8 and report["failed"] == 0 and report["model"] == MODEL
    assert report["output_tokens"] == 8 * 16 and report["short_outputs"] == 0
    assert report["mean_prompt_tokens"] == sum(map(len, prompts)) / 8
    for name in ("time_to_first_block", "end_to_end"):
        p = report[name]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"] <= report["wall_seconds"]
    json.dumps(report)  # JSON as it is written


GRACE = 1.0


@pytest.fixture(scope="module")
def second(tmp_path_factory, cache, server):
    """A second server (the shared one's programs, read from the cache it filled), with a queue of two and
    a grace period of GRACE: the queue test fills its queue, then the SIGTERM test (after it in
    this file) ends it. One server start for both."""
    server = Server(tmp_path_factory.mktemp("second") / "server.log", cache, "--max-queue", "2",
                    "--grace-period", str(GRACE), optimise=True)
    yield server.wait_ready()
    server.stop()


def test_full_queue_answers_429_with_retry_after(second):
    small = second
    assert small.process.poll() is None, "the SIGTERM test ran first and ended the server"

    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=DEADLINE) as client:
            return await asyncio.gather(*(
                client.post(small.url + "/v1/chat/completions",
                            json=chat(max_tokens=MAX_TOKENS, threshold=1.0))
                for _ in range(SLOTS + 8)))

    responses = asyncio.run(flood())
    full = [r for r in responses if r.status_code == 429]
    assert full and all(r.status_code == 200 for r in responses if r not in full)
    assert full[0].headers["Retry-After"] == "1"
    assert assert_openai_error(full[0], 429)["code"] == "queue_full"
    assert small.metric("focus_jax_requests_total", outcome="rejected") == len(full)
    assert small.post("/v1/chat/completions", chat(max_tokens=1)).status_code == 200
    wait_for(lambda: small.metric("focus_jax_running_slots") == 0, "the slots to empty")


def test_sigterm_ends_every_request_and_exits_0(second):
    grace, server = GRACE, second
    streams: list[list[str]] = [[] for _ in range(6)]

    async def stream(lines: list[str]) -> None:
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=DEADLINE) as client, client.stream(
                "POST", server.url + "/v1/chat/completions",
                json=chat(stream=True, **SLOW)) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line.removeprefix("data: "))

    async def run() -> float:
        tasks = [asyncio.ensure_future(stream(lines)) for lines in streams]
        deadline = time.monotonic() + DEADLINE
        while not all(streams) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert all(streams), "every request should be streaming before SIGTERM"
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        async with httpx.AsyncClient(timeout=10) as probe:  # still answering while it drains
            while (health := await probe.get(server.url + "/health")).status_code == 200:
                assert time.monotonic() < signalled + DEADLINE
                await asyncio.sleep(0.01)
            assert health.status_code == 503
            until = time.monotonic() + 0.3  # and goes on answering it (the drain takes longer)
            while time.monotonic() < until and not all(task.done() for task in tasks):
                assert (await probe.get(server.url + "/health")).status_code == 503
                await asyncio.sleep(0.02)
        await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE)
        code = await asyncio.to_thread(server.process.wait, 60)
        assert code == 0, server.tail()
        return time.monotonic() - signalled

    try:
        took = asyncio.run(run())
    finally:
        server.stop()
    assert took < grace + 15
    for lines in streams:
        assert lines[-1] == "[DONE]"
        last = json.loads(lines[-2])
        completed = "choices" in last and last["choices"][0]["finish_reason"] == "length"
        assert completed or last["error"]["code"] == "unavailable", lines[-2]


def test_a_server_on_a_two_device_mesh_answers_as_generate_does(tmp_path, cache, model):
    """``--mesh data=2`` (two CPU devices, half the slots on each): concurrent greedy answers
    equal ``focus_jax.generate`` on one device. Baseline mode: FOCUS's eviction on a mesh equals
    one device only where XLA rounds alike (tests/sharding/compare.py)."""
    two = Server(tmp_path / "mesh.log", cache, "--mesh", "data=2", "--mode", "baseline",
                 env={"XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=2")})
    config = focus_jax.GenerationConfig(mode="baseline", bucket_ladder=LADDER, max_batch=SLOTS,
                                        max_new_tokens=MAX_TOKENS, max_cache_len=CONTEXT)
    expected = [r.text for r in focus_jax.generate(model, list(PROMPTS), config)]
    two.wait_ready()
    try:
        async def ask_all() -> list[str]:
            client = two.async_client()
            answers = await asyncio.gather(*(
                client.chat.completions.create(model=MODEL, max_tokens=MAX_TOKENS,
                                               messages=[{"role": "user", "content": prompt}])
                for prompt in PROMPTS))
            return [a.choices[0].message.content for a in answers]

        assert asyncio.run(ask_all()) == expected
    finally:
        two.stop()


def test_a_mixture_of_experts_model_serves_the_tokens_generate_gives(tmp_path, cache):
    """A tiny LLaDA2-style model (a dense first layer, then experts: sigmoid scores with an
    expert bias, group-limited top-k, a shared expert; partial rotary) saved as a folder and
    served by ``focus-jax serve``: concurrent greedy completions through the official client are
    ``focus_jax.generate``'s tokens for the same folder."""
    from focus_jax.config import MoEConfig
    from focus_jax.testing import tiny_model

    moe = MoEConfig(num_experts=16, experts_per_token=4, expert_size=32, dense_layers=(0,),
                    scores="sigmoid", routed_scaling_factor=2.5, num_groups=4,
                    groups_per_token=2, expert_bias=True, shared_expert_size=32)
    folder = tmp_path / "llada2-tiny"
    focus_jax.save(tiny_model(seed=1, scale=4.0, tokenizer=True, model_type="llada2_moe",
                              moe=moe, partial_rotary_factor=0.5, block_size=8), folder)
    # A context of 32 holds these prompts (9-20 tokens) and their answers: 4 prompt buckets of
    # the MoE prefill to compile instead of 8.
    context = 32
    served = Server(tmp_path / "moe.log", cache, "--model", str(folder), "--max-model-len",
                    str(context))
    model = focus_jax.load(folder)
    prompts = [focus_jax.encode_prompt(model, p, chat=False) for p in PROMPTS[:4]]
    expected = [(r.text, len(r.token_ids)) for r in focus_jax.generate(
        model, prompts, focus_jax.GenerationConfig(
            mode="focus", bucket_ladder=LADDER, max_batch=SLOTS, max_new_tokens=SHORT,
            max_cache_len=context, stop_token_ids=()))]
    assert len(set(expected)) > 1 and all(n == SHORT for _, n in expected)
    served.wait_ready()
    try:
        async def ask_all() -> list[tuple[str, int]]:
            client = served.async_client()
            answers = await asyncio.gather(*(
                client.completions.create(model=folder.name, prompt=prompt, max_tokens=SHORT,
                                          extra_body={"ignore_eos": True})
                for prompt in prompts))
            return [(a.choices[0].text, a.usage.completion_tokens) for a in answers]

        assert asyncio.run(ask_all()) == expected
    finally:
        served.stop()


def test_serve_refuses_a_port_in_use(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code = main(["serve", "--port", str(taken.getsockname()[1])])
    assert code == 2 and "cannot listen" in capsys.readouterr().err
