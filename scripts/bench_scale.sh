#!/usr/bin/env bash
# Elastic data parallel (issue 54): seconds from POST /scale to the answer (the new size
# serving), SmolLM2 started at dp1 with --data-parallel-size-max 2, warm cache (the server
# has loaded the model once). REPS times up (1 -> 2) and down (2 -> 1, idle: nothing to
# drain); prints each and min/median. STRATEGY, FROM and TO set another layout and sizes,
# e.g. STRATEGY=p1xd1 FROM=2 TO=3: prefill/decode pools growing their decode pool.
#   scripts/bench_scale.sh [REPS]
set -euo pipefail
reps=${1:-5}
PY=${PARASHIFT_PY:-python}
PORT=${PORT:-8033}
KEY=bench-scale-key
FROM=${FROM:-1}; TO=${TO:-2}
SERVE=(--port "$PORT" --strategy "${STRATEGY:-dp$FROM}" --data-parallel-size-max "$TO"
       --admin-api-key "$KEY")
source "$(dirname "$0")/lib/serve.sh"  # serve LOG ARGS..., stop
log=$(mktemp)
serve "$log"
trap 'stop; rm -f "$log"' EXIT
scale() {  # scale N: seconds to the answer
  curl -sf -o /dev/null -w '%{time_total}\n' -H "Authorization: Bearer $KEY" \
    -H 'Content-Type: application/json' -d "{\"data_parallel_size\": $1}" \
    "http://127.0.0.1:$PORT/scale"
}
ups=(); downs=()
for _ in $(seq "$reps"); do
  ups+=("$(scale "$TO")"); downs+=("$(scale "$FROM")")
done
summary() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {printf "min %.2f s, median %.2f s (%d runs)\n", a[1], a[int((NR+1)/2)], NR}'; }
echo "up $FROM -> $TO:   ${ups[*]}"; echo -n "  "; summary "${ups[@]}"
echo "down $TO -> $FROM: ${downs[*]}"; echo -n "  "; summary "${downs[@]}"
