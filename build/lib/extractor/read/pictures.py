"""The images of a store's rows as the job saw them (PIL only), for its figures."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL import Image

    from .reader import ActivationStore

__all__ = ["crop_like_job"]


def crop_like_job(item: Any, store: ActivationStore) -> Image.Image:
    """The image as the job saw it: decoded like the job (any path, URL, tar member), resized and
    cropped as its ``preprocess`` record says."""
    from ..data import of_store, open_rgb

    img = open_rgb(item, None, store.spec["data"].get("max_image_pixels"))
    return of_store(store.attrs).geometry(img)
