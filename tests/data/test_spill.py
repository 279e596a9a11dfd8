"""The driver's listing past memory (issue 57): columns spilled to the disk, hashes sorted in buckets on the disk
(duplicate ids, the store's id index), checked against numpy in memory; a whole job whose every column spills
stores what a job in memory stores."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers.jobs import job
from helpers.stores import opened

from extractor._text import size
from extractor.data import spill
from extractor.data.rows import Strings, duplicate, text_hashes
from extractor.driver.runner import run
from extractor.errors import DataError
from extractor.read.reader import open_store
from extractor.spec.load import parse_spec


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every builder spills past 16 bytes; hashes are sorted in buckets of about 4."""
    monkeypatch.setattr(spill, "SPILL_BYTES", 16)
    monkeypatch.setattr(spill, "BUCKET_ROWS", 4)


def test_columns_past_their_limit_are_the_values_appended(tiny):
    rng = np.random.default_rng(0)
    values = rng.integers(-(2**40), 2**40, 1000)
    column = spill.Column("q")
    for v in values[:300].tolist():
        column.append(v)
    column.extend(values[300:700])
    column.extend(values[700:].tolist())
    assert len(column) == 1000 and [column[n] for n in (0, 5, 299, 700, 998, -1)] == \
        values[[0, 5, 299, 700, 998, -1]].tolist()  # read back from the file and from memory alike
    got = column.array()
    assert isinstance(got, np.memmap) and got.tolist() == values.tolist()
    texts = [f"{'é' * (n % 7)}id-{n}" for n in range(500)]
    strings = Strings()
    for t in texts[:200]:
        strings.append(t)
    strings.extend(texts[200:])
    assert [strings[n] for n in (0, 3, 199, 200, 499)] == [texts[n] for n in (0, 3, 199, 200, 499)]
    gathered = strings.array()
    assert isinstance(gathered.data, np.memmap) and gathered.tolist() == texts
    assert gathered.part(100, 250).tolist() == texts[100:250] and text_hashes(gathered.part(100, 250)).tolist() == \
        text_hashes(texts[100:250]).tolist()
    small = spill.Column("i", spill_bytes=1 << 20)
    small.extend([1, 2, 3])
    assert not isinstance(small.array(), np.memmap)  # a column that stays small never touches the disk


@pytest.mark.parametrize("limit", [16, 1 << 20])
def test_snapshots_of_growing_columns_hold_what_was_appended_and_stay_so(limit: int, monkeypatch):
    """A listing streamed takes its rows so far while its builders grow (past their limit on the disk, or not yet):
    each snapshot holds the values appended before it, after more are appended and once the builder is made whole."""
    monkeypatch.setattr(spill, "SPILL_BYTES", limit)
    values, texts = np.arange(300, dtype=np.int64) * 7 - 50, [f"{'é' * (n % 5)}r{n}" for n in range(300)]
    column, strings, taken = spill.Column("q"), Strings(), []
    assert spill.Column("q").snapshot().tolist() == [] and spill.Bytes().snapshot().tolist() == []
    for start, stop in ((0, 1), (1, 40), (40, 41), (41, 300)):
        column.extend(values[start:stop])
        strings.extend(texts[start:stop])
        taken.append((stop, column.snapshot(), strings.snapshot()))
    whole, all_texts = column.array(), strings.array()
    for stop, numbers, part in taken:
        assert numbers.tolist() == values[:stop].tolist() and part.tolist() == texts[:stop]
    assert whole.tolist() == values.tolist() and all_texts.tolist() == texts


def test_hashes_sorted_in_buckets_on_the_disk_are_numpys_stable_sort(tiny):
    rng = np.random.default_rng(1)
    hashes = rng.integers(-(2**63), 2**63 - 1, 300, dtype=np.int64)
    hashes[[10, 200, 250]] = hashes[7]  # rows sharing a hash: in row order
    hashes[50] = np.iinfo(np.int64).min
    hashes[51] = np.iinfo(np.int64).max
    blocks = [hashes[a:a + 37] for a in range(0, 300, 37)]
    parts = list(spill.by_hash(iter(blocks), len(hashes)))
    assert len(parts) == 128  # 300 / 4 rows a bucket: 2^7 buckets (at most 2^8)
    order = np.argsort(hashes, kind="stable")
    assert np.concatenate([p[0] for p in parts]).tolist() == hashes[order].tolist()
    assert np.concatenate([p[1] for p in parts]).tolist() == order.tolist()


