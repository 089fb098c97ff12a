#!/usr/bin/env bash
# KV tiers on a multi-turn chat (issue 53): the same `parashift bench serve --dataset
# multi-turn` against servers whose KV pool holds about a third of the conversations' working
# set, with the tiers off, with the host tier, and after a restart with the disk tier.
#   scripts/bench_kv_tiers.sh OUT_DIR [REPS]
# Each rep alternates the configurations; the JSON of every run lands in OUT_DIR.
set -euo pipefail
out=${1:?OUT_DIR}; reps=${2:-3}
mkdir -p "$out"
PY=${PARASHIFT_PY:-python}
PORT=${PORT:-8031}
SERVE=(--port "$PORT" --max-model-len 2048 --kv-cache-memory 48MiB --max-num-seqs 8)
BENCH=(--base-url "http://127.0.0.1:$PORT" --dataset multi-turn --multi-turn-users 8
       --multi-turn-rounds 4 --multi-turn-system-len 1000 --multi-turn-question-len 100
       --output-len 64 --max-concurrency 8 --vocab-size 49152)

serve() {  # serve LOG ARGS...: starts a server, waits for it
  local log=$1; shift
  setsid "$PY" -m parashift.cli run "${SERVE[@]}" "$@" > "$log" 2>&1 &
  pid=$!
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && return 0
    kill -0 "$pid" 2> /dev/null || { cat "$log"; return 1; }
    sleep 1
  done
  return 1
}
stop() { kill -INT "$pid"; wait "$pid" || true; }
bench() { "$PY" -m parashift.cli bench serve "${BENCH[@]}" --seed "$1" --save-json "$2" > "$2.txt"; }

for rep in $(seq "$reps"); do
  seed=$rep
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
