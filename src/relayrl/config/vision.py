"""The vision section: images in the data and what of a vision-language policy trains (``relayrl.models.vision``)."""

from __future__ import annotations

from pydantic import Field

from relayrl.config.base import _Section


class VisionCfg(_Section):
    """Vision-language policies (model.path a model with a vision tower) and image data."""

    image_field: str | None = Field(
        "images", description="Row field with the prompt's images: a list (or one) of file paths relative to the data "
        "file, data:image URLs, or bytes (Parquet; a datasets Image feature). Each goes where the prompt has an "
        "<image> marker or an image content part ({'type': 'image'}), in order; unmarked, before the first user "
        "message's text. Checked when the data is read (a missing or unreadable image names its row and field). "
        "null: rows have no images.")
    train_tower: bool = Field(
        False, description="Train the vision tower and its connector too (false: frozen, as prime-rl's default; the "
        "language model trains, and an image is encoded without a graph).")
