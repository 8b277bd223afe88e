"""An agent loop over the Responses WebSocket mode with the official SDK.

Each turn sends only the new items with `previous_response_id`; tool calls
the model makes are run locally (a `read_file` tool over this repository)
and their results go back as `function_call_output` items. Every turn
prints how much of its prompt came from the server's cache.

    caracal serve --model ~/.cache/caracal/smollm2-135m-instruct --served-model-name smollm2
    pip install openai websockets
    python examples/agent_loop.py --model smollm2 --turns 4
"""

import argparse
import json
import pathlib

import openai

TOOLS = [{"type": "function", "name": "read_file", "description": "Read a text file of the repository",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]


def read_file(path: str) -> str:
    p = pathlib.Path(path)
    if not p.is_file():
        return f"error: {path} does not exist"
    return p.read_text(errors="replace")[:2000]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default="kimi-k3-tiny")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--prompt", default="Read README.md and tell me what this project is.")
    a = ap.parse_args()
    client = openai.OpenAI(base_url=a.base_url, api_key="unused")
    instructions = "You are a coding agent. Use read_file to look at files before answering."
    with client.responses.connect() as conn:
        # Warm-up: the instructions and tools are prefilled and cached.
        conn.response.create(model=a.model, store=False, generate=False, instructions=instructions,
                             tools=TOOLS, input=[])
        prev = None
        for ev in conn:
            if ev.type == "response.completed":
                prev = ev.response.id
                break
        items = [{"type": "message", "role": "user", "content": a.prompt}]
        for turn in range(a.turns):
            conn.response.create(model=a.model, store=False, previous_response_id=prev,
                                 instructions=instructions, tools=TOOLS, input=items, max_output_tokens=256)
            final = None
            for ev in conn:
                if ev.type == "response.output_text.delta":
                    print(ev.delta, end="", flush=True)
                elif ev.type in ("response.completed", "response.incomplete", "response.failed"):
                    final = ev.response
                    break
                elif ev.type == "error":
                    raise SystemExit(f"error: {ev.error.code}: {ev.error.message}")
            print()
            u = final.usage
            print(f"[turn {turn}] {final.status}: {u.input_tokens_details.cached_tokens}/{u.input_tokens} "
                  f"prompt tokens cached, {u.output_tokens} generated")
            prev = final.id
            calls = [o for o in final.output if o.type == "function_call"]
            if not calls:
                break
            items = []
            for c in calls:
                args = json.loads(c.arguments or "{}")
                print(f"[tool] read_file({args.get('path')!r})")
                items.append({"type": "function_call_output", "call_id": c.call_id,
                              "output": read_file(str(args.get("path", "")))})


if __name__ == "__main__":
    main()
