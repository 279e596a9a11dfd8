"""WebDataset-style tar shards: brace patterns, planning rows from tar headers.

A sample is the group of members sharing a key (the member path up to the first dot of its
file name); its image is the member with an image extension, its label the content of a
``.cls`` member (an integer or a class name) or the ``label`` field of a ``.json`` member.
Planning reads only headers (and the small label members), in parallel over tars, so rows
are known and deterministic before any image is decoded; each row records its image's
byte offset and size so workers read just those bytes.

A row's stored path is ``TAR_URL#MEMBER``. Both parts may contain ``#`` (a folder
``run#1``, a member ``a#1.jpg``), so the tar URL is the part before the first ``#`` at
which an existing file ends (:func:`tar_url_of`); listing refuses a tar whose path would
make that ambiguous. Local tar paths are stored absolute.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import tarfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .errors import DataError
from .sources import Rows, _remote_error, absolute, is_url, labels_of

__all__ = ["expand_braces", "list_tars", "scan_tar", "tar_url_of"]

log = logging.getLogger(__name__)

_BRACE = re.compile(r"\{(\d+)\.\.(\d+)\}|\{([^{}]*,[^{}]*)\}")


def expand_braces(pattern: str) -> list[str]:
    """``a-{000..002}.tar`` -> a-000.tar, a-001.tar, a-002.tar; ``{x,y}`` alternatives too."""
    m = _BRACE.search(pattern)
    if m is None:
        return [pattern]
    if m.group(3) is not None:
        options = m.group(3).split(",")
    else:
        lo, hi = m.group(1), m.group(2)
        width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
        step = 1 if int(hi) >= int(lo) else -1
        options = [str(i).zfill(width) for i in range(int(lo), int(hi) + step, step)]
    head, tail = pattern[: m.start()], pattern[m.end():]
    return list(itertools.chain.from_iterable(expand_braces(head + o + tail) for o in options))


_IS_FILE: dict[tuple[str, str], bool] = {}  # (URL, storage options) -> is a file: remote answers, per process


def _is_file(url: str, storage_options: dict[str, Any]) -> bool:
    if not is_url(url):
        return os.path.isfile(url.removeprefix("file://"))
    key = (url, repr(sorted(storage_options.items())))
    if key not in _IS_FILE:
        import fsspec

        fs, p = fsspec.core.url_to_fs(url, **storage_options)
        try:
            _IS_FILE[key] = bool(fs.isfile(p))
        except FileNotFoundError:  # a missing bucket; other errors (credentials, network) are the row's error
            _IS_FILE[key] = False
    return _IS_FILE[key]


def tar_url_of(path: str, storage_options: dict[str, Any] | None = None) -> str:
    """The tar URL of a stored row path ``TAR_URL#MEMBER``.

    With one ``#`` that is where the URL ends. With several (``#`` in a folder name or a
    member name), it is the first ``#`` before which an existing file ends: listing refused
    tars with a file at an earlier ``#`` (:func:`_check_unambiguous`), so this is the tar.
    Raises FileNotFoundError, naming the whole path, when no prefix is a file.
    """
    if path.count("#") <= 1:
        return path.split("#", 1)[0]
    for i, c in enumerate(path):
        if c == "#" and _is_file(path[:i], storage_options or {}):
            return path[:i]
    raise FileNotFoundError(f"no tar shard found for {path} (no part of it before a '#' is a file)")


def _check_unambiguous(url: str, storage_options: dict[str, Any]) -> None:
    """Refuse a tar whose path has a file at one of its own ``#``: its rows could not be read back."""
    for i, c in enumerate(url):
        if c == "#" and _is_file(url[:i], storage_options):
            raise DataError(
                f"tar shard {url}: {url[:i]} is a file too, so rows stored as TAR#MEMBER would read it "
                "instead; rename the folder or the file so that no part of the tar's path before a '#' is a file"
            )


def _key_and_ext(name: str) -> tuple[str, str]:
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    return (name, "") if dot < 0 else (name[:dot], name[dot:].lower())


