"""A CSV manifest listed behind the job's start (issue 57): its rows counted as its lines, the store made, the rows
read by pyarrow a block at a time on a thread and written as they come (each file stat-ed meanwhile: 5.6 s of CPU a
million rows), the first shards run meanwhile. Each test holds the listing at a block until a shard is done, which
a listing made whole first never lets happen (the wait's bound fails it); what is stored equals a listing made
whole."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.jobs import job
from helpers.parquet import images_of
from helpers.stores import opened
from helpers.streamed import WAIT_S, Held, held_at, same_rows

import extractor.data.sources.manifest as manifest
import extractor.store.layout as layout
from extractor.data.files import local_fingerprint
from extractor.data.listing import list_rows, stream_rows
from extractor.data.streamed import Streamed
from extractor.driver.runner import run
from extractor.errors import DataError
from extractor.read.reader import open_store
from extractor.spec.data_spec import DataSpec
from extractor.spec.load import parse_spec
from extractor.store import read_state

pytest.importorskip("pyarrow")

def _hold(monkeypatch: pytest.MonkeyPatch, block: int) -> Held:
    """The first listing waits before it reads its block ``block`` (from 0) until the event returned is set; blocks
    of 64 bytes (a few rows each)."""
    monkeypatch.setattr(manifest, "BLOCK_BYTES", 64)
    return held_at(monkeypatch, manifest._Bulk, "prepare", block)


_same = same_rows


def _streams_as_listed(data: DataSpec, want: Any, block_bytes: int = 64) -> None:
    """``data`` streams its rows (held at its fourth block of ``block_bytes``): the prefix handed out while it is
    held holds the whole listing's (``want``) first rows, and the whole equals it, its classes and record too."""
    with pytest.MonkeyPatch.context() as patch:
        release = _hold(patch, 3)
        patch.setattr(manifest, "BLOCK_BYTES", block_bytes)
        streamed = stream_rows(data)
        assert isinstance(streamed, Streamed) and len(streamed) == len(want)
        assert streamed.classes == want.classes
        assert release.reached.wait(WAIT_S)
        listed = streamed.listed
        assert 0 < listed < len(want)
        _same(streamed.upto(listed), want, listed)
        release.set()
        whole = streamed.whole()
    _same(whole, want, len(want))
    assert whole.classes == want.classes and whole.listing == want.listing is not None


