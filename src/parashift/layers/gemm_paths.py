"""Which GEMM path each weight shape takes on this CPU, chosen by timing, never assumed: the
CPUs these engines run on differ (a layout that wins on one Xeon loses on a Zen 4; bf16 is
native on some, emulated on others; docs/BENCHMARKS.md).

At load time every distinct (dtype, shape) of the model's GEMM weights is timed once per
candidate path at decode-sized rows, with the weight streamed as in a real step (several
copies, cycled, so that none stays in cache), and the fastest is kept; our own bf16 kernel,
when it wins there, must also hold within 10% of the best other path at prefill rows. The
choices are cached in a JSON file per CPU (model name, the instruction-set flags that matter,
torch version, threads), so a later start reads them; a corrupt file is timed again and
rewritten.

The candidates are the classes of layers/gemm.py (`linear`, `onednn`, `own-bf16`), all in the
model's dtype and each keeping one copy of the weight: the timing picks a speed, never a
memory size. A candidate this CPU cannot run (oneDNN's fp16 without AVX512-FP16) drops out
when timed. A weight another module also reads (a tied LM head) takes a prepared path where
one runs, in float32 or bfloat16 (F.linear on a plain bf16 weight reorders it on every call):
its one extra copy is then known too. `prepare_gemm_weights` gives every linear module of a
loaded model its path's GEMM, or its quantized one (`--quantization`); the decoder layers'
projections all take our kernel where whole steps ran faster so (the fused layers: the choice
of executor/layer_paths.py, cached in the same file)."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import re
import tempfile
import time

import torch
from torch import nn

from parashift import env
from parashift.layers.gemm import Gemm, gemm_for_path
from parashift.layers.kernel_dispatch import cpu_kernels_setting, cpu_ops
from parashift.layers.quantization import QuantizedGemm, quantize

logger = logging.getLogger(__name__)

ROWS = 32  # decode-sized: where the path matters most on a CPU
# Our own bf16 kernel runs every row count; at prefill rows it must be within 10% of the best
# other path (timings here vary by 10-30% from run to run), or that path is taken.
PREFILL_ROWS = 512
LOSS_MARGIN = 0.9
STREAM_BYTES = 64 << 20  # copies of a weight cycled per timing: past any cache
PATHS_VERSION = 8  # bumped when the candidates change, so older cached choices are timed again
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "asimd", "sve")


def can_reorder() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                            "_linear_pointwise")


def can_own_bf16() -> bool:
    ops = cpu_ops()
    return ops is not None and ops.bf16_gemm is not None


def candidates(dtype: torch.dtype) -> list[str]:
    """The paths a weight of `dtype` may take here, all in that dtype."""
    own = ["own-bf16"] if dtype == torch.bfloat16 and can_own_bf16() else []
    return ["linear", *(["onednn"] if can_reorder() else []), *own]


def row_invariant_path(dtype: torch.dtype, in_features: int) -> str:
    """--deterministic's path: our kernel where it takes the weight (each output a reduction
    over K in one fixed order, threads splitting columns only, whatever the row count), else
    one row at a time (`RowGemm`)."""
    return ("own-bf16" if dtype == torch.bfloat16 and can_own_bf16() and in_features % 2 == 0
            else "rows")


def prepares_shared_weights(dtype: torch.dtype) -> bool:
    """Whether a weight another module also reads takes a prepared path (its own copy) in
    `dtype` on a CPU: float32 and bfloat16, where oneDNN's reorder runs on every CPU
    (`plan` counts that copy)."""
    return dtype in (torch.float32, torch.bfloat16) and can_reorder()


def time_paths(dtype: torch.dtype, out_features: int, in_features: int, rows: int = ROWS,
               rounds: int = 3, paths: tuple[str, ...] | None = None) -> dict[str, float]:
    """Seconds of one GEMM of `rows` rows by each candidate path (or `paths`), the weight
    streamed at decode rows. From PREFILL_ROWS a GEMM is bound by its arithmetic, not by the
    weight's bytes: two copies then."""
    nbytes = out_features * in_features * torch.empty((), dtype=dtype).element_size()
    copies = (2 if rows >= PREFILL_ROWS
              else max(2, min(16, math.ceil(STREAM_BYTES / nbytes))))
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(out_features, in_features, generator=g) * 0.02).to(dtype)
               for _ in range(copies)]
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    times = {}
    with torch.inference_mode():
        for path in paths or candidates(dtype):
            try:
                prepared = [gemm_for_path(w, path) for w in weights]
                prepared[0](x, None)  # first-call costs out
            except RuntimeError as e:  # not on this CPU
                logger.debug("GEMM path %s unavailable for %s: %s", path, dtype, e)
                continue
            best = math.inf
            for _ in range(rounds):
                start = time.perf_counter()
                for gemm in prepared:
                    gemm(x, None)
                best = min(best, (time.perf_counter() - start) / copies)
            times[path] = best
            del prepared
    return times


