"""Writes that cannot land once their job has lost the store: the lease's check and the write made one step.

A lease checked before each write leaves a window: a process paused between the check and the write (SIGSTOP,
a long GC pause, a storage stall) writes after another job took the store over. What closes it is the storage:

- **A local store** (a folder on a local disk, or NFSv4, whose locks are POSIX locks): every write of a job happens
  under a *shared* lock of the store's lock file (``lease/lock``), taken before the lease is read; changing the
  lease's holder (taking the store) takes the *exclusive* lock. So the token read under the lock stays the holder's
  until the write is done: a job that lost its store finds another token and stops; a job stopped while it holds
  the lock keeps the store, and a takeover waits for it, then refuses naming it (:class:`LockFile`).
- **S3** (``s3://``): data objects are created only where absent (``If-None-Match: *``) and metadata replaced only
  at the ETag this job last wrote or read under its lease (``If-Match``). A stale writer can then never replace an
  object the new holder wrote: its write fails, it reads the lease and stops. Where the holder's own create meets
  an object (a stale writer's, or its own older one), it removes it and writes again, under the lease. Each write
  carries a stamp (``x-amz-meta-extractor-write``), read back when a write is refused: a retry of a write whose
  first response was lost is not taken for another job's (:class:`FencedStore`). A storage that accepts a
  conditional write it should refuse is found at the lease's start (:func:`conditional_writes`).
- **Other stores** (``memory://``, gcs, ...): the lease is checked before each write (a window remains; the README
  says so).

:class:`FencedStore` wraps a zarr store with these rules; every writer of a job opens the store through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from zarr.abc.store import Store
from zarr.core.buffer import Buffer
from zarr.storage import FsspecStore, LocalStore, WrapperStore

from ..errors import FencedError, StoreError

log = logging.getLogger(__name__)

LEASE_KEY = "lease/zarr.json"  # the lease record: the attributes of the ``lease`` group
# a local store's lock file: only its locks matter; it is an empty group's metadata, never rewritten, so that zarr
# sees a group where it lists the store's members
LOCK_KEY = "lease/lock/zarr.json"
_LOCK_BODY = b'{"zarr_format": 3, "node_type": "group", "attributes": {}}'
WIPE_CHECK = 64  # S3: the lease checked again after this many removals of a wipe
STAMP = "extractor-write"  # S3 user metadata on each object a job writes: its lease token and a nonce
_S3 = ("s3://", "s3a://")


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


class LockFile:
    """A local store's lock file: shared holds by the job's writers, an exclusive one to change the lease's holder.

    ``flock`` locks belong to an open file: each process keeps one shared hold, counted over its threads (the
    writer threads, the lease's renewal), and lets it go when the last of them is done. One object per file per
    process (:meth:`of`). Where the file system has no ``flock`` (some FUSE, SMB or Lustre ``noflock`` mounts; a
    platform without ``fcntl``), writes go on with the lease checked before each, and a warning says so."""

    _all: dict[str, LockFile] = {}
    _all_lock = threading.Lock()

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._holds = 0
        self.works = True  # the file system takes flock locks

    @classmethod
    def of(cls, root: str) -> LockFile:
        path = os.path.join(os.path.abspath(root), *LOCK_KEY.split("/"))
        with cls._all_lock:
            if path not in cls._all:
                cls._all[path] = cls(path)
            return cls._all[path]

    def _open(self) -> int:
        if not os.path.exists(self.path):  # made whole under a temporary name, then linked: never seen empty
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            tmp = f"{self.path}.{uuid.uuid4().hex[:8]}.tmp"
            with open(tmp, "wb") as f:
                f.write(_LOCK_BODY)
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                pass
            except OSError:  # no hard links here (exFAT, some FUSE mounts): renamed, if still absent
                if not os.path.exists(self.path):
                    os.replace(tmp, self.path)
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
        return os.open(self.path, os.O_RDWR)

    def _flock(self, fd: int, how: str) -> bool:
        """Lock ``fd`` (``shared``, ``exclusive``: without waiting); False where it would wait. Where the file system
        takes no locks, says so once and from then on locks nothing (True)."""
        try:
            import fcntl
        except ImportError:  # not a POSIX platform
            return self._unsupported("this platform has no flock")
        try:
            fcntl.flock(fd, fcntl.LOCK_SH if how == "shared" else fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        except OSError as err:
            if err.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                return self._unsupported(os.strerror(err.errno or 0))
            raise

    def _unsupported(self, why: str) -> bool:
        if self.works:
            self.works = False
            log.warning("the file system of %s takes no flock locks (%s): each write checks the lease just before it, "
                        "and a job paused between that check and its write could still write; run one job at a time "
                        "on this store", os.path.dirname(os.path.dirname(os.path.dirname(self.path))), why)
        return True

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        """Held by a writer while it checks the lease and writes (blocks while a takeover holds it)."""
        with self._lock:
            if self._holds == 0 and self.works:
                fd = self._open()
                try:
                    self._flock(fd, "shared")
                except BaseException:
                    os.close(fd)
                    raise
                self._fd = fd
            self._holds += 1
        try:
            yield
        finally:
            with self._lock:
                self._holds -= 1
                if self._holds == 0 and self._fd is not None:
                    os.close(self._fd)  # closing lets the lock go
                    self._fd = None

    @contextlib.contextmanager
    def exclusive(self, wait_s: float, busy: Callable[[], str]) -> Iterator[None]:
        """Held while the lease changes holder: no writer of any job writes meanwhile. Waits up to ``wait_s`` for
        the writers that hold it shared, then raises StoreError with ``busy()`` (a writer stopped mid-write)."""
        fd = self._open()
        try:
            deadline = time.monotonic() + wait_s
            while not self._flock(fd, "exclusive"):
                if time.monotonic() > deadline:
                    raise StoreError(busy()) from None
                time.sleep(0.02)
            yield
        finally:
            os.close(fd)


def read_record(root: str) -> dict[str, Any]:
    """A local store's lease record (``{}`` when none), read straight from its file."""
    try:
        with open(os.path.join(root, *LEASE_KEY.split("/")), "rb") as f:
            return dict(json.loads(f.read()).get("attributes") or {})
    except FileNotFoundError:
        return {}


def write_record(root: str, record: Mapping[str, Any]) -> None:
    """A local store's lease record, replaced whole (a reader never sees half of it)."""
    path = os.path.join(root, *LEASE_KEY.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    with open(tmp, "wb") as f:
        f.write(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": dict(record)}).encode())
    os.replace(tmp, path)


class Fence:
    """A job's right to write into the store at ``url``: its lease ``token`` is the store's.

    :meth:`held` is the step a write happens in: on a local store the shared lock is held and the token checked
    under it; elsewhere the token is checked (S3 then relies on its conditional writes)."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None, token: str,
                 read_token: Callable[[], str | None]) -> None:
        self.url, self.storage_options, self.token = url, storage_options, token
        self.root = local_root(url)
        self.lock = LockFile.of(self.root) if self.root is not None else None
        self._read_token = read_token

    def current(self) -> str | None:
        """The token of the job that holds the store now."""
        if self.root is not None:
            return read_record(self.root).get("token")
        return self._read_token()

    def check(self) -> None:
        """Raise :class:`FencedError` when another job holds the store now."""
        now = self.current()
        if now != self.token:
            raise fenced(self.url, now)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The store is this job's for the duration (locally: no takeover can happen meanwhile)."""
        if self.lock is None or not self.lock.works:
            self.check()
            yield
            return
        with self.lock.shared():
            self.check()
            yield


def _put_file(path: str, data: Any) -> None:
    """A local object written whole: under a temporary name, then renamed (as zarr's LocalStore does)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def fenced(url: str, token: str | None) -> FencedError:
    return FencedError(
        f"this job no longer holds {url}: another job took it over (this one was paused or cut off for longer "
        f"than output.lease_timeout_s{'' if token is None else ', or the store was replaced'}); it stops and "
        "writes nothing more. Look at the store with `extractor inspect` before running anything on it"
    )


class FencedStore(WrapperStore[Store]):
    """A zarr store whose writes land only while ``fence``'s job holds the store (see the module's docstring).

    Local: each write inside :meth:`Fence.held`. S3: data objects created only where absent, metadata
    (``zarr.json``) replaced only at the ETag this job last saw, each with a stamp; a refused write is the job's
    own lost one, another job's (then this job is fenced), or, for the holder, an object to remove and write
    again. Others: the lease checked before each write."""

    def __init__(self, store: Store, fence: Fence) -> None:
        super().__init__(store)
        self.fence = fence
        self.etags: dict[str, str] = {}  # S3: each metadata object's ETag as this job last wrote or read it
        self._s3 = isinstance(store, FsspecStore) and is_s3(fence.url)

    def _with_store(self, store: Store) -> FencedStore:
        return type(self)(store, self.fence)

    @property
    def root(self) -> Any:  # what a local store's writers (chunks.ShardStream) write beside
        return getattr(self._store, "root", None)

    @property
    def fs(self) -> Any:
        return getattr(self._store, "fs", None)

    @property
    def path(self) -> str:
        return str(getattr(self._store, "path", ""))

    def held(self) -> contextlib.AbstractContextManager[None]:
        return self.fence.held()

    async def set(self, key: str, value: Buffer) -> None:
        if self._s3:
            await self._s3_put(key, value.to_bytes())
        elif self.root is not None:  # the lock held in the thread that writes, for that write alone
            await asyncio.to_thread(self._local, _put_file, key, value.as_buffer_like())
        else:
            await self._checked()
            await self._store.set(key, value)

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        if self.root is not None:
            with self.fence.held():
                await self._store.set_if_not_exists(key, value)
        else:
            await self._checked()
            await self._store.set_if_not_exists(key, value)

    def put_whole(self, items: Iterable[tuple[str, Any]]) -> bool:
        """A local store: each object of ``items`` written whole, in order, all within one step of the fence (one
        lease read for them all); False, writing nothing, on other stores."""
        if self.root is None or self._s3:
            return False
        with self.fence.held():
            for key, data in items:
                _put_file(os.path.join(str(self.root), *key.split("/")), data)
        return True

    async def _set_many(self, values: Iterable[tuple[str, Buffer]]) -> None:
        for key, value in values:
            await self.set(key, value)

    async def delete(self, key: str) -> None:
        if self.root is not None:
            await asyncio.to_thread(self._local, _remove, key)
        elif self._s3:
            await self._s3_delete(key)
        else:
            await self._checked()
            await self._store.delete(key)

    async def delete_dir(self, prefix: str) -> None:
        if self.root is not None:
            await asyncio.to_thread(self._local, _remove, prefix)
            return
        await self._checked()
        await self._store.delete_dir(prefix)

    async def _checked(self) -> None:
        """The lease checked, off the event loop (its read may use zarr's own loop: ``memory://``)."""
        await asyncio.to_thread(self.fence.check)

    def _local(self, step: Callable[..., None], key: str, *args: Any) -> None:
        """``step(path of key, *args)`` within one step of the fence (a local store)."""
        with self.fence.held():
            step(os.path.join(str(self.root), *key.split("/")), *args)

    async def clear(self) -> None:
        raise StoreError("a job's store is never cleared whole: wipe() keeps its lease")

    # S3

    def _key(self, key: str) -> tuple[str, str]:
        bucket, _, prefix = f"{self.path.rstrip('/')}/{key}".partition("/")
        return bucket, prefix

    async def _stamp_of(self, key: str) -> tuple[str | None, str | None]:
        """The stamp and ETag of object ``key`` now (None, None: absent)."""
        bucket, k = self._key(key)
        try:
            head = await self.fs._call_s3("head_object", Bucket=bucket, Key=k)
        except FileNotFoundError:
            return None, None
        return (head.get("Metadata") or {}).get(STAMP), head.get("ETag")

    async def _s3_put(self, key: str, data: bytes) -> None:
        """Put ``key`` under a condition: created only where absent, or replaced only at the ETag this job saw (its
        own last write of a metadata object, or an object it found there while it held the store). A refusal is the
        job's own earlier try (its stamp), another job's store (fenced), or an object written since it looked."""
        stamp = f"{self.fence.token}.{uuid.uuid4().hex[:12]}"
        bucket, k = self._key(key)
        for _ in range(4):
            if key.endswith("zarr.json") and key not in self.etags:  # a first write of this metadata: at its ETag
                self.etags[key] = (await self._stamp_of(key))[1] or ""
                await self._checked()
            etag = self.etags.get(key, "")
            cond = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
            try:
                out = await self.fs._call_s3("put_object", Bucket=bucket, Key=k, Body=data,
                                             Metadata={STAMP: stamp}, **cond)
            except Exception as err:  # noqa: BLE001 - told apart just below
                if not refused(err):
                    raise
                mine, found = await self._stamp_of(key)
                if mine == stamp:  # this very write landed; its answer was lost
                    out = {"ETag": found}
                else:
                    await self._checked()  # another job's store now: this job stops here
                    self.etags[key] = found or ""  # the object there now, replaced only as it is
                    continue
            self.fs.invalidate_cache(f"{bucket}/{k}")
            if key.endswith("zarr.json"):
                self.etags[key] = str(out.get("ETag") or "")
            else:
                self.etags.pop(key, None)  # a data object: created only where absent next time
            return
        raise StoreError(f"cannot write {key} of {self.fence.url}: the storage refused it four times (another "
                         "writer of the same object?); run again with --resume")

    async def s3_wipe(self, keep: str) -> None:
        """Remove every object of the store but those under ``keep`` (its lease), as this job saw them: listed with
        their ETags first, then the lease checked, then each removed only at its listed ETag (If-Match), the root's
        ``zarr.json`` first and the lease checked again every :data:`WIPE_CHECK` objects. A job paused anywhere in
        here removes nothing another job wrote after its listing (that job rewrites the root first: refused);
        what is gone already is skipped."""
        base = self.path.rstrip("/")
        found = await self.fs._find(base, detail=True)
        listed = sorted(((name[len(base) + 1:], info.get("ETag")) for name, info in found.items()
                         if not name[len(base) + 1:].startswith(f"{keep}/")), key=lambda kv: kv[0] != "zarr.json")
        await self._checked()
        for i, (key, etag) in enumerate(listed):
            if i and i % WIPE_CHECK == 0:
                await self._checked()
            bucket, k = self._key(key)
            try:
                await self.fs._call_s3("delete_object", Bucket=bucket, Key=k, **({"IfMatch": etag} if etag else {}))
            except FileNotFoundError:
                continue  # removed already
            except Exception as err:  # noqa: BLE001 - told apart just below
                if not refused(err):
                    raise
                await self._checked()  # written since the listing: another job's store, or a stray write
                raise fenced(self.fence.url, self.fence.token) from None
        self.fs.invalidate_cache(base)

    async def _s3_delete(self, key: str) -> None:
        """Remove ``key`` as this job saw it (If-Match on its ETag, read while the lease is checked)."""
        bucket, k = self._key(key)
        _, etag = await self._stamp_of(key)
        if etag is None:
            return
        await self._checked()
        try:
            await self.fs._call_s3("delete_object", Bucket=bucket, Key=k, IfMatch=etag)
        except Exception as err:  # noqa: BLE001 - written since: not this job's to remove
            if not refused(err):
                raise
            await self._checked()
        self.fs.invalidate_cache(f"{bucket}/{k}")


def conditional_writes(fs: Any, path: str) -> bool:
    """Whether the object store honours a create-only write: a probe object is created twice, and the second
    create must be refused (a storage that ignores If-None-Match replaces it). The probe is removed."""
    probe = f"{path.rstrip('/')}/lease/probe-{uuid.uuid4().hex}"
    try:
        fs.pipe_file(probe, b"1", mode="create")
        try:
            fs.pipe_file(probe, b"2", mode="create")
        except Exception as err:  # noqa: BLE001 - told apart just below
            if refused(err):
                return True
            raise
        return False
    finally:
        with contextlib.suppress(Exception):
            fs.rm_file(probe)


def fenced_store(url: str, storage_options: Mapping[str, Any] | None, fence: Fence | None) -> Store:
    """The store at ``url`` for a job's writers: every write through :class:`FencedStore` (without ``fence``: the
    plain store, for tests and benchmarks that write alone)."""
    store: Store
    root = local_root(url)
    if root is not None:
        store = LocalStore(root, read_only=False)
    else:
        # never a listing from a cache: fsspec keeps one per thread and file system, and an object another writer
        # (a worker, a job that took the store over) made since would be missing from it (a done shard read as not
        # done: a complete store marked incomplete)
        options = {**dict(storage_options or {}), "use_listings_cache": False}
        store = FsspecStore.from_url(url, storage_options=options, read_only=False)
    return FencedStore(store, fence) if fence is not None else store


def fenced_group(url: str, storage_options: Mapping[str, Any] | None, fence: Fence | None) -> Any:
    """The store's root group opened for writing through :func:`fenced_store`."""
    import zarr

    return zarr.open_group(store=fenced_store(url, storage_options, fence), mode="r+", use_consolidated=False)
