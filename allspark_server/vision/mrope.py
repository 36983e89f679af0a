"""M-RoPE positions of a Qwen2-VL / Qwen2.5-VL prompt: each token's (temporal, height, width) rotary position.

Text tokens have three equal components, counting up from where the previous span ended. An image's tokens (one
per merged patch block, row-major over its grid of `h / merge` x `w / merge` blocks, frame after frame) have
temporal = start (+ the frame's time for a video), height = start + row, width = start + column, and the text
after it starts at start + max(rows, columns), as transformers 5.23's `get_rope_index` does (for a video, whose
temporal positions can go further, that is where transformers 5.23 puts it too). Video frames step by 1
(Qwen2-VL) or by tokens_per_second x second_per_grid_t (Qwen2.5-VL), truncated to an integer.

The prompt's `rope_delta` is its largest position + 1 - its length: the token at index i >= len(prompt) (every
generated token) has all three components i + rope_delta. Pure numpy, no torch."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from allspark_server.vision.geometry import grid_rows
from allspark_server.vision.tower_config import DEFAULT_TOKENS_PER_SECOND, family_of


def mrope_positions(input_ids: Sequence[int], image_grid_thw=None, video_grid_thw=None, *, image_token_id: int,
                    video_token_id: int | None = None, spatial_merge_size: int = 2, tokens_per_second: int = 0,
                    second_per_grid_ts: Sequence[float] | None = None) -> tuple[np.ndarray, int]:
    """([3, T] int64 positions, rope_delta) of a prompt whose image (video) tokens are expanded as the processor
    makes them: each image's `t * h * w / merge^2` tokens in a row, images in `image_grid_thw`'s order.
    `tokens_per_second` 0: frames step by 1 (Qwen2-VL). ValueError when the tokens and the grids disagree."""
    ids = np.asarray(input_ids, dtype=np.int64).reshape(-1)
    kinds = np.zeros(len(ids), dtype=np.int8)
    kinds[ids == image_token_id] = 1
    if video_token_id is not None:
        kinds[ids == video_token_id] = 2
    grids = {1: grid_rows(image_grid_thw) if image_grid_thw is not None else [],
             2: grid_rows(video_grid_thw) if video_grid_thw is not None else []}
    used = {1: 0, 2: 0}
    seconds = list(second_per_grid_ts) if second_per_grid_ts is not None else None
    merge = spatial_merge_size
    out = np.empty((3, len(ids)), dtype=np.int64)
    i, pos = 0, 0
    while i < len(ids):
        kind = int(kinds[i])
        if kind == 0:
            j = i
            while j < len(ids) and kinds[j] == 0:
                j += 1
            out[:, i:j] = np.arange(pos, pos + j - i)
            pos += j - i
            i = j
            continue
        what = "image" if kind == 1 else "video"
        if used[kind] >= len(grids[kind]):
            raise ValueError(f"the prompt has more {what} tokens than its {len(grids[kind])} {what} grid(s) make")
        t, h, w = grids[kind][used[kind]]
        if h % merge or w % merge:
            raise ValueError(f"{what} grid {[t, h, w]}: height and width must be multiples of {merge}")
        gh, gw = h // merge, w // merge
        n = t * gh * gw
        if i + n > len(ids) or (kinds[i:i + n] != kind).any():
            raise ValueError(f"{what} {used[kind]} (grid {[t, h, w]}) needs {n} {what} tokens in a row at index "
                             f"{i}; the prompt has fewer")
        step = 1.0
        if kind == 2 and tokens_per_second:
            second = seconds[used[kind]] if seconds is not None else 1.0
            step = np.float32(tokens_per_second * float(second))
        frames = (np.arange(t, dtype=np.float32) * np.float32(step)).astype(np.int64) if step != 1.0 \
            else np.arange(t, dtype=np.int64)
        out[0, i:i + n] = np.repeat(frames, gh * gw) + pos
        out[1, i:i + n] = np.tile(np.repeat(np.arange(gh), gw), t) + pos
        out[2, i:i + n] = np.tile(np.arange(gw), t * gh) + pos
        pos += max(gh, gw)
        used[kind] += 1
        i += n
    for kind, what in ((1, "image"), (2, "video")):
        if used[kind] != len(grids[kind]):
            raise ValueError(f"the prompt's {what} tokens make {used[kind]} {what}(s) but {len(grids[kind])} "
                             f"{what} grid(s) were given")
    delta = int(out.max()) + 1 - len(ids) if len(ids) else 0
    return out, delta


def rope_index(input_ids: Sequence[int], image_grid_thw, config: dict, video_grid_thw=None,
               second_per_grid_ts: Sequence[float] | None = None) -> tuple[np.ndarray, int]:
    """mrope_positions with the token ids, merge size and (Qwen2.5-VL) tokens_per_second of config.json's dict."""
    vision = config.get("vision_config") or {}
    per_second = 0
    if family_of(config) == "qwen2_5_vl":      # transformers' default when the file has none
        per_second = int(vision.get("tokens_per_second", DEFAULT_TOKENS_PER_SECOND))
    return mrope_positions(input_ids, image_grid_thw, video_grid_thw, image_token_id=int(config["image_token_id"]),
                           video_token_id=config.get("video_token_id"),
                           spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
                           tokens_per_second=per_second, second_per_grid_ts=second_per_grid_ts)


def generated_position(index: int, rope_delta: int) -> int:
    """The (equal) rotary position components of the token at `index` >= the prompt's length."""
    return index + rope_delta