def cpu_signature() -> str:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        m = re.search(r"^model name\s*:\s*(.+)$", info, re.MULTILINE)
        model = m.group(1).strip() if m else model
        m = re.search(r"^(?:flags|Features)\s*:\s*(.+)$", info, re.MULTILINE)
        flags = set(m.group(1).split()) if m else set()
    except OSError:
        pass
    kept = "+".join(f for f in FLAGS if f in flags)
    # the kernels' build (--cpu-kernels) sets which of our bf16 kernels competes
    return (f"{model}|{kept}|torch {torch.__version__}|{torch.get_num_threads()} threads"
            f"|paths {PATHS_VERSION}|march {cpu_kernels_setting()}")


def cache_file(signature: str | None = None) -> str:
    signature = signature or cpu_signature()
    slug = re.sub(r"[^a-z0-9]+", "-", signature.split("|")[0].lower()).strip("-")[:40]
    digest = hashlib.sha1(signature.encode(), usedforsecurity=False).hexdigest()[:12]
    return os.path.join(env.cache_dir(), "gemm-paths", f"{slug}-{digest}.json")


class GemmPaths:
    """The choices of one CPU, read from and written back to its cache file."""

    def __init__(self, path: str | None = None):
        self.path = path or cache_file()
        self.choices: dict[str, str] = {}
        self._read()
        self.timed: dict[str, dict] = {}  # chosen now, with their timings

    def _read(self) -> None:
        try:
            with open(self.path) as f:
                data = json.load(f)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            logger.warning("GEMM path cache %s unreadable (%s): timing again", self.path, e)
            return
        if not isinstance(data, dict) or not isinstance(data.get("choices", {}), dict) or not all(
                isinstance(v, str) for v in data.get("choices", {}).values()):
            logger.warning("GEMM path cache %s is malformed: timing again", self.path)
            return
        self.choices = dict(data.get("choices", {}))

    @staticmethod
    def _key(dtype: torch.dtype, out_features: int, in_features: int, shared: bool) -> str:
        return (f"{str(dtype).removeprefix('torch.')}:{out_features}x{in_features}"
                + (":shared" if shared else ""))

    def choose(self, dtype: torch.dtype, out_features: int, in_features: int,
               shared: bool = False, policy: tuple[str, ...] | None = None) -> str:
        """The path of a weight of this dtype and shape, among those of `policy` (the
        config's gemm_paths; None: all) this CPU runs; `shared`: another module also reads
        the weight (prepares_shared_weights)."""
        key = self._key(dtype, out_features, in_features, shared)
        every = candidates(dtype)
        allowed = [p for p in every if policy is None or p in policy]
        if shared and prepares_shared_weights(dtype) and len(allowed) > 1:
            allowed.remove("linear")
        known = self.choices.get(key)
        if known in allowed:
            return known
        if len(allowed) == 1:
            return allowed[0]
        best, timed = self._time(dtype, out_features, in_features, allowed)
        if policy is None or set(every) <= set(policy):  # a narrower policy's pick: not cached
            self.record(key, best, timed)
        return best

    def record(self, key: str, choice: str, timed: dict) -> None:
        """Keep a choice made now, with its timings (written by `save`)."""
        self.choices[key] = choice
        self.timed[key] = timed

    @staticmethod
    def _time(dtype: torch.dtype, out_features: int, in_features: int, allowed: list[str]
              ) -> tuple[str, dict]:
        times = time_paths(dtype, out_features, in_features, paths=tuple(allowed))
        best = min(times, key=times.get)
        timed: dict = {"rows": times}
        if best == "own-bf16" and len(times) > 1:
            others = tuple(path for path in times if path != "own-bf16")
            timed["prefill"] = prefill = time_paths(dtype, out_features, in_features,
                                                    PREFILL_ROWS, paths=("own-bf16", *others))
            rival = min(others, key=lambda path: prefill.get(path, math.inf))
            if prefill.get(rival, math.inf) < LOSS_MARGIN * prefill["own-bf16"]:
                best = rival
        return best, timed

    def save(self) -> None:
        """Atomically, and only if something new was timed; a read-only cache is no error."""
        if not self.timed:
            return
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), suffix=".tmp")
            with os.fdopen(fd, "w") as f:  # O_EXCL under a fresh name: no planted link
                json.dump({"cpu": cpu_signature(), "rows": ROWS, "choices": self.choices}, f,
                          indent=1)
            os.replace(tmp, self.path)
        except OSError as e:
            logger.warning("could not write the GEMM path cache %s: %s", self.path, e)


