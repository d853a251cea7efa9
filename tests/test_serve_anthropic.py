"""`woodcock serve`'s Anthropic Messages API over loopback: the official anthropic client against
a real server process on the offline demo pair, answers equal to the OpenAI endpoint's for the
same conversation, streamed and not, stop sequences, token counts, and the error shapes."""

import http.client
import json
import threading

import anthropic
import pytest
import test_serve
from test_serve import CONTEXT, TIMEOUT, Server, request

from woodcock.runtime.decode import Stats
from woodcock.runtime.generate import Generation, encode_messages
from woodcock.serve.anthropic import MessageAnswer, error_body
from woodcock.serve.request import GenerationRequest, RequestError

demo, session = test_serve.demo, test_serve.session  # the fixtures, shared

SYSTEM = "You answer briefly."
QUESTION = [{"role": "user", "content": "The quick brown"}]
EVENTS = ["message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop"]


@pytest.fixture(scope="module")
def server(demo, tmp_path_factory):
    running = Server(demo, tmp_path_factory.mktemp("logs") / "server.log")
    yield running
    running.stop()


def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", timeout=TIMEOUT, max_retries=0)


def message(server, messages, max_tokens=24, **fields):
    return client(server).messages.create(model=server.model, messages=messages, max_tokens=max_tokens, **fields)


def streamed_message(server, messages, max_tokens=24, **fields):
    """(the streamed text, the final message) of a streamed answer."""
    with client(server).messages.stream(model=server.model, messages=messages, max_tokens=max_tokens, **fields) as stream:
        text = "".join(stream.text_stream)
        return text, stream.get_final_message()


def openai_chat(server, messages, max_tokens=24, **fields):
    return server.client().chat.completions.create(
        model=server.model, messages=messages, max_tokens=max_tokens, temperature=0, **fields
    )


