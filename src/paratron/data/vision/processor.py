"""Images -> the pixel tensors a vision encoder reads, as Hugging Face's CLIP and SigLIP image
processors make them (read from a model folder's `processor_config.json` or `preprocessor_config.json`).

transformers has written a processor's settings in two layouts: the image processor's alone in
`preprocessor_config.json`, and (newer releases, which no longer write that file) the whole processor in
`processor_config.json`, the image processor's settings under its "image_processor" key. Both are read,
with transformers' own precedence (the nested settings first); a folder that declares a processor whose
image settings are in neither is refused, never replaced by the defaults.

The steps and their order are those processors' own, so a model converted from Hugging Face sees
the pixels it was trained on:

1. to RGB: a picture with transparency is laid over white; greyscale and palettes are expanded;
2. resize with Pillow (`resample`), either the shortest edge to `size["shortest_edge"]` (the other
   edge scaled and rounded down) or to exactly `size["height"]` x `size["width"]`;
3. center crop to `crop_size`, padding with black where the picture is smaller than the crop;
4. rescale the 0-255 values by `rescale_factor` (in float64, then stored as float32);
5. normalize each channel: (value - mean) / std, in float32.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from paratron.errors import DataError

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)
BICUBIC = int(Image.Resampling.BICUBIC)
RESAMPLERS = {int(r): r.name.lower() for r in Image.Resampling}
PROCESSOR_FILE = "processor_config.json"
"""The whole processor's settings; transformers 5 puts its image processor's under "image_processor"."""
IMAGE_PROCESSOR_FILE = "preprocessor_config.json"
"""The image processor's settings alone (the layout of earlier releases)."""
NESTED_KEY = "image_processor"
KINDS = {"CLIPImageProcessor": "clip", "SiglipImageProcessor": "siglip"}
"""Hugging Face's processors whose steps these are (their Pil and Fast twins read the same settings)."""
FIELDS = (
    "do_resize",
    "size",
    "resample",
    "do_center_crop",
    "crop_size",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "image_mean",
    "image_std",
    "do_convert_rgb",
)


