#!/usr/bin/env bash
# `pdinfer bench serve` against one NORMAL engine (`pdinfer serve`) and a 1P1D cluster
# (`pdinfer launch --prefill 1 --decode 1`) on the default model, at several concurrencies.
# Writes benchmarks/serving.png and benchmarks/out/serving.json; prints the table.
#   benchmarks/serve_bench.sh [extra `bench serve` flags, e.g. --num-prompts 32 --loads 1,4,16]
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINE=(--kv-cache-memory 1GiB --max-model-len 2048)
LOGS=$(mktemp -d /tmp/serve-bench-XXXX)
NORMAL_PORT=${NORMAL_PORT:-8301}
PD_PORT=${PD_PORT:-8302}
mkdir -p benchmarks/out

pdinfer serve --port "$NORMAL_PORT" "${ENGINE[@]}" >"$LOGS/normal.log" 2>&1 &
NORMAL_PID=$!
pdinfer launch --prefill 1 --decode 1 --port "$PD_PORT" --log-dir "$LOGS/pd" "${ENGINE[@]}" \
    >"$LOGS/launch.log" 2>&1 &
LAUNCH_PID=$!
trap 'kill -TERM $NORMAL_PID $LAUNCH_PID 2>/dev/null; wait $NORMAL_PID $LAUNCH_PID 2>/dev/null || true' EXIT

for url in "http://127.0.0.1:$NORMAL_PORT" "http://127.0.0.1:$PD_PORT"; do
    until curl -sf "$url/health" >/dev/null; do
        kill -0 $NORMAL_PID $LAUNCH_PID || { cat "$LOGS"/*.log; exit 1; }
        sleep 2
    done
done
grep -q "is ready" "$LOGS/launch.log" || sleep 5

pdinfer bench serve \
    --url "http://127.0.0.1:$NORMAL_PORT" --label "serve (NORMAL)" \
    --url "http://127.0.0.1:$PD_PORT" --label "launch 1P1D" \
    --concurrency 1 --loads 1,4,16 --num-prompts 16 --input-len 32-256 --output-len 64 \
    --plot benchmarks/serving.png --json benchmarks/out/serving.json "$@"
