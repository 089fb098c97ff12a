"""This node's part of the device mesh, from the devices this process sees: the one place
where a launch (served, headless, offline, bench) turns the strategy into placements."""

from __future__ import annotations

import os

import torch

from parashift.strategies.mesh import DeviceMesh, EnginePlacement
from parashift.strategies.spec import StrategySpec


def node_mesh(spec: StrategySpec, device: str, engines: list[int]) -> DeviceMesh:
    """`engines` (dp ranks) on this node's GPUs, or on the cores this process may use."""
    if device == "cpu":
        cores = sorted(os.sched_getaffinity(0))
        return DeviceMesh(spec, len(cores), "cpu", engines=engines, cpu_ids=cores)
    count = torch.cuda.device_count()
    if count < 1:
        raise ValueError(f"--device {device}: no GPU is visible")
    return DeviceMesh(spec, count, device, engines=engines)


def engine_placement(spec: StrategySpec, device: str, engine: int) -> EnginePlacement:
    return node_mesh(spec, device, [engine]).engine_placement(engine)


def ray_engine_placement(spec: StrategySpec, device: str, engine: int) -> EnginePlacement:
    """On Ray, each worker's actor gets its device from its bundle (one GPU, or one CPU): the
    mesh still names and orders the workers, over one device per worker."""
    workers = spec.processes().workers_per_engine
    mesh = DeviceMesh(spec, workers, device, engines=[engine])
    return mesh.engine_placement(engine)