def test_a_duplicate_id_is_found_across_buckets_as_in_memory(tiny):
    ids = [f"img-{n}" for n in range(400)]
    assert duplicate(Strings().array()) is None
    strings = Strings()
    strings.extend(ids)
    assert duplicate(strings.array()) is None
    ids[390], ids[399] = ids[120], ids[5]  # the first id seen again: row 5's, at row 399? no: 120's, at row 390
    strings.extend(ids)
    assert duplicate(strings.array()) == (120, 390)
    assert duplicate(np.asarray(ids, dtype=np.dtypes.StringDType())) == (120, 390)  # Python's hash, same buckets


def _store_columns(url: Path) -> dict[str, list]:
    group = opened(str(url))
    names = ["ids", "paths", "labels", "fingerprint", "layer4", "id_index/hashes", "id_index/rows"]
    return {name: group[name][:].tolist() for name in names}


def test_a_job_whose_listing_spills_stores_what_a_job_in_memory_stores(image_dir: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch):
    rows = sorted(p for p in image_dir.rglob("*") if p.is_file())
    manifest = tmp_path / "m.csv"
    manifest.write_text("path,id,label\n" + "".join(f"{p.relative_to(image_dir)},x{n},{p.parent.name}\n"
                                                     for n, p in enumerate(rows)))

    def spec(store: Path):
        return parse_spec(job(image_dir, store, data={"source": "manifest", "manifest": str(manifest),
                                                      "root": str(image_dir), "shard_size": 6},
                              capture=[{"layer": "layer4", "reduce": "mean"}]))

    run(spec(tmp_path / "held.zarr"))
    monkeypatch.setattr(spill, "SPILL_BYTES", 16)
    monkeypatch.setattr(spill, "BUCKET_ROWS", 2)
    summary = run(spec(tmp_path / "spilled.zarr"))
    assert summary.ok == len(rows)
    assert _store_columns(tmp_path / "spilled.zarr") == _store_columns(tmp_path / "held.zarr")
    s = open_store(str(tmp_path / "spilled.zarr"))
    assert [s.row_numbers([f"x{n}"])[0] for n in (0, 7, len(rows) - 1)] == [0, 7, len(rows) - 1]  # the id index
    manifest.write_text(manifest.read_text() + f"{rows[0].relative_to(image_dir)},x3,cats\n")
    with pytest.raises(DataError, match=rf"id 'x3' appears in rows 4 and {len(rows) + 1}"):
        run(spec(tmp_path / "twice.zarr"))


def test_the_listings_bytes_on_the_disk_are_its_spilled_columns_and_plan_says_them(image_dir: Path, tmp_path: Path,
                                                                                    tiny):
    from extractor.data import list_rows
    from extractor.driver.dry_run import preview

    spec = parse_spec(job(image_dir, tmp_path / "s.zarr"))
    rows = list_rows(spec.data)
    assert rows.paths.tails is rows.ids  # a folder's paths: its root and the ids, held once
    assert rows.fingerprints is None  # (each file fingerprinted by the worker that reads it)
    expected = rows.ids.data.nbytes + rows.ids.ends.nbytes + rows.labels.nbytes
    assert rows.on_disk() == expected > 0
    planned = preview(spec)
    assert planned.listing is not None and planned.listing.on_disk == expected
    assert f"{size(expected)} of the listing on its local disk" in planned.report()

def test_a_listing_that_stays_small_has_nothing_on_the_disk(image_dir: Path, tmp_path: Path):
    from extractor.data import list_rows

    assert list_rows(parse_spec(job(image_dir, tmp_path / "s.zarr")).data).on_disk() == 0


def test_a_spill_folder_that_cannot_take_the_listing_is_one_clear_error(image_dir: Path, tmp_path: Path, tiny,
                                                                       monkeypatch: pytest.MonkeyPatch):
    from extractor.data import list_rows

    monkeypatch.setenv("EXTRACTOR_SPILL_DIR", str(tmp_path / "gone"))
    with pytest.raises(DataError, match=r"listing cannot go to .*gone .*set EXTRACTOR_SPILL_DIR"):
        list_rows(parse_spec(job(image_dir, tmp_path / "s.zarr")).data)
    assert not (tmp_path / "s.zarr").exists()  # refused before the store is touched
