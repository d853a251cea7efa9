"""`woodcock serve --max-batch`: requests decoded together, each with its own speculation, over
loopback with both official clients, streamed and not. Every answer is the one the same request
gets alone (from this server, and from the one-at-a-time server of test_serve); a request
cancelled mid-batch leaves the others' answers unchanged; seeds, the prefix pool and plain
decoding (no drafter) work batched."""

import asyncio
import http.client
import json
import threading

import anthropic
import pytest
import test_serve
from test_serve import PROMPTS, TIMEOUT, Server, completion, mlx_lm_text, woodcock_text

from woodcock.runtime.generate import encode_messages
from woodcock.serve.batching import Batcher
from woodcock.serve.engine import Engine
from woodcock.serve.request import GenerationRequest
from woodcock.serve.worker import Job

demo, session = test_serve.demo, test_serve.session  # the fixtures, shared


@pytest.fixture(scope="module")
def server(demo, tmp_path_factory):
    running = Server(demo, tmp_path_factory.mktemp("logs") / "batched.log", max_batch=4, queue_size=16)
    yield running
    running.stop()


def metric_summary(server, name):
    _, _, text = test_serve.request(server, "GET", "/metrics")
    values = dict(line.split() for line in text.decode().splitlines() if line.startswith(f"woodcock_{name}_"))
    return float(values[f"woodcock_{name}_sum"]), float(values[f"woodcock_{name}_count"])


def at_once(calls):
    """Run the calls in threads released together; their results in order."""
    results = [None] * len(calls)
    barrier = threading.Barrier(len(calls))

    def run(i):
        barrier.wait()
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(2 * TIMEOUT)
    return results


def test_concurrent_answers_are_each_requests_own_with_both_clients(server, session):
    expected = [woodcock_text(session, session.tokenizer.encode(p), 24) for p in PROMPTS]
    alone = [completion(server, p) for p in PROMPTS]
    assert alone == expected
    assert metric_summary(server, "batch_size")[0] == metric_summary(server, "batch_size")[1]  # one at a time so far
    anthropic_client = anthropic.Anthropic(base_url=server.url, api_key="unused", timeout=TIMEOUT, max_retries=0)
    questions = [[{"role": "user", "content": p}] for p in PROMPTS[:4]]
    anthropic_alone = [
        anthropic_client.messages.create(model=server.model, messages=q, max_tokens=16, extra_body={"temperature": 0}).content[0].text
        for q in questions
    ]

    def streamed_message(q):
        with anthropic_client.messages.stream(model=server.model, messages=q, max_tokens=16, extra_body={"temperature": 0}) as stream:
            return "".join(stream.text_stream)

    calls = [lambda i=i: completion(server, PROMPTS[i], stream=bool(i % 2)) for i in range(len(PROMPTS))]
    calls += [lambda q=q: streamed_message(q) for q in questions[:2]]
    calls += [
        lambda q=q: anthropic_client.messages.create(model=server.model, messages=q, max_tokens=16, extra_body={"temperature": 0})
        .content[0]
        .text
        for q in questions[2:]
    ]
    got = at_once(calls)
    assert got == expected + anthropic_alone
    total, rounds = metric_summary(server, "batch_size")
    assert total > rounds  # some rounds verified several requests together
    _, _, text = test_serve.request(server, "GET", "/metrics")
    gauges = dict(line.split() for line in text.decode().splitlines() if not line.startswith("#"))
    assert gauges["woodcock_max_batch_size"] == "4" and gauges["woodcock_running_requests"] == "0"


def test_a_request_cancelled_mid_batch_leaves_the_others_unchanged(server, session):
    long_prompt, others = "Paris is", PROMPTS[:3]
    expected = [completion(server, p, max_tokens=48) for p in others]
    cancelled = server.metric("cancelled_requests")

    def cancelled_stream():
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT)
        body = {"prompt": long_prompt, "max_tokens": 600, "stream": True}
        connection.request("POST", "/v1/completions", body=json.dumps(body))
        response = connection.getresponse()
        first = response.readline()
        connection.close()  # the client goes away after its first chunk
        return first

    calls = [cancelled_stream] + [lambda p=p: completion(server, p, max_tokens=48) for p in others]
    got = at_once(calls)
    assert got[0].startswith(b"data: {")
    assert got[1:] == expected
    assert server.metric("cancelled_requests") == cancelled + 1
    assert server.metric("cancelled_completion_tokens") < 600 // 2  # stopped early


def test_seeded_sampling_draws_the_same_alone_and_batched(server):
    def sampled(prompt, seed):
        return completion_with(server, prompt, temperature=1.0, seed=seed)

    alone = [sampled(p, 7) for p in PROMPTS[:3]]
    assert len(set(sampled(PROMPTS[0], s) for s in (1, 2, 3))) > 1  # the seed matters
    assert at_once([lambda p=p: sampled(p, 7) for p in PROMPTS[:3]]) == alone


def batched_results(engine, requests):
    """Each request's Generation, all admitted into one batch of their number."""
    batcher, loop = Batcher(engine, len(requests)), asyncio.new_event_loop()
    try:
        jobs, results = [Job(r, loop) for r in requests], {}
        for job in jobs:
            if (result := batcher.admit(job)) is not None:
                results[id(job)] = result
        while batcher.running:
            for job, result in batcher.round():
                results[id(job)] = result
        return [results[id(job)] for job in jobs]
    finally:
        loop.close()