def _manifest(path: Path, lines: list[str], header: str = "path,id") -> Path:
    path.write_text(header + "\n" + "\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("last", ["b/9.jpg,", "./b/9.jpg,"])  # the last read in bulk, or row by row
def test_a_streamed_manifest_gives_the_rows_of_a_whole_listing_prefix_by_prefix(tmp_path: Path, last: str):
    """Relative and absolute paths (some files there: fingerprinted), ids given from a later block on: each prefix
    handed out while the listing is held holds the whole listing's first rows, and the whole equals list_rows' (its
    listing record too). A last block that the bulk reader leaves to the row-by-row reader (a path absolute()
    changes) has the file listed row by row, the rows handed out before the same."""
    root = tmp_path / "images"
    (root / "a").mkdir(parents=True)
    for i in range(0, 20, 3):
        (root / "a" / f"{i}.jpg").write_bytes(b"x" * i)
    lines = [f"a/{i}.jpg,{'id' + str(i) if i % 2 and i > 12 else ''}" for i in range(20)] + [
        f"{root}/a/3.jpg,again", last]  # (ids their paths in the prefix, then given: the paths copied as ids)
    data = DataSpec(source="manifest", manifest=str(_manifest(tmp_path / "m.csv", lines)), root=str(root),
                    outside_root=True)
    want = list_rows(data)
    with pytest.MonkeyPatch.context() as patch:
        release = _hold(patch, 3)
        streamed = stream_rows(data)
        assert isinstance(streamed, Streamed) and len(streamed) == 22 and streamed.classes == []
        assert release.reached.wait(WAIT_S)
        listed = streamed.listed
        assert 0 < listed < 22
        prefix = streamed.upto(listed)
        assert len(prefix) == listed and prefix.listing is None  # (held: a part)
        _same(prefix, want, listed)
        release.set()
        whole = streamed.whole()
    _same(whole, want, 22)
    assert whole.classes == want.classes == [] and whole.listing == want.listing is not None
    assert want.ids[1] == "a/1.jpg" and want.ids[13] == "id13" and want.fingerprints is None


def test_a_csv_of_quoted_values_streams_its_rows_counted_from_the_breaks_outside_quotes(tmp_path: Path):
    """Quoted values as Python's csv writes them (a path with a comma, captions with line breaks, doubled quotes
    and a blank line inside; a header quoted whole, as R and QUOTE_ALL write it), lines ended by \\n or \\r\\n
    (Python's csv's own), blank lines between rows (no row to pyarrow or Python's csv): counted from the line breaks
    outside quotes, streamed prefix by prefix, the whole equal to a listing made whole, which Python's csv reads
    (and the count to it). Quotes that Python's csv and pyarrow read otherwise, or left open, a carriage return
    alone: listed whole."""
    import csv

    rows = [[f"a/{i},{i}.jpg" if i % 4 == 0 else f"a/{i}.jpg", f"c{i % 3}",
             ['a "big" dog', "two\nlines", "one, two", "", "blank\r\n\r\nline"][i % 5]] for i in range(30)]
    for name, quoting, end in (("minimal.csv", csv.QUOTE_MINIMAL, "\n"), ("all.csv", csv.QUOTE_ALL, "\r\n"),
                               ("blank.csv", csv.QUOTE_MINIMAL, "\r\n")):
        with open(tmp_path / name, "w", newline="") as f:
            writer = csv.writer(f, lineterminator=end, quoting=quoting)
            writer.writerow(["path", "label", "caption"])
            for i, row in enumerate(rows):
                f.write(end if name == "blank.csv" and i % 7 == 0 else "")  # (after the header, then every 7th)
                writer.writerow(row)
            f.write(end if name == "blank.csv" else "")
        assert manifest._lines(str(tmp_path / name), {}, manifest._Columns(name, {})) == 30, name
        data = DataSpec(source="manifest", manifest=str(tmp_path / name), root=str(tmp_path),
                        classes=("c0", "c1", "c2"))
        want = list_rows(data)
        assert list(want.paths) == [str(tmp_path / r[0]) for r in rows]
        assert want.labels.tolist() == [i % 3 for i in range(30)]
        _streams_as_listed(data, want)
    for name, text in (("inside.csv", 'path,caption\na/1.jpg,5\'10"\na/2.jpg,x\n'),  # a quote inside a value
                       ("after.csv", 'path,caption\na/1.jpg,"tall"er\na/2.jpg,x\n'),  # text after a closing one
                       ("open.csv", 'path,caption\na/1.jpg,"never closed\na/2.jpg,x\n'),
                       ("space.csv", 'path,caption\na/1.jpg, "spaced"\na/2.jpg,x\n'),
                       ("return.csv", 'path,caption\na/1.jpg,x\ra/2.jpg,x\n'),  # (a line end to both: not counted)
                       ("header.csv", 'path,"cap""tion"\na/1.jpg,x\n')):  # (a quote inside a name)
        (tmp_path / name).write_text(text)
        assert stream_rows(DataSpec(source="manifest", manifest=str(tmp_path / name), root=str(tmp_path))) is None, name
    (tmp_path / "some.csv").write_text('path,"caption"\r\na/1.jpg,x\r\n"a/2.jpg",y\r\n')  # (one name quoted)
    assert len(stream_rows(DataSpec(source="manifest", manifest=str(tmp_path / "some.csv"), root=str(tmp_path)))) == 2
    (tmp_path / "long.csv").write_text(f'path,caption\n./a/1.jpg,"{"x" * 140_000}"\n')  # (read by Python's csv)
    with pytest.raises(DataError, match=r"data.manifest \S+long.csv line 2 is not a row Python's csv reads \(field "
                                        r"larger than field limit \(131072\)\); fix that line"):
        list_rows(DataSpec(source="manifest", manifest=str(tmp_path / "long.csv"), root=str(tmp_path)))


@pytest.mark.parametrize("kind", ["names", "indices"])
def test_a_manifest_whose_labels_data_classes_names_streams_them_as_indices(tmp_path: Path, kind: str):
    """Labels that data.classes names (its names, or its indices as numbers: 3.0 too), some rows without one:
    each prefix handed out while the listing is held holds the class indices a listing made whole gives, and so
    does the whole (its classes data.classes)."""
    classes = ["cat", "dog", "emu"]
    label = (lambda i: classes[i % 3]) if kind == "names" else (lambda i: f"{i % 3}{'.0' if i == 7 else ''}")
    lines = [f"a/{i}.jpg,{'' if i % 5 == 4 else label(i)}" for i in range(24)]
    data = DataSpec(source="manifest", manifest=str(_manifest(tmp_path / "m.csv", lines, "path,label")),
                    root=str(tmp_path), classes=tuple(classes))
    want = list_rows(data)
    assert want.labels.tolist()[:5] == [0, 1, 2, 0, -1] and want.classes == classes
    _streams_as_listed(data, want)
    assert want.classes == classes


@pytest.mark.parametrize(("labels", "error"), [
    (["cat"] * 12 + ["yak"], r"m.csv row 13: label 'yak' is not in data.classes \(2 names\)"),
    (["1"] * 12 + ["2"], r"m.csv row 13: label '2' is none of data.classes' indices \(0 to 1, or -1: none\)"),
    (["1"] * 12 + ["0.5"], r"m.csv row 13: label '0.5' is none of data.classes' indices"),
    (["0", ""] * 6 + ["dog"],
     r"labels are class indices \(\S+m.csv row 1: '0'\) and class names \(\S+m.csv row 13: 'dog'\)"),
])
def test_a_streamed_manifest_refuses_a_label_where_it_reads_it(tmp_path: Path, labels: list[str], error: str):
    """A label that a listing made whole refuses once every label is read (a name not in data.classes, a number that
    is none of its indices, numbers beside names) stops the streamed listing at the row that holds it, its first
    blocks handed out; a listing made whole refuses it too. Where data.classes has a name that reads as a number
    (the label 3 could be an index or that name), the manifest is listed whole."""
    lines = [f"a/{i}.jpg,{v}" for i, v in enumerate(labels)]
    data = DataSpec(source="manifest", manifest=str(_manifest(tmp_path / "m.csv", lines, "path,label")),
                    root=str(tmp_path), classes=("cat", "dog"))
    with pytest.raises(DataError, match=r"not in data.classes|data.classes names 2 classes|labels are class indices "
                                        r"\('0'\) and class names \('dog'\)") as refused:
        list_rows(data)
    assert ("labels are class indices" in str(refused.value)) == ("dog" in labels)  # (not "add them")
    with pytest.MonkeyPatch.context() as patch:
        release = _hold(patch, 2)  # (row 13 is in a later block)
        streamed = stream_rows(data)
        assert streamed is not None and release.reached.wait(WAIT_S)
        assert 0 < streamed.listed < 13 and len(streamed.upto(streamed.listed)) == streamed.listed
        release.set()
        with pytest.raises(DataError, match=error):
            streamed.whole()
    assert stream_rows(data.model_copy(update={"classes": ("cat", "3")})) is None


@pytest.mark.parametrize("kind", ["none", "indices", "names"])
def test_json_lines_stream_prefix_by_prefix(tmp_path: Path, kind: str):
    """JSON lines (other fields, quotes, escapes; ids as whole numbers in some rows; lines ended by \\n, or by \\r\\n
    among blank ones): no labels, class indices without data.classes, names of data.classes: each prefix handed out
    while the listing is held holds the whole listing's first rows, and the whole equals list_rows'."""
    label = {"none": lambda i: None, "indices": lambda i: i % 3, "names": lambda i: ["cat", "dog", "emu"][i % 3]}[kind]
    lines = [json.dumps({"path": f"a/{i}.jpg", "text": 'a "quoted" word', "id": i if i % 2 else None,
                         **({} if label(i) is None or i % 5 == 4 else {"label": label(i)})}) for i in range(24)]
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(lines) + "\n")
    spaced = tmp_path / "spaced.jsonl"  # \r\n line ends, blank lines and lines of spaces: no row to either reader
    spaced.write_bytes(b"\r\n" + b"".join(line.encode() + (b"\r\n  \r\n\n" if i % 5 == 0 else b"\r\n")
                                          for i, line in enumerate(lines)) + b" \t")
    for source in (path, spaced):
        data = DataSpec(source="manifest", manifest=str(source), root=str(tmp_path),
                        classes=("cat", "dog", "emu") if kind == "names" else None)
        want = list_rows(data)
        assert len(want) == 24
        _streams_as_listed(data, want, block_bytes=160)  # (pyarrow's JSON blocks hold a row at least)
        assert want.labels.tolist()[:5] == ([-1] * 5 if kind == "none" else [0, 1, 2, 0, -1])


