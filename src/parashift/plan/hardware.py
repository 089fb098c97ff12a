"""Device and link numbers for the roofline (datasheet figures: dense bf16 tensor FLOP/s,
HBM bandwidth; links per device, one direction). Estimates, not measurements."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: int
    memory_bw: float  # bytes/s
    bf16_flops: float  # FLOP/s
    is_gpu: bool = True


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float  # bytes/s per device
    latency: float  # seconds per collective step


GiB = 1 << 30
DEVICES = {d.name: d for d in [
    Device("h100-80g", 80 * GiB, 3.35e12, 989e12),
    Device("h200-141g", 141 * GiB, 4.8e12, 989e12),
    Device("a100-80g", 80 * GiB, 2.0e12, 312e12),
    Device("a100-40g", 40 * GiB, 1.55e12, 312e12),
    Device("l40s-48g", 48 * GiB, 0.864e12, 362e12),
    Device("b200-180g", 180 * GiB, 8.0e12, 2250e12),
    # One CPU core of this project's machines, as measured (docs/BENCHMARKS.md): ~12 GB/s,
    # ~70 GFLOP/s fp32; its memory is what --kv-cache-memory and the weights take.
    Device("cpu", 16 * GiB, 12e9, 70e9, is_gpu=False),
]}
INTRA_NODE = {"nvlink": Link("nvlink", 450e9, 5e-6), "pcie": Link("pcie", 32e9, 10e-6),
              "shm": Link("shm", 10e9, 20e-6)}
INTER_NODE = {"ib": Link("ib", 50e9, 10e-6), "ethernet": Link("ethernet", 12.5e9, 30e-6)}
