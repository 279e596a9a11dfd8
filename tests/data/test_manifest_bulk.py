"""A CSV manifest read in bulk by pyarrow (issue 57: Python's csv and a path made a row at a time were 11 s of CPU a
million rows) lists the rows the row-by-row reader lists, and leaves to that reader what it reports or reads
otherwise: each case is listed both ways and compared column by column."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from extractor.data.listing import list_rows, stream_rows
from extractor.data.sources import manifest as manifest_source
from extractor.errors import DataError
from extractor.spec.data_spec import DataSpec

pytest.importorskip("pyarrow")


def _listed(csv: Path, root: str | None, bulk: bool, monkeypatch: pytest.MonkeyPatch, **kwargs):
    """The manifest's rows, read in bulk (the bulk reader must take it) or row by row."""
    taken = []
    real = manifest_source._arrow_bulk

    def spy(*args):
        out = None if not bulk else real(*args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(manifest_source, "_arrow_bulk", spy)
    try:
        return manifest_source._list_manifest(str(csv), root, {}, **kwargs), taken[0]
    finally:
        monkeypatch.setattr(manifest_source, "_arrow_bulk", real)


def _same(csv: Path, root: str | None, monkeypatch: pytest.MonkeyPatch, bulk_expected: bool = True, **kwargs):
    rows, taken = _listed(csv, root, True, monkeypatch, **kwargs)
    by_row, _ = _listed(csv, root, False, monkeypatch, **kwargs)
    assert taken == bulk_expected
    assert rows.ids.tolist() == by_row.ids.tolist()
    assert list(rows.paths) == list(by_row.paths)
    assert rows.labels.tolist() == by_row.labels.tolist() and rows.classes == by_row.classes
    assert rows.fingerprints is None and by_row.fingerprints is None  # no file stat-ed: its workers fingerprint them
    return rows


def test_relative_paths_named_labels_ids_and_quoting_list_as_row_by_row(tmp_path: Path, monkeypatch):
    root = tmp_path / "images"
    for folder in ("cats", "dogs", "a b"):
        (root / folder).mkdir(parents=True)
    names = [f"{f}/{n}.jpg" for n in range(40) for f in ("cats", "dogs", "a b")]  # folders interleaved
    for n in names[::3]:
        (root / n).write_bytes(b"x")  # files that exist, and some that do not
    lines = [f'"{n}",{"id-" + str(i) if i % 3 else ""},{("cat", "dog", "")[i % 3]}' for i, n in enumerate(names)]
    lines.append('"a b/quoted, with a comma.jpg",,"dog"')
    lines.append('a b/.hidden.jpg,"an id\nover two lines",cat')
    csv = tmp_path / "m.csv"
    csv.write_bytes(b"\xef\xbb\xbf" + ("path,id,label,other\n" + "\n".join(f"{ln},x" for ln in lines) + "\n").encode())
    rows = _same(csv, str(root), monkeypatch)
    assert rows.classes == ["cat", "dog"] and rows.labels[:3].tolist() == [0, 1, -1]
    assert rows.ids[0] == "cats/0.jpg" and rows.ids[1] == "id-1" and rows.paths[0] == f"{root}/cats/0.jpg"


def test_numbers_absolute_paths_urls_and_a_url_root_list_as_row_by_row(tmp_path: Path, monkeypatch):
    csv = tmp_path / "m.csv"
    (tmp_path / "x.jpg").write_bytes(b"x")
    csv.write_text(f"path,label\nimgs/1.jpg,3\n{tmp_path}/x.jpg,3.0\ns3://bucket/k/2.jpg,\nimgs/3.jpg,7\n")
    rows = _same(csv, None, monkeypatch, outside_root=True)
    assert rows.labels.tolist() == [3, 3, -1, 7] and rows.classes == []
    assert rows.paths[2] == "s3://bucket/k/2.jpg"
    plain = tmp_path / "plain.csv"
    plain.write_text("path\na/1.jpg\nb/2.jpg\n")
    rows = _same(plain, "s3://bucket/root/", monkeypatch)
    assert list(rows.paths) == ["s3://bucket/root/a/1.jpg", "s3://bucket/root/b/2.jpg"]
    assert rows.labels.tolist() == [-1, -1]


def test_json_lines_list_in_bulk_as_row_by_row(tmp_path: Path, monkeypatch):
    """JSON lines read by pyarrow (ids as texts or whole numbers, some rows without one; labels as numbers, as
    names, null or absent; escapes; other fields; a blank line, which no reader takes for a row) list what Python's
    json lists; types that change from row to row, a first row that is not an object, a key given twice, or an id
    that is a number that is not whole: read row by row."""
    root = tmp_path / "images"
    (root / "a").mkdir(parents=True)
    (root / "a" / "0.jpg").write_bytes(b"x")
    rows = [{"path": f"a/{i}.jpg", "caption": "a \"cat\"\n", "id": i * 10 if i % 4 else None,
             "label": (i % 3) if i % 5 else None} for i in range(40)]
    rows[7].pop("label")
    rows[9]["path"] = "a/caf\u00e9.jpg"
    text = "".join(json.dumps(r) + "\n" for r in rows[:20]) + "\n" + "".join(json.dumps(r) + "\n" for r in rows[20:])
    jsonl = tmp_path / "m.jsonl"
    jsonl.write_text(text)
    got = _same(jsonl, str(root), monkeypatch)
    assert got.ids[:2].tolist() == ["a/0.jpg", "10"] and got.labels[:6].tolist() == [-1, 1, 2, 0, 1, -1]
    assert got.paths[9] == f"{root}/a/café.jpg"
    names = tmp_path / "names.jsonl"
    names.write_text("".join(json.dumps({"path": f"b/{i}.jpg", "label": ["cat", "dog", ""][i % 3]}) + "\n"
                             for i in range(9)))
    assert _same(names, str(root), monkeypatch).classes == ["cat", "dog"]
    for odd in ('{"path": "a.jpg", "label": 1}\n{"path": "b.jpg", "label": "cat"}\n',
                '["a.jpg"]\n', '{"path": "a.jpg", "path": "b.jpg"}\n', '{"path": "a.jpg", "id": 1.5}\n',
                '{"path": "a.jpg", "id": 1}\n{"path": "b.jpg", "id": "x"}\n'):
        jsonl.write_text(odd)
        if odd.startswith("["):
            with pytest.raises(DataError, match="missing 'path'"):
                manifest_source._list_manifest(str(jsonl), str(root), {})
            continue
        _same(jsonl, str(root), monkeypatch, bulk_expected=False)


@pytest.mark.parametrize("path", ["./a.jpg", "a/../b.jpg", "a//b.jpg", "dir/", "file:///x/a.jpg"])
def test_a_path_made_absolute_otherwise_is_read_row_by_row(tmp_path: Path, monkeypatch, path: str):
    csv = tmp_path / "m.csv"
    csv.write_text(f"path\nz/ok.jpg\n{path}\n")
    _same(csv, str(tmp_path), monkeypatch, bulk_expected=False, outside_root=True)


@pytest.mark.parametrize(("text", "columns", "match"), [
    ("path\n/etc/passwd\n", {}, "lies outside data.root"),
    ("file,label\na.jpg,1\n", {}, "missing 'path'"),
    ("path,label\na.jpg,1\n,2\n", {}, "row 2: missing 'path'"),
    ("path,label\na.jpg,1\nb.jpg\n", {}, None),  # a short row: Python's csv reads it (no label)
    ("path,label\na.jpg,1\n", {"label": "class"}, "'class' is not a column"),
    ("path,id\na.jpg,x\nb.jpg,y\nc.jpg,x\n", {}, "id 'x' appears in rows 1 and 3"),
])
def test_what_the_row_by_row_reader_reports_it_still_reports(tmp_path: Path, monkeypatch, text: str, columns: dict,
                                                              match: str | None):
    csv = tmp_path / "m.csv"
    csv.write_text(text)
    if match is None:
        _same(csv, str(tmp_path), monkeypatch, bulk_expected=False)
        return
    with pytest.raises(DataError, match=match):
        manifest_source._list_manifest(str(csv), str(tmp_path), {}, columns=columns)


def test_a_remote_manifest_lists_as_a_local_one_read_as_it_is_parsed(tmp_path: Path, moto_s3: dict[str, str],
                                                                     monkeypatch: pytest.MonkeyPatch):
    """A manifest on S3 (moto): its CSV read by pyarrow and its JSON lines row by row, each from the server a block
    at a time (it was read whole, and decoded whole: 12 GB in the driver for 100M rows), list what the same local
    file lists, streamed too; one not there is named with the hint to check its path."""
    import s3fs

    fs = s3fs.S3FileSystem(**moto_s3)
    fs.mkdir("manifests")
    lines = [f"train/n{i % 1000:08d}/n{i % 1000:08d}_{i}.JPEG,{i % 7}" for i in range(240_000)]
    local = tmp_path / "m.csv"
    local.write_text("path,label\n" + "\n".join(lines) + "\n")
    fs.put(str(local), "manifests/m.csv")
    small = tmp_path / "m.jsonl"
    small.write_text("".join(f'{{"path": "a/{i}.jpg", "id": "r{i}", "label": "c{i % 3}"}}\n' for i in range(50)))
    fs.put(str(small), "manifests/m.jsonl")
    fetched: list[int] = []
    real = s3fs.core.S3File._fetch_range

    def fetch(self, start: int, end: int) -> bytes:
        fetched.append(end - start)
        return real(self, start, end)

    monkeypatch.setattr(s3fs.core.S3File, "_fetch_range", fetch)
    root = "s3://images/train-root"  # (its images are URLs: none stat-ed)
    paths = tmp_path / "paths.csv"  # no label column: streamed
    paths.write_text("path\n" + "".join(f"{line.split(',')[0]}\n" for line in lines[:50_000]))
    fs.put(str(paths), "manifests/paths.csv")
    streamed = stream_rows(DataSpec(source="manifest", manifest="s3://manifests/paths.csv", root=root,
                                    storage_options=moto_s3))
    want = list_rows(DataSpec(source="manifest", manifest=str(paths), root=root))
    assert streamed is not None and len(streamed) == len(want) == 50_000
    assert streamed.whole().ids.tolist() == want.ids.tolist() and streamed.whole().paths[-1] == want.paths[-1]
    for url, path in (("s3://manifests/m.csv", local), ("s3://manifests/m.jsonl", small)):
        remote = manifest_source._list_manifest(url, root, moto_s3)
        want = manifest_source._list_manifest(str(path), root, {})
        assert len(remote) == len(want) > 0 and remote.ids.tolist() == want.ids.tolist()
        assert list(remote.paths[:100]) == list(want.paths[:100]) and remote.paths[-1] == want.paths[-1]
        assert remote.labels.tolist() == want.labels.tolist() and remote.classes == want.classes
        if path == local:  # a block at a time: never the whole file in one read
            assert local.stat().st_size > 8 << 20 and max(fetched) <= 6 << 20 and len(fetched) > 1, fetched
    with pytest.raises(DataError, match=r"cannot read data.manifest s3://manifests/gone.csv: .*check the bucket"):
        manifest_source._list_manifest("s3://manifests/gone.csv", root, moto_s3)


def test_a_nul_byte_a_column_named_twice_and_bytes_not_utf8_are_one_line_each(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch):
    """A path with a NUL byte (a stat raised ValueError: a traceback), a header naming a column twice (pyarrow took
    the first, Python's csv the last: two readers, two listings), bytes that are not UTF-8 (named by their line):
    refused by either reader, with one line that says what to fix."""
    (tmp_path / "nul.csv").write_bytes(b"path\na/0.jpg\na/\x001.jpg\n")
    (tmp_path / "nul.jsonl").write_bytes(b'{"path": "a/0.jpg"}\n{"path": "a/\\u00001.jpg"}\n')
    for name in ("nul.csv", "nul.jsonl"):
        with pytest.raises(DataError, match=r"row 2: path 'a/\\x001.jpg' holds a NUL byte"):
            manifest_source._list_manifest(str(tmp_path / name), str(tmp_path), {})
    (tmp_path / "twice.csv").write_text("path,id,path\na/0.jpg,x,b/0.jpg\n")
    for bulk in (True, False):
        with pytest.raises(DataError, match=r"its header names column 'path' twice; name each once"):
            _listed(tmp_path / "twice.csv", str(tmp_path), bulk, monkeypatch)
    (tmp_path / "latin.csv").write_bytes(b"path\n" + b"".join(b"a/%d.jpg\n" % i for i in range(3000)) + b"a/\xe9.jpg\n")
    with pytest.raises(DataError, match=r"not UTF-8 text \(line 3002: invalid continuation byte, .*save it as UTF-8"):
        manifest_source._list_manifest(str(tmp_path / "latin.csv"), str(tmp_path), {})


def test_ids_given_from_a_later_block_on_list_as_row_by_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Blocks of a few rows (64 bytes): the first ones' ids are their paths (held once), then ids are given (the
    paths so far copied as ids, a part at a time), then not: the ids equal the row-by-row reader's."""
    monkeypatch.setattr(manifest_source, "BLOCK_BYTES", 64)
    csv = tmp_path / "m.csv"
    csv.write_text("path,id\n" + "".join(f"a/{i}.jpg,{'r' + str(i) if 20 <= i < 30 else ''}\n" for i in range(40)))
    real = manifest_source._copy
    monkeypatch.setattr(manifest_source, "_copy", lambda a, b: real(a, b, part=3))
    rows = _same(csv, str(tmp_path), monkeypatch)
    assert rows.ids[19] == "a/19.jpg" and rows.ids[20] == "r20" and rows.ids[39] == "a/39.jpg"