def test_json_lines_with_names_but_no_data_classes(tmp_path: Path):
    """Label names in the first block of JSON lines, data.classes not given: streamed, its names read first (as a
    listing made whole numbers them; :func:`test_a_manifest_of_names_without_data_classes_streams_them`). A name
    first read in a later block, after class indices: the listing stops there, naming the row and saying to list
    the classes in data.classes."""
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"path": f"a/{i}.jpg", "label": ["dog", "cat"][i % 2]}) + "\n"
                            for i in range(4)))
    streamed = stream_rows(DataSpec(source="manifest", manifest=str(path)))
    assert streamed is not None and streamed.classes == ["cat", "dog"]
    assert streamed.whole().labels.tolist() == [1, 0, 1, 0]
    path.write_text("".join(json.dumps({"path": f"a/{i}.jpg", **({"label": "cat"} if i == 20 else {})}) + "\n"
                            for i in range(24)))
    _stops(path, r"m.jsonl row 21: label 'cat' is a class name, .* list the classes' names in data.classes")
    assert list_rows(DataSpec(source="manifest", manifest=str(path))).classes == ["cat"]
    path.write_text("".join(json.dumps({"path": f"a/{i}.jpg", "label": "cat" if i == 20 else i % 3}) + "\n"
                            for i in range(24)))  # (read by pyarrow as numbers: the name's block read row by row)
    _stops(path, r"m.jsonl row 21: label 'cat' is a class name, .* list the classes' names in data.classes")


