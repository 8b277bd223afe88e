"""End-to-end tests with clients nobody here wrote: the official `openai`
Python SDK (chat completions streaming and tools, Responses over HTTP and
over `responses.connect()` with a tool loop chained by
`previous_response_id`, the Realtime client) and the `websockets` package
for raw frames and bad input, against a running `caracal serve`.

`run.sh` starts the server on the built-in default model (the synthesized
tiny Kimi K3, random weights) and sets CARACAL_BASE_URL.
"""

import json
import os

import openai
import pytest
import websockets.sync.client as ws_client

BASE = os.environ["CARACAL_BASE_URL"]  # e.g. http://127.0.0.1:8123/v1
MODEL = os.environ.get("CARACAL_MODEL", "moonshotai/kimi-k3-tiny")
WS_BASE = BASE.replace("http://", "ws://")

TOOLS_CHAT = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
               "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
TOOLS_FLAT = [{"type": "function", "name": "read_file", "description": "Read a file",
               "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
               "strict": True}]
INSTRUCTIONS = ("You are a coding agent working in a Rust repository. Read files before you change them, "
                "keep edits small, run the tests after each change, and report what you did in one short paragraph. ") * 40


@pytest.fixture(scope="module")
def client():
    return openai.OpenAI(base_url=BASE, api_key="unused", max_retries=0)


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_completion_and_stream_helper(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                       max_tokens=6, temperature=0, tools=TOOLS_CHAT)
    assert r.object == "chat.completion"
    assert r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                                 max_tokens=6, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}, tools=TOOLS_CHAT))
    assert chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0, "the repeated prompt hits the cache"
    # The stream helper refuses a `length` finish, and the random-weight model
    # never ends by itself: stop on a piece of its greedy text.
    msg = r.choices[0].message
    text = (msg.content or "") + ((msg.model_extra or {}).get("reasoning_content") or "")
    stop = next(c for c in text[1:] if not c.isspace())
    with client.chat.completions.stream(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                        max_tokens=6, temperature=0, stop=[stop], tools=TOOLS_CHAT) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    assert final.choices[0].message.role == "assistant"
    assert final.choices[0].finish_reason == "stop"


def test_logprobs_through_the_sdk_types(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                       max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) >= 1
    for t in content:
        assert t.logprob <= 0.0
        assert len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
    c = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logprobs=1)
    assert len(c.choices[0].logprobs.token_logprobs) == len(c.choices[0].logprobs.tokens) >= 1


def _metric(name):
    import urllib.request
    root = BASE.rsplit("/v1", 1)[0]
    text = urllib.request.urlopen(root + "/metrics").read().decode()
    return int(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_images_through_chat_and_responses_are_encoded_once(client):
    import base64
    here = os.path.dirname(os.path.abspath(__file__))
    png = open(os.path.join(here, "..", "..", "media", "tests", "fixtures", "images", "mandelbrot_37x301.png"), "rb").read()
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    assert client.models.list().data[0].model_extra.get("supports_images") is True
    before = _metric("caracal_vision_items_encoded_total")
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=3, temperature=0,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                {"type": "text", "text": "What is in the picture?"}]}])
    assert chat.usage.prompt_tokens > 20
    assert _metric("caracal_vision_items_encoded_total") == before + 1
    resp = client.responses.create(
        model=MODEL, max_output_tokens=3, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_image", "image_url": url},
                                             {"type": "input_text", "text": "What is in the picture?"}]}])
    assert resp.usage.input_tokens > 20
    again = client.chat.completions.create(
        model=MODEL, max_tokens=3, temperature=0,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                {"type": "text", "text": "What is in the picture?"}]}])
    assert _metric("caracal_vision_items_encoded_total") == before + 1, "the same image is not encoded again"
    assert again.usage.prompt_tokens_details.cached_tokens >= chat.usage.prompt_tokens // 16 * 16 - 16


def test_errors_map_to_sdk_exceptions(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=2)
    assert e.value.code == "unsupported_parameter"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="not-this-one", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_missing")
    assert e.value.code == "previous_response_not_found"


def _output_text(response):
    """All text of a response's output items (reasoning and message)."""
    out = ""
    for item in response.output:
        for part in (getattr(item, "content", None) or []):
            out += getattr(part, "text", "") or ""
    return out


