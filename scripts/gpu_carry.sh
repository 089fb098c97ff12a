#!/usr/bin/env bash
# Run HERE (the CPU machine) before `scripts/gpu_check.sh` on a lent GPU: it fills .whl/ with
# what the device image lacks and nothing outside the device can fetch there:
#   - wheels for its Python 3.12 (msgspec, pyzmq, gguf, setproctitle; the image has torch,
#     triton, transformers, aiohttp, typer, ... already);
#   - SmolLM2's tokenizer files (.whl/tokenizer): the 93 MB GGUF does not fit the 64 MiB a
#     device call carries, so the check runs SmolLM2's exact shapes with random weights.
# Then call the device with carry [".whl"] and `bash scripts/gpu_check.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)  # also in a worktree, where .git is a file
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl msgspec pyzmq gguf setproctitle
python3 - <<'PY'
from transformers import AutoTokenizer
from parashift.models.loader import resolve_model_path
AutoTokenizer.from_pretrained(resolve_model_path(None)).save_pretrained(".whl/tokenizer")
PY
du -sh .whl
