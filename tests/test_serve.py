"""`woodcock serve` over loopback: the official openai client against a real server process on
the offline demo pair, greedy answers equal to `woodcock generate` and to plain mlx-lm, the
queue, cancellation, the prompt cache, and the bad-request table; the loop's prefix reuse and
cancellation hook on every kind of drafter."""

import codecs
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.generate import generate_step
from mlx_targets import tiny_target

from woodcock.errors import DrafterError
from woodcock.runtime.decode import Stats, speculative_generate_step
from woodcock.runtime.generate import (
    TextStream,
    TokenLogprob,
    encode_messages,
    encode_prompt,
    generate,
    token_bytes,
)
from woodcock.runtime.policy import FixedPolicy
from woodcock.runtime.sampling import Sampling
from woodcock.serve.openai import TextOffsets, completion_logprobs

CONTEXT = 1024  # the demo target's context, made small enough to exceed in a test
TIMEOUT = 30.0  # seconds any one HTTP exchange may take
PROMPTS = [
    "The quick brown",
    "Paris is",
    "One, two",
    "def add(a, b):",
    "Small models",
    "A drafter reads",
    "Speculative decoding",
    "Berlin is the",
]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from woodcock.demo import bigram_drafter, write_tiny_target
    from woodcock.formats import native

    root = tmp_path_factory.mktemp("serve")
    write_tiny_target(root / "target")
    config_file = root / "target" / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    native.write(bigram_drafter(root / "target"), root / "drafter")
    return root


@pytest.fixture(scope="module")
def session(demo):
    from woodcock.runtime.session import open_session

    return open_session(str(demo / "target"), str(demo / "drafter"))