@pytest.mark.parametrize("kind", ["csv", "jsonl"])
def test_a_manifest_of_names_without_data_classes_streams_them(tmp_path: Path, kind: str):
    """Label names (some rows without one, names first read in later blocks that sort before the first ones),
    data.classes not given: the label column is read first, alone, so the rows stream as if data.classes named
    the names sorted (as a listing made whole numbers them): each prefix handed out while the listing is held holds
    the whole listing's class indices, and so does the whole. Names beside numbers, or more distinct labels than
    NAMES_MOST: listed whole (it decides what the numbers are)."""
    label = ["yak", "emu", "dog"]
    names = [("" if i % 5 == 4 else label[i % 3] if i < 12 else f"ant{i % 2}") for i in range(24)]
    if kind == "csv":
        path = _manifest(tmp_path / "m.csv", [f"a/{i}.jpg,{v}" for i, v in enumerate(names)], "path,label")
    else:
        path = tmp_path / "m.jsonl"
        path.write_text("".join(json.dumps({"path": f"a/{i}.jpg", **({"label": v} if v else {})}) + "\n"
                                for i, v in enumerate(names)))
    data = DataSpec(source="manifest", manifest=str(path), root=str(tmp_path))
    want = list_rows(data)
    assert want.classes == ["ant0", "ant1", "dog", "emu", "yak"]
    assert want.labels.tolist()[:5] == [4, 3, 2, 4, -1] and want.labels.tolist()[12:14] == [0, 1]
    _streams_as_listed(data, want, block_bytes=64 if kind == "csv" else 160)
    mixed = _manifest(tmp_path / "mixed.csv", [f"a/{i}.jpg,{'cat' if i < 12 else i % 3}" for i in range(24)],
                      "path,label")
    assert stream_rows(DataSpec(source="manifest", manifest=str(mixed))) is None
    assert list_rows(DataSpec(source="manifest", manifest=str(mixed))).classes == ["0", "1", "2", "cat"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(manifest, "NAMES_MOST", 5)  # (5 names; the empty label is none)
        _streams_as_listed(data, want, block_bytes=64 if kind == "csv" else 160)
        patch.setattr(manifest, "NAMES_MOST", 4)
        assert stream_rows(data) is None


@pytest.mark.parametrize("late", ["names", "halves", "indices"])
def test_a_csv_whose_first_block_has_no_label_reads_its_labels_first(tmp_path: Path, late: str):
    """A CSV whose header names a label column, its first block (64 bytes here) holding none: what its labels are
    is read first. Names after: streamed with them as its classes, as a listing made whole numbers them. Names and
    whole numbers after, or numbers that are not whole (every label a name to the listing made whole): listed
    whole. Class indices after: streamed as indices. JSON lines have no header to say a label is to come: a name
    after a first block without one stops the job, saying to list the classes."""
    after = {"names": lambda i: ["dog", "cat"][i % 2], "halves": lambda i: f"{i % 3}.5", "indices": lambda i: i % 3}
    lines = [f"a/{i}.jpg,{after[late](i) if i >= 10 else ''}" for i in range(24)]
    data = DataSpec(source="manifest", manifest=str(_manifest(tmp_path / "m.csv", lines, "path,label")))
    want = list_rows(data)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(manifest, "BLOCK_BYTES", 64)
        if late == "halves":
            assert stream_rows(data) is None and want.classes == ["0.5", "1.5", "2.5"]
            return
    assert want.labels.tolist()[9:12] == ([-1, 1, 0] if late == "names" else [-1, 1, 2])
    assert want.classes == (["cat", "dog"] if late == "names" else [])
    _streams_as_listed(data, want)
    if late == "names":
        path = tmp_path / "m.jsonl"
        path.write_text("".join(json.dumps({"path": f"a/{i}.jpg", **({"label": "cat"} if i >= 10 else {})}) + "\n"
                                for i in range(24)))
        _stops(path, r"m.jsonl row 11: label 'cat' is a class name, .* list the classes' names in data.classes")


def test_names_read_first_refuse_a_manifest_changed_meanwhile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A streamed manifest's names read first (data.classes not given) meet a label that was not there then, or
    miss one that was (the file rewritten while it was listed: the indices after it would be the listing's, less
    one): the listing stops, naming the label and saying why (not taking it for a name missing from data.classes),
    and the store, made for those names, is made again (a RemakeError: --overwrite)."""
    from extractor.errors import RemakeError

    codes = manifest._ArrowCodes("m.csv", ["cat", "dog"], found=True)
    pa = pytest.importorskip("pyarrow")
    assert codes.coded(pa.array(["dog", "", "cat"])).tolist() == [1, -1, 0]
    for added in ("emu", "3"):
        with pytest.raises(RemakeError, match=rf"m.csv changed while it was listed \(m.csv row 5: label '{added}' was "
                                              r"not there when the labels were read first\); run again"):
            codes.coded(pa.array(["cat", added]))
    path = _manifest(tmp_path / "m.csv", [f"a/{i}.jpg,{['dog', 'cat'][i % 2]}" for i in range(24)], "path,label")
    real = manifest._label_names
    monkeypatch.setattr(manifest, "_label_names", lambda *a: ["ant", *real(*a)])  # ("ant": rewritten to "cat")
    for last in ("a/23.jpg", "./a/23.jpg"):  # (read in bulk, or the file read row by row from its start)
        _manifest(path, [*(f"a/{i}.jpg,{['dog', 'cat'][i % 2]}" for i in range(23)), f"{last},cat"], "path,label")
        monkeypatch.setattr(manifest, "BLOCK_BYTES", 64)
        streamed = stream_rows(DataSpec(source="manifest", manifest=str(path)))
        assert streamed is not None and streamed.classes == ["ant", "cat", "dog"]
        with pytest.raises(RemakeError, match=r"m.csv changed while it was listed \((no row's label is 'ant' now|its "
                                              r"labels name 2 classes, 3 when they were read first)\); run again"):
            streamed.whole()


def test_a_csv_of_class_indices_without_data_classes_streams_them(tmp_path: Path):
    """Labels that are class indices (3, 3.0, none), data.classes not given: streamed, each prefix the whole
    listing's rows. Names in the first block: listed whole (the names numbered once all are read). A name first
    read in a later block: the listing stops at its row, saying to list the classes in data.classes (the listing
    made whole takes every label for a name there)."""
    lines = [f"a/{i}.jpg,{'' if i % 5 == 4 else f'{i % 3}.0' if i == 7 else i % 3}" for i in range(24)]
    data = DataSpec(source="manifest", manifest=str(_manifest(tmp_path / "m.csv", lines, "path,label")),
                    root=str(tmp_path))
    want = list_rows(data)
    assert want.labels.tolist()[:9] == [0, 1, 2, 0, -1, 2, 0, 1, 2] and want.classes == []
    _streams_as_listed(data, want)
    _manifest(tmp_path / "n.csv", ["a/0.jpg,cat", "a/1.jpg,0"], "path,label")
    assert stream_rows(DataSpec(source="manifest", manifest=str(tmp_path / "n.csv"))) is None
    late = _manifest(tmp_path / "late.csv", [f"a/{i}.jpg,{'cat' if i == 20 else i % 3}" for i in range(24)],
                     "path,label")
    _stops(late, r"late.csv row 21: label 'cat' is a class name, .* list the classes' names in data.classes", 64)
    assert list_rows(DataSpec(source="manifest", manifest=str(late))).classes == ["0", "1", "2", "cat"]
    odd = _manifest(tmp_path / "odd.csv", [f"{'./' if i == 16 else ''}a/{i}.jpg,{'cat' if i == 20 else i % 3}"
                                           for i in range(24)], "path,label")  # (row 17 read row by row from the start)
    _stops(odd, r"odd.csv row 21: label 'cat' is a class name, .* list the classes' names in data.classes", 64)


def _stops(path: Path, error: str, block_bytes: int = 160) -> None:
    """The manifest at ``path`` streams (blocks of ``block_bytes``), and its listing stops with ``error``."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(manifest, "BLOCK_BYTES", block_bytes)
        streamed = stream_rows(DataSpec(source="manifest", manifest=str(path)))
        assert streamed is not None
        with pytest.raises(DataError, match=error):
            streamed.whole()


def test_json_lines_that_are_not_one_object_a_line(tmp_path: Path):
    """Lines of white space (ASCII's, or Unicode's as Python's str.strip takes them: no row to either reader):
    streamed, no row counted. Two objects on one line, or one
    over two lines (pyarrow reads them, Python's json refuses them): the listing made whole reads it row by row and
    refuses it naming the line; streamed, Python's json refuses it where pyarrow refuses its block, else its counts of
    lines and of rows differ, said so at its end (the store made for the lines: --overwrite once it is fixed)."""
    rows = [json.dumps({"path": f"a/{i}.jpg"}) for i in range(24)]
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join([*rows[:10], "  \t", "\u00a0\u3000\u2028", *rows[10:]]) + "\n")  # (NBSP...: Python's)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(manifest, "BLOCK_BYTES", 64)  # (pyarrow refuses Unicode's white space: read by Python's json)
        spaced = stream_rows(DataSpec(source="manifest", manifest=str(path)))
        assert spaced is not None and len(spaced) == 24
        _same(spaced.whole(), list_rows(DataSpec(source="manifest", manifest=str(path))), 24)
    for odd, match in ((rows[10] + rows[11], "Extra data"), ('{"path":\n"a/10.jpg"}', "Expecting")):
        path.write_text("\n".join([*rows[:10], odd, *rows[12:]]) + "\n")
        with pytest.raises(DataError, match=rf"m.jsonl:11: not valid JSON: {match}"):
            list_rows(DataSpec(source="manifest", manifest=str(path)))
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(manifest, "SNIFF_ROWS", 5)  # (its types taken before the odd line)
            streamed = stream_rows(DataSpec(source="manifest", manifest=str(path)))
            assert streamed is not None
            with pytest.raises(DataError, match=r"m.jsonl: \d+ lines, but \d+ rows read from them: a line holds more "
                                                r"than one object, or an object spans lines"):
                streamed.whole()


