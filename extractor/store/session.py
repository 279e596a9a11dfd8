"""One job's session with its store: what the job does to it, from the first read to the last write.

:class:`StoreSession` has the store's life cycle in a few verbs, in the shape of Ray Data's ``Datasink``: decide
(read only; ``extractor plan`` stops there), start (``on_write_start``: the store made, a generation swapped in
by the head, or resumed; this process a claimant of it), the workers' attempts (each shard claimed, written and
committed in the ledger by a ``ShardWriter`` holding the session's :attr:`ticket`), then ``on_write_complete``
(the final record, once every shard is committed) or ``on_write_failed``, and ``close``. No write of the job is
read before a commit names it (:mod:`.generation`, :mod:`.ledger`).
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .._text import count, now
from ..data import Rows, Shard, Streamed, reuse, source
from ..errors import FencedError, RemakeError, StoreError
from ..spec import JobSpec
from .chunks import read_all
from .claimants import Claimant, alive, gone
from .generation import FORMAT, Generation, Head, collect_others, done_shards, open_group, read_head, swap_head
from .layout import (
    FAILED,
    OK,
    RowsBehind,
    StoreArrays,
    get_array,
    locator_arrays,
    rewrite_rows,
    root_attrs,
    start_generation,
)
from .ledger import Table, Verdict, amend_rows, new_id, reset
from .objects import Objects, is_s3
from .provenance import (
    Probe,
    StoreRecord,
    changed_rows,
    check_half_made,
    check_resumable,
    committed_blocks,
    kept_probe,
    moved_locators,
    owner,
    row_blocks,
    store_attrs,
    stored_prints,
    with_digests,
)
from .recorded import StoredRows
from .reuse import check_sources
from .stats import Fresh, PartMerger, Totals, merge_shards
from .views import write_view
from .writer import Ticket, _Opened

__all__ = ["Decision", "IndexHooks", "Outcome", "StoreSession", "live_claimants"]

log = logging.getLogger(__name__)

CHECKPOINT_SHARDS = 256  # a claimant leaves its statistics as a partial every this many shards it merged
WAIT_S = 1.0  # a claimant waiting for shards other live claimants hold reads the ledger again this often


class IndexHooks(Protocol):
    """The write-time feature indexes, as the store's session uses them (``index.JobIndexes``, wired in by the
    driver: the store does not import the index)."""

    def parts(self, captures: Mapping[str, Any]) -> dict[str, int]:
        """The bytes of a shard's part of each indexed capture's index (their arrays are made with the store)."""

    def fresh(self, captures: Mapping[str, Any], prefix_tokens: int | None) -> Fresh | None:
        """An empty part of each indexed capture's index, by its key (None: no capture is indexed)."""

    def finish(self, group: Any, generation: Generation, merged: Mapping[str, Any],
               held: Mapping[str, np.ndarray]) -> list[str]:
        """Every committed shard's parts merged into the indexes (``group``: the generation read as committed; those
        of the shards ``held`` given ``merged`` already), written into ``generation``; the names written."""


@dataclass(frozen=True)
class Decision:
    """What a job will do to its store, decided from a read of it before anything is written."""

    create: bool  # make a new generation (replacing what is there when ``old`` is not None), or resume one
    old: dict[str, Any] | None  # the store's state as read (None: nothing there)
    todo: list[Shard]  # the shards to compute
    redo: list[Shard] = field(default_factory=list)  # done shards whose images changed: computed again
    fingerprints: np.ndarray | None = None  # the source's, to record on resume where they changed
    locators: dict[str, np.ndarray] | None = None  # the source's locator arrays now, where it moved the bytes
    head: Head | None = None  # the store's head as read (a new generation is swapped in from it)
    rows_again: bool = False  # a store left half-made: its rows written again behind its shards (RowsBehind)

    @property
    def nothing_to_do(self) -> bool:
        """A resume of a complete store: nothing is computed, and nothing written."""
        return not self.create and not self.todo and (self.old or {}).get("status") == "complete"


def _claimants_text(claimants: list[dict[str, Any]]) -> str:
    m = claimants[0]
    age = time.time() - float(m.get("heartbeat", 0))
    more = f" and {count(len(claimants) - 1, 'other process')}" if len(claimants) > 1 else ""
    return (f"pid {m.get('pid')} on {m.get('host')} (user {m.get('user')}, started {m.get('started')}, last "
            f"heartbeat {age:.0f} s ago){more}")


def decide(spec: JobSpec, rows: Rows | Streamed, shards: list[Shard], attrs: StoreRecord, objects: Objects) -> Decision:
    """Whether the job may create, replace, resume or join the store, and what it would compute; refuses (another
    job's live claimants without --join, an existing store without --resume or --overwrite, a store made by another
    job) without writing anything."""
    url, mode = spec.output.store, spec.output.if_exists
    head = read_head(objects)
    if head is None:
        return Decision(True, None, shards, head=head)
    if head.generation is None:  # format 1 (before December 2026): made again, or refused
        old = dict(head.attrs)
        if mode == "overwrite":
            return Decision(True, old, shards, head=head)
        raise StoreError(f"store {url} was made by an older extractor (format {head.format_version}, now {FORMAT}): "
                         "it is read as it is, but not resumed; --overwrite makes it again")
    generation = Generation(objects, head.generation)
    if mode == "join":
        _made_by_another(generation, url, head, spec.output.lease_timeout_s)  # joined once its maker has made it
    old = generation.state()
    live = list(generation.roster.live())
    if live and mode != "join":
        what = "being made" if old.get("status") == "creating" else "in use"
        raise StoreError(f"store {url} is {what} by another extractor job: {_claimants_text(live)}. Wait for it to "
                         "finish, run this job with --join to compute beside it, or, if it died, run again once "
                         f"its heartbeat is {_timeout(live):.0f} s old (output.lease_timeout_s)")
    if old.get("status") == "creating":  # left half-made by a job that is gone
        if mode == "error":
            raise StoreError(generation.being_made())
        if mode in ("resume", "join") and generation.root() is not None:  # its rows were being written: again
            writers = _writers(generation)
            if not writers:
                return _resume(spec, rows.whole(), shards, old, generation.open(), head, attrs)
            log.warning("%s was left half-made by a job that wrote its rows and may only be paused (%s: silent, "
                        "not known to have ended); it is made again", url, _claimants_text(writers))
        return Decision(True, old, shards, head=head)
    group = generation.open()
    if mode == "error":
        n_done = int(done_shards(group).sum())
        raise StoreError(
            f"store {url} already exists ({n_done} of {old.get('n_shards', '?')} shards done, status "
            f"{old.get('status', '?')}); pass --resume to finish it, --join to compute beside other processes, or "
            "--overwrite to replace it"
        )
    if mode == "overwrite":
        return Decision(True, old, shards, head=head)
    rows = rows.whole()  # (a listing streamed: a store there is resumed from its rows, all of them)
    check_resumable(url, old, json.loads(json.dumps(with_digests(attrs, rows))), group, rows.paths, rows.ids)
    return _resume(spec, rows, shards, old, group, head)


