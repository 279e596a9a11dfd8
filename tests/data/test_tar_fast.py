"""The tar source's listing against Python's tarfile (an independent reading of the same tars): the bulk header
reader (``_tar_fast``), the plain one it falls back to, and the rows ``list_tars`` makes of them."""

from __future__ import annotations

import io
import json
import mmap
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from extractor.data.sources import _tar_fast
from extractor.data.sources.tar import list_tars, scan_tar
from extractor.errors import DataError

PROBE, FAR = _tar_fast._PROBE, _tar_fast._FAR  # (as the module sets them: the fixture below changes them)


@pytest.fixture(autouse=True, params=["interpreted", "compiled", "pread"])
def walk(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test with the headers walked in the tar's mapping by the interpreter (no numba), then by the compiled
    walk (numba, the ``index`` extra), each past a tar's first header (as a tar of more than ``_INTERPRETED``
    headers); then read by ``pread`` (as a tar whose headers are far apart: large images)."""
    monkeypatch.setattr(_tar_fast, "_INTERPRETED", 1)
    monkeypatch.setattr(_tar_fast, "_PROBE", 1)
    monkeypatch.setattr(_tar_fast, "_FAR", 0 if request.param == "pread" else 1 << 62)
    if request.param == "compiled":
        pytest.importorskip("numba")
        assert _tar_fast._walk_kernel() is not None
    else:
        monkeypatch.setattr(_tar_fast, "_KERNEL", [None])
    return str(request.param)


def _expected(path: Path, exts: tuple[str, ...]) -> list[tuple[str, str, int, int, Any]]:
    """(key, image member, data offset, size, raw label) of each sample with an image, from tarfile's members:
    the key is the name to the first dot of its file name; the label the last ``.cls`` text, else the first
    ``.json`` label."""
    samples: dict[str, dict[str, Any]] = {}
    with tarfile.open(path, "r:") as tar:
        for m in tar:
            if not m.isfile():
                continue
            base = m.name.rsplit("/", 1)[-1]
            key = m.name[:len(m.name) - len(base)] + base.split(".", 1)[0]
            ext = base[len(base.split(".", 1)[0]):].lower()
            s = samples.setdefault(key, {})
            if ext.endswith(exts):
                s["image"] = (m.name, m.offset_data, m.size)
            elif ext == ".cls":
                s["cls"] = tar.extractfile(m).read().decode().strip()
            elif ext == ".json":
                meta = json.loads(tar.extractfile(m).read())
                if "label" in meta:
                    s.setdefault("json", meta["label"])
    imageless = [k for k, s in samples.items() if "image" not in s]  # left out: their count and the first
    return [(k, *s["image"], s.get("cls", s.get("json"))) for k, s in samples.items() if "image" in s] + \
        [(len(imageless), imageless[0] if imageless else None)]


def _listed(path: Path, exts: tuple[str, ...]) -> list[tuple[str, str, int, int, Any]]:
    s = scan_tar(str(path), exts, {})
    return [*zip(s.keys, s.members, s.offsets, s.sizes, s.each_label(), strict=True), (s.left_out, s.left_out_key)]


def _walked(mm: mmap.mmap, fd: int) -> tuple[np.ndarray, int, np.ndarray | None, np.ndarray | None]:
    """The walk's parts joined: the headers' positions, where it stopped, the compiled walk's facts (None unless
    every part has them), each header with the first bytes of its data (None unless every part was read by pread)."""
    walk = _tar_fast._Walk(mm, fd)
    parts = list(walk.parts())
    starts = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64)
    facts = None if any(p[2] is None for p in parts) else np.concatenate([p[2] for p in parts], axis=1)
    heads = None if any(p[3] is None for p in parts) else np.concatenate([np.hstack([p[1], p[3]]) for p in parts])
    return starts, walk.stop, facts, heads


def _fast(path: Path) -> bool:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        return _tar_fast.fast_samples(mm, f.fileno(), (".jpg",), str(path), lambda *a: None, object()) is not None


def _write(path: Path, members: list[tuple[str, bytes]], fmt: int = tarfile.GNU_FORMAT, **kw: Any) -> Path:
    rng = np.random.default_rng(len(members))
    with tarfile.open(path, "w", format=fmt, **kw) as tar:
        folder = tarfile.TarInfo("d.x")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        for n, (name, data) in enumerate(members):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            if rng.random() < 0.2:
                link = tarfile.TarInfo(f"link{n}")
                link.type, link.linkname = tarfile.SYMTYPE, name
                tar.addfile(link)
    return path


def _members(n: int) -> list[tuple[str, bytes]]:
    """A WebDataset-like tar's members: images of many sizes with .cls or .json labels (some both, some
    neither), keys with dots in folders, upper-case extensions, a sample of no image, a member of no extension."""
    rng = np.random.default_rng(n)
    out: list[tuple[str, bytes]] = []
    for i in range(n):
        key = f"d.x/s{i:05d}" if i % 3 else f"part.{i % 4}/{i:05d}"
        ext = ".JPG" if i % 7 == 0 else ".jpg"
        out.append((f"{key}{ext}", bytes(rng.integers(0, 256, int(rng.integers(0, 3000)), dtype=np.uint8))))
        if i % 2 == 0:
            out.append((f"{key}.cls", f" {i % 5}\n".encode()))
        if i % 3 == 0:
            out.append((f"{key}.json", json.dumps({"label": f"c{i % 4}"} if i % 4 else {"x": 1}).encode()))
    out += [("d.x/alone.txt", b"no image"), ("noext", b"x"), ("a" * 92 + ".jpg", b"long name")]
    return out


def test_the_bulk_reader_gives_tarfiles_samples(tmp_path: Path):
    path = _write(tmp_path / "t.tar", _members(300))
    assert _fast(path)
    assert _listed(path, (".jpg",)) == _expected(path, (".jpg",))
    ustar = _write(tmp_path / "u.tar", _members(50), fmt=tarfile.USTAR_FORMAT)
    assert _fast(ustar) and _listed(ustar, (".jpg",)) == _expected(ustar, (".jpg",))


def test_the_compiled_walk_finds_what_the_bulk_steps_find(tmp_path: Path, walk: str):
    """Where the walk is compiled it also gives each header's size, byte sum and name length: the same as the bulk
    steps make of the headers (the reference, as without numba), on a tar of many kinds of member. A size field
    the compiled walk does not read (spaces before its digits, which tarfile and ``int()`` read) hands the rest of
    the tar to the interpreted walk: the same members, the facts then made in bulk."""
    path = _write(tmp_path / "t.tar", _members(300))
    data = bytearray(path.read_bytes())
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        starts, stop, facts, heads = _walked(mm, f.fileno())
        block = _tar_fast._gathered(mm, starts)
    assert (heads is not None) == (walk == "pread")
    if heads is not None:  # (each header, and the first bytes of its data: what follows it in the file)
        assert heads.tolist() == [list(data[s:s + 576].ljust(576, b"\0")) for s in starts.tolist()]
    assert len(starts) > 300 and data[stop:stop + 512] == bytes(512)  # (members, folders, links; the end mark)
    assert (facts is not None) == (walk == "compiled")
    if facts is not None:
        assert facts[0].tolist() == _tar_fast._octal(block[:, 124:136], 11).tolist()
        assert facts[1].tolist() == block.sum(1).tolist()
        assert facts[2].tolist() == _tar_fast._first_zero(block[:, :100]).tolist()
    third = int(starts[3])  # a member's header: its size field written "  000000017" (as some writers pad)
    field = bytes(data[third + 124:third + 135])
    assert field[:2] == b"00"
    data[third + 124:third + 135] = b"  " + field[2:]
    data[third + 148:third + 156] = b" " * 8
    data[third + 148:third + 156] = b"%06o\0 " % sum(data[third:third + 512])
    odd = tmp_path / "odd.tar"
    odd.write_bytes(bytes(data))
    with open(odd, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        again, _, facts, _ = _walked(mm, f.fileno())
    assert again.tolist() == starts.tolist() and facts is None
    assert _fast(odd) and _listed(odd, (".jpg",)) == _expected(odd, (".jpg",)) == _expected(path, (".jpg",))


def test_headers_far_apart_are_read_by_pread_and_list_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A tar whose first headers are far apart on average (images of 70-90 KB: a page fault a header in the
    mapping, or its read-ahead) is read by ``pread``, one of near headers in the mapping, one of fewer headers than
    the probe reads by ``pread``: each lists as tarfile does (labels of .cls and .json members read from the
    file)."""
    monkeypatch.setattr(_tar_fast, "_PROBE", PROBE)
    monkeypatch.setattr(_tar_fast, "_FAR", FAR)
    rng = np.random.default_rng(0)

    def members(n: int, low: int, high: int) -> list[tuple[str, bytes]]:
        out = []
        for i in range(n):
            out.append((f"s/{i:04d}.jpg", rng.bytes(int(rng.integers(low, high)))))
            if i % 2:
                out.append((f"s/{i:04d}.cls", f"{i % 7}".encode()))
            if i % 3 == 0:
                out.append((f"s/{i:04d}.json", json.dumps({"label": f"j{i % 5}", "pad": "x" * 90}).encode()))
        return out

    def three(n: int) -> list[tuple[str, bytes]]:  # (img2dataset's: an image, its .json and .txt; headers 27 KB apart)
        meta = [json.dumps({"label": i % 4, "url": "x" * 600}).encode() for i in range(n)]
        return [m for i in range(n) for m in ((f"{i:05d}.jpg", rng.bytes(int(rng.integers(70_000, 90_000)))),
                                              (f"{i:05d}.json", meta[i]), (f"{i:05d}.txt", b"a caption"))]

    for name, made, far in (("far.tar", members(70, 70_000, 90_000), True), ("near.tar", members(90, 100, 900), False),
                            ("few.tar", members(10, 100, 900), True), ("three.tar", three(40), True)):
        path = _write(tmp_path / name, made)
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            assert (_walked(mm, f.fileno())[3] is not None) == far, name
        assert _listed(path, (".jpg",)) == _expected(path, (".jpg",)), name


