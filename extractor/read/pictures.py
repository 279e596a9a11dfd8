"""Helpers shared by the pictures of a store (:mod:`.analysis` and :mod:`.show`; PIL only)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL import Image, ImageDraw

    from .reader import ActivationStore

__all__ = ["crop_like_job", "fit_text"]


def crop_like_job(item: Any, store: ActivationStore) -> Image.Image:
    """The image as the job saw it: decoded like the job (any path, URL, tar member), resized and
    cropped as its ``preprocess`` record says."""
    from ..data import of_store, open_rgb

    img = open_rgb(item, None, store.spec["data"].get("max_image_pixels"))
    return of_store(store.attrs).geometry(img)


def fit_text(draw: ImageDraw.ImageDraw, text: str, width: float) -> str:
    """``text`` cut to ``width`` pixels, so that the captions of neighbouring cells never overlap."""
    if draw.textlength(text) <= width:
        return text
    while text and draw.textlength(text + "..") > width:
        text = text[:-1]
    return text + ".." if text else ""
