"""extractor.store.chunks writes whole chunks as zarr writes them: the same bytes under the same keys,
for every compression a store can have; what it does not know goes through zarr."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr
from zarr.codecs import TransposeCodec

from extractor.store.chunks import ChunkCodec, read_whole, write_chunks, write_whole
from extractor.store.dtypes import numpy_dtype
from extractor.store.layout import _compressors
from extractor.store.snapshot import snapshot_store


def _pair(tmp_path: Path, compression: str, level: int | None, dtype: str, shape: tuple[int, ...]):
    group = zarr.open_group(str(tmp_path / "s.zarr"), mode="w")
    size = numpy_dtype(dtype).itemsize
    codec = _compressors(compression, level, itemsize=size)
    made = [group.create_array(name, shape=(10, *shape), chunks=(4, *shape), dtype=dtype, fill_value=np.nan,
                               compressors=codec) for name in ("zarr", "ours")]
    return group, made[0], made[1]


def _chunk_files(root: Path, name: str) -> dict[str, bytes]:
    files = sorted(p for p in (root / name).rglob("c/**/*") if p.is_file())
    return {str(p.relative_to(root / name)): p.read_bytes() for p in files}


@pytest.mark.parametrize(("compression", "level"), [("lz4", None), ("lz4", 1), ("zstd", None), ("zstd", 9),
                                               ("blosc", None), ("blosc", 1), ("gzip", None), ("none", None)])
@pytest.mark.parametrize(("dtype", "shape"), [("float32", (5,)), ("float16", (3, 2, 2)), ("bfloat16", (4,))])
def test_whole_chunks_are_the_bytes_zarr_writes(tmp_path: Path, compression: str, level: int | None,
                                                dtype: str, shape: tuple[int, ...]):
    _group, by_zarr, ours = _pair(tmp_path, compression, level, dtype, shape)
    codec = ChunkCodec.of(ours)
    assert codec is not None, f"{compression} should have the fast path"
    data = np.random.default_rng(0).standard_normal((10, *shape)).astype(numpy_dtype(dtype))
    for start in (0, 4):
        by_zarr[start : start + 4] = data[start : start + 4]
        assert write_chunks(start, {"ours": (ours, codec, data[start : start + 4])}) == data[start : start + 4].nbytes
    root = tmp_path / "s.zarr"
    ours_files, zarr_files = (_mtime_out(_chunk_files(root, side), compression) for side in ("ours", "zarr"))
    assert ours_files == zarr_files != {}
    np.testing.assert_array_equal(zarr.open_group(str(root), mode="r")["ours"][:8], data[:8])


def test_a_partial_last_chunk_and_unknown_codecs_go_through_zarr(tmp_path: Path):
    group, _, ours = _pair(tmp_path, "zstd", None, "float32", (5,))
    data = np.random.default_rng(1).standard_normal((10, 5)).astype("float32")
    codec = ChunkCodec.of(ours)
    write_chunks(0, {"ours": (ours, codec, data[:4])})
    write_chunks(8, {"ours": (ours, codec, data[8:])})  # rows 8-9: the array's last chunk, partial
    transposed = group.create_array("t", shape=(8, 2, 3), chunks=(4, 2, 3), dtype="float32",
                                    filters=[TransposeCodec(order=(0, 2, 1))])
    split = group.create_array("s", shape=(8, 6), chunks=(4, 3), dtype="float32")
    assert ChunkCodec.of(transposed) is None and ChunkCodec.of(split) is None
    cube = np.arange(48, dtype="float32").reshape(8, 2, 3)
    write_chunks(4, {"t": (transposed, None, cube[4:]), "s": (split, None, cube[4:].reshape(4, 6))})
    back = zarr.open_group(str(tmp_path / "s.zarr"), mode="r")
    np.testing.assert_array_equal(back["ours"][:4], data[:4])
    np.testing.assert_array_equal(back["ours"][8:], data[8:])
    assert np.isnan(back["ours"][4:8]).all()
    np.testing.assert_array_equal(back["t"][4:], cube[4:])
    np.testing.assert_array_equal(back["s"][4:], cube[4:].reshape(4, 6))


def _mtime_out(files: dict[str, bytes], compression: str) -> dict[str, bytes]:
    """gzip's header holds the second it was written (bytes 4-8, MTIME): two encodings a second apart differ there."""
    if compression != "gzip":
        return files
    return {k: v[:4] + bytes(4) + v[8:] if v[:2] == b"\x1f\x8b" else v for k, v in files.items()}


