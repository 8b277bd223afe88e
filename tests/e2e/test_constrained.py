"""Constrained decoding with the official `openai` SDK against `caracal
serve` on the built-in default model (random weights: unconstrained, its
output never parses). `tool_choice="required"` returns calls whose
arguments parse and match the declared schema; `response_format` of type
`json_schema` returns JSON matching the schema.
"""

import json
import os

import openai
import pytest

BASE = os.environ["CARACAL_BASE_URL"]
MODEL = os.environ.get("CARACAL_MODEL", "moonshotai/kimi-k3-tiny")

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def client():
    return openai.OpenAI(base_url=BASE, api_key="unused", max_retries=0)


def check_weather(args):
    """A hand-written check of WEATHER (no validator package needed)."""
    assert isinstance(args, dict)
    assert set(args) <= {"city", "days", "unit"}
    assert isinstance(args["city"], str) and len(args["city"]) <= 24
    assert isinstance(args["days"], int) and 1 <= args["days"] <= 14
    if "unit" in args:
        assert args["unit"] in ("celsius", "fahrenheit")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_tool_call_arguments_parse_and_match_the_schema(client, seed):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris for three days?"}],
        tools=TOOLS,
        tool_choice="required",
        max_tokens=200,
        seed=seed,
        reasoning_effort="none",
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name == "get_weather"
        check_weather(json.loads(call.function.arguments))


@pytest.mark.parametrize("seed", [0, 1])
def test_json_schema_response_format_gives_matching_json(client, seed):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give a forecast as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "weather", "schema": WEATHER}},
        max_tokens=200,
        seed=seed,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    check_weather(json.loads(choice.message.content))


def test_a_bad_schema_is_a_400_naming_the_problem(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/nowhere"}}},
        )
    assert e.value.code == "unresolved_schema_ref"
