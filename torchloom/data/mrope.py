"""Multimodal RoPE positions (Qwen2-VL's M-RoPE, as Qwen3-VL numbers them) of one sequence.

Every token gets a (t, h, w) position. A text token holds the same number on the three axes,
one more than the token before it. An image's merged tokens hold ``start + (frame, row, col)``
of their place in the image's grid after the spatial merge, where ``start`` is the position the
next text token would have had; the text after the image goes on at ``start + max(rows, cols)``
(for a one-frame image: the image's largest position plus one). An image's tokens are the
``image_token_id`` run that begins right after a ``vision_start_token_id``.

The data loader and the generator call this on the host; the model only reads the result.
"""

from __future__ import annotations

import torch


def mrope_positions(
    tokens: torch.Tensor,
    image_grid_thw: torch.Tensor,
    image_token_id: int,
    vision_start_token_id: int,
    spatial_merge_size: int,
) -> torch.Tensor:
    """int64 ``[T, 3]`` (t, h, w) positions of the sequence ``tokens`` ``[T]`` whose images, in
    order, have the patch grids ``image_grid_thw`` ``[N, 3]`` (all-zero rows, absent image
    slots, are skipped). ValueError when the images and the placeholder runs disagree."""
    tokens = torch.as_tensor(tokens).cpu().long()
    grids = [g for g in torch.as_tensor(image_grid_thw).reshape(-1, 3).tolist() if any(g)]
    follows_start = torch.zeros_like(tokens, dtype=torch.bool)
    follows_start[1:] = tokens[:-1] == vision_start_token_id
    starts = torch.nonzero(follows_start & (tokens == image_token_id)).flatten().tolist()
    if len(starts) != len(grids):
        raise ValueError(
            f"the sequence has {len(starts)} image placeholder runs (image tokens right after a "
            f"vision start token) but {len(grids)} image grids."
        )
    positions = torch.empty(len(tokens), 3, dtype=torch.int64)
    next_position = cursor = 0  # the next text token's position, and its index
    for start, (frames, height, width) in zip(starts, grids, strict=True):
        rows, cols = height // spatial_merge_size, width // spatial_merge_size
        count = frames * rows * cols
        if start < cursor or not bool((tokens[start : start + count] == image_token_id).all()):
            raise ValueError(
                f"the image at token {start} has a {frames}x{rows}x{cols} merged grid but not "
                f"{count} image tokens there."
            )
        text = start - cursor
        positions[cursor:start] = next_position + torch.arange(text)[:, None]
        next_position += text
        t, h, w = torch.meshgrid(
            torch.arange(frames), torch.arange(rows), torch.arange(cols), indexing="ij"
        )
        grid_positions = torch.stack((t, h, w), dim=-1).reshape(count, 3)
        positions[start : start + count] = next_position + grid_positions
        next_position += max(rows, cols)  # as transformers' get_rope_index, whatever the frames
        cursor = start + count
    positions[cursor:] = next_position + torch.arange(len(tokens) - cursor)[:, None]
    return positions