def test_a_listing_of_more_rows_than_counted_never_hands_out_a_prefix_as_its_whole():
    """A lister that lists more rows than were counted: whole() waits for its end and raises, rather than return the
    prefix taken once the count was reached (it did: a JSON line of two objects was then listed without a word)."""
    from extractor.data.rows import Rows

    def rows(n: int) -> Rows:
        return Rows(ids=np.asarray([f"r{i}" for i in range(n)]), paths=np.asarray([f"p{i}" for i in range(n)]),
                    labels=np.full(n, -1), fingerprints=np.zeros(n, np.uint64))

    listed, reached, release, got = [0], threading.Event(), threading.Event(), []

    def lister() -> Any:
        for n in (2, 4):
            yield n, lambda n=n: listed.__setitem__(0, n)
        reached.set()  # (its 4 rows added, the count passed: the listing's end held)
        assert release.wait(WAIT_S)
        return rows(4)

    streamed = Streamed(3, [], lister(), lambda: rows(listed[0]), fingerprinted=True)
    assert reached.wait(WAIT_S)

    def whole() -> None:
        try:
            got.append(len(streamed.whole()))
        except DataError as err:
            got.append(err)

    asking = threading.Thread(target=whole)
    asking.start()
    release.set()
    asking.join(WAIT_S)
    assert len(got) == 1 and isinstance(got[0], DataError) and "3 rows counted first, 4" in str(got[0])


