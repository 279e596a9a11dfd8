"""The lease: which job holds a store (its record, taking, renewing and releasing it), the fence of a job's
writes, and what a store being created says (numpy and zarr only)."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import uuid
from collections.abc import Mapping
from typing import Any, TypedDict, cast

import zarr

from ..data import is_url
from ..errors import FencedError, StoreError
from .fence import (
    Fence,
    LockFile,
    conditional_writes,
    fenced,
    fenced_group,
    is_s3,
    local_root,
    read_record,
    refused,
    write_record,
)
from .layout import ATTR, now, open_group

log = logging.getLogger(__name__)


class LeaseRecord(TypedDict, total=False):
    """The attributes of the ``lease`` group: the job that holds the store (see :class:`Lease`)."""

    token: str
    heartbeat: float  # time.time() of its last renewal
    timeout_s: float  # its job's output.lease_timeout_s: silent this long, the lease is stale
    released: str  # when the job let go of the store
    host: str
    pid: int
    user: str
    started: str
    command: str


def read_lease(group: zarr.Group) -> LeaseRecord:
    """The store's lease (``{}`` when no job ever held it)."""
    try:
        return cast(LeaseRecord, dict(group["lease"].attrs))  # written only by Lease._write
    except KeyError:
        return {}


def half_created(url: str) -> str:
    """What to say of a store whose creation failed midway (status "creating", its lease let go or stale)."""
    return (f"store {url} was left half-created by a run that failed while creating it: it holds no data; "
            "run the job again with --resume (or --overwrite)")


def being_created(url: str, group: zarr.Group, timeout_s: float) -> str:
    """What to say of a store with status "creating": half-created, or being created by a live job now."""
    held = read_lease(group)
    if held and not held.get("released") and _fresh(held, timeout_s):
        return (f"store {url} is being created by another extractor job now: pid {held.get('pid')} on "
                f"{held.get('host')} (user {held.get('user')}, started {held.get('started')}); open it once that job "
                "has created it")
    return half_created(url)


