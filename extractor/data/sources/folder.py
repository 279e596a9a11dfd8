"""The folder source (``data.root``): images under a local or remote folder, walked in sorted order, labelled
by their class folders."""

from __future__ import annotations

import logging
import os
from array import array
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from ...errors import DataError
from ..files import (
    absolute,
    display_name,
    local_fingerprint,
    remote_error,
    remote_fingerprint,
    storable_path,
)
from ..rows import Joined, Joining, Rows, Strings, distinct, strings

log = logging.getLogger(__name__)


def _list_remote_folder(root: str, extensions: Sequence[str], storage: dict) -> Rows:
    import fsspec

    exts = tuple(e.lower() for e in extensions)
    try:
        fs, base = fsspec.core.url_to_fs(root, **storage)
        infos = fs.find(base, detail=True)  # sizes and ETags come with the listing: the rows' fingerprints
        found = sorted(p for p in infos if p.lower().endswith(exts))
    except Exception as err:  # noqa: BLE001 - every backend raises its own errors
        raise remote_error("data.root", root, err) from err
    base = base.rstrip("/")
    kept = [p for p in found if not any(part.startswith(".") for part in p[len(base) + 1:].split("/"))]  # hidden
    ids = strings(p[len(base) + 1:] for p in kept)
    labels, classes = _folder_labels(ids)
    return Rows(ids=ids, paths=Joined(strings([f"{root.rstrip('/')}/"]), ids), labels=labels, classes=classes,
                fingerprints=np.fromiter((remote_fingerprint(infos[p]) for p in kept), np.uint64, len(kept)))


def _folder_labels(rel: Iterable[str]) -> tuple[np.ndarray, list[str]]:
    """ImageFolder labels: an image's class is its top-level folder. Images directly in the
    root have no class (-1); when others do, a warning names them."""
    codes, tops, firsts = distinct(r.split("/", 1)[0] if "/" in r else "" for r in rel)
    if tops == [""] or not tops:
        return np.full(len(codes), -1, dtype=np.int64), []
    if "" in tops:
        loose = tops.index("")
        log.warning("%d images lie directly in data.root (first: %s), outside the class folders; they get "
                    "no label (-1). Move them into a class folder, or list them in a manifest",
                    int((codes == loose).sum()), rel[firsts[loose]])  # type: ignore[index]
    classes = sorted(str(t) for t in tops if t)
    index = {c: i for i, c in enumerate(classes)}
    return np.asarray([index.get(str(t), -1) for t in tops], dtype=np.int64)[codes], classes


def _list_folder(root: Path, extensions: Sequence[str]) -> Rows:
    if not root.exists():
        raise DataError(f"data.root {root} does not exist; set data.root to a folder of images")
    if not root.is_dir():
        raise DataError(f"data.root {root} is not a folder; for a file list use data.source: manifest")
    exts = tuple(e.lower() for e in extensions)
    top = absolute(str(root))
    ids = Strings()
    paths = Joining([os.path.join(top, "")], ids)  # a relative path is its id: held once
    prints = array("Q")
    seen_dirs: set[str] = set()

    def onerror(err: OSError) -> None:
        log.warning("cannot list %s: %s", err.filename, err.strerror)

    def walk() -> None:
        for dirpath, dirnames, filenames in os.walk(root, onerror=onerror, followlinks=True):
            real = os.path.realpath(dirpath)
            if real in seen_dirs:  # a symlink loop, or a second link to a folder already walked
                log.warning("skipping %s: it leads back to %s, already listed", dirpath, real)
                dirnames[:] = []
                continue
            seen_dirs.add(real)
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))  # .ipynb_checkpoints, .git: not classes
            base = Path(dirpath).relative_to(root)
            for name in sorted(filenames):
                if name.lower().endswith(exts) and not name.startswith("."):
                    rel = (base / name).as_posix()
                    full = os.path.join(top, rel)
                    ids.append(display_name(rel))
                    paths.whole(storable_path(full))  # undecodable names: hex, whole
                    prints.append(local_fingerprint(full))

    walk()
    listed = ids.array()
    labels, classes = _folder_labels(listed)
    return Rows(ids=listed, paths=paths.joined(listed), labels=labels, classes=classes,
                fingerprints=np.frombuffer(prints, dtype=np.uint64) if prints else None)

