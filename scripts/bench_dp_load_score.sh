#!/usr/bin/env bash
# The DP router's load score (issue 54): a skewed workload on dp2 -- a few 2,000-token prompts
# among many 64-token ones, 32 output tokens each, Poisson arrivals -- served with
# `--dp-load-score tokens` and `--dp-load-score requests`, alternated in one sitting. The same
# `parashift bench serve` against each; the JSON of every run lands in OUT_DIR, and the TTFT
# of the short requests alone (those the score protects) is printed beside the summary.
#   scripts/bench_dp_load_score.sh OUT_DIR [REPS]
set -euo pipefail
out=${1:?OUT_DIR}; reps=${2:-3}
mkdir -p "$out"
PY=${PARASHIFT_PY:-python}
PORT=${PORT:-8032}
N=${N:-200}; LONG_EVERY=${LONG_EVERY:-25}; RATE=${RATE:-2}
SERVE=(--port "$PORT" --strategy dp2 --max-model-len 4096 --kv-cache-memory 256MiB)
"$PY" - "$out/workload.jsonl" "$N" "$LONG_EVERY" <<'EOF'
import json, random, sys
path, n, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(0)
longs = set(rng.sample(range(n), n // every))  # where the long ones fall, the same each run
with open(path, "w") as f:
    for i in range(n):
        f.write(json.dumps({"prompt_len": 2000 if i in longs else 64, "output_len": 32}) + "\n")
EOF

source "$(dirname "$0")/lib/serve.sh"  # serve LOG ARGS..., stop
bench() {
  "$PY" -m parashift.cli bench serve --base-url "http://127.0.0.1:$PORT" \
    --dataset "$out/workload.jsonl" --num-prompts "$N" --request-rate "$RATE" \
    --vocab-size 49152 --seed "$1" --save-json "$2" > "$2.txt"
  "$PY" - "$2" <<'EOF'
import json, sys
import numpy as np
run = json.load(open(sys.argv[1]))
records = run["requests"]
short = [r["ttft"] * 1000 for r in records if r["prompt_len"] <= 64 and r.get("ttft")]
every = [r["ttft"] * 1000 for r in records if r.get("ttft")]
print(f"{sys.argv[1]}: TTFT p50/p99 all {np.percentile(every, 50):.0f}/"
      f"{np.percentile(every, 99):.0f} ms, short {np.percentile(short, 50):.0f}/"
      f"{np.percentile(short, 99):.0f} ms")
EOF
}

for rep in $(seq "$reps"); do
  for score in tokens requests; do
    serve "$out/$score-$rep.log" --dp-load-score "$score"
    bench "$rep" "$out/$score-$rep.json"; stop
  done
done
grep -h "Total token throughput" "$out"/*.json.txt
