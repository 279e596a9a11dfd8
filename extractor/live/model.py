"""The store's model, live (issue 59, "run this image"): built again from the store's record of its job, checked to
be the store's own (the preprocessing, the weights' digest, the forward on the probe's fixed input and the captures'
records against the store's: refused on any difference), and run on one image given as bytes as the job ran its
rows (the worker's decoding and preprocessing, its hooked forward), eagerly, in float32 as the job did: its captures
in the store's dtypes, and the model's output scores; again with one of an index's features switched off at its
layer. Nothing is written anywhere: the image, its values and the model stay in this process.

    >>> live = Live(store)                 # builds the model (minutes for a large one), refused if not the store's
    >>> ran = live.run(open("dog.jpg", "rb").read())
    >>> ran.values["blocks.11"]           # (1, 197, 768): as the store's row of this image would hold it
    >>> live.switched_off(ran, ix, 42)    # the model's output scores with latent 42 of ix taken out of its layer
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..compute import Worker, host_array
from ..errors import ExtractorError
from ..index import FeatureIndex
from ..read import ActivationStore
from ..spec import apply_overrides, parse_spec
from ..store import model_differences

__all__ = ["MAX_IMAGE_BYTES", "Live", "LiveError", "Ran"]

log = logging.getLogger(__name__)
MAX_IMAGE_BYTES = 16 << 20  # an image given is at most this many bytes (and data.max_image_pixels pixels decoded)


class LiveError(ExtractorError, ValueError):
    """The store's model cannot be run here as the store's (another model, weights or preprocessing), or an image
    or a feature it cannot take."""


@dataclass(frozen=True)
class Ran:
    """One image through the store's model."""

    pixels: torch.Tensor  # (3, h, w) as the model took it: uint8 levels (or a library processor's float pixels)
    values: dict[str, np.ndarray]  # capture -> (1, *shape) in the store's dtype
    output: np.ndarray | None  # (C,) float32: the model's output scores (None: its output is no vector of scores)


class Live:
    """The store's model built once, its runs one at a time (a lock: the viewer's threads share it)."""

    def __init__(self, store: ActivationStore, device: str = "auto") -> None:
        self.store = store
        raw = apply_overrides(dict(store.spec), [f"model.device={device}"])
        try:
            spec = parse_spec(raw, source=f"the job recorded in {store.url}")
            self.worker = Worker(spec)
        except ExtractorError as err:
            raise LiveError(f"the model of {store.url} cannot be built here: {err}") from None
        self.lock = threading.Lock()
        try:
            self._check()
        except BaseException:
            self.worker.close()
            raise

    def close(self) -> None:
        self.worker.close()

    def _check(self) -> None:
        """Refuse a model built now that is not the store's: other weights, preprocessing, forward or captures."""
        probe = json.loads(json.dumps(self.worker.probe().to_dict()))  # as the store's record gives it back
        problems = model_differences(self.store.attrs, probe)
        if problems:
            raise LiveError(f"the model built now from the job recorded in {self.store.url} is not the one that made "
                            f"it: {'; '.join(problems[:4])}; run images through it where its weights and code are "
                            "the job's")

    def run(self, data: bytes) -> Ran:
        """Image ``data`` (its file's bytes: JPEG, PNG, ...) through the model as the job ran each row."""
        if not isinstance(data, bytes | bytearray) or not data:
            raise LiveError("no image given: send the bytes of an image file")
        if len(data) > MAX_IMAGE_BYTES:
            raise LiveError(f"an image of {len(data):,} bytes: at most {MAX_IMAGE_BYTES:,} are taken")
        try:
            pixels = self.worker.decode.from_bytes(bytes(data))
        except Exception as err:  # noqa: BLE001 - whatever Pillow raises for bytes that are no image it reads
            raise LiveError(f"not an image this reads ({type(err).__name__}: {err})"[:300]) from None
        values, output = self._forward(pixels)
        return Ran(pixels, values, output)

    def _forward(self, pixels: torch.Tensor, edit: Any = None) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
        """One image through the hooked model, eagerly and to its end (the worker stops a job's forward once its
        last capture is taken): its captures on the host, and the model's output; ``edit``: a forward hook's
        registration, undone on every path."""
        w = self.worker
        capturer, keys = w.capturer, set(self.store.captures)
        entry, early = capturer.entry, capturer.stop_early
        kept: dict[str, Any] = {}

        def whole(x: torch.Tensor) -> Any:
            kept["output"] = entry(x)
            return kept["output"]

        labels = np.zeros(1, np.int64) if w.needs_labels else None
        with self.lock, contextlib.ExitStack() as stack:
            capturer.entry, capturer.stop_early = whole, False
            stack.callback(lambda: setattr(capturer, "entry", entry))
            stack.callback(lambda: setattr(capturer, "stop_early", early))
            if edit is not None:
                stack.enter_context(edit())
            out = w._forward(pixels[None], labels, eager=True)
            values = {k: host_array(v.detach().cpu()) for k, v in out.items() if k in keys}
        return values, _scores(kept.get("output"))

    def switched_off(self, ran: Ran, ix: FeatureIndex, f: int) -> np.ndarray | None:
        """The model's output scores for ``ran``'s image with feature ``f`` of index ``ix`` taken out of its layer
        at every position the index covers: a dictionary's latent subtracted (its value there times its decoder
        direction, at the index's scale: the rest of the layer, the SAE's error included, kept), or a channel set
        to 0. None where the model's output is no vector of scores."""
        edit = _Switch(self, ix, f)
        return self._forward(ran.pixels, edit.registered)[1]


