"""What TeleFuser hands out for a chunk, as the runtime checks it: the frame hashes the gate
compares (of the decoded frames, or of the uint8 PIL images a served or computed chunk returns),
those images as one tensor (a lossy codec's quality verdict), and the session's input image.

Kept apart from `cacheseek.runtime.telefuser` (the runtime and its sessions); imports numpy, torch
and PIL only when called.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

__all__ = ["frame_hash", "images_hash", "images_tensor", "pil_image"]


def frame_hash(frames: Any) -> bytes:
    """A chunk's frame hash: sha256 of the decoded frames' bytes (any device), taken before
    TeleFuser's uint8 conversion so that one changed latent bit shows."""
    import torch

    raw = frames.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(raw).digest()


def images_hash(images: Sequence[Any]) -> bytes:
    """A chunk's frame hash on the release and the hooked commit: xxh3-128 of the uint8 frames
    TeleFuser hands out (their size, then their pixels). An equality check between runs, not a
    guard against crafted frames: sha256 took 15 ms of every 480p chunk on the H200 host, more
    than a restored chunk itself (experiments/session_reuse/profile_live.py)."""
    import xxhash

    h = xxhash.xxh3_128()
    for image in images:
        h.update(f"{image.mode}:{image.size}".encode())
        h.update(image.tobytes())
    return h.digest()


def images_tensor(images: Sequence[Any]) -> Any:
    """The uint8 frames TeleFuser hands out as one float32 tensor ``[n, h, w, c]`` (the frames a
    lossy codec's quality verdict compares)."""
    import numpy as np
    import torch

    return torch.from_numpy(np.stack([np.asarray(image) for image in images])).float()


def pil_image(image: Any, width: int, height: int) -> Any:
    """A PIL image: the given one, one made from a PIL-like (mode, size, tobytes) image, or a
    fixed gradient of the configured size."""
    import numpy as np
    from PIL import Image

    if image is None:
        y, x, c = np.ogrid[:height, :width, :3]
        data = ((x * 3 + y * 5 + c * 70) % 256).astype(np.uint8).tobytes()  # 0.37 s a 480p session as a genexpr
        return Image.frombytes("RGB", (width, height), data)
    if isinstance(image, Image.Image):
        return image
    return Image.frombytes(image.mode, tuple(image.size), image.tobytes())
