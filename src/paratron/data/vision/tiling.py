"""Dynamic resolution (Megatron-LM's `--use-tiling --max-num-tiles N --use-thumbnail`): a large
picture is seen as several encoder-sized tiles instead of one squeezed square.

The grid is the one, among all grids of `cols x rows` tiles with 1 <= cols * rows <= N, whose
aspect ratio (cols / rows) is closest to the picture's (width / height). Grids are tried in order
of their tile count, then of their number of columns; on an exact tie with a grid tried earlier,
the later (larger) grid wins when the picture's area exceeds half the area of its tiles, so a big
picture is not shrunk when a finer grid of the same shape is available. The picture is resized to
the grid (cols * S by rows * S pixels, S the encoder's image size) and cut row by row; with the
thumbnail on and more than one tile, the whole picture resized to S x S comes last. Each piece
then goes through the image processor.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from PIL import Image

from paratron.data.vision.processor import ImageProcessor, to_rgb
from paratron.errors import ConfigError


@dataclass(frozen=True)
class ImageTiling:
    """Megatron-LM's --max-num-tiles and --use-thumbnail."""

    max_num_tiles: int
    use_thumbnail: bool = False

    def __post_init__(self) -> None:
        if self.max_num_tiles < 1:
            raise ValueError(f"max_num_tiles is {self.max_num_tiles}; it must be at least 1")


@lru_cache(maxsize=64)
def candidate_grids(max_num_tiles: int) -> tuple[tuple[int, int], ...]:
    """Every (cols, rows) with 1 <= cols * rows <= max_num_tiles, by tile count, then columns."""
    grids = [(c, r) for c in range(1, max_num_tiles + 1) for r in range(1, max_num_tiles // c + 1)]
    return tuple(sorted(grids, key=lambda grid: (grid[0] * grid[1], grid[0])))


def tile_grid(width: int, height: int, max_num_tiles: int, tile_size: int) -> tuple[int, int]:
    """(cols, rows) of the grid a `width` x `height` picture is cut into (see the module docstring)."""
    aspect = width / height
    best, best_gap = (1, 1), float("inf")
    for cols, rows in candidate_grids(max_num_tiles):
        gap = abs(aspect - cols / rows)
        if gap < best_gap:
            best, best_gap = (cols, rows), gap
        elif gap == best_gap and width * height > 0.5 * tile_size * tile_size * cols * rows:
            best = (cols, rows)
    return best


def tile_count(width: int, height: int, tiling: ImageTiling | None, tile_size: int) -> int:
    """How many tensors (tiles, thumbnail included) a `width` x `height` picture becomes."""
    if tiling is None:
        return 1
    cols, rows = tile_grid(width, height, tiling.max_num_tiles, tile_size)
    tiles = cols * rows
    return tiles + 1 if tiling.use_thumbnail and tiles > 1 else tiles


def tile_pictures(image: Image.Image, tiling: ImageTiling, tile_size: int, resample: int) -> list[Image.Image]:
    """The tiles of `image` (in RGB) row by row, then the thumbnail when there is one."""
    image = to_rgb(image)
    width, height = image.size
    cols, rows = tile_grid(width, height, tiling.max_num_tiles, tile_size)
    grid = image.resize((cols * tile_size, rows * tile_size), resample=resample)
    pieces = [
        grid.crop((col * tile_size, row * tile_size, (col + 1) * tile_size, (row + 1) * tile_size))
        for row in range(rows)
        for col in range(cols)
    ]
    if tiling.use_thumbnail and len(pieces) > 1:
        pieces.append(image.resize((tile_size, tile_size), resample=resample))
    return pieces


def square_side(processor: ImageProcessor) -> int:
    """The encoder's image size S, which tiling needs square."""
    height, width = processor.output_size
    if height != width:
        raise ConfigError(
            f"--use-tiling: tiling needs square images, but the image processor makes {height} x {width}; "
            "give it a square crop_size (CLIP) or size (SigLIP)"
        )
    return height


def image_tensors(image: Image.Image, processor: ImageProcessor, tiling: ImageTiling | None) -> torch.Tensor:
    """float32 [n, 3, S, S]: the processed picture (n = 1) or its processed tiles."""
    if tiling is None:
        return processor(image).unsqueeze(0)
    pieces = tile_pictures(image, tiling, square_side(processor), processor.resample)
    return torch.stack([processor(piece) for piece in pieces])