def _writers(generation: Generation) -> list[dict[str, Any]]:
    """The claimants of a half-made generation that may write its rows still (the first started first): the one
    that made it (``rows``; records made before it said so: those that did not join) and those that took a turn at
    writing them again (:meth:`~.generation.Generation.take_rows`; not those that came to and did not), not known to
    be gone (:func:`~.claimants.gone`)."""
    turns = {f"{holder:016x}" for _n, holder in generation.rows_turns()}
    found = [r for r in generation.roster.all()
             if (r.get("rows", not r.get("join")) or r.get("id") in turns) and not gone(r)]
    return sorted(found, key=lambda r: (str(r.get("started", "")), str(r.get("id", ""))))


def _made_by_another(generation: Generation, url: str, head: Head, timeout_s: float) -> None:
    """Wait while a live process makes the generation (a process joining a store another made a moment before), or
    while the head naming it is younger than a claimant's timeout (its maker swaps the head, then writes its record:
    a joiner that looks in between finds no claimant yet, and took the generation for one left half-made: it made
    the store again over it, and the maker stopped, "made again by another job"); return at once where it is made,
    or its maker is gone (half-made: its rows written again, or the store made again)."""
    while not generation.made() and (generation.roster.live() or (not generation.roster.all() and
                                                                  _age_s(head) < timeout_s)):
        if not generation.still_live():
            raise StoreError(f"store {url} was made again by another job while this one waited to join it; run "
                             "again")
        time.sleep(WAIT_S / 4)


def _age_s(head: Head) -> float:
    """Seconds since ``head`` was written (its ``created``; unknown: as old as can be)."""
    try:
        made = datetime.datetime.fromisoformat(str(head.attrs["created"]))
    except (KeyError, ValueError):
        return float("inf")
    return (datetime.datetime.now(datetime.timezone.utc) - made).total_seconds()


def _timeout(claimants: list[dict[str, Any]]) -> float:
    return max(float(m.get("timeout_s", 0)) for m in claimants)