@pytest.mark.parametrize("compression", ["zstd", "gzip", "none"])
def test_a_shards_finishing_writes_are_the_bytes_zarr_writes(tmp_path: Path, compression: str):
    """Strings (vlen-utf8), numbers and a last chunk padded with the fill value, put whole by write_whole: each
    object as zarr writes it (with write_empty_chunks, as a shard's writer has it)."""
    group = zarr.open_group(str(tmp_path / "s.zarr"), mode="w")
    made, empty = {}, {"write_empty_chunks": True}
    for side in ("zarr", "ours"):
        made[side] = [group.create_array(f"{side}-{name}", shape=(10,), chunks=(4,), dtype=dtype, fill_value=fill,
                                         compressors=_compressors(compression, None), config=empty)
                      for name, dtype, fill in (("errors", str, ""), ("digest", "uint64", 0), ("done", "uint8", 0))]
    errors = np.asarray(["", "bad jpeg", "héllo", "", "x", "", "", "", "no file", ""], dtype=object)
    digests = np.random.default_rng(2).integers(0, 2**63, 10, dtype=np.uint64)
    for start, stop in ((0, 4), (8, 10)):  # a whole chunk, then the last one (2 rows of 4)
        by_zarr = made["zarr"]
        by_zarr[0][start:stop], by_zarr[1][start:stop] = errors[start:stop], digests[start:stop]
        by_zarr[2][start // 4] = 1
        ours = [(a, ChunkCodec.of(a)) for a in made["ours"]]
        assert all(codec is not None for _, codec in ours)
        write_whole([(*ours[0], start, errors[start:stop]), (*ours[1], start, digests[start:stop]),
                     (*ours[2], start // 4, np.ones(1, np.uint8))])
    root = tmp_path / "s.zarr"
    for name in ("errors", "digest", "done"):
        ours, theirs = (_mtime_out(_chunk_files(root, f"{side}-{name}"), compression) for side in ("ours", "zarr"))
        assert ours == theirs != {}, name
    back = zarr.open_group(str(root), mode="r")
    assert back["ours-errors"][8:].tolist() == errors[8:].tolist() and back["ours-errors"][4:8].tolist() == [""] * 4
    np.testing.assert_array_equal(back["ours-digest"][:4], digests[:4])


@pytest.mark.parametrize("compression", ["zstd", "gzip", "none"])
def test_strings_written_from_their_utf8_in_bulk_are_the_bytes_zarr_writes(tmp_path: Path, compression: str):
    """A new store's ids and paths (a Texts, a Joined of heads and Texts or row numbers, with ends): each chunk's
    vlen-utf8 made from the strings' UTF-8 in bulk, the last chunk padded: each object as zarr writes it from the
    strings."""
    from extractor.data.rows import Joined, strings
    from extractor.store.chunks import write_texts

    ids = strings([f"n{i % 3:03d}/ü_{i}{'x' * (i % 5)}" for i in range(10)] + ["", "a"])
    columns = {"texts": ids, "joined": Joined(["/root/", "s3://b/"], ids, np.arange(12) % 2, [".jpg", ".JPEG"],
                                              np.arange(12) // 7),
               "numbers": Joined(["f.parquet#image/"], np.arange(12) * 997)}
    group = zarr.open_group(str(tmp_path / "s.zarr"), mode="w")
    root = tmp_path / "s.zarr"
    for name, column in columns.items():
        made = {side: group.create_array(f"{side}-{name}", shape=(12,), chunks=(5,), dtype=str, fill_value="",
                                         compressors=_compressors(compression, None)) for side in ("zarr", "ours")}
        made["zarr"][:] = np.asarray(column[0:12])
        codec = ChunkCodec.of(made["ours"])
        assert codec is not None
        write_texts(made["ours"], codec, 0, column, 12)
        ours, theirs = (_mtime_out(_chunk_files(root, f"{side}-{name}"), compression) for side in ("ours", "zarr"))
        assert ours == theirs != {} and len(ours) == 3, name
        assert zarr.open_group(str(root), mode="r")[f"ours-{name}"][:].tolist() == np.asarray(column[0:12]).tolist()


def test_a_new_stores_row_arrays_leave_out_the_chunks_zarr_leaves_out(tmp_path: Path):
    """A chunk of the fill value alone (the labels of a source without any, empty strings) is no object, as zarr
    leaves it; but a rows slot's array (the fingerprints: 0 where URLs, or files the listing did not stat) has every
    chunk written, as a shard's arrays have (`inspect --verify --objects` names one missing); the others are zarr's
    objects, byte for byte."""
    from extractor.data.rows import Rows, strings
    from extractor.store.layout import _create_row_arrays

    ids = strings([f"i{n}" for n in range(10)])
    rows = Rows(ids=ids, paths=strings([""] * 5 + [f"/p/{n}" for n in range(5)]),
                labels=np.asarray([-1] * 8 + [3, -1]), fingerprints=np.asarray([0] * 4 + list(range(1, 7)), np.uint64))
    ours = zarr.open_group(str(tmp_path / "ours.zarr"), mode="w")
    _create_row_arrays(ours, 4, rows, ()).write(0, 10, rows)
    theirs = zarr.open_group(str(tmp_path / "zarr.zarr"), mode="w")
    for name, dtype, fill in (("ids", str, ""), ("paths", str, ""), ("labels", "int64", -1),
                              ("fingerprint", "uint64", 0)):
        arr = theirs.create_array(name, shape=(10,), dtype=dtype, chunks=ours[name].chunks, fill_value=fill,
                                  dimension_names=["row"], config={"write_empty_chunks": name == "fingerprint"})
        arr[:] = np.asarray(getattr(rows, {"fingerprint": "fingerprints"}.get(name, name))[0:10])
        assert _chunk_files(tmp_path / "ours.zarr", name) == _chunk_files(tmp_path / "zarr.zarr", name), name
    assert ours["fingerprint"].chunks == (4,) and len(_chunk_files(tmp_path / "ours.zarr", "fingerprint")) == 3
    assert len(_chunk_files(tmp_path / "ours.zarr", "labels")) == 1
    from extractor.store.chunks import write_texts

    empty = {side: zarr.open_group(str(tmp_path / f"{side}-e.zarr"), mode="w").create_array(
        "e", shape=(8,), dtype=str, chunks=(4,), fill_value="") for side in ("ours", "zarr")}
    texts = strings(["", "", "", "", "a", "", "b", ""])  # its first chunk empty strings alone: no object
    empty["zarr"][:] = np.asarray(texts[0:8])
    write_texts(empty["ours"], ChunkCodec.of(empty["ours"]), 0, texts, 8)
    assert _chunk_files(tmp_path / "ours-e.zarr", "e") == _chunk_files(tmp_path / "zarr-e.zarr", "e") and \
        list(_chunk_files(tmp_path / "ours-e.zarr", "e")) == ["c/1"]


def test_strings_go_through_zarr_where_numcodecs_encodes_them_otherwise(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch):
    """vlen-utf8 made in bulk is checked once against numcodecs itself: where they differ, zarr writes the strings."""
    import extractor.store.chunks as chunks
    from extractor.data.rows import strings

    monkeypatch.setattr(chunks, "_VLEN_SAME", [])
    monkeypatch.setattr(chunks, "vlen_utf8", lambda data, ends, rows: np.zeros(4, np.uint8))  # a wrong encoding
    arr = zarr.open_group(str(tmp_path / "s.zarr"), mode="w").create_array("t", shape=(4,), dtype=str, chunks=(4,),
                                                                          fill_value="")
    chunks.write_texts(arr, ChunkCodec.of(arr), 0, strings(["a", "bé", "", "c"]), 4)
    assert chunks._VLEN_SAME == [False] and arr[:].tolist() == ["a", "bé", "", "c"]


@pytest.mark.parametrize("compression", ["zstd", "blosc", "gzip", "none"])
def test_a_whole_array_read_a_file_a_chunk_is_what_zarr_reads(tmp_path: Path, compression: str):
    """Per-row and per-shard arrays of numbers and strings (chunks of 4 rows and of 1, the last partial, some never
    written: the fill value) read file by file, whole or rows a:b, equal zarr's reads; 2-D and sharded arrays are
    left to zarr."""
    group = zarr.open_group(str(tmp_path / "s.zarr"), mode="w")
    rng = np.random.default_rng(0)
    for name, dtype, chunk, fill in (("status", "uint8", 4, 0), ("fingerprint", "uint64", 4, 0),
                                     ("labels", "int64", 4, -1), ("done", "uint8", 1, 0), ("x", "float32", 3, np.nan),
                                     ("paths", str, 4, "")):
        array = group.create_array(name, shape=(11,), chunks=(chunk,), dtype=dtype, fill_value=fill,
                                   compressors=_compressors(compression, None))
        values = rng.standard_normal(11, "f4") if dtype == "float32" else \
            np.asarray([f"/d/ü{i}/{'x' * i}.jpg" for i in range(11)]) if dtype is str else \
            rng.integers(1, 2**62, 11).astype(dtype)
        array[:chunk] = values[:chunk]  # the first chunk
        array[8:] = values[8:]  # and the last ones, one of them partial: those between never written
        stored = zarr.open_group(str(tmp_path / "s.zarr"), mode="r")[name]
        for a, b in ((0, None), (0, 11), (1, 9), (5, 7), (8, 11), (10, 11), (3, 3)):
            got = read_whole(stored, a, b)
            assert got is not None and got.dtype == array.dtype, (name, a, b)
            np.testing.assert_array_equal(got, array[a:b])
        got = read_whole(stored)
        assert (got[:chunk] == values[:chunk]).all() and (got[8:] == values[8:]).all()
        through = zarr.open_group(snapshot_store(str(tmp_path / "s.zarr")), mode="r")[name]  # the reader's store
        np.testing.assert_array_equal(read_whole(through), array[:])  # type: ignore[arg-type]
        if dtype is str:  # as read: Python strings, the same
            assert read_whole(stored, as_read=True).tolist() == array[:].tolist()  # type: ignore[union-attr]
    assert read_whole(group.create_array("two", shape=(4, 2), chunks=(2, 2), dtype="uint8")) is None
    assert read_whole(group.create_array("sharded", shape=(8,), chunks=(2,), shards=(4,), dtype="uint8")) is None
