"""A store's inside as tests reach it: what is committed, its claimants, and its arrays edited in place (as a damaged
or older store would hold them)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import zarr

from extractor.store import Generation, Objects, read_head
from extractor.store.views import GenerationStore


def generation(url: str, storage_options: Mapping[str, Any] | None = None) -> Generation:
    """The store's live generation."""
    objects = Objects.at(str(url), storage_options)
    head = read_head(objects)
    assert head is not None and head.generation is not None, f"no store of format 2 at {url}"
    return Generation(objects, head.generation)


def committed(url: str, shard: int | None = None, storage_options: Mapping[str, Any] | None = None) -> bool:
    """Whether ``shard`` (None: every shard) is committed (False before the store's root is written, or absent; a
    shard may be committed while a new store's rows are still written behind it)."""
    try:
        gen = generation(str(url), storage_options)
        if gen.root() is None:
            return False
        done = gen.ledger().read().done
    except (AssertionError, OSError, ValueError):
        return False
    return bool(done.all() if shard is None else done[shard])


def committed_count(url: str, storage_options: Mapping[str, Any] | None = None) -> int:
    """How many shards are committed (0 before the store's root is written, or absent)."""
    try:
        gen = generation(str(url), storage_options)
        return 0 if gen.root() is None else int(gen.ledger().read().done.sum())
    except (AssertionError, OSError, ValueError):
        return 0


def claimants(url: str, storage_options: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """The records of the processes that wrote into the store's live generation."""
    return generation(str(url), storage_options).roster.all()


def edited(url: str, storage_options: Mapping[str, Any] | None = None) -> zarr.Group:
    """The store's live generation opened to be written in place: a chunk of a committed shard is replaced in the
    attempt that holds it (what a damaged store, or one made by an older extractor, would hold), and the root's
    attributes are rewritten as given. For tests only: no job ever writes a committed attempt."""
    gen = generation(str(url), storage_options)
    table = gen.ledger().read()

    class InPlace(GenerationStore):
        def physical(self, key: str, slot: Any, coord: int) -> str | None:
            where = super().physical(key, slot, coord)
            if slot is not None and where is None:
                raise AssertionError(f"{key}: its shard is not committed")
            return where

        async def set(self, key: str, value: Any) -> None:
            where = await self.resolve(key)
            assert where is not None
            await self._store.set(where, value)

    store = InPlace(gen.objects.zarr_store(gen.name, read_only=False), table=table, url=str(url))
    with zarr.config.set({"array.write_empty_chunks": True}):
        return zarr.open_group(store=store, mode="r+", use_consolidated=False)


def root_attrs(url: str, storage_options: Mapping[str, Any] | None = None, **changes: Any) -> dict[str, Any]:
    """The live generation root's extractor attributes, changed by ``changes`` (written back) where given."""
    gen = generation(str(url), storage_options)
    key = gen.key("__root.json")
    meta = json.loads(gen.objects.get(key) or b"{}")
    attrs = meta.setdefault("attributes", {}).setdefault("extractor", {})
    if changes:
        attrs.update(changes)
        gen.objects.put(key, json.dumps(meta).encode())
    return dict(attrs)


def opened(url: str, storage_options: Mapping[str, Any] | None = None) -> zarr.Group:
    """The store's root group as readers see it (its live generation, what its commits name)."""
    from extractor.store import open_group

    return open_group(str(url), storage_options)


def made_again(url: str) -> str:
    """A local store made again (as ``--overwrite`` makes it): its generation copied under a new name that the head
    now names. The new generation's name."""
    import shutil
    import uuid
    from pathlib import Path

    gen = generation(str(url))
    name = uuid.uuid4().hex[:16]
    shutil.copytree(Path(url) / gen.name, Path(url) / name)
    for block in (Path(url) / name / "__txn" / "ledger").iterdir():  # each block names its generation
        data = block.read_bytes()
        size = int.from_bytes(data[4:8], "little")
        header = json.loads(data[8 : 8 + size])
        header["generation"] = name
        new = json.dumps(header).encode()
        block.write_bytes(data[:4] + len(new).to_bytes(4, "little") + new + data[8 + size :])
    head = json.loads((Path(url) / "zarr.json").read_text())
    head["attributes"]["extractor"]["generation"] = name
    (Path(url) / "zarr.json").write_text(json.dumps(head))
    return name


def claimant_record(url: str, **changes: Any) -> dict[str, Any]:
    """The store's last claimant's record, changed by ``changes`` (a key set to None is removed) and written back."""
    gen = generation(str(url))
    names = gen.objects.list(gen.claimants_prefix)
    key = f"{gen.claimants_prefix}/{names[-1]}"
    record = json.loads(gen.objects.get(key) or b"{}")
    for k, v in changes.items():
        if v is None:
            record.pop(k, None)
        else:
            record[k] = v
    gen.objects.put(key, json.dumps(record).encode())
    return record


def dropped(url: str, name: str) -> None:
    """A local store's node ``name`` removed, from the generation and from its root's consolidated metadata (as a
    store made before it was written holds it)."""
    import shutil
    from pathlib import Path

    gen = generation(str(url))
    shutil.rmtree(Path(url) / gen.name / name)
    key = gen.key("__root.json")
    meta = json.loads(gen.objects.get(key) or b"{}")
    inner = meta.get("consolidated_metadata", {}).get("metadata", {})
    for k in [k for k in inner if k == name or k.startswith(f"{name}/")]:
        del inner[k]
    gen.objects.put(key, json.dumps(meta).encode())


def pending(url: str, shards: list[int], storage_options: Mapping[str, Any] | None = None) -> Any:
    """Shards of a store made pending again (as a resume that redoes them makes them) and claimed for a new
    claimant, whose ticket is returned: a worker given it writes them."""
    from extractor.store import Ticket, new_id
    from extractor.store.ledger import reset

    gen = generation(str(url), storage_options)
    claimant = new_id()
    gen.ledger().apply(shards, lambda e, _s: reset(e, claimant, lambda _c: True))
    gen.objects.remove(gen.txn("final"))
    return Ticket(gen.name, claimant)


def replaced_array(url: str, name: str, data: Any, chunks: tuple[int, ...]) -> None:
    """A local store's array ``name`` replaced by a plain one holding ``data`` (an array of another form, as a store
    made by an older extractor holds it), in the generation and in its root's consolidated metadata."""
    import shutil
    from pathlib import Path

    gen = generation(str(url))
    shutil.rmtree(Path(url) / gen.name / name)
    array = zarr.create_array(store=gen.objects.zarr_store(gen.name, read_only=False), name=name, data=data,
                              chunks=chunks)
    key = gen.key("__root.json")
    meta = json.loads(gen.objects.get(key) or b"{}")
    meta["consolidated_metadata"]["metadata"][name] = array.metadata.to_dict()
    gen.objects.put(key, json.dumps(meta).encode())


def wait_dead(url: str, storage_options: Mapping[str, Any] | None = None, seconds: float = 60) -> None:
    """Until no claimant of the store's live generation is alive (those stopped stop renewing their records): what
    another job waits for before it takes their claims, or makes the store again."""
    import time

    from extractor.store import alive

    deadline = time.monotonic() + seconds
    while True:
        head = read_head(Objects.at(str(url), storage_options))
        if head is None or head.generation is None:
            return
        if not any(alive(c) for c in generation(str(url), storage_options).roster.all()):
            return
        assert time.monotonic() < deadline, f"a claimant of {url} was still renewed after {seconds} s"
        time.sleep(0.05)