def prepare_gemm_weights(model: nn.Module, device: torch.device,
                         quantization: str | None = None,
                         policy: tuple[str, ...] | None = None,
                         deterministic: bool = False, paths: GemmPaths | None = None,
                         own_layers: bool = False) -> list[str]:
    """Give every module with a GEMM (a `gemm` attribute) the path chosen for its weight on
    this CPU (in `paths`), or its quantized weight (`quantization`, what layers/quantization.py
    names); `deterministic`: the path whose rows do not depend on the row count
    (`row_invariant_path`); `own_layers`: our bf16 kernel for the decoder layers' projections
    (`quantizable`), so that the fused layer runs (executor/layer_paths.py chooses). A prepared
    path's copy replaces the module's plain weight (then a meta tensor) unless another module
    reads that weight too. Returns what was done, for the load log."""
    if device.type != "cpu":
        return []
    notes = quantize_weights(model, quantization) if quantization else []
    owners: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        owners[id(param)] = owners.get(id(param), 0) + 1
    paths = paths or GemmPaths()
    counts: dict[str, int] = {}
    for m in model.modules():
        if not isinstance(getattr(m, "gemm", None), Gemm) or isinstance(m.gemm, QuantizedGemm):
            continue
        shared = owners.get(id(m.weight), 0) > 1
        if deterministic:
            path = row_invariant_path(m.weight.dtype, m.weight.shape[1])
        elif own_layers and getattr(m, "quantizable", False):
            path = "own-bf16"
        else:
            path = paths.choose(m.weight.dtype, *m.weight.shape, shared=shared, policy=policy)
        m.gemm = gemm_for_path(m.weight.data, path)
        if not m.gemm.reads_plain_weight and not shared:  # the prepared copy is the one kept
            m.weight = nn.Parameter(m.weight.to("meta"), requires_grad=False)
        m.gemm.weight = m.weight
        counts[path] = counts.get(path, 0) + 1
    paths.save()
    timed = f" ({len(paths.timed)} timings now)" if paths.timed else ""
    return [*notes, f"GEMM paths on this CPU{timed}: "
            + ", ".join(f"{n} {path}" for path, n in sorted(counts.items()))]


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's weights: its parameters (a shared one once, a meta one not at all)
    and the copies its GEMMs keep in their place (a prepared layout, a quantized weight)."""
    seen = {id(p): p for p in model.parameters() if not p.is_meta}
    return sum(p.numel() * p.element_size() for p in seen.values()) + sum(
        m.gemm.kept_bytes for m in model.modules() if isinstance(getattr(m, "gemm", None), Gemm))


def quantize_weights(model: nn.Module, method: str) -> list[str]:
    """The linear weights that layers/quantization.py quantizes -> `method`, the float weights
    dropped. A module opts in with `quantizable = True` (the decoder layers' projections)."""
    before = after = count = 0
    for m in model.modules():
        if not getattr(m, "quantizable", False):
            continue
        m.gemm = QuantizedGemm(quantize(m.weight.data, method))
        before += m.weight.numel() * m.weight.element_size()
        after += m.gemm.read_bytes
        # the float weight's shape and dtype stay, on no memory
        m.weight = nn.Parameter(m.weight.to("meta"), requires_grad=False)
        count += 1
    return [f"{method} weights: {count} linear layers, {before / 2**20:.1f} MiB -> "
            f"{after / 2**20:.1f} MiB"]