@pytest.mark.parametrize(("row", "match"), [
    ({"path": "a/1.jpg", "label": {"name": "cat"}}, r"row 2: 'label' is a JSON object \(\{\"name\": \"cat\"\}\)"),
    ({"path": "a/1.jpg", "label": [1, 2]}, r"row 2: 'label' is a JSON list \(\[1, 2\]\)"),
    ({"path": "a/1.jpg", "id": {"k": 1}}, r"row 2: 'id' is a JSON object \(\{\"k\": 1\}\)"),
    ({"path": ["a/1.jpg"]}, r"row 2: 'path' is a JSON list \(\[\"a/1.jpg\"\]\)"),
])
def test_a_json_object_or_list_where_a_value_goes_is_refused_naming_its_row(tmp_path: Path, row: dict, match: str):
    """A label, id or path that is a JSON object or list was taken as its text as Python writes it (a class named
    "{'name': 'cat'}"); each reader refuses it, naming the row (the bulk reader leaves such rows to Python's json)."""
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"path": "a/0.jpg", "label": 1, "id": "x"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError, match=match + r"; give a text or a number there"):
        list_rows(DataSpec(source="manifest", manifest=str(manifest), root=str(tmp_path)))


def test_a_compressed_manifest_is_refused_saying_to_decompress_it(tmp_path: Path):
    manifest = tmp_path / "m.jsonl.gz"
    manifest.write_bytes(b"")
    with pytest.raises(DataError, match=r"expected a .csv, .jsonl or .ndjson file \(uncompressed: decompress it"):
        list_rows(DataSpec(source="manifest", manifest=str(manifest), root=str(tmp_path)))