def scan_tar(url: str, extensions: Sequence[str], storage_options: dict[str, Any]) -> list[dict[str, Any]]:
    """One record per sample with an image: key, member, offset, size, raw label."""
    exts = tuple(e.lower() for e in extensions)
    samples: dict[str, dict[str, Any]] = {}
    order: list[str] = []
    try:
        if is_url(url):
            import fsspec

            fobj = fsspec.open(url, "rb", **storage_options).open()
        else:
            fobj = open(url.removeprefix("file://"), "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        raise DataError(f"tar shard {url} does not exist") from None
    except Exception as err:  # noqa: BLE001 - every backend raises its own errors
        raise _remote_error("tar shard", url, err) from err
    try:
        with tarfile.open(fileobj=fobj, mode="r:") as tar:
            for member in _members(tar, url):
                if not member.isfile():
                    continue
                key, ext = _key_and_ext(member.name)
                if key not in samples:
                    samples[key] = {"key": key}
                    order.append(key)
                rec = samples[key]
                if ext.endswith(exts) and "member" not in rec:
                    rec.update(member=member.name, offset=member.offset_data, size=member.size)
                elif ext in (".cls", ".json") and member.size < 1 << 20:
                    f = tar.extractfile(member)
                    text = f.read().decode("utf-8", "replace").strip() if f else ""
                    if ext == ".cls":
                        rec["label"] = text
                    else:
                        try:
                            meta = json.loads(text)
                        except json.JSONDecodeError:
                            meta = {}
                        if isinstance(meta, dict) and "label" in meta and "label" not in rec:
                            rec["label"] = meta["label"]
    except tarfile.TarError as err:
        raise DataError(f"tar shard {url} is not a readable tar file ({type(err).__name__}: {err})") from None
    except DataError:
        raise
    except Exception as err:  # noqa: BLE001
        raise _remote_error("tar shard", url, err) from err
    finally:
        fobj.close()
    records = [samples[k] for k in order if "member" in samples[k]]
    if not records:
        names = ", ".join(order[:5]) or "no members"
        raise DataError(f"tar shard {url} holds no image members (keys: {names}); check data.extensions")
    return records


def _members(tar: tarfile.TarFile, url: str):  # -> Iterator[tarfile.TarInfo]
    """The members of a tar; a tar cut short ends the listing (its last rows then fail on read)."""
    count = 0
    while True:
        try:
            member = tar.next()
        except tarfile.ReadError as err:
            if count == 0:
                raise
            log.warning("tar shard %s ends early after %d members (%s): truncated?", url, count, err)
            return
        if member is None:
            return
        count += 1
        yield member


def list_tars(patterns: str | Sequence[str] | None, extensions: Sequence[str], so: dict[str, Any]) -> Rows:
    """Rows of every sample of every tar, in pattern order then member order."""
    pats = [patterns] if isinstance(patterns, str) else list(patterns or [])
    urls = [absolute(u) for p in pats for u in expand_braces(p)]
    if not urls:
        raise DataError("data.tars names no tar shards")
    for url in urls:
        if "#" in url:
            _check_unambiguous(url, so)
    with ThreadPoolExecutor(min(16, len(urls))) as pool:
        scanned = list(pool.map(lambda u: scan_tar(u, extensions, so), urls))
    ids, paths, offsets, sizes, raw, where = [], [], [], [], [], []
    seen: dict[str, str] = {}
    for url, records in zip(urls, scanned, strict=True):
        for r in records:
            if r["key"] in seen:
                raise DataError(f"sample key {r['key']!r} appears in {seen[r['key']]} and {url}; keys must be unique")
            seen[r["key"]] = url
            ids.append(r["key"])
            paths.append(f"{url}#{r['member']}")
            offsets.append(int(r["offset"]))
            sizes.append(int(r["size"]))
            raw.append(r.get("label"))
            where.append(f"tar shard {url}, sample {r['key']!r}")
    labels, classes = labels_of(raw, where.__getitem__)
    return Rows(ids=ids, paths=paths, labels=labels, classes=classes, offsets=offsets, sizes=sizes)