class Server:
    def __init__(self, demo: Path, log: Path, **options):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = str(demo / "target")
        options = {"port": self.port, "log_level": "warning", **options}
        plain = options.get("plain", False)
        drafter = None if plain else str(demo / "drafter")
        code = (
            "from woodcock.serve import serve;"
            f" serve({self.model!r}, {drafter!r}, 'fixed:4', **{options!r})"
        )
        # the same BLAS as this test process, so that greedy ties break the same way
        env = {**os.environ, "WOODCOCK_OPENBLAS": "0", "XDG_CACHE_HOME": str(log.parent / "xdg")}
        self.log = log
        self.process = subprocess.Popen(
            [sys.executable, "-c", code], stdout=log.open("w"), stderr=subprocess.STDOUT, env=env
        )
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"the server exited: {log.read_text()}")
            try:
                if request(self, "GET", "/health", timeout=2)[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        self.stop()
        pytest.fail(f"the server did not start: {log.read_text()}")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.url + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0
        )

    def metric(self, name: str) -> float:
        _, _, text = request(self, "GET", "/metrics")
        return sum(
            float(line.split()[-1])
            for line in text.decode().splitlines()
            if line.startswith(f"woodcock_{name}_total")
        )

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def request(server, method, path, body=None, *, timeout=TIMEOUT):
    """(status, headers, body bytes); body: a dict (sent as JSON), bytes, or None."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if isinstance(body, dict | list) else body
        connection.request(method, path, body=data, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


@pytest.fixture(scope="module")
def server(demo, tmp_path_factory):
    running = Server(demo, tmp_path_factory.mktemp("logs") / "server.log")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def plain_server(demo, tmp_path_factory):
    """mlx-lm decoding without a drafter, a queue of two, no prompt cache."""
    log = tmp_path_factory.mktemp("logs") / "plain.log"
    running = Server(demo, log, plain=True, queue_size=2, prefix_cache=False)
    yield running
    running.stop()


def woodcock_text(session, ids, max_tokens):
    policy = FixedPolicy(4)
    return generate(session, ids, max_tokens=max_tokens, policy=policy, sampling=Sampling()).text


def mlx_lm_text(session, ids, max_tokens):
    detokenizer = session.tokenizer.detokenizer
    detokenizer.reset()
    for token, _ in generate_step(mx.array(ids), session.model, max_tokens=max_tokens):
        if token in session.tokenizer.eos_token_ids:
            break
        detokenizer.add_token(token)
    detokenizer.finalize()
    return detokenizer.text


def chat(server, messages, max_tokens=24, **fields):
    return server.client().chat.completions.create(
        model=server.model, messages=messages, max_tokens=max_tokens, temperature=0, **fields
    )


def streamed_chat(server, messages, max_tokens=24, **fields):
    """(text, finish reason, usage dict) of a streamed chat answer."""
    chunks = chat(server, messages, max_tokens, stream=True, stream_options={"include_usage": True}, **fields)
    text, finish, usage = "", None, None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish, usage


def test_answers_are_the_targets_greedy_text_streamed_or_not(server, session):
    messages = [{"role": "user", "content": "The quick brown"}]
    ids = encode_prompt(session.tokenizer, "The quick brown", chat=True)
    expected = woodcock_text(session, ids, 24)
    assert expected == mlx_lm_text(session, ids, 24) and expected
    answer = chat(server, messages)
    assert answer.choices[0].message.content == expected
    assert answer.choices[0].finish_reason == "length" and answer.model == server.model
    usage = answer.usage.model_dump()
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(ids), 24)
    assert usage["total_tokens"] == len(ids) + 24
    speculative = usage["speculative"]
    assert speculative["rounds"] >= 1 and speculative["tokens_per_round"] > 1
    assert speculative["accepted_tokens"] <= speculative["drafted_tokens"]
    assert len(speculative["acceptance_by_position"]) == 4
    assert usage["completion_tokens_details"]["accepted_prediction_tokens"] == speculative["accepted_tokens"]
    text, finish, streamed_usage = streamed_chat(server, messages)
    assert (text, finish) == (expected, "length")
    assert streamed_usage["completion_tokens"] == 24 and "speculative" in streamed_usage

    plain_ids = encode_prompt(session.tokenizer, "Paris is", chat=False)
    expected = woodcock_text(session, plain_ids, 20)
    assert expected == mlx_lm_text(session, plain_ids, 20)
    client = server.client()
    completion = client.completions.create(model=server.model, prompt="Paris is", max_tokens=20, temperature=0)
    assert completion.choices[0].text == expected
    assert completion.usage.prompt_tokens == len(plain_ids)
    by_ids = client.completions.create(model=server.model, prompt=plain_ids, max_tokens=20)
    assert by_ids.choices[0].text == expected
    chunks = client.completions.create(model=server.model, prompt="Paris is", max_tokens=20, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected


def test_stop_strings_seeds_and_sampling(server, session):
    ids = encode_prompt(session.tokenizer, "The quick brown", chat=False)
    full = woodcock_text(session, ids, 40)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    client = server.client()
    for stream in (False, True):
        answer = client.completions.create(
            model=server.model, prompt="The quick brown", max_tokens=40, stop=[stop], stream=stream
        )
        if stream:
            chunks = list(answer)
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            text, finish = answer.choices[0].text, answer.choices[0].finish_reason
        assert (text, finish) == (full[: full.index(stop)], "stop")
    def sampled(seed):
        return client.completions.create(
            model=server.model, prompt="One, two", max_tokens=30, temperature=1.0, top_p=0.95, seed=seed
        ).choices[0].text

    assert sampled(3) == sampled(3)  # the seed fixes the draws, whatever ran before
    # OpenAI's seeds are signed 64-bit integers: the negative ones are seeds too
    assert sampled(-1) == sampled(-1) and sampled(-(2**63)) == sampled(-(2**63))


def test_models_health_and_metrics(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [server.model]
    assert models.data[0].model_dump()["backend"]["backend"] == "cpu"
    assert "; cpu backend)" in server.log.read_text()  # the line saying where it listens
    status, _, body = request(server, "GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    before = server.metric("completion_tokens")
    chat(server, [{"role": "user", "content": "Paris is"}], max_tokens=7)
    assert server.metric("completion_tokens") == before + 7
    status, headers, text = request(server, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    for name in ("requests", "drafted_tokens", "accepted_tokens", "rounds", "request_errors", "queue_rejections", "cancelled_requests"):
        assert f"# TYPE woodcock_{name}_total counter" in text.decode()
    assert server.metric("rounds") > 0 and server.metric("accepted_tokens") > 0


def completion(server, prompt, max_tokens=24, stream=False):
    answer = server.client().completions.create(
        model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=stream
    )
    if stream:
        return "".join(chunk.choices[0].text for chunk in answer if chunk.choices)
    return answer.choices[0].text


def test_eight_clients_at_once_each_get_their_own_answer(server):
    # completions: a chat prompt ends in the template's assistant header, and the demo target's
    # next token depends mostly on the last one
    sequential = [completion(server, prompt) for prompt in PROMPTS]
    assert len(set(sequential)) == len(PROMPTS)  # different prompts, different answers
    answers = [None] * len(PROMPTS)
    barrier = threading.Barrier(len(PROMPTS))

    def client(i):
        barrier.wait()
        answers[i] = completion(server, PROMPTS[i], stream=bool(i % 2))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert answers == sequential


def test_a_second_turn_reuses_the_cache_and_answers_the_same(server, session):
    first = [{"role": "user", "content": "The quick brown"}]
    reply = chat(server, first).choices[0].message.content
    second = first + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Paris is the capital of"},
    ]
    ids = encode_messages(session.tokenizer, second)
    expected = woodcock_text(session, ids, 24)  # from empty caches
    assert expected == mlx_lm_text(session, ids, 24)
    answer = chat(server, second)
    assert answer.choices[0].message.content == expected
    first_ids = encode_messages(session.tokenizer, first)
    cached = answer.usage.model_dump()["prompt_tokens_details"]["cached_tokens"]
    assert len(first_ids) <= cached < len(ids)  # the first turn's prompt and part of its reply
    text, _, usage = streamed_chat(server, second)  # the same prompt again: all but its end
    assert text == expected and usage["prompt_tokens_details"]["cached_tokens"] == len(ids) - 1


def test_a_client_that_disconnects_mid_stream_frees_the_model(server, session):
    prompt, longest = "Paris is", CONTEXT - 16
    client = server.client()
    full = client.completions.create(model=server.model, prompt=prompt, max_tokens=longest)
    assert full.choices[0].finish_reason == "length"  # it would run to the end
    cancelled = server.metric("cancelled_requests")
    wasted = server.metric("cancelled_completion_tokens")
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT)
    body = {"prompt": prompt, "max_tokens": longest, "stream": True}
    connection.request("POST", "/v1/completions", body=json.dumps(body))
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: {")
    connection.close()
    start = time.monotonic()
    answer = chat(server, [{"role": "user", "content": "Paris is"}], max_tokens=8)
    assert answer.choices[0].finish_reason == "length" and time.monotonic() - start < 10
    assert server.metric("cancelled_requests") == cancelled + 1
    assert server.metric("cancelled_completion_tokens") - wasted < longest // 4  # stopped early


def test_plain_decoding_without_the_drafter_or_the_prompt_cache(plain_server, session):
    messages = [{"role": "user", "content": "One, two"}]
    ids = encode_messages(session.tokenizer, messages)
    expected = mlx_lm_text(session, ids, 24)
    for _ in range(2):
        answer = chat(plain_server, messages)
        assert answer.choices[0].message.content == expected
        usage = answer.usage.model_dump()
        assert usage["speculative"]["rounds"] == 0 and usage["prompt_tokens_details"]["cached_tokens"] == 0
    models = plain_server.client().models.list().data[0].model_dump()
    assert models["drafter"] is None and models["prefix_cache"] is False


def test_a_full_queue_answers_503_with_retry_after_and_recovers(plain_server, session):
    longest = CONTEXT - 16
    holding = http.client.HTTPConnection("127.0.0.1", plain_server.port, timeout=TIMEOUT)
    holding.request("POST", "/v1/completions", body=json.dumps({"prompt": "Paris is", "max_tokens": longest, "stream": True}))
    response = holding.getresponse()
    assert response.readline().startswith(b"data: {")  # it runs; two may wait behind it
    results = [None] * 5
    barrier = threading.Barrier(len(results))

    def client(i):
        barrier.wait()
        results[i] = request(plain_server, "POST", "/v1/completions", {"prompt": "Paris is", "max_tokens": 32})

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(results))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    response.read()  # the held stream runs to its end
    holding.close()
    rejected = [r for r in results if r[0] == 503]
    assert len(rejected) >= 1 and len(rejected) + sum(r[0] == 200 for r in results) == len(results)
    for _, headers, body in rejected:
        assert int(headers["retry-after"]) >= 1
        error = json.loads(body)["error"]
        assert error["code"] == "queue_full" and "--queue-size 2" in error["message"]
    ids = encode_prompt(session.tokenizer, "Paris is", chat=False)
    expected = mlx_lm_text(session, ids, 32)
    for status, _, body in results:
        if status == 200:
            assert json.loads(body)["choices"][0]["text"] == expected
    status, _, body = request(plain_server, "POST", "/v1/completions", {"prompt": "Paris is", "max_tokens": 32})
    assert status == 200 and json.loads(body)["choices"][0]["text"] == expected
    assert plain_server.metric("queue_rejections") == len(rejected)



def test_a_client_gone_before_its_body_is_whole_is_no_server_error(server):
    errors = server.metric("request_errors")
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens"):
        with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as sock:
            head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
            sock.sendall(head.encode() + b'{"prompt":')
        time.sleep(0.3)
    status, _, _ = request(server, "GET", "/health")
    assert status == 200 and server.metric("request_errors") == errors
    assert "Traceback" not in server.log.read_text()


def test_the_slot_is_free_when_the_answer_arrives(server):
    """A client that sends its next request as soon as an answer arrives finds the model idle."""
    for i in range(12):
        request(server, "POST", "/v1/completions", {"prompt": PROMPTS[i % 8], "max_tokens": 4})
        status, _, body = request(server, "GET", "/health")
        assert json.loads(body)["busy"] is False, i


@pytest.mark.parametrize("max_batch", [1, 2])
def test_a_stopped_server_ends_waiting_and_running_requests_with_a_503(demo, tmp_path, max_batch):
    """SIGTERM with requests running and waiting: the waiting ones are answered 503 at once, the
    running ones finish or end with it before uvicorn would cut them off; streams end with an
    error event and their closing line; no traceback, and the process exits."""
    stopping = Server(demo, tmp_path / "stopping.log", max_batch=max_batch, queue_size=8)
    results = [None] * 8
    answered_at = [None] * 8

    def client(i):
        body = {"prompt": PROMPTS[i], "max_tokens": CONTEXT - 16, "stream": i % 2 == 1}
        path = "/v1/messages" if i == 7 else "/v1/completions"
        if i == 7:
            body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": CONTEXT - 64}
        results[i] = request(stopping, "POST", path, body)
        answered_at[i] = time.monotonic()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(results))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + TIMEOUT
    # every request in: those generating and the rest waiting
    while json.loads(request(stopping, "GET", "/health")[2])["waiting"] < len(results) - max_batch:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    stopped_at = time.monotonic()
    stopping.process.terminate()
    for thread in threads:
        thread.join(TIMEOUT)
    stopping.process.wait(TIMEOUT)
    refused = 0
    for i, (status, _, body) in enumerate(results):
        if i == 7:  # Anthropic's shape: a 503 is its 529 overloaded_error
            assert status in (200, 529), (status, body)
            if status == 529:
                refused += 1
                error = json.loads(body)["error"]
                assert error["type"] == "overloaded_error" and "shutting down" in error["message"]
        elif status == 503:  # waiting, not streamed, or arriving after the signal
            refused += 1
            assert json.loads(body)["error"]["code"] == "shutting_down"
        elif i % 2 == 1:  # streamed: its 200 went out when it was queued
            assert status == 200
            events = [event for event in body.decode().split("\n\n") if event]
            assert events[-1] == "data: [DONE]"
            last = json.loads(events[-2].removeprefix("data: "))
            if "error" in last:
                refused += 1
                assert last["error"]["code"] == "shutting_down"
            else:
                assert last["choices"][0]["finish_reason"] in ("length", "stop")
        else:
            assert status == 200
            assert json.loads(body)["choices"][0]["finish_reason"] in ("length", "stop")
        assert answered_at[i] - stopped_at < 4.9  # before uvicorn's grace of 5 s ran out
    assert refused >= len(results) - max_batch - 1  # those waiting when the signal came
    log = stopping.log.read_text()
    assert "Traceback" not in log and "timeout graceful shutdown exceeded" not in log, log


# -- logprobs, logit bias and penalties ---------------------------------------------------------

PENALTIES = {  # request fields, as mlx-lm's make_logits_processors takes them
    "presence_penalty": 1.5,
    "frequency_penalty": 0.7,
    "repetition_penalty": 1.4,
    "logit_bias": {"17": 5.0, "40": -100.0},
}


def mlx_lm_answer(session, ids, max_tokens, **fields):
    """mlx-lm's greedy decoding with the fields' logits processors: (text, the target's
    log-probabilities at each token [n, V] as numpy)."""
    import numpy as np
    from mlx_lm.sample_utils import make_logits_processors

    bias = fields.get("logit_bias")
    processors = make_logits_processors(
        {int(k): v for k, v in bias.items()} if bias else None,
        fields.get("repetition_penalty"),
        presence_penalty=fields.get("presence_penalty"),
        frequency_penalty=fields.get("frequency_penalty"),
    )
    detokenizer = session.tokenizer.detokenizer
    detokenizer.reset()
    rows = []
    steps = generate_step(mx.array(ids), session.model, max_tokens=max_tokens, logits_processors=processors)
    for token, logprobs in steps:
        if token in session.tokenizer.eos_token_ids:
            break
        detokenizer.add_token(token)
        rows.append(np.array(logprobs))
    detokenizer.finalize()
    return detokenizer.text, np.stack(rows)


@pytest.mark.parametrize("field", list(PENALTIES) + ["all"])
def test_penalties_and_bias_answer_as_mlx_lm_decodes_with_them(server, plain_server, session, field):
    fields = PENALTIES if field == "all" else {field: PENALTIES[field]}
    messages = [{"role": "user", "content": "One, two"}]
    ids = encode_messages(session.tokenizer, messages)
    expected, _ = mlx_lm_answer(session, ids, 32, **fields)
    assert expected != mlx_lm_text(session, ids, 32)  # the field changes the answer
    for running in (server, plain_server):
        answer = chat(running, messages, 32, extra_body=fields)
        assert answer.choices[0].message.content == expected, running
    text, _, _ = streamed_chat(server, messages, 32, extra_body=fields)
    assert text == expected
    plain_ids = encode_prompt(session.tokenizer, "Paris is", chat=False)
    expected, _ = mlx_lm_answer(session, plain_ids, 24, **fields)
    client = server.client()
    completion = client.completions.create(model=server.model, prompt="Paris is", max_tokens=24, temperature=0, extra_body=fields)
    assert completion.choices[0].text == expected


def test_chat_logprobs_are_the_targets_streamed_or_not(server, plain_server, session):
    import numpy as np

    messages = [{"role": "user", "content": "The quick brown"}]
    ids = encode_messages(session.tokenizer, messages)
    fields = {"presence_penalty": 0.8}
    expected, rows = mlx_lm_answer(session, ids, 20, **fields)
    for running in (server, plain_server):
        answer = chat(running, messages, 20, logprobs=True, top_logprobs=3, extra_body=fields)
        choice = answer.choices[0]
        assert choice.message.content == expected
        content = choice.logprobs.content
        assert len(content) == len(rows)  # tokens decoded alone: not always the text's pieces
        # each token's own bytes (the demo's answer splits characters): together, the text's as
        # the tokenizer decodes it
        tokens = rows.argmax(axis=-1).tolist()
        together = bytes(b for entry in content for b in entry.bytes)
        assert together.decode(errors="replace") == session.tokenizer.decode(tokens)
        for entry, row in zip(content, rows, strict=True):
            assert len(entry.top_logprobs) == 3
            assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely
            assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
            assert np.allclose([t.logprob for t in entry.top_logprobs], np.sort(row)[::-1][:3], atol=2e-4)
            assert abs(entry.logprob - row.max()) < 2e-4
    plain = chat(server, messages, 20).choices[0]
    assert plain.logprobs is None
    without_top = chat(server, messages, 20, logprobs=True, extra_body=fields).choices[0].logprobs.content
    assert [t.top_logprobs for t in without_top] == [[]] * len(rows)
    # values to within the rounding of different verification shapes (the prompt cache)
    assert np.allclose([t.logprob for t in without_top], rows.max(axis=-1), atol=2e-4)
    chunks = chat(server, messages, 20, stream=True, logprobs=True, top_logprobs=3, extra_body=fields)
    streamed = [t for c in chunks for choice in c.choices if choice.logprobs for t in choice.logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert np.allclose([t.logprob for t in streamed], rows.max(axis=-1), atol=2e-4)


def test_completion_logprobs_in_the_legacy_shape_streamed_or_not(server, session):
    import numpy as np

    ids = encode_prompt(session.tokenizer, "Paris is", chat=False)
    expected, rows = mlx_lm_answer(session, ids, 16)
    client = server.client()
    answer = client.completions.create(model=server.model, prompt="Paris is", max_tokens=16, temperature=0, logprobs=2)
    logprobs = answer.choices[0].logprobs
    assert answer.choices[0].text == expected and len(logprobs.tokens) == len(rows)
    assert np.allclose(logprobs.token_logprobs, rows.max(axis=-1), atol=2e-4)
    assert all(len(top) <= 2 and top[token] == value for top, token, value in zip(logprobs.top_logprobs, logprobs.tokens, logprobs.token_logprobs, strict=True))
    # each token's offset: the characters of the answer its predecessors' bytes complete (this
    # random target's answer holds tokens that are parts of characters)
    decoder, completed = codecs.getincrementaldecoder("utf-8")("replace"), [0]
    for piece in token_bytes(session.tokenizer, rows.argmax(axis=-1).tolist()):
        completed.append(completed[-1] + len(decoder.decode(piece)))
    assert logprobs.text_offset == completed[:-1] and completed[-2] <= len(expected)
    chunks = client.completions.create(model=server.model, prompt="Paris is", max_tokens=16, logprobs=0, stream=True)
    tokens, values, offsets = [], [], []
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            values += chunk.choices[0].logprobs.token_logprobs
            offsets += chunk.choices[0].logprobs.text_offset
    assert (tokens, offsets) == (logprobs.tokens, logprobs.text_offset)
    assert np.allclose(values, rows.max(axis=-1), atol=2e-4)
    assert client.completions.create(model=server.model, prompt="Paris is", max_tokens=4).choices[0].logprobs is None


def test_text_offsets_count_a_character_split_over_tokens_once():
    # "\ufffd" (a lone continuation byte), "\u00e9" twice over two tokens each, a last lead byte
    pieces = [b"\xa9", b"\xc3", b"\xa9", b"\xc3", b"\xa9", b"\xc3"]
    entries = [TokenLogprob(i, "\ufffd", raw, -1.0, []) for i, raw in enumerate(pieces)]
    assert completion_logprobs(entries)["text_offset"] == [0, 1, 1, 2, 2, 3]
    offsets = TextOffsets()  # a stream's chunks share the offsets, a character split across two
    chunks = [completion_logprobs(entries[:2], offsets), completion_logprobs(entries[2:], offsets)]
    assert [o for c in chunks for o in c["text_offset"]] == [0, 1, 1, 2, 2, 3]
    words = [TokenLogprob(0, " the", b" the", -1.0, []), TokenLogprob(1, " end", b" end", -1.0, [])]
    assert completion_logprobs(words)["text_offset"] == [0, 4]


def test_a_completion_continues_its_prompt_leading_space_included(server, plain_server, session):
    """A completion is appended to its prompt: it keeps the space that starts its first token
    (mlx-lm's detokenizers drop it from an answer), and its stop strings and offsets see it."""
    tokenizer = session.tokenizer
    (the,) = tokenizer.encode(" the", add_special_tokens=False)
    bias = {str(the): 100.0}  # every token " the", the one before the forced token a space
    for running in (server, plain_server):
        client = running.client()
        answer = client.completions.create(
            model=running.model, prompt="Paris is", max_tokens=4, temperature=0, logprobs=1, logit_bias=bias
        ).choices[0]
        assert answer.text == " the" * 4
        assert answer.logprobs.tokens == [" the"] * 4 and answer.logprobs.text_offset == [0, 4, 8, 12]
        chunks = client.completions.create(
            model=running.model, prompt="Paris is", max_tokens=4, logit_bias=bias, stream=True
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == " the" * 4
        stopped = client.completions.create(
            model=running.model, prompt="Paris is", max_tokens=4, logit_bias=bias, stop=[" the"]
        ).choices[0]
        assert (stopped.text, stopped.finish_reason) == ("", "stop")
        reply = chat(running, [{"role": "user", "content": "Paris is"}], 4, logit_bias=bias)
        assert reply.choices[0].message.content == "the the the the"  # an answer, as mlx-lm's


def test_a_stop_string_completed_by_text_held_back_to_the_end_still_stops(session):
    """mlx-lm's detokenizer holds a lone space (and part of a character) back until the next
    token; where generation ends there, the flushed text is checked for stop strings too."""
    tokenizer = session.tokenizer
    tokens = tokenizer.encode("The answer is ", add_special_tokens=False)
    for max_tokens in (len(tokens), len(tokens) + 5):  # ends by length, or by the caller
        text = TextStream(tokenizer, max_tokens=max_tokens, stop=["is "])
        for token in tokens:
            text.add(token)
        result = text.close()
        assert (result.text, result.finish_reason, result.stop_string) == ("The answer ", "stop", "is ")


def test_token_bytes_rebuild_characters_split_over_tokens(session):
    tokenizer = session.tokenizer
    text = "Pizza: \U0001f355\U0001f355, d\u00e9j\u00e0 vu"
    tokens = tokenizer.encode(text, add_special_tokens=False)
    assert any(tokenizer.decode([t]) == "\ufffd" for t in tokens)  # part of a character alone
    assert b"".join(token_bytes(tokenizer, tokens)) == text.encode("utf-8")


def test_plain_decoding_keeps_the_penalties_history_over_the_prompt_cache(session):
    """The engine without a drafter: a prompt whose start is cached still has every prompt token
    in the penalties' window, as when nothing was cached."""
    from woodcock.serve.engine import Engine
    from woodcock.serve.request import GenerationRequest

    engine = Engine(session, None)
    fields = {"repetition_penalty": 1.6, "presence_penalty": 1.0}
    first = encode_prompt(session.tokenizer, "One, two, one, two", chat=False)
    engine.run(GenerationRequest("completions", first, 12, **fields))
    prompt = first + engine.cached_tokens[len(first) :] + [5]
    expected, _ = mlx_lm_answer(session, prompt, 12, **fields)
    assert engine.reusable(prompt) > len(first)
    result = engine.run(GenerationRequest("completions", prompt, 12, **fields))
    assert result.stats.cached_tokens > len(first) and result.text == expected


USER = [{"role": "user", "content": "Hi"}]
BAD_REQUESTS = [
    # (name, path, body, status, param, part of the message)
    ("malformed JSON", "/v1/chat/completions", b'{"messages": [', 400, None, "not valid JSON"),
    ("not an object", "/v1/completions", [1, 2], 400, None, "must be a JSON object"),
    ("NaN", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, None, "not valid JSON"),
    ("nested too deeply", "/v1/chat/completions", b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b', "messages": []}', 400, None, "nested too deeply"),
    ("half an emoji", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud83db"}]}', 400, "messages[0].content", "lone UTF-16 surrogate ('\\ud83d' at character 1)"),
    ("half an emoji in a stop string", "/v1/completions", b'{"prompt": "x", "stop": ["\\udc00"]}', 400, "stop[0]", "lone UTF-16 surrogate"),
    ("no messages", "/v1/chat/completions", {"max_tokens": 4}, 400, "messages", "required"),
    ("messages a string", "/v1/chat/completions", {"messages": "Hi"}, 400, "messages", "expected a non-empty array"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages", "at least one"),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "'robot'"),
    ("no role", "/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages[0].role", "messages[0].role: required: expected one of"),
    ("content a number", "/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content", "got an integer"),
    ("image part", "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content[0]", "only text parts"),
    ("no prompt", "/v1/completions", {"max_tokens": 4}, 400, "prompt", "required"),
    ("prompt batch", "/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", "a batch of 2 prompts"),
    ("token id out of range", "/v1/completions", {"prompt": [1, 99999]}, 400, "prompt", "token id 99999"),
    ("token id past int64", "/v1/completions", {"prompt": [2**64]}, 400, "prompt", f"token id {2**64}"),
    ("negative max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens", ">= 1"),
    ("zero max_completion_tokens", "/v1/chat/completions", {"messages": USER, "max_completion_tokens": 0}, 400, "max_completion_tokens", ">= 1"),
    ("max_tokens a string", "/v1/completions", {"prompt": "x", "max_tokens": "8"}, 400, "max_tokens", "got a string"),
    ("negative temperature", "/v1/chat/completions", {"messages": USER, "temperature": -0.5}, 400, "temperature", "in [0, 2]"),
    ("top_p above 1", "/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p", "in [0, 1]"),
    ("negative top_k", "/v1/completions", {"prompt": "x", "top_k": -2}, 400, "top_k", ">= 0"),
    ("min_p a boolean", "/v1/completions", {"prompt": "x", "min_p": True}, 400, "min_p", "got a boolean"),
    ("seed a string", "/v1/completions", {"prompt": "x", "seed": "s"}, 400, "seed", "expected an integer"),
    ("seed past int64", "/v1/completions", {"prompt": "x", "seed": 2**63}, 400, "seed", "expected an integer in"),
    ("n of 2", "/v1/chat/completions", {"messages": USER, "n": 2}, 400, "n", "n = 2"),
    ("empty stop", "/v1/completions", {"prompt": "x", "stop": ["a", ""]}, 400, "stop", "empty stop"),
    ("stop a number", "/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop", "expected a string or an array"),
    ("stop with a number", "/v1/completions", {"prompt": "x", "stop": ["a", None]}, 400, "stop[1]", "stop[1]: expected a string, got null"),
    ("stream a string", "/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream", "expected a boolean"),
    ("stream_options without stream", "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", "only allowed with stream"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs", "only allowed with logprobs: true"),
    ("top_logprobs above 20", "/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "in [0, 20]"),
    ("logprobs a string", "/v1/chat/completions", {"messages": USER, "logprobs": "yes"}, 400, "logprobs", "expected a boolean"),
    ("completion logprobs above 5", "/v1/completions", {"prompt": "x", "logprobs": 6}, 400, "logprobs", "in [0, 5]"),
    ("completion logprobs a boolean", "/v1/completions", {"prompt": "x", "logprobs": True}, 400, "logprobs", "expected an integer"),
    ("presence_penalty above 2", "/v1/chat/completions", {"messages": USER, "presence_penalty": 2.5}, 400, "presence_penalty", "in [-2, 2]"),
    ("frequency_penalty below -2", "/v1/completions", {"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty", "in [-2, 2]"),
    ("negative repetition_penalty", "/v1/completions", {"prompt": "x", "repetition_penalty": -1}, 400, "repetition_penalty", ">= 0"),
    ("logit_bias a list", "/v1/completions", {"prompt": "x", "logit_bias": [1]}, 400, "logit_bias", "expected an object"),
    ("logit_bias key not a token", "/v1/completions", {"prompt": "x", "logit_bias": {"fox": 1}}, 400, "logit_bias", "key 'fox'"),
    ("logit_bias key past the vocabulary", "/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias", "[0, 320)"),
    ("logit_bias value above 100", "/v1/chat/completions", {"messages": USER, "logit_bias": {"5": 101}}, 400, "logit_bias[5]", "in [-100, 100]"),
    ("tools", "/v1/chat/completions", {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools", "not supported"),
    ("unknown model", "/v1/chat/completions", {"messages": USER, "model": "gpt-4o"}, 404, "model", "'gpt-4o' does not exist"),
    ("model a number", "/v1/completions", {"prompt": "x", "model": 7}, 400, "model", "expected a string"),
    ("prompt past the context", "/v1/completions", {"prompt": "The quick brown fox. " * 400}, 400, "prompt", f"the model's context is {CONTEXT} tokens"),
    ("messages past the context", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Paris is. " * 600}]}, 400, "messages", "context is"),
    ("max_tokens past the context", "/v1/completions", {"prompt": "x", "max_tokens": 1000000000000}, 400, "max_tokens", f"This model's maximum context length is {CONTEXT} tokens. However, you requested 1000000000"),
    ("max_completion_tokens past the context", "/v1/chat/completions", {"messages": USER, "max_completion_tokens": CONTEXT}, 400, "max_completion_tokens", f"maximum context length is {CONTEXT} tokens"),
    ("unknown path", "/v1/embeddings", {"input": "x"}, 404, None, "no route POST /v1/embeddings"),
]


@pytest.mark.parametrize("name, path, body, status, param, message", BAD_REQUESTS, ids=[r[0] for r in BAD_REQUESTS])
def test_bad_requests_are_refused_naming_the_field(server, name, path, body, status, param, message):
    got, _, raw = request(server, "POST", path, body)
    error = json.loads(raw)["error"]
    assert (got, error["param"]) == (status, param), error
    assert message in error["message"] and error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}


def test_a_prompt_and_max_tokens_past_the_context_are_refused_with_the_numbers(server, session):
    ids, limit = encode_messages(session.tokenizer, USER), 1000000000000
    status, _, raw = request(server, "POST", "/v1/chat/completions", {"messages": USER, "max_tokens": limit})
    error = json.loads(raw)["error"]
    assert (status, error["code"], error["param"]) == (400, "context_length_exceeded", "max_tokens")
    assert error["message"] == (
        f"This model's maximum context length is {CONTEXT} tokens. However, you requested {len(ids) + limit} tokens"
        f" ({len(ids)} in the messages, {limit} in the completion). Please reduce the length of the messages or completion."
    )
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="However, you requested"):
        client.chat.completions.create(model=server.model, messages=USER, max_completion_tokens=CONTEXT, stream=True)
    prompt = (encode_prompt(session.tokenizer, "Paris is", chat=False) * CONTEXT)[: CONTEXT - 6]
    with pytest.raises(openai.BadRequestError, match=rf"you requested {CONTEXT + 1} tokens \({CONTEXT - 6} in the messages, 7 in the completion\)"):
        client.completions.create(model=server.model, prompt=prompt, max_tokens=7)
    filled = client.completions.create(model=server.model, prompt=prompt, max_tokens=6)  # exactly the context
    assert filled.usage.prompt_tokens + filled.usage.completion_tokens <= CONTEXT
    unnamed = client.completions.create(model=server.model, prompt=prompt)  # no limit: what the context leaves
    assert unnamed.choices[0].text == filled.choices[0].text


def test_the_server_keeps_serving_after_bad_requests(server):
    status, _, body = request(server, "GET", "/v1/chat/completions")  # a POST route
    assert status == 405 and json.loads(body)["error"]["code"] == "method_not_allowed"
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="gpt-4o", messages=USER)
    assert chat(server, USER, max_tokens=4).choices[0].finish_reason in ("length", "stop")
    assert server.metric("request_errors") >= len(BAD_REQUESTS)


REQUEST_FIELDS = [
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "top_k", "min_p", "stop", "seed", "n", "stream", "stream_options", "logprobs",
    "top_logprobs", "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty",
]
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
    body=st.dictionaries(st.sampled_from(REQUEST_FIELDS), JSON_VALUES, max_size=5),
)
def test_random_request_bodies_get_an_answer_or_an_error_object_never_a_crash(server, path, body):
    body.setdefault("max_tokens", 4)  # a body that happens to be valid answers quickly
    status, _, raw = request(server, "POST", path, body)
    assert status in (200, 400, 404), (body, status, raw[:300])
    if status != 200:
        error = json.loads(raw)["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
    assert request(server, "GET", "/health")[0] == 200


def test_serve_refuses_bad_values_before_listening(demo):
    from woodcock.serve import serve

    target, drafter = str(demo / "target"), str(demo / "drafter")
    with pytest.raises(DrafterError, match="--queue-size 0: expected at least 1"):
        serve(target, drafter, queue_size=0)
    with pytest.raises(DrafterError, match="--drafter is required"):
        serve(target, None)
    with pytest.raises(DrafterError, match="give it or --drafter, not both"):
        serve(target, drafter, plain=True)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(DrafterError, match="cannot listen there"):
            serve(target, drafter, port=taken.getsockname()[1])
    with pytest.raises(DrafterError, match="--policy 'fixed:0'"):
        serve(target, drafter, "fixed:0", port=0)


# -- the loop's prefix reuse and cancellation ------------------------------------------------------


def runtime_pair(kind):
    """(target, drafter, lookup) on a tiny random target."""
    from woodcock.runtime.block import BlockDrafter
    from woodcock.runtime.eagle3 import Eagle3Drafter
    from woodcock.runtime.ngram import NgramDrafter, PromptLookup
    from woodcock.runtime.target import MlxTarget
    from woodcock.synthetic import random_drafter, tiny_spec

    model = tiny_target("qwen3", scale=0.5)
    if kind == "ngram":
        target = MlxTarget(model, ())
        return target, NgramDrafter(target.vocab_size), None
    if kind.startswith("eagle3"):
        spec = tiny_spec("eagle3", hidden_size=64, vocab_size=96, target_layers=4)
        drafter = random_drafter(spec, seed=1)
        target = MlxTarget(model, drafter.spec.taps.layer_ids)
        lookup = PromptLookup(96) if kind == "eagle3+lookup" else None
        return target, Eagle3Drafter(drafter, target.shared_tensors()), lookup
    from test_block_decode import block_spec

    fields = {"block_size": 4, "num_layers": 2, "attention": "block_causal", "window": 6}
    if kind == "dspark":
        fields = {"block_size": 4, "markov_head_type": "gated"}
    drafter = random_drafter(block_spec(model, kind, **fields), seed=2)
    target = MlxTarget(model, drafter.spec.taps.layer_ids)
    return target, BlockDrafter(drafter, target.shared_tensors()), None


def run_loop(target, drafter, lookup, prompt, max_tokens, *, cached=0, cancelled=None):
    stats, tokens = Stats(), []
    steps = speculative_generate_step(
        prompt, target, drafter, policy=FixedPolicy(3), stats=stats, lookup=lookup, cached=cached, cancelled=cancelled
    )
    for token, _ in steps:
        tokens.append(token)
        if len(tokens) == max_tokens:
            break
    return tokens, stats


@pytest.mark.parametrize("kind", ["eagle3", "eagle3+lookup", "dflash", "dspark", "ngram"])
def test_the_loop_keeps_a_shared_prefix_and_stays_exact(kind):
    target, drafter, lookup = runtime_pair(kind)
    first_prompt = list(range(10, 30))
    first, _ = run_loop(target, drafter, lookup, first_prompt, 17)  # stops inside a round
    held = (first_prompt + first)[: target.offset]
    for follow_up in ([5, 6, 7], []):  # a next turn; the same prompt again
        prompt = first_prompt + first[:12] + follow_up
        common = next((i for i, (a, b) in enumerate(zip(held, prompt, strict=False)) if a != b), min(len(held), len(prompt)))
        cached = min(common - 1, len(prompt) - 1)
        reused, reused_stats = run_loop(target, drafter, lookup, prompt, 30, cached=cached)
        assert reused_stats.cached_tokens == cached > 20
        fresh, fresh_stats = run_loop(target, drafter, lookup, prompt, 30)
        assert reused == fresh
        assert reused == [t for t, _ in generate_step(mx.array(prompt), target.model, max_tokens=30)]
        # the drafter's state was the same: every round drafted and accepted alike
        assert reused_stats.accepted == fresh_stats.accepted and reused_stats.copied == fresh_stats.copied
        first, held = fresh, (prompt + fresh)[: target.offset]
        first_prompt = prompt


def test_a_cancelled_loop_ends_before_the_next_round():
    target, drafter, lookup = runtime_pair("eagle3")
    stats = Stats()
    steps = speculative_generate_step(
        list(range(10, 30)), target, drafter, policy=FixedPolicy(3), stats=stats, cancelled=lambda: stats.rounds >= 2
    )
    assert 3 <= len(list(steps)) <= 1 + 2 * 4 and stats.rounds == 2
    steps = speculative_generate_step(list(range(10, 30)), target, drafter, policy=FixedPolicy(3), cancelled=lambda: True)
    assert list(steps) == [] and target.offset == 0  # cut in the prefill: empty caches
    with pytest.raises(ValueError, match="cached = 20"):
        next(speculative_generate_step(list(range(10, 30)), target, drafter, policy=FixedPolicy(3), cached=20))
