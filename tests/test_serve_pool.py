"""`woodcock serve`'s prefix pool and back-pressure over loopback with the official openai
client, on the offline demo pair (EAGLE-3 drafter and prompt lookup): a request reuses the
cached rows of any recent conversation, not only the last one, and answers token for token as
it does cold; the pool evicts the least recently used beyond its size; request timeouts; the
metrics that count all of these; and a pooled cache stays as it was while a request that took
it over rolls back and writes."""

import json
import socket
import threading
import time

import mlx.core as mx
import openai
import pytest
from mlx_lm.models.cache import KVCache as MlxLmKVCache
from test_serve import Server, demo, request, session, woodcock_text  # noqa: F401 (fixtures)

from woodcock.errors import DrafterError
from woodcock.runtime.generate import encode_prompt, generate
from woodcock.runtime.layers import KVCache
from woodcock.runtime.policy import FixedPolicy
from woodcock.runtime.sampling import Sampling
from woodcock.serve import serve
from woodcock.serve.engine import Engine
from woodcock.serve.prefix import detached
from woodcock.serve.request import GenerationRequest

TURN_TOKENS = 20


@pytest.fixture(scope="module")
def pool_server(demo, tmp_path_factory):  # noqa: F811
    running = Server(demo, tmp_path_factory.mktemp("logs") / "pool.log")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def cold_server(demo, tmp_path_factory):  # noqa: F811
    running = Server(demo, tmp_path_factory.mktemp("logs") / "cold.log", prefix_cache=False)
    yield running
    running.stop()


def complete(server, prompt_ids, max_tokens=TURN_TOKENS):
    """(token ids of the answer, cached prompt tokens, speculative usage) of a greedy completion
    over token ids (no chat template: the prompts share exactly what the test says)."""
    answer = server.client().completions.create(
        model=server.model, prompt=prompt_ids, max_tokens=max_tokens, temperature=0
    )
    usage = answer.usage.model_dump()
    return answer.choices[0].text, usage["prompt_tokens_details"]["cached_tokens"], usage


def gauge(server, name: str) -> float:
    _, _, text = request(server, "GET", "/metrics")
    return next(
        float(line.split()[-1])
        for line in text.decode().splitlines()
        if line.split()[0] == f"woodcock_{name}"
    )


def cold(session, ids, max_tokens=TURN_TOKENS):  # noqa: F811
    """(text, tokens) of a greedy answer from empty caches, in this process."""
    result = generate(session, ids, max_tokens=max_tokens, policy=FixedPolicy(4), sampling=Sampling())
    return result.text, result.tokens


def turns(session):  # noqa: F811
    """Two conversations' first prompts, as token ids."""
    tokenizer = session.tokenizer
    return [
        encode_prompt(tokenizer, "The quick brown fox", chat=False),
        encode_prompt(tokenizer, "Paris is the capital of", chat=False),
    ]


def test_interleaved_conversations_hit_the_pool_and_answer_as_cold(
    pool_server, cold_server, session  # noqa: F811
):
    hits = pool_server.metric("prefix_cache_hits")
    prompts = turns(session)
    replies = {}
    for name, prompt in zip("AB", prompts, strict=True):  # A, then B: A is not the last one
        text, replies[name] = cold(session, prompt)
        assert complete(pool_server, prompt)[0] == text
    for round_ in range(2):  # A continued, B continued, then both once more
        for i, name in enumerate("AB"):
            follow_up = prompts[i] + replies[name] + [5 + round_]
            text, cached, usage = complete(pool_server, follow_up)
            cold_text, cold_cached, cold_usage = complete(cold_server, follow_up)
            # the pooled conversation's rows: its prompt and most of its answer
            assert cold_cached == 0 and cached >= len(prompts[i]) + TURN_TOKENS // 2
            expected, replies[name] = cold(session, follow_up)
            assert text == cold_text == expected
            # the drafter and the prompt lookup were restored as they were: the same rounds
            assert usage["speculative"] == {**cold_usage["speculative"], **_times(usage)}
            prompts[i] = follow_up
    assert pool_server.metric("prefix_cache_hits") >= hits + 4
    assert gauge(pool_server, "prefix_cache_entries") >= 2
    assert gauge(pool_server, "prefix_cache_bytes") > 0
    assert gauge(pool_server, "prefix_cache_limit_bytes") == 2**30


def _times(usage) -> dict:
    return {k: v for k, v in usage["speculative"].items() if k.endswith("_seconds")}


def test_the_pool_evicts_the_least_recently_used_beyond_its_size(demo, session, tmp_path):  # noqa: F811
    a, b = turns(session)
    c = encode_prompt(session.tokenizer, "One, two, three, four", chat=False)
    engine = Engine(session, "fixed:4")
    sizes = []
    for prompt in (a, b, c):
        engine.run(GenerationRequest("completions", prompt, TURN_TOKENS))
        sizes.append(engine.pool.entries[tuple(engine.cached_tokens)].nbytes)
    limit = 2 * max(sizes) + min(sizes) // 2  # two conversations fit, not three
    assert sum(sizes) > limit
    server = Server(demo, tmp_path / "small.log", prefix_cache_gb=limit / 2**30)
    try:
        complete(server, a)
        complete(server, b)
        assert gauge(server, "prefix_cache_entries") == 2
        expected = cold(session, a)[0]
        # A, not the last one, is reused (now B is the least recently used)
        assert complete(server, a)[:2] == (expected, len(a) - 1)
        assert server.metric("prefix_cache_evictions") == 0
        complete(server, c)
        assert server.metric("prefix_cache_evictions") == 1
        assert gauge(server, "prefix_cache_entries") == 2
        assert 0 < gauge(server, "prefix_cache_bytes") <= limit
        assert complete(server, a)[:2] == (expected, len(a) - 1)  # A was kept, and still is A
        text, cached, _ = complete(server, b)  # B went: prefilled again, the same answer
        assert cached < len(b) - 1 and text == cold(session, b)[0]
        assert server.metric("prefix_cache_evictions") == 2
    finally:
        server.stop()


