#!/usr/bin/env bash
# Start-up time (command to "is serving") and serving throughput of `parashift run` with the
# mp and Ray backends, alternating, on the default model:  bash scripts/bench_backends.sh [ROUNDS] [STRATEGY]
set -euo pipefail
rounds=${1:-2}
strategy=${2:-dp2}
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0
log=$(mktemp -d)
for round in $(seq 1 "$rounds"); do
  for backend in mp ray; do
    port=$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    start=$(date +%s.%N)
    parashift run --port "$port" --strategy "$strategy" --backend "$backend" > "$log/$backend.log" 2>&1 &
    pid=$!
    until grep -q "is serving" "$log/$backend.log"; do
      kill -0 "$pid" 2>/dev/null || { cat "$log/$backend.log"; exit 1; }
      sleep 0.1
    done
    echo "round $round $backend: start-up $(python -c "print(f'{$(date +%s.%N) - $start:.1f}')") s"
    parashift bench serve --base-url "http://127.0.0.1:$port" --num-prompts 32 \
      --request-rate inf --input-len 64 --output-len 128 --seed 0 2>&1 \
      | grep -E "Duration|Output token|Total token"
    kill -TERM "$pid"; wait "$pid" || true
  done
done
rm -rf "$log"