def test_a_tar_of_far_headers_then_near_ones_is_read_by_pread_then_walked_in_its_mapping(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Large images first (read by pread, a part at a time), then small ones: from the first part that took less
    than ``_FAR`` bytes a read, the rest is walked in the mapping (compiled where numba is); the labels of both
    (.cls texts kept by pread, then gathered from the mapping) and the listing as tarfile's."""
    monkeypatch.setattr(_tar_fast, "_PROBE", 4)
    monkeypatch.setattr(_tar_fast, "_FAR", FAR)
    monkeypatch.setattr(_tar_fast, "_CHUNK", 16)
    rng = np.random.default_rng(1)
    members = [m for i in range(100) for m in ((f"s/{i:04d}.jpg", rng.bytes(70_000 if i < 20 else 300)),
                                               (f"s/{i:04d}.cls", f"label{i % 9}".encode()))]
    path = _write(tmp_path / "mixed.tar", members)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        walk = _tar_fast._Walk(mm, f.fileno())
        ways = [p[3] is not None for p in walk.parts()]
        members = _tar_fast._members(mm, f.fileno(), str(path))
    assert ways[0] and not ways[-1] and ways == sorted(ways, reverse=True) and len(ways) > 4  # (pread, then mapped)
    assert members is not None and members[4] is not None
    raw = path.read_bytes()  # (each member's first bytes: kept by pread, then gathered from the mapping)
    assert members[4].tolist() == [list(raw[o:o + 64]) for o in members[2].tolist()]
    assert _listed(path, (".jpg",)) == _expected(path, (".jpg",))


def test_a_numba_that_does_not_load_leaves_the_walk_interpreted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """numba installed but broken (llvmlite's library not loaded: an OSError on import; a compile error; no folder
    for its cache): the tar is listed as without numba, never refused."""
    path = _write(tmp_path / "t.tar", _members(40))

    def broken() -> None:
        raise OSError("Could not find/load shared object file: libllvmlite.so")

    monkeypatch.setattr(_tar_fast, "_KERNEL", [])
    monkeypatch.setattr(_tar_fast, "_compiled", broken)
    monkeypatch.setattr(_tar_fast, "_FAR", 1 << 62)  # (walked in the mapping)
    assert _listed(path, (".jpg",)) == _expected(path, (".jpg",)) and _tar_fast._KERNEL == [None]


def test_tars_the_bulk_reader_leaves_to_the_plain_one_list_the_same(tmp_path: Path):
    """pax headers (a name beyond ASCII, a long name) and a ustar prefix folder: read the plain way, as tarfile."""
    for name, fmt, extra in (("pax.tar", tarfile.PAX_FORMAT, [("ünï/cödé.jpg", b"u")]),
                             ("long.tar", tarfile.GNU_FORMAT, [("x" * 150 + ".jpg", b"l")]),
                             ("prefix.tar", tarfile.USTAR_FORMAT, [("/".join(["f" * 30] * 4) + "/p.jpg", b"p")])):
        path = _write(tmp_path / name, _members(20) + extra, fmt=fmt)
        assert not _fast(path)
        assert _listed(path, (".jpg",)) == _expected(path, (".jpg",))


def test_samples_without_an_image_are_left_out_with_one_warning_naming_the_first(tmp_path: Path,
                                                                                 caplog: pytest.LogCaptureFixture):
    first = _write(tmp_path / "0.tar", [("a/k0.jpg", b"x"), ("a/k0.cls", b"1"), ("a/k1.tiff", b"y"),
                                       ("a/k1.cls", b"2")])
    _write(tmp_path / "1.tar", [("b/k2.tif", b"z"), ("b/k3.jpg", b"w")])
    with caplog.at_level("WARNING", logger="extractor.data.sources.tar"):
        rows = list_tars(str(tmp_path / "{0..1}.tar"), [".jpg"], {})
    assert list(rows.ids) == ["a/k0", "b/k3"]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("2 samples of data.tars have no member whose extension is one of "
                                                 f"data.extensions (.jpg), and are left out (the first: 'a/k1' in "
                                                 f"{first})"), said


def test_a_tar_cut_short_lists_the_members_before_the_cut(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    path = _write(tmp_path / "t.tar", _members(40))
    whole = _listed(path, (".jpg",))
    cut = tmp_path / "cut.tar"
    cut.write_bytes(path.read_bytes()[: whole[20][2] - 300])  # inside the header of the 21st image
    assert _fast(cut)
    inside = tmp_path / "inside.tar"  # 10 bytes into the 21st image's data: its header read, zeros past the end
    inside.write_bytes(path.read_bytes()[: whole[20][2] + 10])
    with open(inside, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        starts, _, _, heads = _walked(mm, f.fileno())
    assert int(starts[-1]) == whole[20][2] - 512
    if heads is not None:  # (as the mapping's gather gives the bytes past the end: zeros)
        raw = inside.read_bytes()
        assert heads.tolist() == [list(raw[s:s + 576].ljust(576, b"\0")) for s in starts.tolist()]
    assert _listed(cut, (".jpg",)) == _expected(cut, (".jpg",))
    assert _listed(cut, (".jpg",))[:-1] == whole[:20]  # (then the samples left out: their count, the first)
    assert "ends early" in caplog.text
    junk = tmp_path / "junk.tar"  # a block of noise where the 21st image's header was
    data = bytearray(path.read_bytes())
    data[whole[20][2] - 512:whole[20][2]] = np.random.default_rng(0).bytes(512)
    junk.write_bytes(bytes(data))
    assert _listed(junk, (".jpg",))[:-1] == whole[:20]


def test_two_images_under_one_key_are_refused_naming_both(tmp_path: Path):
    path = _write(tmp_path / "t.tar", [("a.jpg", b"1"), ("b.jpg", b"2"), ("b.x.jpg", b"3")])
    with pytest.raises(DataError, match=r"sample 'b' has two images, b\.jpg and b\.x\.jpg"):
        scan_tar(str(path), [".jpg"], {})


def test_list_tars_rows_are_tarfiles_members(tmp_path: Path):
    """The rows' ids, paths (TAR#MEMBER), offsets, sizes and labels equal tarfile's listing of the same tars."""
    tars = [_write(tmp_path / f"{t}.tar", [(f"t{t}/{name}", d) for name, d in _members(30 + t)]) for t in range(3)]
    rows = list_tars([str(t) for t in tars], [".jpg"], {})
    want = [(k, f"{t}#{m}", o, s, lab) for t in tars for k, m, o, s, lab in _expected(t, (".jpg",))[:-1]]
    offsets, sizes = rows.locators["byte_offset"].tolist(), rows.locators["byte_size"].tolist()
    assert list(zip(rows.ids, rows.paths, offsets, sizes, strict=True)) == \
        [w[:4] for w in want]
    labels = [lab for *_, lab in want]
    assert rows.classes == sorted({str(v) for v in labels if v is not None})
    assert [rows.classes[c] if c >= 0 else None for c in rows.labels.tolist()] == labels


def _webdataset(n: int, odd: dict[int, bytes] | None = None) -> list[tuple[str, bytes]]:
    """A WebDataset writer's members: keys in order, each sample's members adjacent, one ``.cls`` each (some with
    spaces, some samples without); ``odd``: other ``.cls`` bytes of some samples."""
    out: list[tuple[str, bytes]] = []
    for i in range(n):
        out.append((f"shard/{i:06d}.{'JPG' if i % 5 == 0 else 'jpg'}", bytes(i % 700)))
        if i % 4:
            out.append((f"shard/{i:06d}.cls", (odd or {}).get(i, f" {i % 3}\n".encode())))
    return out


def test_a_webdataset_tar_is_grouped_and_labelled_in_bulk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Keys in order and one short .cls a sample: grouped without sorting and the labels read at once, the same
    samples as tarfile's; a .cls the bulk path cannot hold (a zero byte, 100 bytes) and keys out of order or
    met again later are read the plain way, still the same."""
    bulk: list[bool] = []
    real_labels, real_unique = _tar_fast._short_labels, np.unique
    monkeypatch.setattr(_tar_fast, "_short_labels", lambda *a: bulk.append((r := real_labels(*a)) is not None) or r)
    sorts: list[int] = []
    monkeypatch.setattr(_tar_fast.np, "unique", lambda a, *x, **k: sorts.append(len(a)) or real_unique(a, *x, **k))
    path = _write(tmp_path / "w.tar", _webdataset(400))
    assert _listed(path, (".jpg",)) == _expected(path, (".jpg",)) and bulk == [True]
    assert sorts and 700 not in sorts  # the keys of the 700 members were not sorted
    for name, members in (("zero.tar", _webdataset(50, {5: b"1\x002"})), ("long.tar", _webdataset(50, {6: b"7" * 100})),
                          ("again.tar", [("a.jpg", b"1"), ("b.jpg", b"2"), ("a.cls", b"3"), ("b.cls", b"4")]),
                          ("order.tar", [("b.jpg", b"1"), ("b.cls", b"2"), ("a.jpg", b"3"), ("a.cls", b"4")])):
        bulk.clear()
        path = _write(tmp_path / name, members)
        assert _listed(path, (".jpg",)) == _expected(path, (".jpg",)), name
        assert bulk == [name in ("again.tar", "order.tar")], name


def test_a_listing_shared_out_to_worker_processes_gives_the_same_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Many tars are listed by worker processes (``python -m``, one a core; issue 57): the rows are those this process
    lists itself (bulk and plain headers, labels, samples of no image, fingerprints, the listing's record); a tar
    that cannot be listed stops the listing with the error this process gives, and no worker is left."""
    import subprocess

    import extractor.data.sources._tar_processes as tp

    tars = [_write(tmp_path / f"{t}.tar", [(f"t{t}/{'ü' if t == 2 else ''}{n}", d) for n, d in _members(20 + t)],
                   fmt=tarfile.PAX_FORMAT if t == 2 else tarfile.GNU_FORMAT) for t in range(6)]
    urls = [str(t) for t in tars]
    here = list_tars(urls, [".jpg"], {})
    monkeypatch.setattr(tp, "PROCESS_TARS", 2)
    monkeypatch.setattr(tp.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    started: list[subprocess.Popen] = []
    popen = subprocess.Popen

    def spawn(*args: Any, **kwargs: Any) -> subprocess.Popen:
        started.append(popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(tp.subprocess, "Popen", spawn)
    there = list_tars(urls, [".jpg"], {})
    assert len(started) == 2 and all(p.returncode == 0 for p in started)
    assert list(there.ids) == list(here.ids) and list(there.paths) == list(here.paths)
    assert there.classes == here.classes and there.labels.tolist() == here.labels.tolist()
    assert there.fingerprints.tolist() == here.fingerprints.tolist() and there.listing == here.listing  # type: ignore[union-attr]
    for name, column in here.locators.items():
        assert there.locators[name].tolist() == column.tolist(), name
    (tmp_path / "bad.tar").write_bytes(b"not a tar, " * 100)
    broken = [*urls[:3], str(tmp_path / "bad.tar"), *urls[3:]]
    monkeypatch.setattr(tp, "PROCESS_TARS", 10**9)
    with pytest.raises(DataError) as in_here:
        list_tars(broken, [".jpg"], {})
    monkeypatch.setattr(tp, "PROCESS_TARS", 2)
    started.clear()
    with pytest.raises(DataError) as in_workers:
        list_tars(broken, [".jpg"], {})
    assert str(in_workers.value) == str(in_here.value) and started and all(p.poll() is not None for p in started)
    worker = tp._WORKER
    monkeypatch.setattr(tp, "_WORKER", "import sys; sys.stdin.buffer.read(); sys.exit(3)")  # a worker that dies
    with pytest.raises(DataError, match=r"the process listing tar shard .*0\.tar stopped \(exit status 3\); its error "
                                        r"is above \(EXTRACTOR_LISTING_PROCESSES=0 lists the tars in the driver\)"):
        list_tars(urls, [".jpg"], {})
    monkeypatch.setattr(tp, "_WORKER", worker)
    started.clear()
    monkeypatch.setenv("EXTRACTOR_LISTING_PROCESSES", "0")  # the driver lists them itself
    assert list(list_tars(urls, [".jpg"], {}).ids) == list(here.ids) and not started
    monkeypatch.setenv("EXTRACTOR_LISTING_PROCESSES", "-3")  # (it was taken as none)
    with pytest.raises(DataError, match="EXTRACTOR_LISTING_PROCESSES='-3' is not a number of processes"):
        list_tars(urls, [".jpg"], {})
    monkeypatch.setenv("EXTRACTOR_LISTING_PROCESSES", "many")
    with pytest.raises(DataError, match="EXTRACTOR_LISTING_PROCESSES='many' is not a number of processes"):
        list_tars(urls, [".jpg"], {})
