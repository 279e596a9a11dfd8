"""The rows as the driver holds them (issue 29): numpy columns, paths as shared heads and tails, duplicates found
by hashes; each checked against the plain list form it replaced."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest

from extractor.data.rows import (
    BLOCK,
    Distinct,
    Joined,
    Joining,
    Rows,
    Strings,
    Texts,
    distinct,
    duplicate,
    labels_of,
    strings,
    utf8,
)
from extractor.store.provenance import _digest


def test_strings_across_blocks_equal_the_list_and_read_while_gathered():
    items = [f"img{i:07d}" + "é" * (i % 3) for i in range(2 * BLOCK + 17)]
    gathered = Strings()
    for n, item in enumerate(items):
        gathered.append(item)
        assert gathered[n] == item and gathered[n // 2] == items[n // 2]
    assert gathered.array().tolist() == items
    assert strings(iter(items)).tolist() == items and strings([]).tolist() == []


def test_texts_hold_one_buffer_and_give_back_every_string():
    """A column of strings as UTF-8 and ends: every string (accents, the empty one) comes back, by index (numpy's
    integers too), slice, iteration and as an array; a lone surrogate by index (an array of strings holds none)."""
    assert strings(["x\udcff.jpg"])[0] == "x\udcff.jpg"
    items = ["", "a", "é" * 20, "ü", "b" * 16, *(f"train/n{i:08d}_{i}.JPEG" for i in range(BLOCK + 5))]
    texts = strings(iter(items))
    assert isinstance(texts, Texts) and len(texts) == len(items) and texts.ends.dtype == np.int64
    assert texts.nbytes == sum(len(i.encode("utf-8", "surrogatepass")) for i in items) + 8 * len(items)
    assert [texts[i] for i in range(6)] == items[:6] and texts[np.int64(7)] == items[7] and texts[-1] == items[-1]
    assert texts[2:9].tolist() == items[2:9] and texts[2:9].dtype == np.dtypes.StringDType()
    assert texts[5:5].tolist() == [] and texts[::2].tolist() == items[::2] and texts[9:2:-3].tolist() == items[9:2:-3]
    assert list(texts) == items and texts.tolist() == items and np.asarray(texts).tolist() == items
    numbered = Joined(["/f/a.parquet#image/", "/f/b.parquet#image/"], np.array([0, 1, 0]), np.array([0, 0, 1]))
    assert numbered[1] == "/f/a.parquet#image/1" and numbered[0:3].tolist() == [
        "/f/a.parquet#image/0", "/f/a.parquet#image/1", "/f/b.parquet#image/0"]  # rows as integers


def test_joined_paths_equal_their_strings_whether_tails_are_the_ids_or_not():
    for differ_at in (None, 0, 5, BLOCK + 3):  # every tail its id / not from the first / from row 5 / past a block
        rel = [f"c{i % 7}/x{i}.jpg" for i in range(BLOCK + 10)]
        full = ["/root/" + r for r in rel]
        if differ_at is not None:
            full[differ_at] = "s3://elsewhere/y.jpg"  # not under the head: held whole
        ids = Strings()
        paths = Joining(["/root/"], ids)
        for r, f in zip(rel, full, strict=True):
            ids.append(r)
            paths.whole(f)
        listed = ids.array()
        joined = paths.joined(listed)
        assert (joined.tails is listed) == (differ_at is None)  # the ids' array, held once
        assert list(joined) == full and joined[3] == full[3] and joined[2:9].tolist() == full[2:9]
        assert joined[len(full) - 2:].tolist() == full[-2:]


def test_joined_tar_members_and_rows_made_of_lists():
    paths = Joining(["/t/a.tar#", "/t/b.tar#"])
    for t, member in [(0, "k1.jpg"), (0, "k2.jpg"), (1, "k3.jpg")]:
        paths.part(t, member)
    joined = paths.joined()
    assert list(joined) == ["/t/a.tar#k1.jpg", "/t/a.tar#k2.jpg", "/t/b.tar#k3.jpg"]
    rows = Rows(ids=["k1", "k2", "k3"], paths=joined, labels=[1, -1, 2],
                locators={"byte_offset": [0, 512, 1024], "byte_size": [3, 4, 5]})
    assert isinstance(rows.ids, Texts) and rows.ids.tolist() == ["k1", "k2", "k3"]
    assert rows.labels.dtype == np.int64 and len(rows) == 3
    assert rows.locators["byte_offset"].tolist() == [0, 512, 1024] and rows.paths is joined
    assert isinstance(rows.locators["byte_size"], np.ndarray)


def test_duplicate_finds_the_first_id_seen_again_as_a_set_would():
    rng = random.Random(0)
    for _ in range(30):
        n = rng.randrange(2, 300)
        ids = [f"k{rng.randrange(n * 3)}" for _ in range(n)]
        seen: dict[str, int] = {}
        want = None
        for row, key in enumerate(ids):  # the reference: the listing's set-based check before issue 29
            if key in seen:
                want = (seen[key], row)
                break
            seen[key] = row
        assert duplicate(strings(ids)) == want
    assert duplicate(strings([])) is None and duplicate(strings(["a"])) is None


def test_labels_decided_on_distinct_values_equal_per_row_labels():
    mixed, classes = labels_of([3, "3", 3.0, None, "", True, 1, "1e1"])  # True is a name: all of them are
    assert classes == ["1", "1e1", "3", "3.0", "True"] and mixed.dtype == np.int64
    assert mixed.tolist() == [2, 2, 3, -1, -1, 4, 0, 1]
    numbers, none = labels_of(["3", 3.0, None, "1e1", 7])
    assert numbers.tolist() == [3, 3, -1, 10, 7] and none == []
    names, named = labels_of(["dog", "cat", "dog", None])
    assert named == ["cat", "dog"] and names.tolist() == [1, 0, 1, -1]


def test_distinct_values_found_in_bulk_are_those_found_one_by_one():
    pa = pytest.importorskip("pyarrow")
    blocks = [[7, "7"], pa.array([3, None, 1, 3, 1]), pa.array(["a", None, "b", "a", ""]), pa.array([[1], [2], [1]]),
              pa.array(["x", "y", "x"]).dictionary_encode(), pa.array([1.0, 2.5, 1.0]), [1.0, True, 1],
              pa.chunked_array([[1, 2], [2, 3]]), pa.array([True, False, True]), pa.array([4, 3, None, 9], pa.int32()),
              pa.array(["b", "q", None], pa.large_string()), pa.array([None, None], pa.null()), ("dog", "a"),
              pa.array([], pa.int64()), pa.array([9, 1, 3] * 2000), pa.array(np.array([1, 2, 1], np.float16)),
              pa.array(["dog", "a", None], pa.string_view()), pa.array([b"x", b"y"], pa.binary_view())]
    found, every = Distinct(), []
    for block in blocks:  # each kind of block after the others: codes carried over, first rows counted on
        if isinstance(block, tuple):  # the distinct values and each row's code (the tar reader's)
            codes = np.array([1, 1, 0, 2])
            found.add_coded([*block, None], codes)
            every += [[*block, None][c] for c in codes]
        elif isinstance(block, list):
            found.add(block)
            every += block
        else:
            found.add_arrow(block)
            every += block.to_pylist()
    codes, values, firsts = found.result()
    want = distinct(every)  # the reference: one by one (1, 1.0 and True three values; "1" a fourth)
    assert codes.tolist() == want[0].tolist() and values == want[1] and firsts == want[2]
    assert [values[c] for c in codes.tolist()] == every


def test_the_digest_of_ids_is_the_one_older_stores_recorded():
    ids = [f"a/{i}.jpg" for i in range(BLOCK + 5)] + ["é", ""]
    h = hashlib.sha256()
    for i in ids:  # as provenance hashed a list of str before issue 29
        h.update(i.encode("utf-8", "surrogateescape") + b"\0")
    paths = Joining(["/r/"])
    for i in ids:
        paths.whole("/r/" + i)
    assert _digest(strings(ids)) == h.hexdigest()[:16]
    assert _digest(paths.joined()) == _digest(strings(["/r/" + i for i in ids]))
    numbers = Joined(["f.parquet#image/", "g/"], np.arange(BLOCK + 5) * 7, np.arange(BLOCK + 5) % 2, [".a", ""],
                     np.arange(BLOCK + 5) // BLOCK)  # a Parquet file's rows, and a tar's paths with their ends
    assert _digest(numbers) == _digest(strings(numbers[:].tolist()))
    large = np.array([0, 9, 10, 10**16 - 1, 2**53 + 1, 2**63 - 1], np.int64)  # digits exact past float64's
    for tails in (large, np.array([10**19, 2**64 - 1], np.uint64)):
        data, ends = utf8(Joined(["r/"], tails), 0, len(tails))
        assert bytes(data) == "".join(f"r/{int(t)}" for t in tails.tolist()).encode() and len(ends) == len(tails)


def test_strings_extended_at_once_hold_what_appending_one_by_one_holds():
    items = ["a", "", "ünï", "x\udcff", "long" * 50]  # a file name's escaped byte round-trips
    one, many = Strings(), Strings()
    for item in items * 3:
        one.append(item)
    many.extend(items)
    many.extend([])
    many.append(items[0])
    many.extend(iter(items[1:] + items))
    a, b = one.array(), many.array()
    assert a.tolist() == b.tolist() == items * 3
    assert np.array_equal(a.ends, b.ends) and np.array_equal(a.data, b.data)