class _Switch:
    """One feature of an index taken out of its capture's layer, as a forward hook on that layer."""

    def __init__(self, live: Live, ix: FeatureIndex, f: int) -> None:
        w = live.worker
        target = next((t for t in w.targets if t.key == ix.key), None)
        record: dict[str, Any] = dict(live.store.captures.get(ix.key) or {})
        _check_switch(ix, f, target, record)
        assert target is not None  # checked
        dic = ix.dictionary
        self.module = dict(w.model.named_modules())[target.layer]
        self.ix, self.f, self.dic = ix, int(f), dic
        self.kind: str = ix.layout.kind
        self.skip = int(record.get("drop_prefix") or 0) + ix.layout.skip  # the layer's tokens before those covered
        self.shape = tuple(int(v) for v in record["original_shape"])

    @contextlib.contextmanager
    def registered(self) -> Iterator[None]:
        handle = self.module.register_forward_hook(lambda _m, _a, out: self._edited(out))
        try:
            yield
        finally:
            handle.remove()

    def _edited(self, out: Any) -> Any:
        if not isinstance(out, torch.Tensor) or tuple(out.shape[1:]) != self.shape:
            raise LiveError(f"layer of {self.ix.key} gave {type(out).__name__} {getattr(out, 'shape', '')}, not "
                            f"the {list(self.shape)} the store recorded")
        x = out.detach().float().clone()
        positions = x.flatten(2).transpose(1, 2) if self.kind == "map" else x.reshape(len(x), -1, x.shape[-1])
        covered = positions[:, self.skip :]  # (B, P, D): a view of x, edited in place
        covered -= self._part(covered)
        return x.to(out.dtype)

    def _part(self, x: torch.Tensor) -> torch.Tensor:
        """What feature f contributes at each position of ``x`` (B, P, D)."""
        if self.dic is None:
            part = torch.zeros_like(x)
            part[..., self.f] = x[..., self.f]
            return part
        shift, scale = self.ix.normalization()
        b, p, d = x.shape
        xs = x.reshape(b * p, d)
        if shift is not None:
            xs = xs - torch.as_tensor(shift, device=x.device)
        if scale is not None:
            xs = xs / scale
        z = self.dic.encode_tensor(xs)[:, self.f]  # (B x P,)
        assert self.dic.w_dec is not None  # refused above without a decoder
        direction = torch.as_tensor(self.dic.w_dec[self.f], device=x.device) * (scale or 1.0)
        return (z[:, None] * direction[None, :]).reshape(b, p, d)


def _check_switch(ix: FeatureIndex, f: int, target: Any, record: dict[str, Any]) -> None:
    """Refuse a feature that cannot be taken out of its layer: a capture that is not the layer's output as it gives
    it, a feature the index does not have, a latent without a decoder direction."""
    if target is None or target.what != "output" or target.reduce != "none" or target.index is not None or \
            target.sample or target.project:
        raise LiveError(f"index {ix.name}: switching a feature off needs its capture {ix.key} stored as its layer "
                        "gives it (a module's output, reduce none, not sampled or projected)")
    if ix.layout.kind != "tokens" and list(record.get("original_shape", [])) != list(record.get("shape", [])):
        raise LiveError(f"index {ix.name}: its capture {ix.key} is stored in another layout than its layer gives "
                        f"({record.get('original_shape')} as {record.get('shape')}): a feature cannot be taken out")
    if not 0 <= int(f) < ix.features:
        raise LiveError(f"index {ix.name} has features 0 to {ix.features - 1}, not {f}")
    dic = ix.dictionary
    if dic is not None and dic.w_dec is None:
        raise LiveError(f"the dictionary of {ix.name} has no decoder (W_dec): a latent cannot be taken out")


def _scores(output: Any) -> np.ndarray | None:
    """The model's output as one image's vector of scores (a tensor (1, C), or a ModelOutput's ``logits``)."""
    if not isinstance(output, torch.Tensor):
        output = getattr(output, "logits", None)
    if not isinstance(output, torch.Tensor) or output.ndim != 2 or output.shape[0] != 1 or output.shape[1] < 2:
        return None
    return output[0].detach().float().cpu().numpy()
