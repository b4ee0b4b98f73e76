"""Pixels: the image processor against Hugging Face's CLIP and SigLIP processors (their Pillow
versions: the same pixel values for the same pictures, the same preprocessor_config.json), and
tiling (Megatron-LM's dynamic resolution)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from paratron.data.vision import (
    ImageProcessor,
    ImageSettings,
    ImageTiling,
    candidate_grids,
    image_tensors,
    tile_count,
    tile_grid,
)
from paratron.data.vision.processor import settings_file
from paratron.errors import ConfigError, DataError

from tiny import write_processor_config

try:
    import transformers
except ImportError:  # the tiling tests need no reference
    transformers = None
needs_transformers = pytest.mark.skipif(transformers is None, reason="transformers is the reference")

S = 16  # the encoder's image size in the tiling tests
SIZES = [(24, 24), (12, 30), (40, 17), (5, 7), (16, 9), (1, 33)]  # (width, height): square, portrait, landscape, tiny


def _picture(width: int, height: int, mode: str, seed: int = 0) -> Image.Image:
    """Random pixels in `mode`; RGBA with every level of transparency, P with a transparent colour."""
    rng = np.random.default_rng([seed, width, height])
    if mode == "L":
        return Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8), "L")
    if mode == "RGBA":
        return Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8), "RGBA")
    picture = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
    if mode == "P":
        picture = picture.convert("P")
        picture.info["transparency"] = 0
    return picture


def _theirs(processor, picture: Image.Image) -> np.ndarray:
    return np.asarray(processor(images=picture, return_tensors="np")["pixel_values"][0])


def _json(processor) -> dict:
    """Hugging Face's settings as its preprocessor_config.json holds them."""
    return json.loads(processor.to_json_string())


def _pairs():
    clip, siglip = transformers.CLIPImageProcessorPil, transformers.SiglipImageProcessorPil
    square = {"height": 16, "width": 16}
    yield ImageProcessor.clip(16), clip(size={"shortest_edge": 16}, crop_size=square)
    yield ImageProcessor.siglip(16), siglip(size=square)
    wider = clip(size={"shortest_edge": 20}, crop_size={"height": 12, "width": 14}, resample=2)  # resize, then crop
    yield ImageProcessor.from_dict(_json(wider)), wider
    oblong = siglip(size={"height": 10, "width": 18}, do_convert_rgb=True, resample=1)
    yield ImageProcessor.from_dict(_json(oblong)), oblong


@needs_transformers
@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "P"])
def test_pixels_equal_hugging_faces(mode):
    for mine, theirs in _pairs():
        for width, height in SIZES:
            picture = _picture(width, height, mode)
            pixels = mine(picture)
            expected = _theirs(theirs, picture)
            assert pixels.dtype == torch.float32 and pixels.shape == (3, *mine.output_size) == expected.shape
            np.testing.assert_allclose(pixels.numpy(), expected, rtol=0, atol=1e-6, err_msg=f"{width}x{height}")


def test_transparency_is_laid_over_white():
    picture = Image.new("RGBA", (16, 16), (0, 0, 0, 0))  # fully transparent black
    pixels = ImageProcessor.siglip(16)(picture)
    assert torch.allclose(pixels, torch.ones_like(pixels))  # white, normalized by mean = std = 0.5


def test_a_picture_smaller_than_the_crop_is_padded_with_black():
    processor = ImageProcessor.from_dict({"size": {"height": 4, "width": 4}, "crop_size": 8, "do_center_crop": True})
    pixels = processor(Image.new("RGB", (9, 9), (255, 255, 255)))
    black = (0 - torch.tensor(processor.image_mean)) / torch.tensor(processor.image_std)
    white = (1 - torch.tensor(processor.image_mean)) / torch.tensor(processor.image_std)
    assert torch.allclose(pixels[:, 2:6, 2:6], white[:, None, None].expand(3, 4, 4))
    assert torch.allclose(pixels[:, 0, 0], black) and torch.allclose(pixels[:, 7, 7], black)


@needs_transformers
def test_settings_round_trip_through_preprocessor_config(tmp_path):
    for mine, theirs in _pairs():
        written = _json(theirs)
        assert mine.to_dict() == written
        theirs.save_pretrained(tmp_path)
        from_file = ImageProcessor.from_file(tmp_path)
        assert from_file == mine and from_file.to_dict() == written
        from_file.save(tmp_path / "again.json")
        assert json.loads((tmp_path / "again.json").read_text()) == written
    written = {**ImageProcessor.clip(8).to_dict(), "processor_class": "LlavaProcessor"}
    written["image_processor_type"] = "CLIPImageProcessorFast"
    assert ImageProcessor.from_dict(written).to_dict() == written  # keys of no effect here are kept


