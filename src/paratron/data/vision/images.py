"""The images of a sample: what they cost in tokens (known before training, from each file's
header) and their pixels (decoded only when the sample is drawn, in a data-loader worker)."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image, UnidentifiedImageError

from paratron.data.vision.processor import ImageProcessor
from paratron.data.vision.tiling import ImageTiling, image_tensors, square_side, tile_count
from paratron.errors import DataError


@dataclass(frozen=True)
class ImageSettings:
    """How images become placeholder tokens and pixels (set from the vision model's config)."""

    processor: ImageProcessor
    image_token_id: int
    """The id that stands for one image embedding in a token row."""
    tokens_per_image: int
    """Embeddings the encoder gives per image (per tile, with tiling)."""
    tiling: ImageTiling | None = None

    def __post_init__(self) -> None:
        if self.tokens_per_image < 1:
            raise ValueError(f"tokens_per_image is {self.tokens_per_image}; it must be at least 1")
        if self.tiling is not None:
            square_side(self.processor)

    @property
    def pixel_shape(self) -> tuple[int, int, int]:
        """(3, H, W) of one image tensor (one tile)."""
        return (3, *self.processor.output_size)

    def no_images(self) -> torch.Tensor:
        """float32 [0, 3, H, W]: the images of a sample that has none."""
        return torch.zeros((0, *self.pixel_shape), dtype=torch.float32)


@dataclass(frozen=True)
class ImageRef:
    """One image of a conversation: its file and how many tensors (tiles) it becomes."""

    path: str
    tiles: int
    member: tuple[int, int] | None = None
    """For an image inside a tar shard: (offset, size) of its bytes in the shard `shard`, and `path`
    reads "SHARD#MEMBER"."""
    shard: str = ""


DATA_FILE_FIX = "fix the path in the data file or --image-folder"
"""What to do about an unreadable image a data file names (the default of `image_ref`'s `fix`)."""


def _open(
    path: Path, where: str, member: tuple[int, int] | None = None, shard: str = "", fix: str = DATA_FILE_FIX
) -> Image.Image:
    """The opened image (header read, pixels not yet decoded), or a DataError naming `where` and `fix`.
    With `member`, the image is the bytes at (offset, size) of the tar shard `shard`."""
    fix = fix if member is None else "replace it in the shard"
    try:
        if member is not None:
            return Image.open(io.BytesIO(_read_member(Path(shard), *member)))
        return Image.open(path)
    except FileNotFoundError:
        raise DataError(f"{where}: image {path} does not exist; {fix}") from None
    except IsADirectoryError:
        raise DataError(f"{where}: image {path} is a folder, not an image file; {fix}") from None
    except UnidentifiedImageError:
        raise DataError(f"{where}: {path} is not an image Pillow can read (PNG, JPEG, ...); {fix}") from None
    except Image.DecompressionBombError as exc:
        raise DataError(f"{where}: image {path} is too large to decode safely ({exc}); shrink it") from None
    except OSError as exc:
        raise DataError(f"{where}: image {path} cannot be read ({exc.strerror or exc}); {fix}") from None


def _read_member(shard: Path, offset: int, size: int) -> bytes:
    with open(shard, "rb") as file:
        file.seek(offset)
        data = file.read(size)
    if len(data) != size:  # a short read is an OSError to the caller, as for a damaged file
        raise OSError(f"the shard ends {size - len(data)} byte(s) before the image does")
    return data


def image_ref(
    path: Path,
    settings: ImageSettings,
    where: str,
    member: tuple[int, int] | None = None,
    shard: str = "",
    fix: str = DATA_FILE_FIX,
) -> ImageRef:
    """Check that `path` is a readable image and count its tiles, reading only its header; `fix` says
    what to do when it is not (where its path came from). With `member`, `path` names the image
    "SHARD#MEMBER" and its bytes are at (offset, size) of `shard`."""
    with _open(path, where, member, shard, fix) as image:
        width, height = image.size
    if width < 1 or height < 1:
        raise DataError(f"{where}: image {path} is {width} x {height} pixels, so it holds nothing; replace it")
    tiles = tile_count(width, height, settings.tiling, settings.pixel_shape[1])
    return ImageRef(str(path), tiles, member, shard)


def load_pixels(ref: ImageRef, settings: ImageSettings, where: str, fix: str = DATA_FILE_FIX) -> torch.Tensor:
    """float32 [ref.tiles, 3, H, W]: the image decoded and processed (tiled when tiling is on)."""
    with _open(Path(ref.path), where, ref.member, ref.shard, fix) as image:
        try:
            image.load()
        except (OSError, ValueError, SyntaxError) as exc:  # Pillow reports broken data as any of these
            raise DataError(f"{where}: image {ref.path} cannot be decoded ({exc}); replace the file") from None
        try:
            pixels = image_tensors(image, settings.processor, settings.tiling)
        except ValueError as exc:
            raise DataError(f"{where}: image {ref.path} cannot be processed: {exc}") from None
    if pixels.shape[0] != ref.tiles:  # the file changed since it was counted
        raise DataError(
            f"{where}: image {ref.path} now gives {pixels.shape[0]} tiles, not the {ref.tiles} counted "
            "when the data was read; do not change images while training"
        )
    return pixels


def load_images(refs: list[ImageRef], settings: ImageSettings, where: str, fix: str = DATA_FILE_FIX) -> torch.Tensor:
    """float32 [sum of tiles, 3, H, W]: the images in order (empty when there are none)."""
    if not refs:
        return settings.no_images()
    return torch.cat([load_pixels(ref, settings, where, fix) for ref in refs])