def sse_events(raw: bytes) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event."""
    events = []
    for block in raw.decode().strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        events.append((lines["event"], json.loads(lines["data"])))
    return events


def test_a_greedy_message_is_the_openai_endpoints_answer_streamed_or_not(server, session):
    expected = openai_chat(server, [{"role": "system", "content": SYSTEM}, *QUESTION])
    text = expected.choices[0].message.content
    assert text and expected.choices[0].finish_reason == "length"
    ids = encode_messages(session.tokenizer, [{"role": "system", "content": SYSTEM}, *QUESTION])
    answer = message(server, QUESTION, system=SYSTEM, extra_body={"temperature": 0})
    assert answer.content[0].text == text and len(answer.content) == 1
    assert (answer.type, answer.role, answer.model) == ("message", "assistant", server.model)
    assert answer.id.startswith("msg_") and answer.stop_reason == "max_tokens" and answer.stop_sequence is None
    usage = answer.usage.model_dump()
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(ids)
    assert usage["cache_read_input_tokens"] == len(ids) - 1  # the same prompt again: all but its end
    assert usage["output_tokens"] == 24
    speculative = usage["speculative"]
    assert speculative["rounds"] >= 1 and speculative["accepted_tokens"] <= speculative["drafted_tokens"]
    # the system prompt as text blocks, and the question as one, are the same conversation
    blocks = [{"role": "user", "content": [{"type": "text", "text": "The quick "}, {"type": "text", "text": "brown"}]}]
    streamed, final = streamed_message(server, blocks, system=[{"type": "text", "text": SYSTEM}], metadata={"user_id": "u"})
    assert streamed == final.content[0].text == text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 24
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == len(ids)


def test_the_stream_sends_anthropics_events_in_order(server):
    body = {"model": server.model, "messages": QUESTION, "max_tokens": 12, "stream": True}
    status, headers, raw = request(server, "POST", "/v1/messages", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = sse_events(raw)
    names = [name for name, _ in events]
    deltas = names.count("content_block_delta")
    assert deltas >= 1 and names == EVENTS[:2] + ["content_block_delta"] * deltas + EVENTS[3:]
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    assert events[1][1]["content_block"] == {"type": "text", "text": ""}
    assert {data["delta"]["type"] for name, data in events if name == "content_block_delta"} == {"text_delta"}
    text = "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta")
    finished = events[-2][1]
    assert finished["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert finished["usage"]["output_tokens"] == 12 and "speculative" in finished["usage"]
    whole = message(server, QUESTION, max_tokens=12)
    assert whole.content[0].text == text
    # sent again, its prompt is cached: message_start counts it as message_delta does
    events = sse_events(request(server, "POST", "/v1/messages", body)[2])
    opening, closing = events[0][1]["message"]["usage"], events[-2][1]["usage"]
    counts = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    assert opening["cache_read_input_tokens"] > 0 and opening["output_tokens"] == 0
    assert {k: opening[k] for k in counts} == {k: closing[k] for k in counts}


def test_stop_sequences_cut_the_answer_and_are_reported(server):
    full = message(server, QUESTION, max_tokens=40).content[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = full[: full.index(stop)]
    answer = message(server, QUESTION, max_tokens=40, stop_sequences=["never in it", stop])
    assert answer.content[0].text == cut
    assert (answer.stop_reason, answer.stop_sequence) == ("stop_sequence", stop)
    streamed, final = streamed_message(server, QUESTION, max_tokens=40, stop_sequences=[stop])
    assert streamed == cut and (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_sampling_fields_are_taken(server):
    fields = {"temperature": 1.0, "top_p": 0.9, "top_k": 20}
    answer = message(server, QUESTION, max_tokens=8, extra_body=fields)
    assert answer.stop_reason == "max_tokens" and answer.usage.output_tokens == 8


def test_stop_reasons():
    request = GenerationRequest("messages", prompt_ids=[1, 2, 3], max_tokens=4)
    answer = MessageAnswer("m", request)
    stats = Stats(prompt_tokens=3, cached_tokens=1)
    cases = [
        (Generation(text="ab", tokens=[5, 6], finish_reason="stop", prompt_tokens=3, stats=stats), ("end_turn", None)),
        (Generation(text="ab", tokens=[5, 6], finish_reason="stop", stop_string="c", prompt_tokens=3, stats=stats), ("stop_sequence", "c")),
        (Generation(text="ab", tokens=[5, 6], finish_reason="length", prompt_tokens=3, stats=stats), ("max_tokens", None)),
    ]
    for result, (reason, sequence) in cases:
        whole = answer.complete(result)
        assert (whole["stop_reason"], whole["stop_sequence"]) == (reason, sequence)
        assert whole["content"] == [{"type": "text", "text": "ab"}]
        assert (whole["usage"]["input_tokens"], whole["usage"]["cache_read_input_tokens"]) == (2, 1)
        delta = sse_events(answer.done(result).encode())[1][1]
        assert delta["delta"] == {"stop_reason": reason, "stop_sequence": sequence}


def test_count_tokens(server, session):
    counted = client(server).messages.count_tokens(model=server.model, messages=QUESTION, system=SYSTEM)
    ids = encode_messages(session.tokenizer, [{"role": "system", "content": SYSTEM}, *QUESTION])
    assert counted.input_tokens == len(ids)
    long = [{"role": "user", "content": "Paris is. " * 600}]
    assert client(server).messages.count_tokens(model=server.model, messages=long).input_tokens > CONTEXT
    with pytest.raises(anthropic.BadRequestError, match="tools: not supported"):
        client(server).messages.count_tokens(model=server.model, messages=QUESTION, tools=[{"name": "f", "input_schema": {"type": "object"}}])


def test_consecutive_turns_of_one_role_are_one_turn(server, session):
    split = [{"role": "user", "content": "The quick"}, {"role": "user", "content": [{"type": "text", "text": " brown"}]}]
    blocks = [{"role": "user", "content": [{"type": "text", "text": "The quick"}, {"type": "text", "text": " brown"}]}]
    whole = len(encode_messages(session.tokenizer, QUESTION))
    for messages in (split, blocks):
        assert client(server).messages.count_tokens(model=server.model, messages=messages).input_tokens == whole
    greedy = {"extra_body": {"temperature": 0}}
    assert message(server, split, **greedy).content[0].text == message(server, QUESTION, **greedy).content[0].text
    answered = [*QUESTION, {"role": "assistant", "content": "fox"}, {"role": "assistant", "content": " jumps"}]
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[2\]: a final assistant turn"):
        message(server, answered)


def test_max_tokens_past_the_context_is_refused_with_the_numbers(server, session):
    ids = encode_messages(session.tokenizer, QUESTION)
    too_many = CONTEXT - len(ids) + 1
    with pytest.raises(anthropic.BadRequestError) as refused:
        message(server, QUESTION, max_tokens=too_many)
    assert refused.value.status_code == 400
    assert refused.value.body["error"] == {
        "type": "invalid_request_error",
        "message": f"input length and `max_tokens` exceed context limit: {len(ids)} + {too_many} > {CONTEXT}, decrease input length or `max_tokens` and try again",
    }
    status, _, raw = request(server, "POST", "/v1/messages", {"messages": QUESTION, "max_tokens": 1000000000000})
    assert status == 400 and f"{len(ids)} + 1000000000000 > {CONTEXT}" in json.loads(raw)["error"]["message"]


USER = [{"role": "user", "content": "Hi"}]
BAD_REQUESTS = [
    # (name, path, body, status, error type, part of the message)
    ("malformed JSON", "/v1/messages", b'{"messages": [', 400, "invalid_request_error", "not valid JSON"),
    ("half an emoji in the system prompt", "/v1/messages", b'{"max_tokens": 4, "system": "\\ud800", "messages": []}', 400, "invalid_request_error", "system: a lone UTF-16 surrogate"),
    ("half an emoji, counting tokens", "/v1/messages/count_tokens", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, "invalid_request_error", "messages[0].content: a lone UTF-16 surrogate"),
    ("no max_tokens", "/v1/messages", {"messages": USER}, 400, "invalid_request_error", "max_tokens: required"),
    ("zero max_tokens", "/v1/messages", {"messages": USER, "max_tokens": 0}, 400, "invalid_request_error", "max_tokens = 0"),
    ("no messages", "/v1/messages", {"max_tokens": 4}, 400, "invalid_request_error", "messages: required"),
    ("system role in messages", "/v1/messages", {"messages": [{"role": "system", "content": "x"}, *USER], "max_tokens": 4}, 400, "invalid_request_error", "messages[0].role: 'system'"),
    ("prefill", "/v1/messages", {"messages": [*USER, {"role": "assistant", "content": "Sure"}], "max_tokens": 4}, 400, "invalid_request_error", "messages[1]: a final assistant turn (prefill)"),
    ("image block", "/v1/messages", {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 4}, 400, "invalid_request_error", "messages[0].content[0]: only text parts"),
    ("system a number", "/v1/messages", {"system": 3, "messages": USER, "max_tokens": 4}, 400, "invalid_request_error", "system: expected a string or an array of text parts"),
    ("stop_sequences a number", "/v1/messages", {"messages": USER, "max_tokens": 4, "stop_sequences": 5}, 400, "invalid_request_error", "stop_sequences: expected an array of strings, got an integer"),
    ("stop_sequences with a number", "/v1/messages", {"messages": USER, "max_tokens": 4, "stop_sequences": ["x", 5]}, 400, "invalid_request_error", "stop_sequences[1]: expected a string, got an integer"),
    ("stop_sequences a string", "/v1/messages", {"messages": USER, "max_tokens": 4, "stop_sequences": "x"}, 400, "invalid_request_error", "stop_sequences: expected an array of strings, got a string"),
    ("temperature above 1", "/v1/messages", {"messages": USER, "max_tokens": 4, "temperature": 1.5}, 400, "invalid_request_error", "temperature = 1.5: expected a number in [0, 1]"),
    ("temperature a string", "/v1/messages", {"messages": USER, "max_tokens": 4, "temperature": "hot"}, 400, "invalid_request_error", "temperature: expected a number"),
    ("tools", "/v1/messages", {"messages": USER, "max_tokens": 4, "tools": [{"name": "f"}]}, 400, "invalid_request_error", "tools: not supported"),
    ("thinking", "/v1/messages", {"messages": USER, "max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "invalid_request_error", "thinking: not supported"),
    ("tool_choice any", "/v1/messages", {"messages": USER, "max_tokens": 4, "tool_choice": {"type": "any"}}, 400, "invalid_request_error", "tool_choice: not supported"),
    ("prompt past the context", "/v1/messages", {"messages": [{"role": "user", "content": "Paris is. " * 600}], "max_tokens": 4}, 400, "invalid_request_error", "prompt is too long: "),
    ("unknown model", "/v1/messages", {"model": "claude-sonnet-4-5", "messages": USER, "max_tokens": 4}, 404, "not_found_error", "'claude-sonnet-4-5' does not exist"),
    ("count_tokens without messages", "/v1/messages/count_tokens", {"system": "x"}, 400, "invalid_request_error", "messages: required"),
]


@pytest.mark.parametrize("name, path, body, status, kind, message", BAD_REQUESTS, ids=[r[0] for r in BAD_REQUESTS])
def test_bad_requests_get_anthropics_error_shape(server, name, path, body, status, kind, message):
    got, _, raw = request(server, "POST", path, body)
    answer = json.loads(raw)
    assert got == status and set(answer) == {"type", "error"} and answer["type"] == "error", answer
    assert answer["error"]["type"] == kind and set(answer["error"]) == {"type", "message"}
    assert message in answer["error"]["message"], answer


def test_the_client_raises_the_matching_errors_and_the_server_keeps_serving(server):
    with pytest.raises(anthropic.NotFoundError):
        client(server).messages.create(model="claude-sonnet-4-5", messages=USER, max_tokens=4)
    with pytest.raises(anthropic.BadRequestError, match="thinking: not supported"):
        message(server, USER, max_tokens=4, thinking={"type": "enabled", "budget_tokens": 1024})
    status, _, raw = request(server, "GET", "/v1/messages")  # a POST route
    assert status == 405 and json.loads(raw)["error"]["type"] == "invalid_request_error"
    assert message(server, USER, max_tokens=4).stop_reason in ("max_tokens", "end_turn")


def test_error_types_by_status():
    assert error_body(RequestError("busy", status=503, kind="server_error")) == ({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}, 529)
    assert error_body(RequestError("failed", status=500))[0]["error"]["type"] == "api_error"
    assert error_body(RequestError("nope", status=404))[0]["error"]["type"] == "not_found_error"


def test_a_full_queue_answers_529_overloaded_with_retry_after(demo, tmp_path_factory):
    busy = Server(demo, tmp_path_factory.mktemp("logs") / "busy.log", plain=True, queue_size=1)
    try:
        holding = http.client.HTTPConnection("127.0.0.1", busy.port, timeout=TIMEOUT)
        body = {"messages": QUESTION, "max_tokens": CONTEXT - 64, "stream": True}
        holding.request("POST", "/v1/messages", body=json.dumps(body))
        response = holding.getresponse()
        assert response.readline().startswith(b"event: message_start")  # it runs; one may wait
        results = [None] * 3
        barrier = threading.Barrier(len(results))

        def send(i):
            barrier.wait()
            results[i] = request(busy, "POST", "/v1/messages", {"messages": QUESTION, "max_tokens": 4})

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(results))]
        for thread in threads:
            thread.start()
        response.read()  # the held stream runs to its end; the one waiting runs next
        holding.close()
        for thread in threads:
            thread.join(TIMEOUT)
        overloaded = [r for r in results if r[0] == 529]
        assert overloaded and all(r[0] in (200, 529) for r in results)
        for _, headers, raw in overloaded:
            assert int(headers["retry-after"]) >= 1
            assert json.loads(raw)["error"]["type"] == "overloaded_error"
    finally:
        busy.stop()
