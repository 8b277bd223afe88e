#!/usr/bin/env bash
# End-to-end tests with the official openai SDK and the websockets package
# against `caracal serve` on the built-in default model.
# Usage: tests/e2e/run.sh   (from the repository root; builds the binary,
# creates .venv with pip when it is missing)
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/pip install -q "openai==3.57.0" "websockets==17.4" "pytest==9.2.0"
cargo build --bin caracal
port=$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
log=$(mktemp)
./target/debug/caracal serve --port "$port" --served-model-name moonshotai/kimi-k3-tiny >"$log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null || true; wait $server 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 1 300); do
  if grep -q "caracal serve: model" "$log"; then break; fi
  if ! kill -0 $server 2>/dev/null; then cat "$log"; exit 1; fi
  sleep 0.2
done
CARACAL_BASE_URL="http://127.0.0.1:$port/v1" CARACAL_MODEL=moonshotai/kimi-k3-tiny \
  .venv/bin/python -m pytest -q tests/e2e
# A graceful stop: SIGTERM, and the server says it stopped.
kill -TERM $server
wait $server
grep -q "caracal serve: stopped" "$log"
