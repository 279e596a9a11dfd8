"""extractor.store.chunks writes whole chunks as zarr writes them: the same bytes under the same keys,
for every compression a store can have; what it does not know goes through zarr."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr
from zarr.codecs import TransposeCodec

from extractor.store.chunks import ChunkCodec, write_chunks
from extractor.store.layout import _compressors


def _pair(tmp_path: Path, compression: str, level: int | None, dtype: str, shape: tuple[int, ...]):
    group = zarr.open_group(str(tmp_path / "s.zarr"), mode="w")
    made = [group.create_array(name, shape=(10, *shape), chunks=(4, *shape), dtype=dtype, fill_value=np.nan,
                               compressors=_compressors(compression, level)) for name in ("zarr", "ours")]
    return group, made[0], made[1]


def _chunk_files(root: Path, name: str) -> dict[str, bytes]:
    files = sorted(p for p in (root / name).rglob("c/**/*") if p.is_file())
    return {str(p.relative_to(root / name)): p.read_bytes() for p in files}


@pytest.mark.parametrize("compression,level", [("zstd", None), ("zstd", 9), ("blosc", None), ("blosc", 1),
                                               ("gzip", None), ("none", None)])
@pytest.mark.parametrize("dtype,shape", [("float32", (5,)), ("float16", (3, 2, 2))])
def test_whole_chunks_are_the_bytes_zarr_writes(tmp_path: Path, compression: str, level: int | None,
                                                dtype: str, shape: tuple[int, ...]):
    group, by_zarr, ours = _pair(tmp_path, compression, level, dtype, shape)
    codec = ChunkCodec.of(ours)
    assert codec is not None, f"{compression} should have the fast path"
    data = np.random.default_rng(0).standard_normal((10, *shape)).astype(dtype)
    for start in (0, 4):
        by_zarr[start : start + 4] = data[start : start + 4]
        assert write_chunks(start, {"ours": (ours, codec, data[start : start + 4])}) == data[start : start + 4].nbytes
    root = tmp_path / "s.zarr"
    assert _chunk_files(root, "ours") == _chunk_files(root, "zarr") != {}
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
    strings = group.create_array("str", shape=(8,), chunks=(4,), dtype=str)
    assert ChunkCodec.of(transposed) is None and ChunkCodec.of(split) is None and ChunkCodec.of(strings) is None
    cube = np.arange(48, dtype="float32").reshape(8, 2, 3)
    write_chunks(4, {"t": (transposed, None, cube[4:]), "s": (split, None, cube[4:].reshape(4, 6))})
    back = zarr.open_group(str(tmp_path / "s.zarr"), mode="r")
    np.testing.assert_array_equal(back["ours"][:4], data[:4])
    np.testing.assert_array_equal(back["ours"][8:], data[8:])
    assert np.isnan(back["ours"][4:8]).all()
    np.testing.assert_array_equal(back["t"][4:], cube[4:])
    np.testing.assert_array_equal(back["s"][4:], cube[4:].reshape(4, 6))