def test_responses_http_stream_helper_and_chain(client):
    # The random-weight model never ends by itself, and the stream helper wants
    # `response.completed`: learn its greedy text, then stop on a piece of it.
    probe = client.responses.create(model=MODEL, input="Open main.rs", instructions=INSTRUCTIONS,
                                    tools=TOOLS_FLAT, max_output_tokens=8, temperature=0)
    text = _output_text(probe)
    stop = next(c for c in text[1:] if not c.isspace())
    with client.responses.stream(model=MODEL, input="Open main.rs", instructions=INSTRUCTIONS,
                                 tools=TOOLS_FLAT, max_output_tokens=8, temperature=0,
                                 extra_body={"stop": [stop]}) as stream:
        kinds = [ev.type for ev in stream]
        first = stream.get_final_response()
    assert kinds[0] == "response.created"
    assert first.status == "completed"
    assert stop not in _output_text(first)
    # Continue the chain with a replayed tool call and its result.
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, instructions=INSTRUCTIONS, tools=TOOLS_FLAT,
        max_output_tokens=4, temperature=0,
        input=[{"type": "function_call", "call_id": "call_1", "name": "read_file", "arguments": '{"path":"main.rs"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "fn main() {}"}])
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens >= 0.8 * second.usage.input_tokens
    got = client.responses.retrieve(first.id)
    assert got.id == first.id
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def _until_terminal(conn):
    events = []
    for ev in conn:
        events.append(ev)
        if ev.type in ("response.completed", "response.incomplete", "response.failed", "error"):
            return events
    raise AssertionError("the connection closed before a terminal event")


def test_responses_websocket_tool_loop_stays_cached(client):
    with client.responses.connect() as conn:
        conn.response.create(model=MODEL, store=False, generate=False, instructions=INSTRUCTIONS,
                             tools=TOOLS_FLAT, input=[])
        warm = _until_terminal(conn)
        assert [e.type for e in warm] == ["response.created", "response.completed"]
        prev = warm[-1].response.id
        shares = []
        for turn in range(4):
            if turn == 0:
                items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Open main.rs"}]}]
            else:
                cid = f"call_{turn}"
                items = [{"type": "function_call", "call_id": cid, "name": "read_file", "arguments": json.dumps({"path": f"f{turn}.rs"})},
                         {"type": "function_call_output", "call_id": cid, "output": f"fn f{turn}() {{}}"}]
            conn.response.create(model=MODEL, store=False, previous_response_id=prev, instructions=INSTRUCTIONS,
                                 tools=TOOLS_FLAT, input=items, max_output_tokens=4, temperature=0)
            events = _until_terminal(conn)
            last = events[-1]
            assert last.type in ("response.completed", "response.incomplete"), last
            u = last.response.usage
            shares.append(u.input_tokens_details.cached_tokens / u.input_tokens)
            prev = last.response.id
        assert all(s >= 0.9 for s in shares[1:]), shares


def test_realtime_client_text_turn(client):
    with client.realtime.connect(model=MODEL) as conn:
        created = conn.recv()
        assert created.type == "session.created"
        conn.session.update(session={"type": "realtime", "output_modalities": ["text"],
                                     "instructions": "Be brief.", "max_output_tokens": 5})
        conn.conversation.item.create(item={"type": "message", "role": "user",
                                            "content": [{"type": "input_text", "text": "Hi"}]})
        conn.response.create()
        kinds = []
        for ev in conn:
            kinds.append(ev.type)
            if ev.type == "response.done":
                assert ev.response.usage.output_tokens == 5
                assert ev.response.usage.input_token_details.cached_tokens is not None
                break
        assert "response.created" in kinds and "session.updated" in kinds


def test_raw_websocket_bad_input_keeps_the_session():
    with ws_client.connect(f"{WS_BASE}/responses") as ws:
        ws.send("{not json")
        err = json.loads(ws.recv())
        assert err["type"] == "error" and err["status"] == 400 and err["error"]["code"] == "invalid_json"
        ws.send(json.dumps({"type": "response.processed", "response_id": "resp_x"}))
        ws.send(json.dumps({"type": "response.create", "model": MODEL, "input": "hi", "max_output_tokens": 2}))
        first = json.loads(ws.recv())
        assert first["type"] == "response.created", first
        while True:
            ev = json.loads(ws.recv())
            if ev["type"] in ("response.completed", "response.incomplete"):
                break