def test_manifests_whose_rows_are_not_their_lines_or_have_labels_are_listed_whole(tmp_path: Path,
                                                                                   monkeypatch: pytest.MonkeyPatch):
    """A label column of names beside numbers (what they are is known once all are read), a carriage return alone
    (in the header, in JSON lines), a column data.columns names that the file lacks, a first block that the
    listing refuses (absolute paths: data.outside_root is a fix of the spec, so refused before any store is made):
    no stream (its digest not made for nothing), and the listing made whole is what it was.
    data.classes beside no label column: the stream's classes from the start."""
    rows = [f"x/{i}.jpg" for i in range(4)]
    cases = {"labels.csv": "path,label\n" + "".join(f"{r},{'cat' if i else 0}\n" for i, r in enumerate(rows)),
             "cr_header.csv": "path\r" + "".join(f"{r}\n" for r in rows),
             "return.jsonl": "".join(f'{{"path":\r"{r}"}}\n' for r in rows)}  # (a line's end to Python alone)
    recorded, record = [], manifest.ManifestSource.listing

    def listing(self: Any, data: DataSpec, was: Any = None) -> Any:
        recorded.append(data.manifest)
        return record(self, data, was)

    monkeypatch.setattr(manifest.ManifestSource, "listing", listing)
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        data = DataSpec(source="manifest", manifest=str(tmp_path / name))
        assert stream_rows(data) is None, name
        assert not recorded  # (the manifest's digest, a read of it whole, made once: by the listing made whole)
        assert len(list_rows(data)) == 4, name
        recorded.clear()
    (tmp_path / "whole.csv").write_text("path\n" + "".join(f"{tmp_path}/{r}\n" for r in rows))
    assert stream_rows(DataSpec(source="manifest", manifest=str(tmp_path / "whole.csv"))) is None
    with pytest.raises(DataError, match=r"row 1: path .* lies outside data.root"):  # (before a store is made)
        list_rows(DataSpec(source="manifest", manifest=str(tmp_path / "whole.csv")))
    (tmp_path / "plain.csv").write_text("path\n" + "\n".join(rows))  # (no line break at its end)
    lacks = DataSpec(source="manifest", manifest=str(tmp_path / "plain.csv"), columns={"id": "key"})
    assert stream_rows(lacks) is None
    with pytest.raises(DataError, match=r"data.columns.id: 'key' is not a column"):
        list_rows(lacks)
    named = stream_rows(DataSpec(source="manifest", manifest=str(tmp_path / "plain.csv"), classes=("c", "d")))
    assert named is not None and len(named) == 4 and named.classes == ["c", "d"]
    assert named.whole().classes == ["c", "d"] and named.whole().labels.tolist() == [-1] * 4


