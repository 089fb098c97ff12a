"""Which GEMM path each weight shape takes on this CPU, chosen by timing, never assumed: the
CPUs these engines run on differ (a layout that wins on one Xeon loses on a Zen 4; bf16 is
native on some, emulated on others; docs/BENCHMARKS.md).

At load time every distinct (dtype, shape) of the model's GEMM weights is timed once per
candidate path at decode-sized rows, with the weight streamed as in a real step (several
copies, cycled, so that none stays in cache), and the fastest is kept. The choices are cached
in a JSON file per CPU (model name, the instruction-set flags that matter, torch version,
threads), so a later start reads them; a corrupt file is timed again and rewritten.

The paths are the classes of layers/gemm.py (`linear`, `packed`, `onednn`, `own-bf16`) and,
for half-precision weights, `fp32` / `fp32-packed` / `fp32-onednn`: the weight widened to fp32
once (the values stay exactly the checkpoint's; activations stay in the model's dtype, each
GEMM rounds its result to it). A candidate this CPU cannot run (oneDNN's fp16 without
AVX512-FP16) drops out when timed. `prepare_gemm_weights` gives every linear module of a
loaded model its path's GEMM, or its quantized one (`--quantization`)."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import re
import sys
import time

import torch
from torch import nn

from parashift import env
from parashift.layers.gemm import Gemm, OwnBf16Gemm, gemm_for_path
from parashift.layers.kernel_dispatch import cpu_ops
from parashift.layers.quantization import QuantizedGemm, quantize

logger = logging.getLogger(__name__)

ROWS = 32  # decode-sized: where the path matters most on a CPU
ROW_PROBES = (64, 128, 256, 512, 1024)  # rows where our own bf16 kernel may lose
# F.linear takes over below batch rows only where it ran in under 90% of our kernel's time:
# it reorders the weight on every call, a costly mistake at decode rows, and timings here vary
# by 10-30% from run to run; from PREFILL_ROWS the reorder is amortized, the two run close,
# and any loss hands over.
LOSS_MARGIN = 0.9
PREFILL_ROWS = 256
STREAM_BYTES = 64 << 20  # copies of a weight cycled per timing: past any cache
PATHS_VERSION = 7  # bumped when the candidates change, so older cached choices are timed again
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "asimd", "sve")


def can_pack() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def can_reorder() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                            "_linear_pointwise")


def can_own_bf16() -> bool:
    ops = cpu_ops()
    return ops is not None and ops.bf16_gemm is not None


def candidates(dtype: torch.dtype) -> list[str]:
    layouts = ["", *(["-packed"] if can_pack() else []), *(["-onednn"] if can_reorder() else [])]
    if dtype == torch.float32:
        return ["linear", *(layout[1:] for layout in layouts[1:])]
    if dtype in (torch.bfloat16, torch.float16):
        own = ["own-bf16"] if dtype == torch.bfloat16 and can_own_bf16() else []
        return ["linear", *(["onednn"] if can_reorder() else []), *own,
                *(f"fp32{layout}" for layout in layouts)]
    return ["linear"]


def time_paths(dtype: torch.dtype, out_features: int, in_features: int, rows: int = ROWS,
               rounds: int = 3, paths: tuple[str, ...] | None = None) -> dict[str, float]:
    """Seconds of one GEMM of `rows` rows by each candidate path (or `paths`), the weight
    streamed at decode rows. From PREFILL_ROWS a GEMM is bound by its arithmetic, not by the
    weight's bytes: two copies then, which is most of a first start's timing saved."""
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
    # the kernels' build (PARASHIFT_CPU_MARCH) sets which of our bf16 kernels competes
    return (f"{model}|{kept}|torch {torch.__version__}|{torch.get_num_threads()} threads"
            f"|paths {PATHS_VERSION}|march {env.cpu_march() or 'native'}")


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
        self.row_limits: dict[str, int] = {}  # shapes on our own kernel: its most rows
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
        if not isinstance(data, dict) or not all(
                isinstance(v, str) for v in data.get("choices", {}).values()) or not all(
                isinstance(v, int) for v in data.get("row_limits", {}).values()):
            logger.warning("GEMM path cache %s is malformed: timing again", self.path)
            return
        self.choices = dict(data.get("choices", {}))
        self.row_limits = dict(data.get("row_limits", {}))

    @staticmethod
    def _key(dtype: torch.dtype, out_features: int, in_features: int) -> str:
        return f"{str(dtype).removeprefix('torch.')}:{out_features}x{in_features}"

    def row_limit(self, dtype: torch.dtype, out_features: int, in_features: int) -> int:
        """The most rows our own bf16 kernel takes for this shape: probed at batch and prefill
        sizes against F.linear on the plain weight, up to the first it loses."""
        key = self._key(dtype, out_features, in_features)
        if key in self.row_limits:
            return self.row_limits[key]
        limit, probes = ROWS, {}  # it won at ROWS to be chosen
        for rows in ROW_PROBES:
            probes[rows] = times = time_paths(dtype, out_features, in_features, rows,
                                              paths=("own-bf16", "linear"))
            margin = LOSS_MARGIN if rows < PREFILL_ROWS else 1.0
            if times["linear"] < margin * times["own-bf16"]:
                break
            limit = rows
        else:
            limit = sys.maxsize
        self.row_limits[key] = limit
        self.timed[f"{key} rows"] = probes
        return limit

    def choose(self, dtype: torch.dtype, out_features: int, in_features: int) -> str:
        key = self._key(dtype, out_features, in_features)
        known = self.choices.get(key)
        if known in candidates(dtype):
            return known
        times = time_paths(dtype, out_features, in_features)
        self.choices[key] = min(times, key=times.get)
        self.timed[key] = times
        return self.choices[key]

    def save(self) -> None:
        """Atomically, and only if something new was timed; a read-only cache is no error."""
        if not self.timed:
            return
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump({"cpu": cpu_signature(), "rows": ROWS, "choices": self.choices,
                           "row_limits": self.row_limits}, f, indent=1)
            os.replace(tmp, self.path)
        except OSError as e:
            logger.warning("could not write the GEMM path cache %s: %s", self.path, e)


def prepare_gemm_weights(model: nn.Module, device: torch.device,
                         quantization: str | None = None) -> list[str]:
    """Give every module with a GEMM (a `gemm` attribute) the path chosen for its weight on
    this CPU, or its quantized weight (`quantization`, what layers/quantization.py names).
    Returns what was done, for the load log."""
    if device.type != "cpu":
        return []
    notes = quantize_weights(model, quantization) if quantization else []
    paths = GemmPaths()
    counts: dict[str, int] = {}
    limits: dict[str, int] = {}  # our own kernel's most rows -> how many weights
    for m in model.modules():
        if not isinstance(getattr(m, "gemm", None), Gemm) or isinstance(m.gemm, QuantizedGemm):
            continue
        path = paths.choose(m.weight.dtype, *m.weight.shape)
        m.gemm = gemm_for_path(m.weight.data, path)
        if isinstance(m.gemm, OwnBf16Gemm):
            m.gemm.max_rows = limit = paths.row_limit(m.weight.dtype, *m.weight.shape)
            label = "any" if limit == sys.maxsize else str(limit)
            limits[label] = limits.get(label, 0) + 1
        if m.gemm.weight.dtype != m.weight.dtype:  # widened: the module keeps it, bias too
            m.weight.data = m.gemm.weight
            if getattr(m, "bias", None) is not None:
                m.bias.data = m.bias.data.float()
        m.gemm.weight = m.weight
        counts[path] = counts.get(path, 0) + 1
    paths.save()
    timed = f" ({len(paths.timed)} timings now)" if paths.timed else ""
    above = ("; own-bf16 up to " + ", ".join(f"{label} rows ({n})" for label, n in limits.items())
             + ", F.linear above" if limits else "")
    return [*notes, f"GEMM paths on this CPU{timed}: "
            + ", ".join(f"{n} {path}" for path, n in sorted(counts.items())) + above]


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
