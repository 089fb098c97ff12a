"""A step's host arrays on the model's device, without a wait. A plain copy from pageable memory
synchronizes the CUDA stream: the host would stop until the step before has run, and async
scheduling's overlap of the next step's preparation would be lost. So on CUDA an array goes
through pinned memory, copied non-blocking; torch's pinned-memory cache keeps the block until
the copy has run. On CPU the array becomes the tensor, with no copy."""

from __future__ import annotations

import numpy as np
import torch


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if device.type == "cpu":
        return tensor
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
