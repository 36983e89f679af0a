"""engine/image_batcher.py with a stand-in encoder (each image's embeddings a function of its own pixels only, as
the vision tower's): concurrent callers share forwards, each gets exactly its images' embeddings, an image asked
for twice is encoded once, the patch budget bounds a forward, and a failing forward fails only its own images."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from allspark_server.engine.image_batcher import ImageBatcher

MERGE = 4   # patches per token


class Encoder:
    def __init__(self, delay: float = 0.0, fail_on: float | None = None):
        self.calls: list[int] = []
        self.delay, self.fail_on = delay, fail_on

    def __call__(self, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        self.calls.append(len(pixels))
        time.sleep(self.delay)
        if self.fail_on is not None and (pixels == self.fail_on).any():
            raise ValueError("a bad image")
        return pixels.reshape(-1, MERGE * pixels.shape[1]).sum(1, keepdim=True) * 2   # [patches / MERGE, 1]


def image(seed: int, patches: int = 8) -> tuple[str, np.ndarray, list[int]]:
    pixels = np.random.default_rng(seed).random((patches, 3), dtype=np.float32)
    return f"img{seed}", pixels, [1, 2, patches // 2]


def alone(item) -> torch.Tensor:
    return Encoder()(torch.from_numpy(item[1]), None)


def test_concurrent_callers_share_forwards_and_each_gets_its_own():
    encoder = Encoder(delay=0.05)
    batcher = ImageBatcher(encoder)
    items = [image(i) for i in range(8)]
    results = [None] * 8

    def call(i):
        results[i] = batcher.embed([items[i], items[(i + 1) % 8]])
    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(8):
        assert torch.equal(results[i][0], alone(items[i])) and torch.equal(results[i][1], alone(items[(i + 1) % 8]))
    assert sum(encoder.calls) == 8 * 8              # every image encoded once, though each was asked for twice
    assert batcher.forwards < 8                     # and in shared forwards
    forwards = batcher.forwards
    assert torch.equal(batcher.embed([items[3]])[0], alone(items[3])) and batcher.forwards == forwards   # cached


def test_the_patch_budget_bounds_a_forward():
    encoder = Encoder()
    batcher = ImageBatcher(encoder, max_patches=16)
    items = [image(i, patches=8) for i in range(5)] + [image(9, patches=40)]   # one image past the budget alone
    out = batcher.embed(items)
    assert [len(o) for o in out] == [2] * 5 + [10]
    assert all(torch.equal(o, alone(it)) for o, it in zip(out, items))
    assert max(encoder.calls) == 40 and sorted(encoder.calls)[:-1] == [8, 16, 16]


def test_a_failing_forward_fails_its_images_and_the_next_call_works():
    items = [image(1), image(2)]
    encoder = Encoder(fail_on=float(items[1][1][0, 0]))
    batcher = ImageBatcher(encoder)
    with pytest.raises(ValueError, match="a bad image"):
        batcher.embed(items)
    assert torch.equal(batcher.embed([items[0]])[0], alone(items[0]))       # not cached as failed: encoded again