def test_a_request_past_its_timeout_is_cancelled(demo, session, tmp_path):  # noqa: F811
    server = Server(demo, tmp_path / "timeout.log", request_timeout=0.25)
    prompt = turns(session)[0]
    try:
        text, _, _ = complete(server, prompt, max_tokens=4)  # well within its time
        assert text == woodcock_text(session, prompt, 4)
        statuses = []

        def long_request():
            try:
                complete(server, prompt, max_tokens=900)
                statuses.append(200)
            except openai.APIStatusError as e:
                statuses.append(e.status_code)
                assert e.code == "timeout" and "--request-timeout 0.25" in e.message

        threads = [threading.Thread(target=long_request) for _ in range(3)]
        for thread in threads:
            thread.start()
        time.sleep(0.05)
        # behind three long requests: its time runs out in the queue, the stream ends in error
        stream = server.client().completions.create(
            model=server.model, prompt=prompt, max_tokens=900, temperature=0, stream=True
        )
        with pytest.raises(openai.APIError, match="--request-timeout"):
            list(stream)
        for thread in threads:
            thread.join(30)
        assert 504 in statuses and len(statuses) == 3
        assert server.metric("timed_out_requests") >= 2
        assert server.metric("request_errors") >= 2
        text, _, _ = complete(server, prompt, max_tokens=4)  # the model is free again
        assert text == woodcock_text(session, prompt, 4)
        # a body that never arrives whole: 408 within the timeout, in each API's shape
        for path, field in (("/v1/completions", "code"), ("/v1/messages", "type")):
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
                head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
                sock.sendall(head.encode() + b'{"prompt":')
                started = time.monotonic()
                reply = sock.recv(65536).decode()
                while "\r\n\r\n" not in reply or not reply.endswith("}"):
                    more = sock.recv(65536).decode()
                    assert more, reply
                    reply += more
            assert reply.startswith("HTTP/1.1 408") and time.monotonic() - started < 5, reply
            error = json.loads(reply.split("\r\n\r\n", 1)[1])
            assert error["error"][field] == ("timeout" if field == "code" else "timeout_error")
            assert "did not arrive within --request-timeout 0.25 seconds" in reply
    finally:
        server.stop()


def test_metrics_report_occupancy_queue_wait_and_tokens_per_round(pool_server, session):  # noqa: F811
    complete(pool_server, turns(session)[0])
    _, _, text = request(pool_server, "GET", "/metrics")
    text = text.decode()
    for summary in ("queue_wait_seconds", "tokens_per_round"):
        assert f"# TYPE woodcock_{summary} summary" in text
    assert gauge(pool_server, "queue_wait_seconds_count") >= 1
    assert gauge(pool_server, "queue_wait_seconds_sum") >= 0
    rounds = gauge(pool_server, "tokens_per_round_count")
    assert rounds >= 1 and gauge(pool_server, "tokens_per_round_sum") / rounds >= 1
    assert gauge(pool_server, "max_batch_size") == 1
    assert gauge(pool_server, "running_requests") == gauge(pool_server, "batch_occupancy") == 0
    for counter in ("prefix_cache_hits", "prefix_cache_misses", "prefix_cache_evictions"):
        assert f"# TYPE woodcock_{counter}_total counter" in text


def test_bad_pool_and_timeout_options_are_refused_before_loading(demo):  # noqa: F811
    target, drafter = str(demo / "target"), str(demo / "drafter")
    with pytest.raises(DrafterError, match="--prefix-cache-gb -1"):
        serve(target, drafter, port=0, prefix_cache_gb=-1)
    with pytest.raises(DrafterError, match="--request-timeout 0"):
        serve(target, drafter, port=0, request_timeout=0)


@pytest.mark.parametrize("kind", [KVCache, MlxLmKVCache])
def test_a_detached_cache_keeps_its_rows_while_the_live_one_rolls_back_and_writes(kind):
    def rows(value, n):
        return mx.full((1, 2, n, 4), value), mx.full((1, 2, n, 4), -value)

    def keep(cache, length):  # the two caches' trims count differently
        cache.trim(length) if kind is KVCache else cache.trim(cache.offset - length)

    live = kind()
    live.update_and_fetch(*rows(1.0, 5))
    entry = detached([live])
    keep(live, 2)
    live.update_and_fetch(*rows(2.0, 3))  # written in place, over rows the entry holds
    taken = detached(entry)
    keep(taken[0], 3)
    taken[0].update_and_fetch(*rows(3.0, 4))
    assert entry[0].offset == 5 and mx.all(entry[0].keys == 1).item()
    assert mx.all(entry[0].values == -1).item()
    assert live.keys[0, 0, :5, 0].tolist() == [1, 1, 2, 2, 2]
    assert taken[0].keys[0, 0, :7, 0].tolist() == [1, 1, 1, 3, 3, 3, 3]
