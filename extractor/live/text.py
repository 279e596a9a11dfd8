"""Search by text (issue 59): a phrase encoded by the text tower of the store's model (a CLIP-style model of open_clip
or Hugging Face), matched against an index's features through the joint space: a feature's score is the mean cosine
of the phrase with its top rows' image embeddings (the store's capture of the model's output), or, where the index's
capture is that embedding and its dictionary has a decoder, the cosine with the latent's decoder direction.

The text tower is built as the job built the image tower (the same architecture, weights, checkpoint or seeded
random init) and used only where that build's image tower has the store's weights digest: another model is
refused, never matched.

    >>> search = TextSearch(store)
    >>> found = search.features(ix, "a dog's ear")     # .features, .scores (highest first), .how
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..index import FeatureIndex
from ..model import ROOT, state_dict_hash
from ..read import ActivationStore, NearestRows
from ..spec import ModelSpec, parse_spec
from ..store import get_array
from .model import LiveError

__all__ = ["Found", "TextSearch", "TextTower", "text_tower"]

# extractor's model build seeds a random init with this (extractor.model.build); the image tower's digest is checked
# against the store's, so a build that differs is refused, never used
SEED = 0


@dataclass(frozen=True)
class TextTower:
    """A model's text encoder: phrases -> (n, D) unit vectors of its joint space."""

    encode: Callable[[list[str]], np.ndarray]
    width: int
    source: str


@dataclass(frozen=True)
class Found:
    """Features matched to a phrase, the best first."""

    features: np.ndarray  # (n,) int64
    scores: np.ndarray  # (n,) float32: cosines
    how: str  # "top rows" (their image embeddings' mean cosine) or "decoder" (the latent's decoder direction)


def text_tower(store: ActivationStore) -> TextTower:
    """The text tower of the store's model: open_clip or a Hugging Face CLIP, checked to come with the store's image
    tower."""
    spec = parse_spec(dict(store.spec), source=f"the job recorded in {store.url}").model
    built = {"open_clip": _open_clip, "hf": _hf}.get(spec.source)
    if built is None:
        raise LiveError(f"search by text needs a model with a text tower (open_clip:, or a CLIP of hf:); "
                        f"{store.url} was made by {spec.name or spec.factory}")
    tower, image, source = built(spec)
    digest = state_dict_hash(image)
    if digest != store.model.get("state_dict_sha256"):
        raise LiveError(f"the text tower of {source} comes with an image tower whose weights are not the store's "
                        f"(digest {digest[:12]}, the store's {str(store.model.get('state_dict_sha256'))[:12]}): "
                        "search by text where the job's model (its weights, checkpoint or cache) is")
    return tower


@contextlib.contextmanager
def _seeded() -> Iterator[None]:
    """The random init of a build seeded as extractor's, the hub read from its local cache only (as the job's build:
    unless EXTRACTOR_ALLOW_DOWNLOAD=1)."""
    import huggingface_hub.constants as hub

    was = hub.HF_HUB_OFFLINE
    hub.HF_HUB_OFFLINE = was or not _downloads()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            yield
    finally:
        hub.HF_HUB_OFFLINE = was


def _downloads() -> bool:
    return os.environ.get("EXTRACTOR_ALLOW_DOWNLOAD") == "1"


def _unit(x: torch.Tensor) -> np.ndarray:
    v = x.detach().float().cpu().numpy()
    return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)


def _open_clip(spec: ModelSpec) -> tuple[TextTower, torch.nn.Module, str]:
    """The whole CLIP of ``open_clip:ARCH``, built as extractor built its image tower."""
    import open_clip

    arch, kind = spec.model, spec.weights_kind
    schema = arch.startswith(("hf-hub:", "local-dir:"))
    with _seeded():
        if kind == "file":
            model = open_clip.create_model(arch, pretrained=None, load_weights=False, **spec.kwargs)
            _load(model, str(spec.weights))
        else:
            tag = str(spec.weights) if kind == "name" else None
            model = open_clip.create_model(arch, pretrained=None if schema else tag, load_weights=kind != "random",
                                           **spec.kwargs)
    model.eval()
    tokenizer = open_clip.get_tokenizer(arch)

    def encode(texts: list[str]) -> np.ndarray:
        with torch.inference_mode():
            return _unit(model.encode_text(tokenizer(texts)))

    width = int(encode(["a"]).shape[1])
    return TextTower(encode, width, f"open_clip:{arch}"), model.visual, f"open_clip:{arch}"


