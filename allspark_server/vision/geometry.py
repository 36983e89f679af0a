"""Where each patch of an image sits, and which patches attend to which.

The processor lays an image's patches out merge block by merge block: blocks of `merge x merge` patches (one
language-model token each) in row-major order over the block grid, row-major inside a block, frame after frame.
`grid_thw` rows are (frames, patch rows, patch columns) of each image. Attention never crosses frames or images
(`frame_bounds`); Qwen2.5-VL's windowed blocks attend within square windows of merged tokens (`window_order`),
for which the patches are reordered window by window (and put back after the merger)."""
from __future__ import annotations

import torch


def grid_rows(grid_thw) -> list[tuple[int, int, int]]:
    """[(t, h, w)] of a [n, 3] tensor, array or list."""
    rows = grid_thw.tolist() if hasattr(grid_thw, "tolist") else list(grid_thw)
    return [(int(t), int(h), int(w)) for t, h, w in rows]


def check_grid(grid_thw, merge: int, num_patches: int | None = None) -> list[tuple[int, int, int]]:
    """The grid rows, each positive with h and w multiples of `merge`, covering `num_patches` when given."""
    rows = grid_rows(grid_thw)
    for i, (t, h, w) in enumerate(rows):
        if t < 1 or h < 1 or w < 1 or h % merge or w % merge:
            raise ValueError(f"image_grid_thw[{i}] = {[t, h, w]}: each must be positive, height and width "
                             f"multiples of spatial_merge_size {merge}")
    if num_patches is not None and sum(t * h * w for t, h, w in rows) != num_patches:
        raise ValueError(f"image_grid_thw covers {sum(t * h * w for t, h, w in rows)} patches but pixel_values has "
                         f"{num_patches} rows")
    return rows


def tokens_per_image(grid_thw, merge: int) -> list[int]:
    """The language-model tokens (merger outputs) of each image."""
    return [t * h * w // (merge * merge) for t, h, w in grid_rows(grid_thw)]


def patch_positions(grid_thw, merge: int) -> torch.Tensor:
    """[N, 2] long: (row, column) of every patch in the processor's order."""
    out = []
    for t, h, w in grid_rows(grid_thw):
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
        # (block row, block column, row in block, column in block)
        hw = torch.stack([rows.permute(0, 2, 1, 3).reshape(-1), cols.permute(0, 2, 1, 3).reshape(-1)], dim=1)
        out.append(hw.repeat(t, 1))
    return torch.cat(out) if out else torch.zeros(0, 2, dtype=torch.long)


def frame_bounds(grid_thw) -> list[int]:
    """Cumulative patch counts at each frame's end, from 0: the full-attention segments."""
    bounds = [0]
    for t, h, w in grid_rows(grid_thw):
        for _ in range(t):
            bounds.append(bounds[-1] + h * w)
    return bounds


def window_order(grid_thw, merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows of `window x window` merged tokens: (order, bounds). `order[j]` is the merged token
    (in the processor's order) that comes j-th when tokens are grouped window by window (frame by frame, windows
    row-major, tokens row-major inside a window; windows at the right and bottom edges are smaller);
    `bounds` are the cumulative patch counts at each window's end, from 0."""
    order, bounds, base = [], [0], 0
    unit = merge * merge
    for t, h, w in grid_rows(grid_thw):
        gh, gw = h // merge, w // merge
        grid = torch.arange(t * gh * gw).view(t, gh, gw)
        for f in range(t):
            for r in range(0, gh, window):
                for c in range(0, gw, window):
                    cell = grid[f, r:r + window, c:c + window].reshape(-1)
                    order.append(cell + base)
                    bounds.append(bounds[-1] + cell.numel() * unit)
        base += t * gh * gw
    return (torch.cat(order) if order else torch.zeros(0, dtype=torch.long)), bounds
