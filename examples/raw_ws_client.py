"""A raw WebSocket client of the Responses WebSocket mode (no SDK): one
`response.create`, every server event printed as it arrives.

    caracal serve
    pip install websockets
    python examples/raw_ws_client.py --url ws://127.0.0.1:8000/v1/responses "Hello!"
"""

import argparse
import json

from websockets.sync.client import connect


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="ws://127.0.0.1:8000/v1/responses")
    ap.add_argument("--api-key")
    ap.add_argument("--max-output-tokens", type=int, default=32)
    ap.add_argument("prompt", nargs="?", default="Hello!")
    a = ap.parse_args()
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else None
    with connect(a.url, additional_headers=headers, max_size=None) as ws:
        ws.send(json.dumps({"type": "response.create", "input": a.prompt,
                            "max_output_tokens": a.max_output_tokens, "store": False}))
        while True:
            ev = json.loads(ws.recv())
            if ev["type"] == "response.output_text.delta":
                print(ev["delta"], end="", flush=True)
                continue
            print(f"\n<- {ev['type']}" + (f" {json.dumps(ev.get('error'))}" if ev["type"] == "error" else ""))
            if ev["type"] in ("response.completed", "response.incomplete", "response.failed", "error"):
                usage = (ev.get("response") or {}).get("usage")
                if usage:
                    print(json.dumps(usage))
                break


if __name__ == "__main__":
    main()