@pytest.mark.parametrize("named", [True, False])
def test_a_job_runs_its_first_shards_while_its_manifest_is_listed(image_dir: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch, named: bool):
    """The manifest's last blocks are read only once shard 0 is done; the store then holds what a listing made
    whole gives (ids, paths, labels: names of data.classes, or, ``named`` False, the labels' own names read first;
    fingerprints, the listing's record) and the folder's store's features. A duplicate id in the last block, found
    then, stops the job naming both rows, the store half-made."""
    images = images_of(image_dir)
    classes = sorted({p.parent.name for p in images})
    lines = [f"{p.relative_to(image_dir)},r{i},{p.parent.name}" for i, p in enumerate(images)]
    path = _manifest(tmp_path / "m.csv", lines, "path,id,label")
    monkeypatch.setattr(layout, "WRITE_ROWS", 2)  # a stretch a shard: a store of a few rows written behind
    monkeypatch.setattr(layout, "ONCE_ROWS", 2)
    release = _hold(monkeypatch, 3)

    def on_event(name: str, info: dict) -> None:
        if name == "shard_done":
            release.set()

    data = {"source": "manifest", "manifest": str(path), "shard_size": 2, "batch_size": 2,
            **({"classes": classes} if named else {})}
    summary = run(parse_spec(job(image_dir, tmp_path / "m.zarr", data=data)), on_event=on_event)
    assert summary.ok == 12 and release.is_set()
    monkeypatch.undo()
    want = list_rows(DataSpec(source="manifest", manifest=str(path), root=str(image_dir),
                              classes=tuple(classes) if named else None))
    s = open_store(str(tmp_path / "m.zarr"))
    assert s.attrs["status"] == "complete" and s.attrs["listing"] == want.listing is not None
    assert s.ids.tolist() == want.ids.tolist() and [str(p) for p in s.paths] == want.paths.tolist()
    assert s.labels.tolist() == want.labels.tolist() == [classes.index(p.parent.name) for p in images]
    assert len(classes) > 1 and s.classes == classes
    g = opened(str(tmp_path / "m.zarr"))  # no file stat-ed by the listing: each fingerprinted as its worker read it
    assert want.fingerprints is None and not g["fingerprint"][:].any()
    assert g["read_fingerprint"][:].tolist() == [local_fingerprint(str(p)) for p in want.paths.tolist()]
    assert run(parse_spec(job(image_dir, tmp_path / "f.zarr", data={"shard_size": 2, "batch_size": 2}))).ok == 12
    np.testing.assert_array_equal(s.numpy("layer4"), open_store(str(tmp_path / "f.zarr")).numpy("layer4"))
    if not named:
        return
    _manifest(path, [*lines[:-1], lines[-1].replace(",r11,", ",r0,")], "path,id,label")
    monkeypatch.setattr(layout, "WRITE_ROWS", 2)
    monkeypatch.setattr(layout, "ONCE_ROWS", 2)
    release = _hold(monkeypatch, 3)
    with pytest.raises(DataError, match=r"id 'r0' appears in rows 1 and 12; ids must be unique"):
        run(parse_spec(job(image_dir, tmp_path / "d.zarr", data=data)), on_event=on_event)
    assert release.is_set() and (read_state(str(tmp_path / "d.zarr")) or {})["status"] == "creating"


