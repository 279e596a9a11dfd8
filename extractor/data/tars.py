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
import re
import tarfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import DataError
from .files import (
    absolute,
    check_unambiguous,
    fingerprint,
    is_url,
    local_fingerprint,
    remote_error,
    remote_fingerprint,
    tar_url_of,
)
from .rows import Rows, labels_of

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


def _key_and_ext(name: str) -> tuple[str, str]:
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    return (name, "") if dot < 0 else (name[:dot], name[dot:].lower())


def scan_tar(url: str, extensions: Sequence[str], storage_options: dict[str, Any]) -> list[dict[str, Any]]:
    """One record per sample with an image: key, member, offset, size, raw label."""
    exts = tuple(e.lower() for e in extensions)
    samples: dict[str, dict[str, Any]] = {}  # by key, in the order of their first member
    fobj = _open_tar(url, storage_options)
    try:
        with tarfile.open(fileobj=fobj, mode="r:") as tar:
            for member in _members(tar, url):
                if not member.isfile():
                    continue
                key, ext = _key_and_ext(member.name)
                rec = samples.setdefault(key, {"key": key})
                if ext.endswith(exts) and "member" not in rec:
                    rec.update(member=member.name, offset=member.offset_data, size=member.size)
                elif ext in (".cls", ".json") and member.size < 1 << 20:
                    _read_label(tar, member, ext, rec)
    except tarfile.TarError as err:
        raise DataError(f"tar shard {url} is not a readable tar file ({type(err).__name__}: {err})") from None
    except DataError:
        raise
    except Exception as err:  # noqa: BLE001
        raise remote_error("tar shard", url, err) from err
    finally:
        fobj.close()
    records = [rec for rec in samples.values() if "member" in rec]
    if not records:
        names = ", ".join(list(samples)[:5]) or "no members"
        raise DataError(f"tar shard {url} holds no image members (keys: {names}); check data.extensions")
    return records


def _open_tar(url: str, storage_options: dict[str, Any]) -> Any:
    """The tar's file object, local or remote; a missing or unreadable one is a DataError."""
    try:
        if is_url(url):
            import fsspec

            return fsspec.open(url, "rb", **storage_options).open()
        return open(url.removeprefix("file://"), "rb")  # noqa: SIM115 - the caller closes it
    except FileNotFoundError:
        raise DataError(f"tar shard {url} does not exist") from None
    except Exception as err:  # noqa: BLE001 - every backend raises its own errors
        raise remote_error("tar shard", url, err) from err


def _read_label(tar: tarfile.TarFile, member: tarfile.TarInfo, ext: str, rec: dict[str, Any]) -> None:
    """A sample's label from its ``.cls`` member (the text), or its ``.json`` member's ``label``
    field when no label was found before."""
    f = tar.extractfile(member)
    text = f.read().decode("utf-8", "replace").strip() if f else ""
    if ext == ".cls":
        rec["label"] = text
        return
    try:
        meta = json.loads(text)
    except json.JSONDecodeError:
        meta = {}
    if isinstance(meta, dict) and "label" in meta and "label" not in rec:
        rec["label"] = meta["label"]


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


def list_tars(patterns: str | Sequence[str] | None, extensions: Sequence[str], storage: dict[str, Any]) -> Rows:
    """Rows of every sample of every tar, in pattern order then member order."""
    pats = [patterns] if isinstance(patterns, str) else list(patterns or [])
    urls = [absolute(u) for p in pats for u in expand_braces(p)]
    if not urls:
        raise DataError("data.tars names no tar shards")
    for url in urls:
        if "#" in url:
            check_unambiguous(url, storage)
    with ThreadPoolExecutor(min(16, len(urls))) as pool:
        scanned = list(pool.map(lambda u: scan_tar(u, extensions, storage), urls))
        tar_prints = list(pool.map(lambda u: _tar_fingerprint(u, storage), urls))
    ids, paths, offsets, sizes, raw, where, prints = [], [], [], [], [], [], []
    seen: dict[str, str] = {}
    for url, records, tar_print in zip(urls, scanned, tar_prints, strict=True):
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
            prints.append(fingerprint(tar_print, r["offset"], r["size"]) if tar_print else 0)
    labels, classes = labels_of(raw, where.__getitem__)
    return Rows(ids=ids, paths=paths, labels=labels, classes=classes, offsets=offsets, sizes=sizes,
                fingerprints=prints)


def _tar_fingerprint(url: str, storage: dict[str, Any]) -> int:
    """The tar's own fingerprint (a member's is it with the member's offset and size); 0 when unknown."""
    if not is_url(url):
        return local_fingerprint(url)
    try:
        import fsspec

        fs, path = fsspec.core.url_to_fs(url, **storage)
        return remote_fingerprint(fs.info(path))
    except Exception:  # noqa: BLE001 - read fine a moment ago: unknown, not an error
        return 0