@needs_transformers
def test_the_named_defaults_are_hugging_faces_defaults():
    clip = ImageProcessor.from_dict({"image_processor_type": "CLIPImageProcessor"})
    assert clip == ImageProcessor.clip(224)
    assert clip.to_dict() == _json(transformers.CLIPImageProcessorPil())
    siglip = ImageProcessor.from_dict({"image_processor_type": "SiglipImageProcessor"})
    assert siglip == ImageProcessor.siglip(224)
    assert siglip.to_dict() == _json(transformers.SiglipImageProcessorPil())
    old_style = ImageProcessor.from_dict({"size": 16, "crop_size": 16})  # ints, as older configs write them
    assert old_style == ImageProcessor.clip(16)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"image_processor_type": "BlipImageProcessor"}, "image_processor_type 'BlipImageProcessor' is not supported"),
        ({"size": {"longest_edge": 9}}, 'size is .*; write it as {"shortest_edge": n} or'),
        ({"resample": 9}, "resample is 9; use one of Pillow's filters"),
        ({"image_mean": [0.5, 0.5]}, "image_mean is .*; write three numbers"),
        ({"do_resize": "yes"}, "do_resize is 'yes'; write true or false"),
        ({"do_center_crop": False}, "without a center crop the images keep their aspect ratio"),
        ({"do_pad": True}, "do_pad is true"),
        ({"image_std": [1, 0, 1]}, "image_std .* has a zero"),
    ],
)
def test_bad_settings_name_the_file_and_the_fix(tmp_path, config, message):
    path = tmp_path / "preprocessor_config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(DataError, match=f"preprocessor_config.json: {message}"):
        ImageProcessor.from_file(path)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(DataError, match="holds neither processor_config.json nor preprocessor_config.json"):
        ImageProcessor.from_file(tmp_path)
    with pytest.raises(DataError, match="preprocessor_config.json: no such file"):
        ImageProcessor.from_file(tmp_path / "preprocessor_config.json")
    (tmp_path / "preprocessor_config.json").write_text("{oops")
    with pytest.raises(DataError, match="not readable JSON"):
        ImageProcessor.from_file(tmp_path)


def test_both_layouts_of_a_processor_are_read(tmp_path):
    odd = ImageProcessor.clip(12).to_dict() | {"image_mean": [0.1, 0.2, 0.3], "image_std": [0.4, 0.5, 0.6]}
    expected = ImageProcessor.from_dict(odd)
    assert expected != ImageProcessor.clip(12)  # (so that defaults in its place would show)
    write_processor_config(tmp_path / "nested", odd)
    assert ImageProcessor.from_file(tmp_path / "nested") == expected
    assert ImageProcessor.from_file(tmp_path / "nested" / "processor_config.json") == expected
    assert settings_file(tmp_path / "nested") == tmp_path / "nested" / "processor_config.json"
    (tmp_path / "alone").mkdir()
    (tmp_path / "alone" / "preprocessor_config.json").write_text(json.dumps(odd))
    assert ImageProcessor.from_file(tmp_path / "alone") == expected
    # a processor_config.json without image settings gives way to a preprocessor_config.json beside it,
    # as in transformers; the nested settings win over it
    (tmp_path / "alone" / "processor_config.json").write_text(json.dumps({"processor_class": "LlavaProcessor"}))
    assert ImageProcessor.from_file(tmp_path / "alone") == expected
    (tmp_path / "nested" / "preprocessor_config.json").write_text(json.dumps(ImageProcessor.clip(12).to_dict()))
    assert ImageProcessor.from_file(tmp_path / "nested") == expected
    assert settings_file(tmp_path) is None