def test_a_listing_stopped_in_its_row_by_row_part_stops_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A path the bulk reader leaves to Python's csv (``./``) has the file listed row by row, in one part of the
    stream: its job's stop is seen within STOP_ROWS rows there, not once the file is read (at 100M rows, 18 minutes
    of a process that would not exit)."""
    path = _manifest(tmp_path / "m.csv", [f"a/{i}.jpg," for i in range(30)] + ["./a/x.jpg,"])
    monkeypatch.setattr(manifest, "STOP_ROWS", 2)
    monkeypatch.setattr(manifest, "BLOCK_BYTES", 64)  # (a first block the bulk reader takes: streamed)
    reached, release, read, records = threading.Event(), threading.Event(), [], manifest._manifest_records

    def held(*args: Any) -> Any:  # (only the row-by-row reader reads records)
        for n, rec in enumerate(records(*args)):
            read.append(n)
            if n == 5:
                reached.set()
                assert release.wait(WAIT_S)
            yield rec

    monkeypatch.setattr(manifest, "_manifest_records", held)
    streamed = stream_rows(DataSpec(source="manifest", manifest=str(path), root=str(tmp_path)))
    assert streamed is not None and reached.wait(WAIT_S)
    streamed.stop()
    release.set()
    with pytest.raises(DataError, match="the listing stopped: its job stopped"):
        streamed.whole()
    streamed._thread.join(WAIT_S)
    assert not streamed._thread.is_alive() and len(read) <= 8


def test_a_store_that_fails_as_its_rows_are_written_stops_the_listing(image_dir: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch):
    """The store's writer of rows fails (its storage, here a full disk) while the manifest is listed: the job stops
    with that error, and so does the listing (it read on to the manifest's end, with no job left to take it)."""
    lines = [f"{p.relative_to(image_dir)},r{i}" for i, p in enumerate(images_of(image_dir))]
    path = _manifest(tmp_path / "m.csv", lines)
    monkeypatch.setattr(layout, "WRITE_ROWS", 2)
    monkeypatch.setattr(layout, "ONCE_ROWS", 2)
    release = _hold(monkeypatch, 2)
    checked, prepare = [], manifest._Bulk.prepare

    def counted(self: Any, *block: Any) -> Any:
        checked.append(len(block[0]))
        return prepare(self, *block)

    monkeypatch.setattr(manifest._Bulk, "prepare", counted)
    write, made = layout._RowArrays.write, []

    def full(self: Any, start: int, stop: int, rows: Any) -> None:
        if start:
            raise OSError(28, "No space left on device")
        write(self, start, stop, rows)

    monkeypatch.setattr(layout._RowArrays, "write", full)
    streams = manifest.ManifestSource.stream

    def stream(self: Any, data: Any, then: Any) -> Any:
        made.append(streams(self, data, then))
        return made[-1]

    monkeypatch.setattr(manifest.ManifestSource, "stream", stream)
    data = {"source": "manifest", "manifest": str(path), "shard_size": 2, "batch_size": 2}
    with pytest.raises(Exception, match="No space left on device"):
        run(parse_spec(job(image_dir, tmp_path / "m.zarr", data=data)))
    assert made and made[0] is not None and made[0].stopping
    release.set()
    made[0]._thread.join(WAIT_S)
    assert not made[0]._thread.is_alive() and sum(checked) < 12


def test_a_remote_manifest_whose_storage_fails_as_its_lines_are_counted_is_one_line(monkeypatch: pytest.MonkeyPatch):
    """A read that fails while a remote manifest's lines are counted (before any store) is the one line a listing
    gives for its storage, not a traceback."""
    import io

    class Failing(io.BytesIO):
        def read(self, size: int | None = -1) -> bytes:
            raise ConnectionResetError(104, "Connection reset by peer")

    monkeypatch.setattr(manifest, "_opened", lambda url, storage: Failing())
    with pytest.raises(DataError, match=r"cannot read data.manifest s3://b/m.csv: ConnectionResetError: .*network"):
        stream_rows(DataSpec(source="manifest", manifest="s3://b/m.csv"))
