"""The objects under a store's URL, as its commits use them: read, put, create only where absent, swap only at
the version read, list, remove (no zarr, no numpy: fsspec for URLs).

Every change of what a store holds is one of two steps (:mod:`.ledger`): an object put under a name no one
else uses (an attempt's chunks, a claimant's record), or a *swap* of a small record, which lands only while the
record is still at the version its writer read (or absent, for a create). Of two writers that read one version,
exactly one lands; the other is told, and reads again. Where that holds:

- **A local folder**: a swap holds the store's lock file (``__lock``) exclusively for its read, compare and
  replace; the record is replaced whole by a rename (readers take no lock and never see half of it). A create
  links a finished temporary file to its name, which fails where the name exists. flock locks end with their
  process: a killed writer holds nothing; one stopped (SIGSTOP) inside a swap holds it for that one swap, and
  the others wait for it, saying which process they wait for.
- **S3** (``s3://``): the record's ETag; a PUT with ``If-Match`` (``If-None-Match: *`` to create). A write refused
  for its condition whose bytes are there all the same was this writer's own, its answer lost (every record
  carries a nonce, so two writers never write the same bytes).
- **Other fsspec stores** (``memory://``, gcs, ...): read, compare and write, not one step; a warning says so
  once. Run one writer at a time there.

A storage that accepts a create it should refuse (some S3-compatible servers ignore ``If-None-Match``) is found
by :meth:`Objects.probe` and treated as the last kind.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["LOCK", "Objects", "is_s3", "local_root", "refused"]

log = logging.getLogger(__name__)

LOCK = "__lock"  # a local store's lock file: only its flock matters
LOCK_WAIT_S = 60.0  # a swap waiting this long for another process's swap to end says which process it waits for
_S3 = ("s3://", "s3a://")
Version = str | None  # what a record was read at (None: absent)


def is_s3(url: str) -> bool:
    return url.startswith(_S3)


def local_root(url: str) -> str | None:
    """The folder of a local store, or None for a URL."""
    return None if "://" in url.removeprefix("file://") else url.removeprefix("file://")


def refused(err: BaseException) -> bool:
    """An S3 write refused for its condition (412 PreconditionFailed, 409 ConditionalRequestConflict)."""
    text = f"{type(err).__name__} {err}"
    return isinstance(err, FileExistsError) or any(
        s in text for s in ("PreconditionFailed", "pre-conditions", "ConditionalRequestConflict"))


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


class Objects:
    """The objects under one store URL (keys are ``/``-separated paths below it). :meth:`at` picks the kind."""

    conditional = True  # swaps and creates are one step of the storage

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    @staticmethod
    def at(url: str, storage_options: Mapping[str, Any] | None = None, lock_wait_s: float = LOCK_WAIT_S) -> Objects:
        """The objects at ``url``; ``lock_wait_s``: how long a local swap waits for another process's swap to end before
        it says which process it waits for (a job's ``output.lease_timeout_s``: longer, that process is stopped)."""
        root = local_root(url)
        if root is not None:
            return LocalObjects(url, root, lock_wait_s)
        return RemoteObjects(url, storage_options)

    def get(self, key: str) -> bytes | None:
        """The object's bytes (None: absent)."""
        raise NotImplementedError

    def put(self, key: str, data: bytes) -> None:
        """Write the object whole (a name only its writer uses)."""
        raise NotImplementedError

    def create(self, key: str, data: bytes) -> bool:
        """Write the object only where none is: False, writing nothing, where one is."""
        raise NotImplementedError

    def read(self, key: str) -> tuple[bytes | None, Version]:
        """The record's bytes and the version they were read at (None, None: absent)."""
        raise NotImplementedError

    def swap(self, key: str, version: Version, data: bytes) -> bool:
        """Replace the record with ``data`` only if it is still at ``version`` (absent, for None): False, writing
        nothing, otherwise."""
        raise NotImplementedError

    def list(self, prefix: str) -> list[str]:
        """The names one level below ``prefix`` (objects and folders; [] where there is nothing)."""
        raise NotImplementedError

    def remove(self, key: str) -> None:
        """Remove the object, or everything under the folder ``key`` (nothing there: nothing done)."""
        raise NotImplementedError

    def exists(self, key: str) -> bool:
        return self.get(key) is not None

    def probe(self) -> bool:
        """Whether the storage refuses a second create of one name (the probe object is removed)."""
        key = f"__probe-{uuid.uuid4().hex}"
        try:
            self.create(key, b"1")
            return not self.create(key, b"2")
        finally:
            with contextlib.suppress(Exception):
                self.remove(key)

    def zarr_store(self, prefix: str = "", read_only: bool = True) -> Any:
        """A zarr store over the objects under ``prefix``."""
        raise NotImplementedError


class LocalObjects(Objects):
    """A local folder (see the module's docstring)."""

    def __init__(self, url: str, root: str, lock_wait_s: float = LOCK_WAIT_S) -> None:
        super().__init__(url)
        self.root = os.path.abspath(root)
        self.lock_wait_s = lock_wait_s

    def path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/")) if key else self.root

    def get(self, key: str) -> bytes | None:
        try:
            with open(self.path(key), "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None

    def put(self, key: str, data: bytes) -> None:
        path = self.path(key)
        tmp = self._temporary(path, data)
        try:
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise

    def create(self, key: str, data: bytes) -> bool:
        path = self.path(key)
        tmp = self._temporary(path, data)
        try:
            os.link(tmp, path)  # fails where the name exists: one of two creators wins
            return True
        except FileExistsError:
            return False
        except OSError as err:  # no hard links here (exFAT, some FUSE mounts): under the lock, where absent
            if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                raise
            with self._locked():
                if os.path.exists(path):
                    return False
                os.replace(tmp, path)
                return True
        finally:
            with contextlib.suppress(OSError):
                os.remove(tmp)

    def read(self, key: str) -> tuple[bytes | None, Version]:
        data = self.get(key)
        return data, None if data is None else _digest(data)

    def swap(self, key: str, version: Version, data: bytes) -> bool:
        path = self.path(key)
        tmp = self._temporary(path, data)
        landed = False
        try:
            with self._locked():
                now = self.get(key)
                if (None if now is None else _digest(now)) != version:
                    return False
                os.replace(tmp, path)
                landed = True  # the temporary file is the record now
                return True
        finally:
            if not landed:
                with contextlib.suppress(OSError):
                    os.remove(tmp)

    def list(self, prefix: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(prefix)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def remove(self, key: str) -> None:
        path = self.path(key)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    def zarr_store(self, prefix: str = "", read_only: bool = True) -> Any:
        from zarr.storage import LocalStore

        return LocalStore(self.path(prefix), read_only=read_only)

    @staticmethod
    def _temporary(path: str, data: bytes) -> str:
        """``data`` written whole under a temporary name beside ``path`` (its folders made)."""
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{uuid.uuid4().hex[:12]}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        return tmp

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The store's lock file held exclusively (a swap's read, compare and replace)."""
        import fcntl

        path = self.path(LOCK)
        os.makedirs(self.root, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._wait_for(fd, path)
            except OSError as err:  # a file system without flock: the swap is not one step there
                if err.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                _warn_once(self.url, f"its file system takes no flock locks ({os.strerror(err.errno or 0)})")
            yield
        finally:
            os.close(fd)  # closing lets the lock go

    def _wait_for(self, fd: int, path: str) -> None:
        """Block until the lock file is this swap's (no polling: the kernel wakes the waiter), saying every
        ``lock_wait_s`` which process holds it meanwhile: a swap takes microseconds, so that one is stopped or
        stuck (one of this process's own threads is waited for silently)."""
        import fcntl

        got = threading.Event()

        def warn() -> None:
            while not got.wait(self.lock_wait_s):
                if _holders(path) - {os.getpid()}:
                    log.warning("%s", _held_by(path))

        threading.Thread(target=warn, name="extractor-lock-wait", daemon=True).start()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        finally:
            got.set()


def _holders(path: str) -> set[int]:
    """The processes holding a flock of the file ``path`` (from /proc/locks, where Linux has it; {-1}: unknown)."""
    pids: set[int] = set()
    try:
        ino = os.stat(path).st_ino
        with open("/proc/locks") as f:
            for line in f:  # 1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF
                parts = line.split()
                if len(parts) > 5 and parts[1] == "FLOCK" and parts[5].rsplit(":", 1)[-1] == str(ino):
                    pids.add(int(parts[4]))
    except (OSError, ValueError):
        return {-1}
    return pids or {-1}


def _held_by(path: str) -> str:
    """What to say of a lock file another process keeps locked."""
    pids = sorted(p for p in _holders(path) if p > 0 and p != os.getpid())
    who = f"process {', '.join(map(str, pids))}" if pids else "another process"
    return (f"the store's lock file {path} stays locked by {who}, stopped in the middle of a change of the store "
            f"(SIGSTOP, a frozen VM?): waiting for it; resume it (kill -CONT PID) or end it")


_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_once(url: str, why: str) -> None:
    with _warned_lock:
        if url in _warned:
            return
        _warned.add(url)
    log.warning("%s: %s, so a change of the store is a read, a compare and a write, not one step: run one writer at "
                "a time on this store", url, why)


class RemoteObjects(Objects):
    """Objects of an fsspec URL: S3 with conditional writes, others read, compared and written (see the module's
    docstring). Listings are never taken from fsspec's cache (another writer's new object would be missing)."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None) -> None:
        import fsspec

        super().__init__(url)
        self.storage_options = {**dict(storage_options or {}), "use_listings_cache": False}
        self.fs, self.base = fsspec.core.url_to_fs(self.url, **self.storage_options)
        self.base = self.base.rstrip("/")
        self.conditional = is_s3(url)
        self._lock = threading.Lock()  # other stores: this process's own swaps at least one at a time
        if not self.conditional:
            _warn_once(self.url, "this storage offers no conditional writes extractor uses")

    def path(self, key: str) -> str:
        return f"{self.base}/{key}" if key else self.base

    def get(self, key: str) -> bytes | None:
        try:
            return bytes(self.fs.cat_file(self.path(key)))
        except (FileNotFoundError, IsADirectoryError):
            return None

    def put(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(self.path(key), data)
        self.fs.invalidate_cache(self.path(key))

    def create(self, key: str, data: bytes) -> bool:
        if not self.conditional:
            with self._lock:
                if self.get(key) is not None:
                    return False
                self.put(key, data)
                return True
        return self._conditional_put(key, data, mode="create")

    def read(self, key: str) -> tuple[bytes | None, Version]:
        path = self.path(key)
        for _ in range(3):
            try:
                self.fs.invalidate_cache(path)
                # the version first: bytes newer than it make the swap fail, never the other way round
                version = str(self.fs.info(path)["ETag"]) if self.conditional else None
                data = bytes(self.fs.cat_file(path))
            except FileNotFoundError:
                return None, None
            return data, version if self.conditional else _digest(data)
        return None, None  # pragma: no cover - unreachable

    def swap(self, key: str, version: Version, data: bytes) -> bool:
        if not self.conditional:
            with self._lock:
                now = self.get(key)
                if (None if now is None else _digest(now)) != version:
                    return False
                self.put(key, data)
                return True
        if version is None:
            return self._conditional_put(key, data, mode="create")
        return self._conditional_put(key, data, IfMatch=version)

    def _conditional_put(self, key: str, data: bytes, **condition: Any) -> bool:
        """A PUT under ``condition``: True when it landed (also when its answer was lost: its bytes are there)."""
        path = self.path(key)
        try:
            self.fs.pipe_file(path, data, **condition)
        except Exception as err:
            if not refused(err):
                raise
            return self.get(key) == data  # this very write, its first answer lost and retried
        finally:
            self.fs.invalidate_cache(path)
        return True

    def list(self, prefix: str) -> list[str]:
        path = self.path(prefix)
        try:
            self.fs.invalidate_cache(path)
            found = self.fs.ls(path, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted({str(name).rstrip("/").rsplit("/", 1)[-1] for name in found} - {""})

    def remove(self, key: str) -> None:
        path = self.path(key)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)
        self.fs.invalidate_cache(path)

    def zarr_store(self, prefix: str = "", read_only: bool = True) -> Any:
        from zarr.storage import FsspecStore

        return FsspecStore.from_url(f"{self.url}/{prefix}".rstrip("/"), storage_options=self.storage_options,
                                    read_only=read_only)