def _load(model: torch.nn.Module, path: str) -> None:
    """A checkpoint of the whole CLIP (one of its image tower alone has no text tower)."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict):
        state = next((state[k] for k in ("state_dict", "model") if isinstance(state.get(k), dict)), state)
    try:
        model.load_state_dict(state)
    except (RuntimeError, TypeError, AttributeError) as err:
        raise LiveError(f"{path} is not a checkpoint of the whole CLIP (its text tower is not in it): "
                        f"{str(err).splitlines()[0]}") from None


def _hf(spec: ModelSpec) -> tuple[TextTower, torch.nn.Module, str]:
    """A Hugging Face CLIP's text model with its projection and tokenizer, from the job's folder or hub id."""
    import transformers

    src = spec.model
    local = not _downloads()
    try:
        with _seeded():
            clip = transformers.CLIPModel.from_pretrained(src, local_files_only=local)
        tokenizer = transformers.AutoTokenizer.from_pretrained(src, local_files_only=local)
    except (OSError, ValueError) as err:
        raise LiveError(f"hf:{src} has no CLIP text tower with a tokenizer here ({type(err).__name__}: "
                        f"{str(err).splitlines()[0]})"[:300]) from None
    clip.eval()
    image = torch.nn.Module()  # the image tower as extractor builds it (CLIPVisionModelWithProjection): its keys
    image.vision_model, image.visual_projection = clip.vision_model, clip.visual_projection

    def encode(texts: list[str]) -> np.ndarray:
        with torch.inference_mode():
            out: Any = clip.get_text_features(**tokenizer(texts, padding=True, return_tensors="pt"))
            return _unit(getattr(out, "pooler_output", out))

    width = int(encode(["a"]).shape[1])
    return TextTower(encode, width, f"hf:{src}"), image, f"hf:{src}"


def joint_capture(store: ActivationStore, width: int) -> str:
    """The store's capture of the model's image embedding: its output ((model)), one vector of the text tower's
    width per row."""
    for key, m in store.captures.items():
        if m["layer"] in ("", ROOT) and m["what"] == "output" and [int(v) for v in m["shape"]] == [width]:
            return key
    raise LiveError(f"search by text matches features through their top rows' image embeddings: capture the model's "
                    f"output (layer: (model), reduce: none; {width} features) in the job; {store.url} holds "
                    f"{', '.join(store.captures) or 'none'}")


class TextSearch:
    """A store's text tower and its rows' image embeddings (read once), matched against its indexes."""

    def __init__(self, store: ActivationStore) -> None:
        self.store = store
        self.tower = text_tower(store)
        self.joint = joint_capture(store, self.tower.width)
        self.embeddings = NearestRows(store, self.joint)  # every ok row's embedding, unit length

    def features(self, ix: FeatureIndex, text: str, n: int = 20) -> Found:
        """The ``n`` features of ``ix`` whose score for ``text`` is highest (ties: the lower feature)."""
        phrase = self.tower.encode([text])[0]
        dic = ix.dictionary
        if ix.key == self.joint and dic is not None and dic.w_dec is not None:
            w = dic.w_dec.astype(np.float64)
            scores, how = (w @ phrase) / np.maximum(np.linalg.norm(w, axis=1), 1e-12), "decoder"
        else:
            scores, how = self._top_rows(ix, phrase), "top rows"
        order = np.lexsort((np.arange(len(scores)), -np.nan_to_num(scores, nan=-np.inf)))
        order = order[np.isfinite(scores[order])][:n]
        return Found(order.astype(np.int64), scores[order].astype(np.float32), how)

    def _top_rows(self, ix: FeatureIndex, phrase: np.ndarray) -> np.ndarray:
        """Each feature's mean cosine of ``phrase`` with its top rows' embeddings (NaN: no top row), in float64,
        summed in row order (features of the same top rows score the same: a tie, to the lower feature)."""
        rows = np.sort(np.asarray(get_array(ix.arrays, "top_rows")[:]), axis=1)  # (F, k), -1 empty
        e = self.embeddings
        at = np.searchsorted(e.rows, np.maximum(rows, 0))
        known = (rows >= 0) & (at < len(e.rows)) & (e.rows[np.minimum(at, len(e.rows) - 1)] == rows)
        each = e.vectors.astype(np.float64) @ phrase.astype(np.float64)
        cos = np.where(known, each[np.minimum(at, len(e.rows) - 1)], 0.0)
        counts = known.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(counts > 0, cos.sum(axis=1, dtype=np.float64) / counts, np.nan)