@dataclass(frozen=True)
class ImageProcessor:
    """One image -> float32 [3, H, W]; the settings are `preprocessor_config.json`'s."""

    size: dict[str, int]
    """{"shortest_edge": n} or {"height": h, "width": w}."""
    crop_size: dict[str, int] | None = None
    do_resize: bool = True
    resample: int = BICUBIC
    do_center_crop: bool = False
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = HALF
    image_std: tuple[float, float, float] = HALF
    do_convert_rgb: bool = True
    processor_type: str = "SiglipImageProcessor"
    """Hugging Face's class name, written back by `to_dict`."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """Keys of the file that change nothing here (written back unchanged)."""

    def __post_init__(self) -> None:
        _check(self)

    @classmethod
    def clip(cls, image_size: int) -> ImageProcessor:
        """OpenAI CLIP's: shortest edge to `image_size`, center crop to a square, bicubic, CLIP's statistics."""
        square = {"height": image_size, "width": image_size}
        return cls(
            {"shortest_edge": image_size},
            square,
            do_center_crop=True,
            image_mean=OPENAI_CLIP_MEAN,
            image_std=OPENAI_CLIP_STD,
            processor_type="CLIPImageProcessor",
        )

    @classmethod
    def siglip(cls, image_size: int) -> ImageProcessor:
        """SigLIP's: resize to a square (no crop), bicubic, mean = std = 0.5."""
        return cls({"height": image_size, "width": image_size}, processor_type="SiglipImageProcessor")

    @classmethod
    def from_file(cls, path: str | Path) -> ImageProcessor:
        """A model folder's image processor: its `processor_config.json` or `preprocessor_config.json`
        (`settings_file` picks), or either file itself."""
        path = Path(path).expanduser()
        if path.is_dir():
            found = settings_file(path)
            if found is None:
                raise DataError(
                    f"{path}: holds neither {PROCESSOR_FILE} nor {IMAGE_PROCESSOR_FILE}; give the folder or file of "
                    "the model's image processor"
                )
            path = found
        if not path.is_file():
            raise DataError(
                f"{path}: no such file; give a {IMAGE_PROCESSOR_FILE}, a {PROCESSOR_FILE} or the folder holding one"
            )
        config = _read_json(path)
        if isinstance(config, dict) and (NESTED_KEY in config or path.name == PROCESSOR_FILE):
            nested = config.get(NESTED_KEY)
            if not isinstance(nested, dict):
                raise DataError(
                    f"{path}: declares the processor {config.get('processor_class', '(unnamed)')} but holds no image "
                    f'processor settings ("{NESTED_KEY}"), and no {IMAGE_PROCESSOR_FILE} is beside it; give the '
                    f"encoder's {IMAGE_PROCESSOR_FILE} with --image-processor"
                )
            return cls.from_dict(nested, f"{path} ({NESTED_KEY})")
        return cls.from_dict(config, str(path))

    @classmethod
    def from_dict(cls, config: dict[str, Any], where: str = "preprocessor config") -> ImageProcessor:
        """The settings of a parsed `preprocessor_config.json`; missing ones take the defaults of
        the processor it names (CLIP's when it names none)."""
        if not isinstance(config, dict):
            raise DataError(f"{where}: not a JSON object; write the processor's settings as an object")
        named = config.get("image_processor_type", "CLIPImageProcessor")
        kind = str(named).removesuffix("Pil").removesuffix("Fast")  # the same settings, another backend
        if kind not in KINDS:
            raise DataError(
                f"{where}: image_processor_type {kind!r} is not supported; the supported are {', '.join(KINDS)}"
            )
        if config.get("do_pad"):
            raise DataError(f"{where}: do_pad is true, which CLIP and SigLIP processors do not do; set it false")
        base = cls.clip(224) if KINDS[kind] == "clip" else cls.siglip(224)
        values = {f.name: getattr(base, f.name) for f in fields(cls) if f.name in FIELDS}
        for key in FIELDS:
            if key in config:
                values[key] = _field_value(key, config[key], where)
        extra = {k: v for k, v in config.items() if k not in FIELDS and k != "image_processor_type"}
        try:
            return cls(**values, processor_type=str(named), extra=extra)
        except ValueError as exc:
            raise DataError(f"{where}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """The settings as `preprocessor_config.json` writes them."""
        out: dict[str, Any] = dict(self.extra)
        for key in FIELDS:
            value = getattr(self, key)
            out[key] = list(value) if isinstance(value, tuple) else (dict(value) if isinstance(value, dict) else value)
        if not self.do_center_crop and self.crop_size is None:
            del out["do_center_crop"], out["crop_size"]
        out["image_processor_type"] = self.processor_type
        return out

    def save(self, path: str | Path) -> None:
        """Write the settings as json, through a temporary file renamed into place."""
        path = Path(path)
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        temporary.replace(path)

    @property
    def output_size(self) -> tuple[int, int]:
        """(height, width) of every tensor this processor makes."""
        if self.do_center_crop:
            assert self.crop_size is not None
            return self.crop_size["height"], self.crop_size["width"]
        return self.size["height"], self.size["width"]

    def __call__(self, image: Image.Image) -> torch.Tensor:
        """float32 [3, H, W] pixel values of `image`."""
        pixels = self.channels_first(image)
        if self.do_resize:
            pixels = _resize(pixels, self._resized_shape(pixels.shape[1:]), self.resample)
        if self.do_center_crop:
            pixels = _center_crop(pixels, self.output_size)
        if self.do_rescale:
            pixels = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            pixels = pixels if np.issubdtype(pixels.dtype, np.floating) else pixels.astype(np.float32)
            mean = np.asarray(self.image_mean, dtype=pixels.dtype)[:, None, None]
            std = np.asarray(self.image_std, dtype=pixels.dtype)[:, None, None]
            pixels = (pixels - mean) / std
        return torch.from_numpy(np.ascontiguousarray(pixels, dtype=np.float32))

    def channels_first(self, image: Image.Image) -> np.ndarray:
        """uint8 [3, H, W]: the image in RGB (converted when do_convert_rgb says so)."""
        if self.do_convert_rgb:
            image = to_rgb(image)
        elif image.mode != "RGB":
            raise ValueError(f"it is in mode {image.mode}, not RGB, and do_convert_rgb is false; set it true")
        return np.moveaxis(np.asarray(image), -1, 0)

    def _resized_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        if "shortest_edge" not in self.size:
            return self.size["height"], self.size["width"]
        height, width = shape
        short, long = sorted((height, width))
        edge = self.size["shortest_edge"]
        scaled = int(edge * long / short)
        return (scaled, edge) if width <= height else (edge, scaled)


def settings_file(folder: Path) -> Path | None:
    """The file of `folder` that says how its images are processed, in transformers' order: a
    `processor_config.json` with "image_processor" settings, else a `preprocessor_config.json`, else a
    `processor_config.json` without them (which `ImageProcessor.from_file` refuses by name); None when
    the folder declares no processor."""
    whole, alone = folder / PROCESSOR_FILE, folder / IMAGE_PROCESSOR_FILE
    if whole.is_file():
        config = _read_json(whole)
        if isinstance(config, dict) and isinstance(config.get(NESTED_KEY), dict):
            return whole
    if alone.is_file():
        return alone
    return whole if whole.is_file() else None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: not readable JSON ({exc}); fix the file") from None


def to_rgb(image: Image.Image) -> Image.Image:
    """An RGB copy; pixels with transparency are laid over white (not on black, as a plain convert would)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def _resize(pixels: np.ndarray, shape: tuple[int, int], resample: int) -> np.ndarray:
    height, width = shape
    resized = Image.fromarray(np.moveaxis(pixels, 0, -1)).resize((width, height), resample=resample)
    return np.moveaxis(np.asarray(resized), -1, 0)


def _center_crop(pixels: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """The centered `shape` window; a picture smaller than it sits centered on black (rounded down and
    right when the margin is odd)."""
    _, height, width = pixels.shape
    crop_h, crop_w = shape
    pad_h, pad_w = max(0, crop_h - height), max(0, crop_w - width)
    if pad_h or pad_w:
        canvas = np.zeros((pixels.shape[0], height + pad_h, width + pad_w), dtype=pixels.dtype)
        top, left = math.ceil(pad_h / 2), math.ceil(pad_w / 2)
        canvas[:, top : top + height, left : left + width] = pixels
        pixels, height, width = canvas, height + pad_h, width + pad_w
    top, left = (height - crop_h) // 2, (width - crop_w) // 2
    return pixels[:, top : top + crop_h, left : left + crop_w]


def _field_value(key: str, value: Any, where: str) -> Any:
    """One setting of the file, in the form the dataclass holds, or a DataError naming it."""
    if key.startswith("do_"):
        if not isinstance(value, bool):
            raise DataError(f"{where}: {key} is {value!r}; write true or false")
        return value
    if key in ("size", "crop_size"):
        return _size(key, value, where)
    if key == "resample":
        if value not in RESAMPLERS:
            names = ", ".join(f"{code} ({name})" for code, name in RESAMPLERS.items())
            raise DataError(f"{where}: resample is {value!r}; use one of Pillow's filters: {names}")
        return int(value)
    if key == "rescale_factor":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise DataError(f"{where}: rescale_factor is {value!r}; write a number such as 0.00392156862745098")
        return float(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = [value] * 3
    if not (isinstance(value, (list, tuple)) and len(value) == 3 and all(isinstance(v, (int, float)) for v in value)):
        raise DataError(f"{where}: {key} is {value!r}; write three numbers, one per RGB channel")
    return tuple(float(v) for v in value)


def _size(key: str, value: Any, where: str) -> dict[str, int]:
    """`size` / `crop_size`: an int (the shortest edge, or a square crop) or a dict of one form."""
    if isinstance(value, int) and not isinstance(value, bool):
        return {"shortest_edge": value} if key == "size" else {"height": value, "width": value}
    if isinstance(value, dict) and all(isinstance(v, int) and not isinstance(v, bool) for v in value.values()):
        if set(value) == {"height", "width"} or (key == "size" and set(value) == {"shortest_edge"}):
            return dict(value)
    forms = '{"shortest_edge": n} or {"height": h, "width": w}' if key == "size" else '{"height": h, "width": w}'
    raise DataError(f"{where}: {key} is {value!r}; write it as {forms}")


def _check(processor: ImageProcessor) -> None:
    """Settings that could not give every image the same shape, or no image at all (ValueError)."""
    sizes = [processor.size] + ([processor.crop_size] if processor.crop_size is not None else [])
    if any(not isinstance(v, int) or v <= 0 for s in sizes for v in s.values()):
        raise ValueError(f"sizes must be positive integers, not {sizes}")
    if processor.do_center_crop and processor.crop_size is None:
        raise ValueError("do_center_crop is true but no crop_size is given; add crop_size")
    if not processor.do_center_crop and ("shortest_edge" in processor.size or not processor.do_resize):
        raise ValueError(
            "without a center crop the images keep their aspect ratio, so they differ in size; "
            'set do_center_crop with a crop_size, or resize to size {"height": h, "width": w}'
        )
    if processor.resample not in RESAMPLERS:
        raise ValueError(f"resample {processor.resample} is not one of Pillow's filters {sorted(RESAMPLERS)}")
    if processor.do_normalize and any(s == 0 for s in processor.image_std):
        raise ValueError(f"image_std {list(processor.image_std)} has a zero; every channel needs a nonzero std")