@pytest.mark.parametrize("policy", ["fixed:8", "auto"])
def test_a_seeded_request_draws_the_same_alone_batched_and_sent_again(session, tmp_path, policy):
    """Its draws follow its draft lengths: those must depend on the request alone, not on a
    batch's cut of long proposals (fixed:8) or on what auto learned from earlier requests."""
    from woodcock.runtime.latency import write_profile

    if policy == "auto":
        write_profile(
            tmp_path / "latency.json",
            {
                "draft_kind": "chain",
                "verify_seconds": {"64": [0.01 + 0.001 * k for k in range(16)]},
                "draft_seconds": {"full": [0.001 * k for k in range(1, 9)]},
            },
        )
        policy = f"auto:{tmp_path / 'latency.json'}"
    engine = Engine(session, policy, prefix_cache=False)
    ids = [session.tokenizer.encode(p) for p in PROMPTS[:2]]

    def seeded():
        return GenerationRequest("completions", ids[0], 40, temperature=0.7, seed=3)

    alone = engine.run(seeded()).tokens
    assert engine.run(seeded()).tokens == alone
    batched, _ = batched_results(engine, [seeded(), GenerationRequest("completions", ids[1], 40)])
    assert batched.tokens == alone
    if policy == "fixed:8":
        assert max(batched.stats.drafted) > 5  # longer than a batch's proposals are cut to


def completion_with(server, prompt, **fields):
    answer = server.client().completions.create(model=server.model, prompt=prompt, max_tokens=24, **fields)
    return answer.choices[0].text


def test_a_batched_second_turn_reuses_the_pool(server, session):
    first = [{"role": "user", "content": "Berlin is the"}]
    reply = server.client().chat.completions.create(model=server.model, messages=first, max_tokens=24, temperature=0)
    second = first + [
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": "One, two"},
    ]
    ids = encode_messages(session.tokenizer, second)
    expected = woodcock_text(session, ids, 24)
    answers = at_once(
        [lambda: server.client().chat.completions.create(model=server.model, messages=second, max_tokens=24, temperature=0)]
        + [lambda p=p: completion(server, p) for p in PROMPTS[:2]]
    )
    assert answers[0].choices[0].message.content == expected
    assert answers[0].usage.model_dump()["prompt_tokens_details"]["cached_tokens"] >= len(encode_messages(session.tokenizer, first))


def test_plain_decoding_batches_too(session):
    """No drafter: the batch decodes one token a round per request, mlx-lm's greedy answers."""
    engine = Engine(session, None, prefix_cache=False)
    batcher = Batcher(engine, 3)
    loop = asyncio.new_event_loop()
    try:
        ids = [session.tokenizer.encode(p) for p in PROMPTS[:5]]
        jobs = [Job(GenerationRequest("completions", i, 20), loop) for i in ids]
        results, waiting = {}, list(jobs)
        while waiting or batcher.running:
            while waiting and not batcher.full:
                job = waiting.pop(0)
                if (result := batcher.admit(job)) is not None:
                    results[id(job)] = result
            for job, result in batcher.round():
                results[id(job)] = result
        texts = [results[id(job)].text for job in jobs]
        assert texts == [mlx_lm_text(session, i, 20) for i in ids]
        assert all(results[id(job)].stats.drafted == [0] * results[id(job)].stats.rounds for job in jobs)
    finally:
        loop.close()


def test_the_queue_bound_counts_only_requests_beyond_the_free_slots():
    """Arrivals wait in the worker's queue until it reaches them (between rounds), those a free
    slot will take included: only the ones beyond the slots count against --queue-size."""
    from woodcock.serve.worker import GenerationWorker

    worker = GenerationWorker(lambda: None, queue_size=1, max_batch=4)
    assert [worker.submit(object()) for _ in range(6)] == [True] * 5 + [False]
    worker = GenerationWorker(lambda: None, queue_size=1, max_batch=4)
    worker.running = [object()] * 3
    assert [worker.submit(object()) for _ in range(3)] == [True, True, False]
    worker = GenerationWorker(lambda: None, queue_size=2, max_batch=1)  # one at a time
    assert [worker.submit(object()) for _ in range(4)] == [True] * 3 + [False]


def test_max_batch_must_be_at_least_one(demo):
    from woodcock.errors import DrafterError
    from woodcock.serve import serve

    with pytest.raises(DrafterError, match="--max-batch 0: expected at least 1"):
        serve(str(demo / "target"), str(demo / "drafter"), "fixed:4", port=0, max_batch=0)


def test_after_a_failed_round_the_batch_starts_empty_and_answers_again(session):
    engine = Engine(session, "fixed:4", prefix_cache=False)
    batcher = Batcher(engine, 2)
    loop = asyncio.new_event_loop()
    try:
        ids = [session.tokenizer.encode(p) for p in PROMPTS[:2]]
        jobs = [Job(GenerationRequest("completions", i, 20), loop) for i in ids]
        for job in jobs:
            assert batcher.admit(job) is None

        def broken(tokens):
            raise RuntimeError("a failed forward")

        batcher.batch.forward = broken
        with pytest.raises(RuntimeError, match="a failed forward"):
            batcher.round()
        assert batcher.drop_all() == jobs and not batcher.running and len(batcher.batch) == 0
        job = Job(GenerationRequest("completions", ids[1], 20), loop)
        assert batcher.admit(job) is None
        while batcher.running:
            finished = batcher.round()
        assert finished[0][1].text == woodcock_text(session, ids[1], 20)
    finally:
        loop.close()
