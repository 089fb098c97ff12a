"""How a launch starts its children (engine cores, API servers, the DP coordinator): forked
from a fork server that imported, once, what they all import; and what a launch starts early
beside its own start (the fork server, the CPU kernels' build).

Spawned, each child imported torch, transformers and the engine or serving stack again: ~4 s
of CPU each on the 2-core machines here, most of a small model's start-up, and in parallel
with nothing else to do. The fork server is a clean single-threaded process that only imports
(it never runs a torch op nor touches CUDA), so its children start as spawned ones do (their
arguments pickled, nothing else of the launcher's inherited: no threads, sockets or CUDA
state), minus the imports. It is started as soon as `parashift run` begins, so that its imports
overlap the launcher's own; it exits with the launcher (multiprocessing closes its pipe)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import threading
from multiprocessing.context import BaseContext

from parashift.engine.args import EngineArgs

PRELOAD = ["parashift.runtime.fork_server_preload", "torch", "transformers",
           "parashift.engine.engine_process", "parashift.serve.api_server",
           "parashift.runtime.coordinator"]


def context() -> BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_early() -> None:
    """Start the fork server now (its imports run beside the caller's)."""
    context()
    multiprocessing.forkserver.ensure_running()


def build_cpu_kernels_early(engine: EngineArgs) -> None:
    """On a fresh machine the engine's first use of the CPU kernels compiles them (seconds of
    g++): a thread starts that build now, beside the model's conversion and the launcher's own
    start, and the engines load the cached library."""
    import torch

    if engine.device not in (None, "cpu") or (engine.device is None
                                               and torch.cuda.is_available()):
        return
    from parashift.config import check_cpu_kernels
    from parashift.layers.kernel_dispatch import cpu_ops, use_cpu_kernels

    try:
        check_cpu_kernels(engine.cpu_kernels)
    except ValueError:
        return  # the config's own check names it
    use_cpu_kernels(engine.cpu_kernels)

    threading.Thread(target=cpu_ops, name="cpu-kernels-build", daemon=True).start()
