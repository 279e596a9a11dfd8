"""Where images are and how their bytes are read: local paths, URLs (fsspec), tar members.

A row's stored path is a local path (absolute), a URL, or ``TAR_URL#MEMBER`` with the
member's byte range (see :mod:`extractor.tarsource`); file names that are not UTF-8 are
stored hex-encoded (``fsbytes:``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ..errors import DataError

__all__ = ["Locator", "is_url", "is_relative", "leaves_root", "absolute", "storable_path", "display_name", "read_bytes",
           "forget_reads", "tar_url_of", "remote_error", "content_digest", "fingerprint", "local_fingerprint",
           "remote_fingerprint"]


def is_url(path: str) -> bool:
    """A remote location (``s3://``, ``gs://``, ``memory://``...); ``file://`` and plain paths are local."""
    return "://" in path and not path.startswith("file://")


def is_relative(path: str) -> bool:
    """A local path relative to the current directory (not a URL, not ``file://``, not absolute)."""
    return "://" not in path and not os.path.isabs(path)


def leaves_root(path: str) -> bool:
    """A path, named by a manifest's row or a Parquet row, that leaves the folder it is relative to: absolute,
    a URL, or climbing out with ``..``. The one rule for every source: such a path is refused unless
    ``data.outside_root: true`` says the source's paths lead elsewhere by design."""
    if not is_relative(path):
        return True
    depth = 0
    for part in path.replace("\\", "/").split("/"):
        depth += -1 if part == ".." else 0 if part in ("", ".") else 1
        if depth < 0:
            return True
    return False


def absolute(path: str) -> str:
    """A local path made absolute (against the current directory), so that workers running
    elsewhere and later readers find the file; URLs (``s3://``, ``file://``...) unchanged."""
    return path if "://" in path else os.path.abspath(path)


def remote_error(what: str, url: str, err: BaseException) -> DataError:
    """A listing error from a remote file system as a DataError with a hint (credentials, bucket, endpoint)."""
    name = type(err).__name__
    hint = ""
    text = str(err).lower()
    if "credential" in text or "access denied" in text or "forbidden" in text or "signature" in text:
        hint = "; check the credentials in data.storage_options"
    elif "bucket" in text or isinstance(err, FileNotFoundError):
        hint = "; check the bucket and path"
    elif "connect" in text or "endpoint" in text:
        hint = "; check data.storage_options.endpoint_url and the network"
    return DataError(f"cannot read {what} {url}: {name}: {err}{hint}")


Locator = str | tuple[str, int, int]  # a path or URL, or (tar URL#member, byte offset, byte size)


FS_BYTES = "fsbytes:"  # prefix of a stored path whose file name is not valid UTF-8 (hex of the raw bytes)


def storable_path(path: str) -> str:
    """A path the store can hold (UTF-8): names with undecodable bytes are hex-encoded, reversibly."""
    try:
        path.encode("utf-8")
        return path
    except UnicodeEncodeError:
        return FS_BYTES + os.fsencode(path).hex()


def display_name(path: str) -> str:
    """A readable UTF-8 form of a file name (undecodable bytes shown as \\xNN)."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def local_path(path: str) -> str | bytes:
    """The path to open for a stored local path (``fsbytes:`` names back to their bytes)."""
    if path.startswith(FS_BYTES):
        return bytes.fromhex(path[len(FS_BYTES):])
    return path.removeprefix("file://")


def forget_reads() -> None:
    """Reads from now on see the sources as they are now: what :func:`read_bytes` keeps of them (a Parquet
    file's footers and row groups) is dropped. Called where rows are read to be computed or checked."""
    import sys

    parquet = sys.modules.get(f"{__package__}.sources.parquet")  # nothing is kept where no Parquet row was read
    if parquet is not None:
        parquet.row_groups.clear()


def read_bytes(item: Locator, storage_options: dict | None = None, outside_root: bool = True) -> bytes:
    """The bytes of one image: a file, a URL, a member's byte range inside a tar, or a Parquet file's row
    (``FILE.parquet#COLUMN/ROW``). ``outside_root``: false, a Parquet row's path that leaves its file's folder
    (:func:`leaves_root`) is refused, not opened (the job's decoders pass ``data.outside_root``)."""
    if isinstance(item, str) and "#" in item:
        from .sources.parquet import is_parquet_row, parquet_bytes

        if is_parquet_row(item):
            return parquet_bytes(item, storage_options, outside_root)
    if isinstance(item, tuple):
        path, offset, size = item
        url = tar_url_of(path, storage_options or {})
        if is_url(url):
            import fsspec

            fs, p = fsspec.core.url_to_fs(url, **(storage_options or {}))
            return fs.cat_file(p, start=offset, end=offset + size)
        with open(url.removeprefix("file://"), "rb") as f:
            f.seek(offset)
            data = f.read(size)
        if len(data) != size:
            raise OSError(f"{url} ends before the member's {size} bytes at offset {offset}: truncated tar")
        return data
    if is_url(item):
        import fsspec

        with fsspec.open(item, "rb", **(storage_options or {})) as f:
            return f.read()
    with open(local_path(item), "rb") as f:
        return f.read()


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
    tars with a file at an earlier ``#`` (:func:`check_unambiguous`), so this is the tar.
    Raises FileNotFoundError, naming the whole path, when no prefix is a file.
    """
    if path.count("#") <= 1:
        return path.split("#", 1)[0]
    for i, c in enumerate(path):
        if c == "#" and _is_file(path[:i], storage_options or {}):
            return path[:i]
    raise FileNotFoundError(f"no tar shard found for {path} (no part of it before a '#' is a file)")


def check_unambiguous(url: str, storage_options: dict[str, Any]) -> None:
    """Refuse a tar whose path has a file at one of its own ``#``: its rows could not be read back."""
    for i, c in enumerate(url):
        if c == "#" and _is_file(url[:i], storage_options):
            raise DataError(
                f"tar shard {url}: {url[:i]} is a file too, so rows stored as TAR#MEMBER would read it "
                "instead; rename the folder or the file so that no part of the tar's path before a '#' is a file"
            )


def content_digest(data: bytes) -> int:
    """The content digest of an image's bytes as read: xxh3-64 (about 20 GB/s, well under 1% of a decode);
    never 0, which the store keeps for "not read"."""
    import xxhash

    return xxhash.xxh3_64_intdigest(data) or 1


def fingerprint(*facts: object) -> int:
    """A cheap fingerprint of where an image's bytes come from (a file's size, mtime, ctime and inode; an
    object's size and ETag; a tar member's tar and place in it): when it is unchanged, the bytes are taken to be.
    Never 0 (unknown)."""
    import xxhash

    return xxhash.xxh3_64_intdigest("|".join(map(str, facts)).encode("utf-8", "surrogateescape")) or 1


def member_fingerprints(tar_print: int, offsets: Sequence[int], sizes: Sequence[int]) -> list[int]:
    """``fingerprint(tar_print, offset, size)`` of each member of a tar, at once (a tar's million members)."""
    import xxhash

    digest = xxhash.xxh3_64_intdigest
    return [digest(f"{tar_print}|{o}|{n}".encode()) or 1 for o, n in zip(offsets, sizes, strict=True)]


def local_fingerprint(path: str) -> int:
    """The fingerprint of a local file, or 0 when it cannot be seen (its row fails on read).

    Its size and mtime, and its ctime and inode: ``touch -r`` (``os.utime``) puts an mtime back, never a
    ctime, and a file replaced by another has another inode. Stores made before ctime and inode were part of
    it recorded ``fingerprint(size, mtime)``: every row of theirs differs now, so a resume reads their bytes
    once and compares content digests (the ground truth), then records the new fingerprints. A ctime moves
    also on chmod or a new hard link, and an inode on a copy: such rows cost a digest read, never a wrong
    answer.
    """
    try:
        st = os.stat(local_path(path))
    except OSError:
        return 0
    return fingerprint(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def remote_fingerprint(info: dict[str, Any]) -> int:
    """The fingerprint of an object from its fsspec ``info`` (size, and its ETag or modification time), 0 when
    the store says neither."""
    tag = next((info[k] for k in ("ETag", "etag", "md5Hash", "mtime", "LastModified", "last_modified", "updated")
                if info.get(k) is not None), None)
    return 0 if tag is None else fingerprint(info.get("size"), tag)
