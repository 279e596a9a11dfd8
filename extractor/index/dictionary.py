"""A dictionary's encoder (a sparse autoencoder's), read from a file without the library that trained it: its
latents are the features of an index (numpy; ``.pt`` files need torch).

Read from ``.safetensors`` (parsed here: no safetensors package needed), ``.npz``, ``.pt``/``.pth`` (a state dict),
or the folder SAELens saves (``cfg.json`` + ``sae_weights.safetensors``; its ``d_in``, ``d_sae``, ``architecture``
or ``activation_fn_str`` with ``activation_fn_kwargs.k``, ``apply_b_dec_to_input``). Tensors: ``W_enc`` (d_in, d_sae),
``b_enc`` (d_sae,), optional ``b_dec`` (d_in,) subtracted from the input first, optional ``threshold`` (d_sae,) of a
JumpReLU; ``encoder.weight`` (d_sae, d_in) and ``encoder.bias`` are read as ``W_enc`` transposed and ``b_enc``; optional
``W_dec`` (d_sae, d_in), or ``decoder.weight`` (d_in, d_sae), the latents' decoder directions (the atlas's
neighbours and map, and switching a latent off in the viewer).

    pre = (x - b_dec) @ W_enc + b_enc
    relu:      max(pre, 0)
    jumprelu:  pre where pre > threshold, else 0
    topk:K     the K largest of pre per token, each max(., 0); the others 0
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ExtractorError

__all__ = ["Dictionary", "DictionaryError", "file_digest", "load_dictionary"]

SAELENS_CONFIG, SAELENS_WEIGHTS = "cfg.json", "sae_weights.safetensors"
_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32}


class DictionaryError(ExtractorError, ValueError):
    """A dictionary file that cannot be read, or does not fit the capture it is applied to."""


@dataclass(frozen=True)
class Dictionary:
    """An SAE encoder: ``encode(x (n, d_in)) -> (n, d_sae)`` in float32."""

    w_enc: np.ndarray  # (d_in, d_sae) float32
    b_enc: np.ndarray  # (d_sae,)
    b_dec: np.ndarray | None  # (d_in,), subtracted from the input first; None: nothing
    threshold: np.ndarray | None  # (d_sae,) of jumprelu
    activation: str  # relu | jumprelu | topk:K
    path: str
    digest: str  # "sha256:..." of the file(s) it was read from
    w_dec: np.ndarray | None = None  # (d_sae, d_in) float32: each latent's decoder direction; None: not in the file

    @property
    def d_in(self) -> int:
        return int(self.w_enc.shape[0])

    @property
    def d_sae(self) -> int:
        return int(self.w_enc.shape[1])

    @property
    def stem(self) -> str:
        """The name an index over it takes after ``KEY@``: the file's stem (a SAELens folder's name)."""
        p = Path(self.path)
        return p.name if p.is_dir() else p.stem

    def record(self) -> dict[str, Any]:
        """What an index records of it."""
        return {"path": self.path, "digest": self.digest, "activation": self.activation, "d_in": self.d_in,
                "d_sae": self.d_sae}

    def check_input(self, width: int, what: str) -> None:
        if width != self.d_in:
            raise DictionaryError(f"dictionary {self.path} encodes inputs of width d_in {self.d_in} (W_enc "
                                  f"{list(self.w_enc.shape)}), but {what} has {width} features per position")

    def encode(self, x: Any) -> Any:
        """The latents of ``x`` (n, d_in): (n, d_sae) float32; computed by torch where it is installed (its matmul
        is the bare loop's), else by numpy. A torch tensor gives a tensor, on its device (:meth:`encode_tensor`)."""
        if not isinstance(x, np.ndarray) and _torch() is not None and isinstance(x, _torch().Tensor):
            return self.encode_tensor(x)
        x = np.asarray(x)
        if x.ndim != 2 or x.shape[1] != self.d_in:
            raise DictionaryError(f"encode needs (n, {self.d_in}) inputs, not {list(x.shape)}")
        torch = _torch()
        if torch is not None:
            return self.encode_tensor(torch.from_numpy(x if x.flags.writeable else x.copy())).numpy()
        x = x.astype(np.float32, copy=False)
        if self.b_dec is not None:
            x = x - self.b_dec
        pre = x @ self.w_enc
        pre += self.b_enc
        if self.activation == "relu":
            return np.maximum(pre, 0, out=pre)
        if self.activation == "jumprelu":
            pre[pre <= self.threshold] = 0
            return pre
        k = self.topk
        if k >= self.d_sae:
            return np.maximum(pre, 0, out=pre)
        top = np.argpartition(pre, self.d_sae - k, axis=1)[:, self.d_sae - k:]
        out = np.zeros_like(pre)
        np.put_along_axis(out, top, np.maximum(np.take_along_axis(pre, top, axis=1), 0), axis=1)
        return out

    @property
    def topk(self) -> int:
        return int(self.activation.split(":")[1]) if self.activation.startswith("topk:") else self.d_sae

    def encode_tensor(self, x: Any) -> Any:
        """The latents of a torch tensor ``x`` (n, d_in), any float dtype, on its device: (n, d_sae) float32 there
        (the one torch encoder: the host's ``encode`` and the write-time index on the device both call it)."""
        torch = _torch()
        if x.ndim != 2 or x.shape[1] != self.d_in:
            raise DictionaryError(f"encode needs (n, {self.d_in}) inputs, not {list(x.shape)}")
        w, b, b_dec, threshold = self._tensors(x.device)
        with torch.inference_mode():
            t = x.float()
            if b_dec is not None:
                t = t - b_dec
            pre = torch.addmm(b, t, w)
            if self.activation == "relu":
                pre.clamp_(min=0)
            elif self.activation == "jumprelu":
                pre.masked_fill_(pre <= threshold, 0)
            elif self.topk < self.d_sae:
                top = torch.topk(pre, self.topk, dim=1)
                pre = torch.zeros_like(pre).scatter_(1, top.indices, top.values.clamp(min=0))
            else:
                pre.clamp_(min=0)
            return pre

    def _tensors(self, device: Any) -> tuple[Any, Any, Any, Any]:
        """The weights as torch tensors on ``device``, made once per device."""
        cache = self.__dict__.setdefault("_torch_tensors", {})
        if device not in cache:
            torch = _torch()
            cache[device] = tuple(None if a is None else torch.from_numpy(np.array(a, np.float32)).to(device)
                                  for a in (self.w_enc, self.b_enc, self.b_dec, self.threshold))  # writable copies
        return cache[device]


@functools.cache
def _torch() -> Any:
    """torch, when installed (the reader never needs it)."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def file_digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return f"sha256:{h.hexdigest()}"


def load_dictionary(path: str | Path, activation: str | None = None) -> Dictionary:
    """The encoder in ``path`` (see the module's doc); ``activation`` overrides what the file says (else SAELens's
    cfg, else jumprelu when it holds a threshold, else relu)."""
    p = Path(path)
    if p.is_dir() or (p.name in (SAELENS_CONFIG, SAELENS_WEIGHTS) and (p.parent / SAELENS_CONFIG).is_file()):
        return _saelens(p if p.is_dir() else p.parent, activation)
    if not p.is_file():
        raise DictionaryError(f"no dictionary file at {path}")
    suffix = p.suffix.lower()
    if suffix == ".safetensors":
        tensors = read_safetensors(p)
    elif suffix == ".npz":
        tensors = _npz(p)
    elif suffix in (".pt", ".pth"):
        tensors = _torch_tensors(p)
    else:
        raise DictionaryError(f"{path}: not a dictionary file this reads (.safetensors, .npz, .pt, or a SAELens folder "
                              f"with {SAELENS_CONFIG} and {SAELENS_WEIGHTS})")
    return _build(tensors, activation, str(p.resolve()), file_digest([p]), {})


def _saelens(folder: Path, activation: str | None) -> Dictionary:
    """A folder as SAELens saves an SAE."""
    cfg_path, weights = folder / SAELENS_CONFIG, folder / SAELENS_WEIGHTS
    if not cfg_path.is_file() or not weights.is_file():
        raise DictionaryError(f"{folder}: a SAELens folder holds {SAELENS_CONFIG} and {SAELENS_WEIGHTS}; "
                              f"found {sorted(x.name for x in folder.iterdir())[:8]}")
    try:
        cfg = json.loads(cfg_path.read_text())
    except ValueError as err:
        raise DictionaryError(f"{cfg_path}: not JSON ({err})") from None
    if not isinstance(cfg, dict):
        raise DictionaryError(f"{cfg_path}: a SAELens cfg is a JSON object of settings, not a {type(cfg).__name__}")
    return _build(read_safetensors(weights), activation, str(folder.resolve()), file_digest([cfg_path, weights]),
                  cfg)


def _cfg_activation(cfg: dict[str, Any]) -> str | None:
    """The activation a SAELens cfg names (None: it names none)."""
    arch = str(cfg.get("architecture") or "").lower()
    fn = str(cfg.get("activation_fn_str") or cfg.get("activation_fn") or "").lower()
    k = cfg.get("k") or (cfg.get("activation_fn_kwargs") or {}).get("k")
    if arch == "gated":
        raise DictionaryError("a gated SAE (architecture: gated) is not supported: its encoder has two paths")
    if arch == "jumprelu":
        return "jumprelu"
    if arch == "topk" or fn == "topk":
        if not k:
            raise DictionaryError("a topk SAE whose cfg names no k (activation_fn_kwargs.k)")
        return f"topk:{int(k)}"
    if fn in ("relu", ""):
        return "relu" if fn else None  # none named: jumprelu when it holds a threshold, else relu
    raise DictionaryError(f"activation {fn!r} of the SAELens cfg is not supported (relu, topk, jumprelu)")


def _check_activation(activation: str, threshold: np.ndarray | None, where: str) -> str:
    if activation == "relu" or (activation == "jumprelu" and threshold is not None):
        return activation
    if activation == "jumprelu":
        raise DictionaryError(f"{where}: activation jumprelu needs a 'threshold' tensor (d_sae,); the file has none")
    name, _, k = activation.partition(":")
    if name == "topk" and k.isdigit() and int(k) > 0:
        return activation
    raise DictionaryError(f"{where}: activation must be relu, jumprelu or topk:K, not {activation!r}")


def _build(tensors: dict[str, np.ndarray], activation: str | None, where: str, digest: str,
           cfg: dict[str, Any]) -> Dictionary:
    _check_finite(tensors, where)
    w, b = _encoder(dict(tensors), where)
    _check_cfg(cfg, w, where)
    b_dec = _b_dec(tensors, cfg, w, where)
    threshold = _threshold(tensors, w.shape[1], where)
    chosen = activation or _cfg_activation(cfg) or ("jumprelu" if threshold is not None else "relu")
    return Dictionary(w, b, b_dec, threshold, _check_activation(chosen, threshold, where), where, digest,
                      _decoder(tensors, w, where))


# the tensors read (as the file names them); a NaN or an infinity in any makes every latent NaN or 0, or every
# decoder direction meaningless
_READ = ("W_enc", "b_enc", "encoder.weight", "encoder.bias", "b_dec", "threshold", "log_threshold", "W_dec",
         "decoder.weight")


def _decoder(t: Mapping[str, np.ndarray], w: np.ndarray, where: str) -> np.ndarray | None:
    """The decoder directions (d_sae, d_in) float32: ``W_dec``, or ``decoder.weight`` (d_in, d_sae) transposed;
    None where the file has neither."""
    if "W_dec" in t:
        w_dec, name = np.asarray(t["W_dec"], np.float32), "W_dec"
    elif "decoder.weight" in t:
        w_dec, name = np.asarray(t["decoder.weight"], np.float32).T, "decoder.weight transposed"
    else:
        return None
    d_in, d_sae = w.shape
    if w_dec.shape != (d_sae, d_in):
        raise DictionaryError(f"{where}: {name} {list(w_dec.shape)} does not fit W_enc {list(w.shape)}: the decoder "
                              f"is (d_sae, d_in) = ({d_sae}, {d_in})")
    return np.ascontiguousarray(w_dec)


def _check_finite(t: Mapping[str, np.ndarray], where: str) -> None:
    """Refuse a tensor the encoder reads that holds a NaN or an infinity (an all-NaN SAE, a diverged run): its
    latents would be NaN, or nothing, everywhere: an index of nothing that looks made."""
    for name in _READ:
        if name in t:
            values = np.asarray(t[name]).reshape(-1)
            bad = _nonfinite(values)
            if bad:
                raise DictionaryError(f"{where}: tensor {name} {list(np.shape(t[name]))} holds {bad} NaN or infinite "
                                      f"values (of {values.size}): these are not an encoder's weights; check the "
                                      "file, or save it again from a run that did not diverge")


def _nonfinite(values: np.ndarray, block: int = 1 << 24) -> int:
    """How many of ``values`` (flat) are NaN or infinite, counted a block at a time (an encoder of a billion
    weights needs no billion-byte mask)."""
    return sum(int(np.count_nonzero(~np.isfinite(values[a : a + block]))) for a in range(0, values.size, block))


def _encoder(t: dict[str, np.ndarray], where: str) -> tuple[np.ndarray, np.ndarray]:
    """``W_enc`` (d_in, d_sae) and ``b_enc`` (d_sae,) float32 (``encoder.weight``/``.bias`` as a Linear holds them)."""
    if "W_enc" not in t and "encoder.weight" in t:
        t["W_enc"] = np.asarray(t.pop("encoder.weight")).T
        if "encoder.bias" in t:
            t["b_enc"] = t.pop("encoder.bias")
    if "W_enc" not in t:
        raise DictionaryError(f"{where}: no encoder weights W_enc (or encoder.weight) among its tensors "
                              f"{sorted(t)[:10]}")
    w = np.asarray(t["W_enc"], np.float32)
    b = np.asarray(t.get("b_enc", np.zeros(w.shape[-1] if w.ndim == 2 else 0)), np.float32)
    if w.ndim != 2 or b.shape != (w.shape[1],):
        raise DictionaryError(f"{where}: W_enc {list(w.shape)} and b_enc {list(b.shape)} do not fit: W_enc must be "
                              "(d_in, d_sae) and b_enc (d_sae,)")
    return w, b


def _check_cfg(cfg: dict[str, Any], w: np.ndarray, where: str) -> None:
    """A SAELens cfg that says other widths than the weights have, or a normalisation this cannot apply: refused."""
    for key, want in (("d_in", w.shape[0]), ("d_sae", w.shape[1])):
        if key in cfg and not (isinstance(cfg[key], int) and not isinstance(cfg[key], bool)):
            raise DictionaryError(f"{where}: cfg.json's {key} must be a whole number, not {cfg[key]!r}")
        if key in cfg and cfg[key] != want:
            raise DictionaryError(f"{where}: cfg.json says {key} {cfg[key]}, but W_enc is {list(w.shape)} "
                                  "(d_in, d_sae)")
    norm = str(cfg.get("normalize_activations") or "none")
    if norm != "none":
        raise DictionaryError(f"{where}: normalize_activations {norm!r} scales inputs by a factor the SAE does not "
                              "store; only 'none' is read")


def _b_dec(t: Mapping[str, np.ndarray], cfg: dict[str, Any], w: np.ndarray, where: str) -> np.ndarray | None:
    """``b_dec``, subtracted from the input first (unless the cfg says ``apply_b_dec_to_input: false``)."""
    if "b_dec" not in t or not cfg.get("apply_b_dec_to_input", True):
        return None
    b_dec = np.asarray(t["b_dec"], np.float32)
    if b_dec.shape != (w.shape[0],):
        raise DictionaryError(f"{where}: b_dec {list(b_dec.shape)} does not fit W_enc {list(w.shape)}: it must be "
                              f"({w.shape[0]},)")
    return b_dec


def _threshold(t: Mapping[str, np.ndarray], d_sae: int, where: str) -> np.ndarray | None:
    """A JumpReLU's threshold per latent (``threshold``, or ``log_threshold``; one for all), or None."""
    threshold = t.get("threshold")
    if threshold is None and "log_threshold" in t:
        threshold = np.exp(np.asarray(t["log_threshold"], np.float64))
    if threshold is None:
        return None
    threshold = np.asarray(threshold, np.float32)
    if threshold.size != 1 and threshold.shape != (d_sae,):
        raise DictionaryError(f"{where}: threshold {list(threshold.shape)} does not fit d_sae {d_sae}: it must be "
                              f"({d_sae},) or one value")
    return np.broadcast_to(threshold.reshape(-1)[:1] if threshold.size == 1 else threshold, (d_sae,)).copy()


def _npz(path: Path) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` file."""
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise DictionaryError(f"{path}: not an .npz file of arrays ({type(err).__name__}: {err})"[:300]) from None


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The tensors of a ``.safetensors`` file (8 bytes of header length, a JSON header, the data), by numpy."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 << 20:
                raise ValueError(f"header of {n} bytes")
            header = json.loads(f.read(n))
            data = f.read()
    except (OSError, ValueError, struct.error) as err:
        raise DictionaryError(f"{path}: not a safetensors file ({err})") from None
    if not isinstance(header, dict):
        raise DictionaryError(f"{path}: not a safetensors file (its header is not a JSON object)")
    try:
        return {str(name): _safetensor(data, name, info, path) for name, info in header.items()
                if name != "__metadata__"}
    except (TypeError, KeyError, ValueError) as err:  # a header that does not describe the data (cut short)
        if isinstance(err, DictionaryError):
            raise
        raise DictionaryError(f"{path}: not a safetensors file ({type(err).__name__}: {err})"[:300]) from None


def _safetensor(data: bytes, name: str, info: Any, path: Path) -> np.ndarray:
    """One tensor of a safetensors file's ``data``, as its header entry ``info`` describes it."""
    dtype = info["dtype"]
    a, b = (int(x) for x in info["data_offsets"])
    if not 0 <= a <= b <= len(data):
        raise ValueError(f"tensor {name} lies at bytes {a} to {b} of {len(data)}: the file is cut short")
    if dtype == "BF16":
        arr = (np.frombuffer(data[a:b], "<u2").astype(np.uint32) << 16).view(np.float32)  # bfloat16's bits
    elif dtype in _SAFETENSORS_DTYPES:
        arr = np.frombuffer(data[a:b], np.dtype(_SAFETENSORS_DTYPES[dtype]).newbyteorder("<"))
    else:
        raise DictionaryError(f"{path}: tensor {name} has dtype {dtype}, which this does not read")
    return arr.reshape([int(x) for x in info["shape"]])


def _torch_tensors(path: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise DictionaryError(f"{path}: a .pt file is read with torch, which is not installed; save it as "
                              ".safetensors or .npz") from None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - whatever torch raises for a file it cannot read
        raise DictionaryError(f"{path}: not a torch state dict ({type(err).__name__}: {err})"[:300]) from None
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise DictionaryError(f"{path}: holds a {type(obj).__name__}, not a dict of tensors")
    return {str(k): v.detach().float().numpy() for k, v in obj.items() if isinstance(v, torch.Tensor)}


_CACHE: dict[tuple[str, str], Dictionary] = {}


def cached_dictionary(path: str, activation: str, digest: str) -> Dictionary:
    """The dictionary at ``path``, read once per process (a job's shards share it); refused when the file is not
    the one the job recorded (``digest``)."""
    key = (path, activation)
    if key not in _CACHE:
        dic = load_dictionary(path, activation)
        if dic.digest != digest:
            raise DictionaryError(f"dictionary {path} changed since the job recorded it (digest {digest}, now "
                                  f"{dic.digest}); run the job again with --overwrite, or put the file back")
        if len(_CACHE) >= 4:  # a job's few dictionaries at a time
            _CACHE.clear()
        _CACHE[key] = dic
    return _CACHE[key]