def test_a_processor_without_image_settings_is_refused_by_name(tmp_path):
    (tmp_path / "processor_config.json").write_text(json.dumps({"processor_class": "LlavaProcessor"}))
    for path in (tmp_path, tmp_path / "processor_config.json"):
        with pytest.raises(DataError, match="processor_config.json: declares the processor LlavaProcessor but holds no "
                           "image processor settings .*; give the encoder's preprocessor_config.json with "
                           "--image-processor"):  # fmt: skip
            ImageProcessor.from_file(path)
    write_processor_config(tmp_path, {"image_processor_type": "BlipImageProcessor"})
    with pytest.raises(DataError, match=r"processor_config.json \(image_processor\): image_processor_type 'Blip"):
        ImageProcessor.from_file(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty: holds neither processor_config.json nor preprocessor_config.json"):
        ImageProcessor.from_file(tmp_path / "empty")


@needs_transformers
def test_the_newest_layout_is_what_transformers_reads(tmp_path):
    """transformers reads the nested settings of a processor_config.json as its image processor: the same
    settings here."""
    theirs = transformers.CLIPImageProcessorPil(size={"shortest_edge": 12}, crop_size=12, image_mean=[0.1, 0.2, 0.3])
    write_processor_config(tmp_path, _json(theirs))
    loaded = transformers.CLIPImageProcessorPil.from_pretrained(tmp_path)
    assert list(loaded.image_mean) == [0.1, 0.2, 0.3]
    mine = ImageProcessor.from_file(tmp_path)
    picture = _picture(20, 14, "RGB")
    np.testing.assert_allclose(mine(picture).numpy(), _theirs(loaded, picture), atol=1e-6)


# ---------------------------------------------------------------- tiling


@pytest.mark.parametrize(
    "width, height, max_tiles, grid",
    [
        (16, 16, 6, (1, 1)),  # square and small: one tile
        (32, 32, 6, (2, 2)),  # square and big enough for 2 x 2 (more than half their area)
        (24, 24, 6, (2, 2)),
        (23, 22, 6, (1, 1)),  # 506 pixels: less than half of 2 x 2 tiles' 1024
        (64, 16, 6, (4, 1)),
        (16, 48, 6, (1, 3)),
        (40, 17, 6, (2, 1)),  # aspect 2.35: 2 / 1 is the closest with at most 6 tiles
        (40, 17, 12, (5, 2)),  # ... and 5 / 2 with at most 12
        (100, 10, 6, (6, 1)),
        (100, 10, 1, (1, 1)),
    ],
)
def test_tile_grids(width, height, max_tiles, grid):
    assert tile_grid(width, height, max_tiles, S) == grid
    tiles = grid[0] * grid[1]
    assert tile_count(width, height, ImageTiling(max_tiles, use_thumbnail=True), S) == tiles + (tiles > 1)
    assert tile_count(width, height, ImageTiling(max_tiles), S) == tiles
    assert tile_count(width, height, None, S) == 1


def test_the_grid_is_the_closest_in_aspect_ratio():
    assert candidate_grids(4) == ((1, 1), (1, 2), (2, 1), (1, 3), (3, 1), (1, 4), (2, 2), (4, 1))
    for width, height in [(7, 50), (33, 20), (90, 41), (31, 31), (200, 9)]:
        cols, rows = tile_grid(width, height, 9, S)
        gap = abs(width / height - cols / rows)
        assert cols * rows <= 9
        assert all(abs(width / height - c / r) >= gap for c, r in candidate_grids(9))


@pytest.mark.parametrize("processor", [ImageProcessor.siglip(S), ImageProcessor.clip(S)])
@pytest.mark.parametrize("width, height, grid", [(40, 17, (2, 1)), (33, 31, (2, 2)), (17, 50, (1, 3))])
def test_each_tile_is_the_processed_crop(processor, width, height, grid):
    rng = np.random.default_rng(0)
    picture = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    tensors = image_tensors(picture, processor, ImageTiling(6, use_thumbnail=True))
    cols, rows = grid
    assert tile_grid(width, height, 6, S) == grid and tensors.shape == (cols * rows + 1, 3, S, S)
    resized = picture.resize((cols * S, rows * S), Image.Resampling.BICUBIC)
    for row in range(rows):  # row by row, left to right
        for col in range(cols):
            crop = resized.crop((col * S, row * S, (col + 1) * S, (row + 1) * S))
            assert torch.equal(tensors[row * cols + col], processor(crop))
    assert torch.equal(tensors[-1], processor(picture.resize((S, S), Image.Resampling.BICUBIC)))  # the thumbnail
    single = image_tensors(picture, processor, None)
    assert single.shape == (1, 3, S, S) and torch.equal(single[0], processor(picture))
    assert image_tensors(picture, processor, ImageTiling(1, use_thumbnail=True)).shape == (1, 3, S, S)


def test_tiling_needs_square_images():
    oblong = ImageProcessor.from_dict(
        {"image_processor_type": "SiglipImageProcessor", "size": {"height": 8, "width": 12}}
    )
    with pytest.raises(ConfigError, match="tiling needs square images, but the image processor makes 8 x 12"):
        ImageSettings(oblong, image_token_id=5, tokens_per_image=4, tiling=ImageTiling(4))
    with pytest.raises(ValueError, match="max_num_tiles is 0"):
        ImageTiling(0)