def read_attrs(url: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """The store's extractor attributes, or None when nothing is at ``url``."""
    if not is_url(url):
        path = url.removeprefix("file://")
        if not os.path.exists(path):
            return None
        if not os.path.exists(os.path.join(path, "zarr.json")):
            if os.path.isdir(path) and not os.listdir(path):
                return None
            if read_record(path) or os.listdir(path) == ["lease"]:  # a job holds it and (re)creates its root, or did
                return {"status": "creating"}
            what = "a folder" if os.path.isdir(path) else "a file"
            raise StoreError(
                f"{url} exists and is {what}, not a Zarr store; choose another output.store "
                f"(extractor never deletes {what} it did not create)"
            )
    try:
        group = open_group(url, "r", storage_options)
    except FileNotFoundError:
        return {"status": "creating"} if _LeaseObject(url, storage_options).read()[0] else None
    except Exception as err:
        raise StoreError(f"cannot open {url} as a Zarr group: {type(err).__name__}: {err}; check output.store and "
                         "output.storage_options (endpoint_url, credentials) and that the storage answers") from err
    attrs = dict(group.attrs).get(ATTR)
    if not isinstance(attrs, dict):
        raise StoreError(
            f"{url} is a Zarr store not written by extractor; choose another output.store "
            "(extractor never deletes stores it did not create)"
        )
    return attrs


def lease_token(group: zarr.Group) -> str | None:
    """The token of the job that holds the store now (None: no lease)."""
    return read_lease(group).get("token")


def job_fence(url: str, storage_options: Mapping[str, Any] | None, token: str) -> Fence:
    """The fence of the job whose lease token is ``token`` on the store at ``url``."""
    lease = _LeaseObject(url, storage_options)
    return Fence(url, storage_options, token, lambda: lease.read()[0].get("token"))


LEASE_TIMEOUT_S = 60.0  # a lease silent this long is stale, where the store's job recorded no other (the spec's
# default output.lease_timeout_s); a lease is renewed every quarter of it


def lease_timeout(held: LeaseRecord, default: float) -> float:
    """How long the lease ``held`` lives without a renewal: its own job's ``output.lease_timeout_s`` (which
    sets how often that job renews it), or ``default`` for leases that did not record it."""
    return float(held.get("timeout_s", default))


def _fresh(held: LeaseRecord, timeout_s: float) -> bool:
    """A lease renewed within its timeout (``timeout_s`` when it has none of its own) whose job, when it
    ran on this machine, is still alive."""
    import time

    if time.time() - float(held.get("heartbeat", 0)) > lease_timeout(held, timeout_s):
        return False
    # its job ran on this machine and its process is gone: no need to wait for the timeout
    return not (held.get("host") == socket.gethostname() and not _alive(int(held.get("pid", 0))))


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Raced(Exception):
    """A conditional write of the lease found it changed since it was read: another job wrote it."""


class _LeaseObject:
    """Where a store's lease record lives (the ``lease`` group's ``zarr.json``) and how it is written.

    Locally it is a file read and replaced whole, under the store's lock file (:class:`LockFile`: exclusive to
    change its holder, shared to renew it). On S3 (``s3://``) it is a compare-and-swap: created with
    ``If-None-Match: *``, replaced with ``If-Match`` on the ETag it was read at (S3 conditional writes, since
    2024-11), so that of two jobs that write it at once exactly one wins and the other is told (:class:`_Raced`).
    Elsewhere (``memory://``, other object stores) it is written as zarr writes attributes, after a read just
    before."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None) -> None:
        self.url, self.storage_options = url, storage_options
        self.root = local_root(url)
        self.fs: Any = None
        self.path = ""
        if self.root is None:
            import fsspec

            self.fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
            self.path = f"{root.rstrip('/')}/lease/zarr.json"

    @property
    def conditional(self) -> bool:
        return is_s3(self.url)

    def read(self) -> tuple[LeaseRecord, str | None]:
        """The record (``{}`` when no job ever held the store) and the version it was read at (its ETag;
        None when absent, or where writes are not conditional). The version is read first: a record
        newer than it makes the write fail, never the other way round."""
        if self.root is not None:
            return cast(LeaseRecord, read_record(self.root)), None
        try:
            self.fs.invalidate_cache(self.path)
            version = str(self.fs.info(self.path)["ETag"]) if self.conditional else None
            meta = json.loads(self.fs.cat_file(self.path))
        except FileNotFoundError:
            return {}, None
        return cast(LeaseRecord, meta.get("attributes") or {}), version

    def write(self, record: LeaseRecord, version: str | None) -> str | None:
        """Write ``record``; where writes are conditional, only if the object is still at ``version``
        (absent when None), raising :class:`_Raced` otherwise. Returns the new version."""
        if self.root is not None:
            write_record(self.root, record)
            return None
        data = json.dumps({"zarr_format": 3, "node_type": "group", "attributes": record}).encode()
        if not self.conditional:  # another object store: written whole
            self.fs.pipe_file(self.path, data)
            self.fs.invalidate_cache(self.path)
            return None
        try:
            if version is None:
                out = self.fs.pipe_file(self.path, data, mode="create")
            else:
                out = self.fs.pipe_file(self.path, data, IfMatch=version)
        except Exception as err:  # noqa: BLE001 - a refused condition is told apart; the rest goes up
            if refused(err):
                raise _Raced from None
            raise
        self.fs.invalidate_cache(self.path)
        tag = out.get("ETag") if isinstance(out, dict) else None
        return str(tag) if tag else str(self.fs.info(self.path)["ETag"])


class Lease:
    """A claim on a store by one running job: owner, host, pid and a heartbeat.

    Kept in the attributes of the child group ``lease``. A second job refuses to run on a
    store whose lease is fresh; a lease whose heartbeat is older than its timeout is stale (its
    job died) and can be taken over. A thread renews it every ``timeout_s / 4``. Every write of it
    happens only while it is still this job's: locally under the store's lock file (a takeover holds it
    exclusively), on S3 conditional on the version this job last saw (:class:`_LeaseObject`). Its
    :attr:`fence` is what each of the job's writes goes through (:class:`FencedStore`).
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None, timeout_s: float, info: dict[str, Any]):
        if not timeout_s > 0:  # renewed every timeout_s / 4: at 0 the heartbeat would write without pause
            raise ValueError(f"a lease's timeout must be > 0 s, not {timeout_s}")
        self.url, self.storage_options, self.timeout_s = url, storage_options, timeout_s
        self.token = uuid.uuid4().hex
        self.info = dict(info)
        self.object = _LeaseObject(url, storage_options)
        self.fence = job_fence(url, storage_options, self.token)
        self.version: str | None = None  # of the lease object as this job last wrote it (conditional writes)
        self._stop: Any = None  # set while the heartbeat thread renews the lease
        self._beat: threading.Thread | None = None
        self.held = False  # written once: from then on it renews only while still its own
        self.lost = False  # another job took the store over
        self.conditional: bool | None = None  # an object store honours create-only writes (None: not asked)

    @staticmethod
    def check(url: str, storage_options: Mapping[str, Any] | None, timeout_s: float, token: str = "") -> None:
        """Raise StoreError when another job holds a fresh lease on ``url``."""
        _refuse_held(url, _LeaseObject(url, storage_options).read()[0], timeout_s, token)

    def _record(self, **extra: Any) -> LeaseRecord:
        import time

        return cast(LeaseRecord, {**self.info, "token": self.token, "heartbeat": time.time(),
                                  "timeout_s": self.timeout_s, **extra})

    def _write(self, **extra: Any) -> None:
        """Renew (or release) the lease, unless another job holds it now: then this job is fenced
        off (``lost``) and writes nothing, not even its lease."""
        if self.object.conditional:
            if self.conditional is False and self.fence.current() != self.token:  # a storage that would let the
                self.lost = True  # write through: read first (the README says what is left)
                raise fenced(self.url, self.fence.current())
            try:
                self.version = self.object.write(self._record(**extra), self.version)
            except _Raced:
                self.lost = True
                raise fenced(self.url, self.fence.current()) from None
            return
        try:
            with self.fence.held():  # locally: under the lock, so no takeover comes between check and write
                self.object.write(self._record(**extra), None)
        except FencedError:
            self.lost = True
            raise

    def acquire(self) -> None:
        """Take the store (a new one, or one whose lease is released or stale), or raise StoreError naming the job
        that holds it; then renew it in the background."""
        if self.object.root is not None:
            _refuse_held(self.url, self.object.read()[0], self.timeout_s, self.token)  # a live job: at once
            with LockFile.of(self.object.root).exclusive(max(self.timeout_s, 1.0), self._busy):
                _refuse_held(self.url, self.object.read()[0], self.timeout_s, self.token)
                self.object.write(self._record(), None)
        else:
            self._acquire_remote()
        self.held = True
        stop = self._stop = threading.Event()

        def beat() -> None:  # its own reference to the event: release() lets go of it
            while not stop.wait(self.timeout_s / 4):
                try:
                    self._write()
                except FencedError:
                    return  # taken over: the shard writers see it too, and stop
                except Exception:  # noqa: BLE001 - a missed heartbeat is retried at the next one
                    pass

        self._beat = threading.Thread(target=beat, name="extractor-lease", daemon=True)
        self._beat.start()

    def _acquire_remote(self) -> None:
        """:meth:`acquire` on an object store: a conditional write of the lease where the storage has them."""
        import time

        if self.object.conditional and self.conditional is None:
            self.conditional = conditional_writes(self.object.fs, self.object.path.removesuffix("/lease/zarr.json"))
            if not self.conditional:
                log.warning("the storage of %s does not honour conditional writes (a create-only write replaced the "
                            "object it should have refused): a job paused past its lease could still write into it "
                            "after another job took it over; run one job at a time on this store", self.url)
        held, version = self.object.read()
        _refuse_held(self.url, held, self.timeout_s, self.token)
        try:
            self.version = self.object.write(self._record(), version)
        except _Raced:  # another job wrote the lease between this job's read and its write: it won
            _refuse_held(self.url, self.object.read()[0], self.timeout_s, self.token)
            raise StoreError(f"store {self.url} was taken by another extractor job at the same moment; run again "
                             "once it is done") from None
        if not self.conditional:  # a race not excluded by the write: seen by reading again
            time.sleep(0.05)
            self.check(self.url, self.storage_options, self.timeout_s, self.token)

    def _busy(self) -> str:
        """What to say when the store's lock stays held by a writer of the job whose lease is stale."""
        held = self.object.read()[0]
        try:
            _refuse_held(self.url, held, self.timeout_s, self.token)  # renewed meanwhile: a live job, busy writing
        except StoreError as err:
            return str(err)
        return (f"store {self.url} is locked by a writer that stopped mid-write: the job that held it (pid "
                f"{held.get('pid')} on {held.get('host')}, user {held.get('user')}) is paused or stuck; resume it "
                f"(kill -CONT {held.get('pid')}) or end it, then run again")

    def open(self) -> zarr.Group:
        """The store's root group for this job's writes: each of them through the lease's fence."""
        return fenced_group(self.url, self.storage_options, self.fence)

    def verify(self) -> None:
        """Raise :class:`FencedError` when another job holds the store now."""
        try:
            self.fence.check()
        except FencedError:
            self.lost = True
            raise

    def release(self) -> None:
        """Stop renewing and mark the lease released, after a renewal in flight (a slow storage) has
        landed, so that no heartbeat lands after the release."""
        if self._stop is None:
            return
        self._stop.set()
        self._stop = None
        if self._beat is not None:
            self._beat.join(timeout=max(self.timeout_s, 1.0))
            self._beat = None
        try:
            self._write(released=now())
        except Exception:  # noqa: BLE001 - an unreleased lease expires by itself; another job's is not ours
            pass


def _refuse_held(url: str, held: LeaseRecord, timeout_s: float, token: str = "") -> None:
    """Raise StoreError when ``held`` is another job's fresh lease on ``url``."""
    import time

    if not held or held.get("released") or held.get("token") == token or not _fresh(held, timeout_s):
        return
    age = time.time() - float(held.get("heartbeat", 0))
    timeout_s = lease_timeout(held, timeout_s)
    raise StoreError(
        f"store {url} is in use by another extractor job: pid {held.get('pid')} on {held.get('host')} "
        f"(user {held.get('user')}, started {held.get('started')}, last heartbeat {age:.0f} s ago). "
        f"Wait for it to finish; if it died, its lease expires {timeout_s - age:.0f} s from now "
        "(output.lease_timeout_s) and the store can then be resumed"
    )