def _resume(spec: JobSpec, rows: Rows, shards: list[Shard], old: dict[str, Any], group: Any, head: Head,
            half_made: StoreRecord | None = None) -> Decision:
    """What resuming a store made by this job computes: the shards not committed, and the committed ones whose
    images changed since (refused unless output.on_change: redo). ``half_made``: this job's record, the store left
    half-made (its rows not all written: they are written again, from this listing, behind its shards), compared
    with the rows its committed shards computed (their ids, paths and labels) and their images."""
    done = done_shards(group)
    blocks = row_blocks(len(rows))
    if half_made is not None:
        blocks = committed_blocks(done, spec.data.shard_size, len(rows))
        check_half_made(spec.output.store, old, json.loads(json.dumps(half_made)), group, rows, blocks)
    _check_labels(spec, rows, old, group, blocks)
    changed, prints = changed_rows(spec, group, rows, blocks)
    hit = {r // spec.data.shard_size for r in changed}  # shards are contiguous runs of shard_size rows
    redo = [s for s in shards if done[s.index] and s.index in hit]
    if changed and spec.output.on_change != "redo":
        raise StoreError(_changed_text(spec, rows, group, changed))
    redone = {s.index for s in redo}
    todo = [s for s in shards if not done[s.index] or s.index in redone]
    if half_made is not None:  # (every row's source facts are written again)
        return Decision(False, old, todo, redo, head=head, rows_again=True)
    return Decision(False, old, todo, redo, prints, moved_locators(group, rows), head)


def _changed_text(spec: JobSpec, rows: Rows, group: Any, changed: list[int]) -> str:
    """The refusal of a resume that found images changed since their rows were read: those computed (their values
    are the old images') and those that failed (no values: a file restored or fixed since) said apart."""
    ids = rows.ids if rows.stored is None else get_array(group, "ids")  # rows left in the store: its ids
    failed = np.asarray(get_array(group, "status").get_coordinate_selection(np.asarray(changed))) == FAILED
    said = []
    for rows_of, what in (([r for r, f in zip(changed, failed, strict=True) if not f], "computed before"),
                          ([r for r, f in zip(changed, failed, strict=True) if f], "that failed before")):
        if rows_of:
            named = ", ".join(f"{str(ids[r])!r}" for r in rows_of[:10])
            said.append(f"the images of {count(len(rows_of), 'row')} {what} have changed since (their content "
                        f"digest differs): {named}{' ...' if len(rows_of) > 10 else ''}")
    why = ("Their stored values are the old images'; resuming would mix both" if not failed.all() else
           "They hold no values (they failed); their images can be read again")
    return (f"cannot resume {spec.output.store}: {'; '.join(said)}. {why}. Set output.on_change: redo (--set "
            "output.on_change=redo) to compute their shards again, or --overwrite")


def _check_labels(spec: JobSpec, rows: Rows, old: dict[str, Any], group: Any, blocks: list[tuple[int, int]]) -> None:
    """Refuse to resume a store whose source now gives other labels or class names (a tar's ``.cls`` rewritten, a
    manifest's label column edited): its rows keep the labels they were listed with, and a gradient of the
    label's logit used them. ``blocks``: the rows to compare (:func:`~.provenance.row_blocks`)."""
    if rows.stored is not None:  # the rows as the store lists them: nothing to compare
        return
    stored = get_array(group, "labels")
    if stored.shape[0] != len(rows):  # another listing altogether: check_resumable refused it
        return
    differ = []  # (a block at a time: 400M labels are 3.2 GB)
    for a, b in blocks:
        differ.append(np.flatnonzero(read_all(stored, a, b) != np.asarray(rows.labels[a:b])) + a)
    n, first = sum(map(len, differ)), next((int(d[0]) for d in differ if len(d)), None)
    if not n and list(old.get("classes") or []) == list(rows.classes):
        return
    if first is not None:
        what = (f"the labels of {count(n, 'row')} differ from the store's (first: row {first} {rows.ids[first]!r}, "
                f"{read_all(stored, first, first + 1)[0]} in the store, {rows.labels[first]} now)")
    else:
        what = f"the class names differ from the store's ({old.get('classes')} in the store, {rows.classes} now)"
    raise StoreError(f"cannot resume {spec.output.store}: {what}; its rows keep the labels they were listed with "
                     "(and a gradient of the label's logit used them): resuming would mix both. Use --overwrite")


class _Raced(Exception):
    """Joining: another process made the store between this one's look and its swap of the head."""


@dataclass(frozen=True)
class Outcome:
    """What the store holds once the job is over, read from it for the run's summary."""

    rows: int
    ok: int
    failed: int
    pending: int
    failures: list[tuple[int, str, str]]  # up to 20 failed rows: (row, id, error)
    nonfinite: dict[str, tuple[int, list[int]]]  # capture -> (rows holding NaN or Inf, the first of them)
    float16: list[str]  # captures stored as float16
    complete: bool = False  # every shard is committed


class StoreSession:
    """One job's session with its store (see the module's docstring).

    :meth:`decide` reads the store and says what the job would do, writing nothing; :meth:`on_write_start` makes
    the store (a new generation) or resumes it, as a claimant, and returns the shards to compute; the workers claim,
    write and commit them with :attr:`ticket`; :meth:`shard_done` merges a committed shard's statistics as it
    comes; :meth:`remaining` says what is left once they ran (shards other claimants hold, or that came free);
    :meth:`on_write_complete` finishes the store once every shard is committed (exactly once, whoever commits
    last), or :meth:`on_write_failed` says how the job stopped; :meth:`close` ends this claimant's part. A resume with
    nothing to do calls :meth:`unchanged` instead."""

    def __init__(self, spec: JobSpec, index: IndexHooks | None = None) -> None:
        self.spec = spec
        self.index = index
        self.objects = Objects.at(spec.output.store, spec.output.storage_options, spec.output.lease_timeout_s)
        self.record: StoreRecord | None = None  # what this job records in the store (decide)
        self.decision: Decision | None = None  # decide's
        self.shards: list[Shard] = []  # the job's, all of them
        self.generation: Generation | None = None  # the store's, from on_write_start
        self.claimant: Claimant | None = None  # this process, a claimant of it from on_write_start
        self.totals: Totals | None = None  # committed shards' statistics, merged as they come
        self._parts: PartMerger | None = None  # and their index parts, by a thread of their own (with the totals)
        self._left = False  # their partial left for the merge of all (:meth:`_leave_partial`)
        self._checkpoint: tuple[str, int] | None = None  # the last one left (:meth:`_leave_checkpoint`): key, shards
        self._merged = 0  # shards whose statistics this job merged as they came (those the totals hold)
        self._probe: Probe | None = None  # decide's
        self._ended = False
        self.behind: RowsBehind | None = None  # a new generation's rows, written behind its making (on_write_start)
        self._writing: threading.Thread | None = None  # ... by this thread
        self._replaced = False  # this job made the store again over one that was there (on_write_start)

    @property
    def ticket(self) -> Ticket | None:
        """What the job's writers claim and commit with (None before the store is started)."""
        if self.generation is None or self.claimant is None:
            return None
        return Ticket(self.generation.name, self.claimant.id, self.spec.output.lease_timeout_s,
                      self.spec.output.if_exists == "join")

    def recorded(self) -> dict[str, Any] | None:
        """The store's state as it is now (None: no store there)."""
        from .generation import read_state

        return read_state(self.spec.output.store, self.spec.output.storage_options)

    def kept_probe(self) -> Probe | None:
        """What a complete store's probe measured, where this job's model would measure the same without being built
        (:func:`~.provenance.kept_probe`); None: the job builds and probes its model."""
        return kept_probe(self.spec, self.recorded())

    def stored_rows(self, labels: bool = False) -> Rows | None:
        """The rows as the store records them, where the source is as it was listed or only parts of it changed
        (those listed again: ``data.reuse``); None: the source is listed again."""
        group = open_group(self.spec.output.store, self.spec.output.storage_options)
        return reuse(self.spec.data, StoredRows(group, labels))

    def stored_chunking(self, keys: list[str]) -> dict[str, tuple[int, bool]]:
        """Rows per chunk and whether sharded, of the store's capture arrays ``keys`` (the generation :meth:`decide`
        read: one left half-made too, its arrays made)."""
        head = self.decision.head if self.decision is not None else None
        group = Generation(self.objects, head.generation).open() if head is not None and head.generation else \
            open_group(self.spec.output.store, self.spec.output.storage_options)
        arrays = {k: get_array(group, k) for k in keys}
        return {k: (int(a.chunks[0]), bool(getattr(a, "shards", None))) for k, a in arrays.items()}

    def decide(self, rows: Rows | Streamed, shards: list[Shard], probe: Probe, sources: bool = True) -> Decision:
        """What the job would do to the store (:func:`decide`), writing nothing; ``sources``: the stores of
        output.reuse checked first. The store record this job writes is :attr:`record` from then on."""
        spec = self.spec
        self.shards = shards
        self._probe = probe
        self.record = store_attrs(spec, rows, len(shards), probe)
        if sources and spec.output.reuse:  # every store to take rows from makes them as this job would
            check_sources(spec.output.reuse, self.record, spec.output.store, spec.output.storage_options)
        self.decision = decide(spec, rows, shards, self.record, self.objects)
        return self.decision

    def _decided(self) -> tuple[Decision, StoreRecord]:
        if self.decision is None or self.record is None:
            raise RuntimeError("StoreSession.decide comes first")
        return self.decision, self.record

    def unchanged(self) -> Outcome:
        """A resume with nothing to compute: what moved in the source recorded (best effort), nothing else
        written; the store's outcome as it is."""
        decision, record = self._decided()
        head = decision.head
        assert head is not None and head.generation is not None  # a complete store of this format
        self.generation = Generation(self.objects, head.generation)
        try:
            self._record_source(decision, record, None)
        except (OSError, StoreError) as err:
            log.info("the source of %s moved but not its images; its new fingerprints were not recorded (%s): the "
                     "next resume compares them again", self.spec.output.store, err)
        return self._outcome()

    # ---------------------------------------------------------------------------------------------- start

    def on_write_start(self, rows: Rows | Streamed) -> list[Shard]:
        """Make the store (a new generation, swapped in by the head: refused when the head changed since
        :meth:`decide` read it; joining, the store another process made meanwhile is joined) or resume it, as a
        claimant; the shards to compute (those not committed; joining, from a place of this claimant's own)."""
        decision, record = self._decided()
        spec = self.spec
        for _ in range(3):
            if not decision.create:
                self._resume(decision, record, rows.whole())
                break
            try:
                self._make(decision, record, rows)
                break
            except _Raced:  # joining: another process made it meanwhile
                assert self._probe is not None
                decision = self.decide(rows, self.shards, self._probe, sources=False)
        assert self.generation is not None and self.claimant is not None
        self.totals = Totals(len(self.shards), self._fresh(record))
        self._parts = PartMerger(self.totals)  # (its thread started by the first part offered)
        if self.behind is not None and self.behind.stretches == 1:  # nothing to write beside: written now
            self.behind.write()
        elif self.behind is not None:  # its shards are handed out as their rows are written (rows_ready)
            self._writing = threading.Thread(target=self._write_rows_behind, name="extractor-rows", daemon=True)
            self._writing.start()
        done = self.generation.ledger().read().done
        todo = [s for s in self.shards if not done[s.index]]
        if spec.output.if_exists == "join" and todo and self._writing is None:  # joiners start apart, so that their
            # claims rarely meet (the maker of a store whose rows are written behind starts at its first rows)
            at = self.claimant.id % len(todo)
            todo = todo[at:] + todo[:at]
        return todo

    def _make(self, decision: Decision, record: StoreRecord, rows: Rows | Streamed) -> None:
        """A new generation swapped in by the head (from the version :meth:`decide` read), this process its claimant,
        the other generations removed, the new one written."""
        spec = self.spec
        try:
            name = swap_head(self.objects, decision.head, now())  # from here on the store is this generation
        except StoreError:
            if spec.output.if_exists == "join":
                raise _Raced from None
            raise StoreError(self._made_meanwhile(decision)) from None
        except OSError as err:  # NotADirectoryError, PermissionError, no bucket, credentials...
            raise StoreError(
                f"cannot create the store at output.store {spec.output.store}: {type(err).__name__}: "
                f"{str(err).rstrip('.')}. Its parent folder or bucket must exist and be writable (check "
                "output.store and output.storage_options)") from err
        self.generation = Generation(self.objects, name)
        self._replaced = decision.old is not None
        self._join()
        legacy = decision.head is not None and decision.head.generation is None  # a store of format 1 replaced
        if collect_others(self.objects, name, legacy):
            log.info("%s: the objects of its earlier generation were removed", spec.output.store)
        self.behind = start_generation(self.objects, name, rows, self._arrays(record), {**record, "status": "running"})
        if not self.generation.still_live():  # made again while this process made it (it was stopped meanwhile)
            self._live()

    @property
    def rows_ready(self) -> RowsBehind | None:
        """Asked which shards' rows are in the store (``ready``, ``wait``) while a new store's rows are written behind
        its making; None: all of them are."""
        return self.behind if self.behind is not None and not self.behind.made else None

    def _write_rows_behind(self) -> None:
        assert self.behind is not None
        try:
            self.behind.write()
        except BaseException as err:  # noqa: BLE001 - raised to whoever asks for a shard's rows next
            log.debug("the rows of %s were not all written: %s", self.spec.output.store, err)

    def _rows_written(self, stop: bool = False, failed: bool = False) -> None:
        """Wait for the rows written behind (``stop``: only the stretch being written); their error raised, but where
        the job ``failed`` (its own error goes up)."""
        if self._writing is None or self.behind is None:
            return
        if stop or (failed and self.behind.listing):  # (a listing streamed: the rest may be minutes away, and the
            self.behind.stop()  # resume of the half-made store keeps the shards committed as it writes them again)
        elif failed and not self.behind.made and self.behind.error is None:
            log.warning("writing the rest of %s's rows, so that its resume keeps the shards committed so far",
                        self.spec.output.store)
        self._writing.join()
        self._writing = None
        if not failed:
            self.behind.wait(len(self.shards) - 1)  # raises what stopped it

    def _made_meanwhile(self, decision: Decision) -> str:
        """What to say where the store was made (again) by another job between this one's look and its swap."""
        what = "created" if decision.head is None else "replaced"
        head = read_head(self.objects)
        live = Generation(self.objects, head.generation).roster.live() if head and head.generation else []
        who = f" (by another extractor job: {_claimants_text(live)})" if live else ""
        return (f"store {self.spec.output.store} was {what} by another job after this one looked at it{who}; run "
                "again (--resume finishes it)")

    def _resume(self, decision: Decision, record: StoreRecord, rows: Rows) -> None:
        """This process a claimant of the generation :meth:`decide` read (refused where the head names another
        now), its changed shards made pending again, the source recorded where it moved; a generation left
        half-made, its rows to write again (:attr:`behind`)."""
        head = read_head(self.objects)
        assert decision.head is not None
        if head is None or head.generation is None or head.generation != decision.head.generation:
            raise StoreError(f"store {self.spec.output.store} was replaced by another job after this one looked at "
                             "it; run again (--resume finishes it)")
        self.generation = Generation(self.objects, head.generation)
        self._join(rows=False)  # (one that writes a half-made store's rows again says so once it took its turn)
        again = decision.rows_again and self._first_to_write_rows()
        if not again:
            self._wait_made()
        table = self._redo(decision)
        self._record_source(decision, record, table)
        if again:
            self._rows_again(rows, table)

    def _first_to_write_rows(self) -> bool:
        """Whether this process writes the rows of the half-made generation again: the one that takes the turn
        (:meth:`.generation.Generation.take_rows`, a create-only write) does, where they are still to write; of
        the others, one resuming is refused, one joining waits for the store made (False), and takes the next turn
        where the holder's is gone first."""
        assert self.generation is not None and self.claimant is not None
        said = False
        while (holder := self.generation.take_rows(self.claimant.id)) is not None:
            if self.spec.output.if_exists != "join":
                err = StoreError(f"store {self.spec.output.store} is being resumed by another extractor job now: "
                                 f"{_claimants_text([self.generation.roster.record(holder)])}. Wait for it to "
                                 "finish, or run this job with --join to compute beside it")
                err.busy = True  # type: ignore[attr-defined]  # (no command to finish it said after: it is not this job's)
                raise err
            if self.generation.made():
                return False
            if not self.generation.still_live():
                raise StoreError(f"store {self.spec.output.store} was made again by another job while this one waited "
                                 "to join it; run again")
            record = self.generation.roster.record(holder)
            if gone(record):
                continue  # (its turn ended meanwhile: the next is taken)
            if not alive(record):  # silent past its timeout elsewhere: it may only be paused, or gone with its host
                raise StoreError(f"store {self.spec.output.store} was left half-made by a job that wrote its rows and "
                                 f"is silent now ({_claimants_text([record])}); run again with --resume (it is made "
                                 "again where that job may only be paused)")
            if not said:
                log.info("%s: its rows are written again by another job; this one waits for them",
                         self.spec.output.store)
                said = True
            time.sleep(WAIT_S / 4)
        self.claimant.say(rows=True)  # (its turn says so already: _writers)
        return not self.generation.made()  # (made meanwhile by the turn before, gone since: nothing to write)

    def _rows_again(self, rows: Rows, table: Table) -> None:
        """The rows of a generation left half-made, to write again behind its shards (:attr:`behind`)."""
        assert self.generation is not None
        attempts = np.unique(table.attempts("rows"))
        if len(attempts) != 1 or not attempts[0]:  # (named once, when the generation was made)
            raise StoreError(f"cannot resume {self.spec.output.store}: its rows are held by {len(attempts)} attempts, "
                             "not the one it was made with; --overwrite makes it again")
        log.info("%s was left half-made: its rows are written again, its %s kept", self.spec.output.store,
                 count(int(table.done.sum()), "committed shard"))
        self.behind = rewrite_rows(self.objects, self.generation.name, rows, int(attempts[0]),
                                   source(self.spec.data.source).locators)

    def _arrays(self, record: StoreRecord) -> StoreArrays:
        spec = self.spec
        parts = self.index.parts(record["captures"]) if self.index is not None else {}
        out = spec.output
        return StoreArrays(captures=record["captures"], extras=record["extras"], shard_size=spec.data.shard_size,
                           chunk_rows=record["chunk_rows"], compression=out.compression,
                           compression_level=out.compression_level, shuffle=out.shuffle, reuse=bool(out.reuse),
                           sharded=spec.output.sharding, locators=source(spec.data.source).locators,
                           index_parts=parts)

    def _join(self, rows: bool = True) -> None:
        """This process, a claimant of the generation (its record renewed until the session ends); ``rows``: it
        writes the generation's rows (it makes it, or writes them again)."""
        assert self.generation is not None
        generation = self.generation
        info = {**owner(), "join": self.spec.output.if_exists == "join", "rows": rows}
        self.claimant = Claimant(self.objects, generation.claimants_prefix, self.spec.output.lease_timeout_s, info,
                             still_ours=generation.still_live)
        self.claimant.start()
        if self.objects.conditional and is_s3(self.objects.url) and not self.objects.probe():
            self.objects.conditional = False  # its swaps read, compare and write from now on
            log.warning("%s does not honour conditional writes (a create-only write replaced the object it should "
                        "have refused): a process paused past its claim could still commit after another took it; "
                        "run one job at a time on this store", self.objects.url)
        opened = _Opened.last
        if opened is not None and opened.key[1] != generation.name:
            _Opened.last = None  # another generation's arrays: opened again by the first shard

    def _wait_made(self) -> None:
        """Joining a generation another live process is still making: wait until it is made (its maker gone
        first: refused)."""
        assert self.generation is not None and self.claimant is not None
        mine = f"{self.claimant.id:016x}"
        while not self.generation.made():
            others = [r for r in self.generation.roster.live() if r.get("id") != mine]  # (this one's is live too)
            if not others or not self.generation.still_live():
                raise StoreError(f"store {self.spec.output.store} was left half-made by the job that made it; run "
                                 "again with --resume (or --overwrite)")
            time.sleep(WAIT_S / 4)

    def _redo(self, decision: Decision) -> Table:
        """The committed shards whose images changed made pending again, claimed by this claimant (their old values
        no longer read); the ledger after."""
        assert self.generation is not None and self.claimant is not None
        ledger, claimant = self.generation.ledger(), self.claimant.id
        dead = self.generation.roster.dead
        verdicts = ledger.apply([s.index for s in decision.redo], lambda e, _s: reset(e, claimant, dead))
        held = [s for s, v in verdicts.items() if v is not Verdict.OK]
        if held:
            raise StoreError(f"cannot redo shards {held[:10]} of {self.spec.output.store}: another live process "
                             "computes them now; run again once it is done")
        return ledger.read()

    def _record_source(self, decision: Decision, record: StoreRecord, table: Table | None) -> None:
        """The source's new fingerprints and locators (where they moved but not the images) recorded under a new
        attempt of the ``rows`` slot, named shard by shard in the ledger; its listing recorded (a swap)."""
        assert self.generation is not None
        generation = self.generation
        self._record_listing(decision, record)
        columns: dict[str, np.ndarray] = {k: np.asarray(v) for k, v in {
            "fingerprint": decision.fingerprints, **(decision.locators or {})}.items() if v is not None}
        redone = [s.index for s in decision.redo] if source(self.spec.data.source).prints_on_read else []
        if not columns and not redone:
            return
        group = generation.open(table)  # (a shard computed again: its workers' fingerprints, not this resume's)
        size = self.spec.data.shard_size
        moved = sorted((set(_moved_shards(group, columns, size)) - set(redone)) |
                       set(_printed_shards(group, redone, size)))
        if moved:
            attempt = self._write_rows(columns, moved, group, set(redone))
            dead, claimant = generation.roster.dead, self.claimant.id if self.claimant is not None else 0
            generation.ledger().apply(moved, lambda e, _s: amend_rows(e, attempt, claimant, dead))

    def _record_listing(self, decision: Decision, record: StoreRecord) -> None:
        """The source's listing recorded (a swap), where it differs from the one recorded."""
        assert self.generation is not None
        listing = record.get("listing")
        was, version = self.generation.listing()
        changed = listing is not None and listing != (was if was is not None else (decision.old or {}).get("listing"))
        if changed and not self.generation.record_listing(listing, version):
            log.info("%s: the source's listing was recorded by another process meanwhile", self.spec.output.store)

    def _write_rows(self, columns: Mapping[str, np.ndarray], shards: list[int], group: Any,
                    zeroed: set[int]) -> int:
        """The rows of ``shards`` of every array of the ``rows`` slot written under a new attempt, which the ledger
        then names for those shards: from ``columns`` (whole arrays) where given, else as ``group`` (the store as
        committed) holds them (an attempt holds every array of its slot: one left out read as fill values, a tar's
        member offsets -1 once its fingerprints alone had moved); the fingerprints of the shards ``zeroed`` 0 (their
        workers' are the ones to compare: :func:`_printed_shards`); the attempt."""
        import zarr

        assert self.generation is not None
        attempt, size = new_id(), self.spec.data.shard_size
        view = write_view(self.objects.zarr_store(self.generation.name, read_only=False), {"rows": attempt},
                          url=self.objects.url)
        with zarr.config.set({"array.write_empty_chunks": True}):
            target = zarr.open_group(store=view, mode="r+", use_consolidated=False)
            for name in ("fingerprint", *locator_arrays(group)):  # the rows slot's arrays (layout.slots)
                array, column = get_array(target, name), columns.get(name)
                for s in shards:
                    a, b = s * size, min((s + 1) * size, array.shape[0])
                    array[a:b] = 0 if name == "fingerprint" and s in zeroed else column[a:b] if column is not None \
                        else read_all(get_array(group, name), a, b)
        return attempt

    # ---------------------------------------------------------------------------------------------- shards

    def _fresh(self, record: StoreRecord) -> Fresh | None:
        if self.index is None:
            return None
        return self.index.fresh(record["captures"], (record.get("model") or {}).get("prefix_tokens"))

    def shard_done(self, index: int, stats: str, attempt: int = 0,
                   parts: Mapping[str, np.ndarray] | None = None) -> None:
        """Merge the statistics record ``stats`` and the index ``parts`` of a shard this job committed now, by
        ``attempt`` (what is not merged now, the end merges from the store)."""
        if self.totals is not None and self.totals.add(index, stats, attempt):
            if parts and self._parts is not None:
                self._parts.offer(index, parts)
            self._merged += 1  # (counted: the shards held, summed at every shard, cost O(shards) a shard)
            if self._merged - (self._checkpoint[1] if self._checkpoint else 0) >= CHECKPOINT_SHARDS:
                self._leave_checkpoint()
        if self.claimant is not None:
            self.claimant.committed()

    def _leave_checkpoint(self) -> None:
        """Every :data:`CHECKPOINT_SHARDS` shards merged: their statistics left as a partial (this claimant's last
        one removed), so that a process killed without leaving its partial (SIGKILL, a node lost) costs whoever
        merges them all the records of its shards since, not of all of them (at 400M rows, up to 390,000 records
        of 800 KB)."""
        if self.totals is None or self.claimant is None or self.generation is None or self.totals.torn:
            return
        held = self._merged
        try:
            if self.generation.final() is not None:  # finished meanwhile: nothing is left to merge
                return
            key = self.generation.leave_partial(self.claimant.id, self._totals_bytes(), held)
            if self._checkpoint is not None:
                self.generation.remove_partial(self._checkpoint[0])  # held in the new one too
        except Exception as err:  # noqa: BLE001 - a checkpoint saves work; the storage may refuse it, the job goes on
            log.debug("statistics checkpoint of %s not left: %s", self.spec.output.store, err)
            return
        self._checkpoint = (key, held)

    def remaining(self, wait: bool) -> list[Shard]:
        """The shards not committed that this claimant may take now (pending, or claimed by a dead claimant); with
        ``wait``, while every shard left is held by another live claimant, waits until one is committed or free.
        [] once every shard is committed."""
        assert self.generation is not None
        ledger = self.generation.ledger()
        while True:
            self._check()
            table = ledger.read()
            left = np.flatnonzero(~table.done)
            if not len(left):  # every shard committed: this claimant merges them too (no partial of its own)
                return []
            claimant = table.entries["claimant"]
            mine = self.claimant.id if self.claimant is not None else 0
            dead = self.generation.roster.dead
            free = [int(s) for s in left if int(claimant[s]) in (0, mine) or dead(int(claimant[s]))]
            if free or not wait:
                return [self.shards[s] for s in free]
            self._leave_partial()  # nothing left to take: another claimant's commit may finish the store
            time.sleep(WAIT_S)

    def _check(self) -> None:
        if self.claimant is not None:
            self.claimant.check()

    def _live(self) -> None:
        """Raise :class:`FencedError` where the store was made again since this job began (its generation is no
        longer the head's): nothing this job would write or say of it holds."""
        assert self.generation is not None
        if not self.generation.still_live():
            if self.claimant is not None:
                self.claimant.lost = True
            self._check()

    # ---------------------------------------------------------------------------------------------- end

    def on_write_complete(self) -> Outcome:
        """The shards ran: once every shard is committed, the store is finished (statistics and write-time indexes
        merged, the final record written: once, whoever comes first; the garbage of attempts no one names removed);
        otherwise this claimant says it ended incomplete. A storage that refuses is a StoreError that says the
        committed shards are kept."""
        assert self.generation is not None
        self._rows_written()
        self._live()
        try:
            complete = bool(self.generation.ledger().read().done.all())
            if complete and self.generation.final() is None:
                self._finish()
                self._live()  # made again while this process merged it (stopped meanwhile): not this job's to say
            self._end("complete" if complete else "incomplete")
            return self._outcome()
        except (StoreError, FencedError):
            raise
        except OSError as err:
            raise StoreError(f"cannot finish {self.spec.output.store}: {type(err).__name__}: {err}; its committed "
                             "shards are kept: --resume finishes it once the storage works") from err

    def _finish(self) -> None:
        """Merge the statistics and the write-time indexes of every committed shard and write the final record."""
        assert self.generation is not None
        generation = self.generation
        group = generation.open()
        merged = self._merged_all(group)
        stats = merged.summary()
        if self.index is not None:
            self.index.finish(group, generation, merged.parts, merged.parts_held)
        by = f"{self.claimant.id:016x}" if self.claimant is not None else None
        if generation.finish({"status": "complete", "stats": stats, "at": now(), "by": by}):
            removed = generation.collect()
            if removed:
                log.info("%s: removed the objects of %s no one committed", self.spec.output.store,
                         count(removed, "attempt"))

    def _leave_partial(self) -> None:
        """Once this claimant has no shard left to take (or stops): the statistics of the shards it committed, left
        for whoever merges them all, who then reads none of their records (at 400M rows, 390,000 records of up to
        800 KB)."""
        if self._left or self.totals is None or self.claimant is None or self.generation is None or self.totals.torn:
            return  # (torn totals: whoever merges them all reads this claimant's shards' records from the store)
        self._left = True
        if self._parts is not None:
            self._parts.drain()  # (a few parts at most: their merges, then the partial holds them)
        try:
            # (a store finished meanwhile merges nothing more: nothing is left in it)
            if self.generation.root() is not None and self.totals.held.any() and self.generation.final() is None:
                self.generation.leave_partial(self.claimant.id, self._totals_bytes())
                if self._checkpoint is not None:
                    self.generation.remove_partial(self._checkpoint[0])  # held in this one too
        except Exception as err:  # noqa: BLE001 - the storage that stopped the job may refuse this too
            log.debug("statistics of %s's shards not left: %s", self.spec.output.store, err)

    def _totals_bytes(self) -> bytes:
        """This claimant's totals as its partial holds them (no part merged meanwhile)."""
        assert self._parts is not None
        with self._parts.held() as totals:
            return totals.to_bytes()

    def _stats(self, group: Any) -> dict[str, Any]:
        """Every committed shard's statistics, merged (:meth:`_merged_all`; the partials' index parts not read)."""
        return self._merged_all(group, parts=False).summary()

    def _merged_all(self, group: Any, parts: bool = True) -> Totals:
        """Every committed shard's statistics, merged: those this job merged as they came, those other claimants left
        merged (their partials), and the records of the shards in neither, read from the store; with the index
        parts of the shards of the first two (those of the others the end reads from the store)."""
        assert self.generation is not None
        if self._parts is not None and parts:
            self._parts.drain()  # (the parts of the shards committed so far: none read from the store again)
        if self.totals is None or self.totals.torn:  # (torn: this job's shards' records read from the store)
            self.totals = Totals(len(self.shards), self.totals.fresh if self.totals is not None else None)
            self._parts = self._parts.restart(self.totals) if self._parts is not None else PartMerger(self.totals)
        assert self._parts is not None
        mine = self.claimant.id if self.claimant is not None else None
        with self._parts.held() as totals:
            merged = copy.deepcopy(totals)  # this job's own stay its own: the partial it leaves
        n, fresh = len(self.shards), self.totals.fresh if parts else None  # partials of another shard count, or cut
        partials = [t for data in self.generation.partials(but=mine)  # short, are left out: their records are read
                    if (t := Totals.from_bytes(data, n, fresh)) is not None]
        partials.sort(key=lambda t: -int(t.held.sum()))  # a claimant's last (most shards) before its earlier ones,
        merge_shards(group, merged, partials)  # which it holds too: refused as overlapping
        return merged

    def on_write_failed(self, err: BaseException) -> None:
        """``err`` stopped the job: this claimant ends, saying how (its claims may be taken at once); the command
        that finishes the store is said by the CLI (``err.resumable``)."""
        # interrupted, or no longer the store's job: its rows stop now (the store half-made); any other error lets
        # them finish, so that the shards committed so far are kept by the resume (rows cost little beside them)
        self._rows_written(stop=not isinstance(err, Exception) or isinstance(err, FencedError), failed=True)
        if self.claimant is None:
            return
        status = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
        # its own record: no one else's object; what the store was made for where only --overwrite finishes it
        self._end(status, f"{type(err).__name__}: {err}"[:1000],
                  **({"remake": err.made_for} if isinstance(err, RemakeError) else {}))
        if isinstance(err, FencedError) or getattr(err, "busy", False):
            return
        gen = self.generation
        creating = gen is not None and not gen.made() and gen.still_live()
        err.resumable = True  # type: ignore[attr-defined]  # the CLI prints the command that finishes it
        err.creating = creating  # type: ignore[attr-defined]  # and says what is left of the store: half-made,
        err.replaced = self._replaced  # type: ignore[attr-defined]  # and what it held before gone

    def _end(self, status: str, error: str | None = None, **said: Any) -> None:
        if self.claimant is None or self._ended:
            return
        self._ended = True
        stats: dict[str, Any] | None = None
        if status != "complete":
            self._leave_partial()
        if status != "complete" and self.generation is not None and self.generation.made():
            try:
                stats = self._stats(self.generation.open())
            except Exception as err:  # noqa: BLE001 - the storage that stopped the job may refuse this too
                log.debug("statistics of %s not merged: %s", self.spec.output.store, err)
        self.claimant.end(status, error, **said, **({"stats": stats} if stats is not None else {}))

    def close(self) -> None:
        """End this claimant's part (one that did not say how it ended is ended as interrupted)."""
        self._rows_written(stop=True, failed=True)
        if self.claimant is not None and not self._ended:
            self._end("interrupted")

    def _counts(self, group: Any, table: Table) -> tuple[int, int, int, np.ndarray]:
        """Rows, ok and failed rows, and the first 20 failed ones: summed from the commits, each of which records
        its shard's (at 400M rows the status array is 400 MB in 390,625 objects), the failed ones read from the shards
        that have some; counted in the status array where a commit records none (a store made before they did)."""
        status = get_array(group, "status")
        done = table.entries[table.done]
        if bool((done["ok"].astype(np.int64) + done["failed"] > 0).all()):
            ok, failed = int(done["ok"].sum(dtype=np.int64)), int(done["failed"].sum(dtype=np.int64))
            return status.shape[0], ok, failed, _first_failed(status, table, self.spec.data.shard_size, 20)
        values = read_all(status)
        failed_rows = np.flatnonzero(values == FAILED)
        return len(values), int((values == OK).sum()), len(failed_rows), failed_rows[:20]

    def _outcome(self) -> Outcome:
        """The store's rows as they are now, read as committed."""
        assert self.generation is not None
        table = self.generation.ledger().read()
        group = self.generation.open(table)
        rows, ok, failed, failed_rows = self._counts(group, table)
        failures = []
        if len(failed_rows):
            ids, errors = get_array(group, "ids"), get_array(group, "errors")
            for r in failed_rows[:20]:
                failures.append((int(r), str(ids[int(r)]), str(errors[int(r)])))
        attrs = root_attrs(group)
        stats = dict(attrs.get("stats") or {})
        return Outcome(
            rows=rows,
            ok=ok,
            failed=failed,
            pending=rows - ok - failed,
            failures=failures,
            nonfinite={k: (v["nonfinite_rows"], v["first_nonfinite_rows"]) for k, v in stats.items()
                       if v["nonfinite_rows"]},
            float16=[k for k, m in attrs["captures"].items() if m["dtype"] == "float16"],
            complete=bool(table.done.all()),
        )


def _moved_shards(group: Any, columns: Mapping[str, np.ndarray], size: int) -> list[int]:
    """The shards (of ``size`` rows) where any of ``columns`` (whole per-row arrays) differs from what the store holds,
    compared a block of rows at a time; its fingerprints (:func:`~.provenance.stored_prints`) where one is known now
    (0: a file that cannot be seen now, which each resume names again, is not recorded over the one it had)."""
    def moved(k: str, v: np.ndarray, a: int, b: int) -> np.ndarray:
        if k != "fingerprint":
            return np.flatnonzero(v[a:b] != read_all(get_array(group, k), a, b))
        now = np.asarray(v[a:b])
        return np.flatnonzero((now != stored_prints(group, a, b)) & (now != 0))

    return sorted({int(r) // size for k, v in columns.items() for a, b in row_blocks(len(v))
                   for r in moved(k, v, a, b) + a})


def _printed_shards(group: Any, redone: list[int], size: int) -> list[int]:
    """Of the shards ``redone`` (a folder's or a manifest's, computed again: their files read anew), those whose rows
    hold a fingerprint a resume recorded (``fingerprint``, which :func:`~.provenance.stored_prints` prefers to the
    worker's ``read_fingerprint``): it is of the file before the shard is computed again, and a file that changed
    meanwhile and then came back to it (a link pointed back) would pass for the one computed."""
    stored = get_array(group, "fingerprint")
    return [s for s in redone if read_all(stored, s * size, min((s + 1) * size, stored.shape[0])).any()]


def _first_failed(status: Any, table: Table, size: int, first: int) -> np.ndarray:
    """The first ``first`` failed rows, read from the status of the committed shards whose commits count failed
    rows, in order (not every row's)."""
    e = table.entries
    found: list[np.ndarray] = []
    for s in np.flatnonzero(table.done & (e["failed"] > 0)).tolist():
        found.append(np.flatnonzero(np.asarray(status[s * size:(s + 1) * size]) == FAILED) + s * size)
        if sum(map(len, found)) >= first:
            break
    return np.concatenate(found)[:first] if found else np.zeros(0, np.int64)


def live_claimants(url: str, storage_options: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """The processes writing into the store's live generation now (inspect shows them)."""
    objects = Objects.at(url, storage_options)
    head = read_head(objects)
    if head is None or head.generation is None:
        return []
    return [m for m in Generation(objects, head.generation).roster.all() if alive(m)]

