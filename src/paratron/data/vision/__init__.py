"""Images for vision-language training: Hugging Face's CLIP and SigLIP pixel preprocessing,
Megatron-LM's dynamic-resolution tiling, LLaVA's files and the messages form with image parts,
webdataset shards and Megatron-Energon folders, and image-text samples (with their pixels) for the loader."""

from paratron.data.vision.dataset import VisionSample, VisionSFTDataset, image_tokens_end
from paratron.data.vision.energon import energon_folder, read_energon
from paratron.data.vision.images import ImageRef, ImageSettings, image_ref, load_images, load_pixels
from paratron.data.vision.llava import (
    PLACEHOLDER,
    VisionConversation,
    VisionRecord,
    image_token,
    iter_vision_file,
    read_samples,
    read_vision_file,
    read_vision_records,
    record_of,
    tokenize_vision_record,
    tokenize_with_images,
)
from paratron.data.vision.mock import MockVisionSamples
from paratron.data.vision.processor import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ImageProcessor, to_rgb
from paratron.data.vision.shards import CAPTION_INSTRUCTION, expand_braces, is_shard_source, read_shards
from paratron.data.vision.tiling import (
    ImageTiling,
    candidate_grids,
    image_tensors,
    tile_count,
    tile_grid,
    tile_pictures,
)

__all__ = [
    "CAPTION_INSTRUCTION",
    "OPENAI_CLIP_MEAN",
    "OPENAI_CLIP_STD",
    "PLACEHOLDER",
    "ImageProcessor",
    "ImageRef",
    "ImageSettings",
    "ImageTiling",
    "MockVisionSamples",
    "VisionConversation",
    "VisionRecord",
    "VisionSFTDataset",
    "VisionSample",
    "candidate_grids",
    "energon_folder",
    "expand_braces",
    "image_ref",
    "image_tensors",
    "image_token",
    "image_tokens_end",
    "is_shard_source",
    "iter_vision_file",
    "load_images",
    "load_pixels",
    "read_energon",
    "read_samples",
    "read_shards",
    "read_vision_file",
    "read_vision_records",
    "record_of",
    "tile_count",
    "tile_grid",
    "tile_pictures",
    "to_rgb",
    "tokenize_vision_record",
    "tokenize_with_images",
]
