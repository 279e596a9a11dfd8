"""The store layout is a contract: these tests pin what the README documents."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml
import zarr
from helpers.jobs import RESNET18, job
from helpers.stores import generation, opened

from extractor.data.files import local_fingerprint
from extractor.driver.runner import run
from extractor.errors import ShardError, StoreError
from extractor.read.reader import open_store
from extractor.spec.load import parse_spec
from extractor.store.layout import FORMAT_VERSION


@pytest.fixture(scope="module")
def store(image_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("layout") / "s.zarr"
    raw = job(image_dir, path, model=RESNET18, capture=[  # the widths the layout pins
        {"layer": "layer3", "reduce": "none", "dtype": "float16"},
        {"layer": "layer4", "reduce": "mean", "key": "pooled"},
    ])
    run(parse_spec(raw))
    return path


def _generation(store: Path) -> Path:
    head = json.loads((store / "zarr.json").read_text())["attributes"]["extractor"]
    return store / head["generation"]


def test_documented_layout(store: Path):
    import extractor

    g = zarr.open_group(extractor.zarr_store(str(store)), mode="r")
    assert sorted(g.array_keys()) == sorted(["ids", "paths", "labels", "status", "errors", "digest", "fingerprint",
                                             "read_fingerprint", "shard_stats", "layer3", "pooled"])
    n = 12
    expect = {"ids": ("row",), "paths": ("row",), "labels": ("row",), "status": ("row",), "errors": ("row",),
              "digest": ("row",), "fingerprint": ("row",), "read_fingerprint": ("row",), "shard_stats": ("shard",),
              "layer3": ("row", "layer3.channel", "layer3.y", "layer3.x"),
              "pooled": ("row", "pooled.channel")}
    for name, dims in expect.items():
        assert g[name].metadata.dimension_names == dims, name
    assert g["labels"].dtype == np.int64 and g["status"].dtype == np.uint8
    assert g["digest"].dtype == g["fingerprint"].dtype == np.uint64
    import xxhash

    files = list(g["paths"][:])
    assert g["digest"][:].tolist() == [xxhash.xxh3_64_intdigest(Path(p).read_bytes()) for p in files]  # as read
    assert not g["fingerprint"][:].any()  # no file stat-ed by the listing: each as its worker opened it
    assert g["read_fingerprint"][:].tolist() == [local_fingerprint(p) for p in files] and all(g["read_fingerprint"][:])
    assert g["layer3"].shape == (n, 256, 4, 4) and g["layer3"].dtype == np.float16
    assert g["layer3"].chunks == (2, 256, 4, 4)  # chunk_rows
    assert g["status"].chunks == (4,)  # one chunk per shard
    assert g["shard_stats"].shape == (3,) and g["shard_stats"].chunks == (1,)
    assert g["pooled"].shape == (n, 512) and g["pooled"].dtype == np.float32
    assert np.isnan(g["pooled"].fill_value)


def test_documented_objects(store: Path):
    """Format 2 on disk: the head names the generation; under it the arrays' metadata (those written shard by shard
    declaring the storage transformer and their ledger slot), each committed attempt's chunks under its own name,
    the ledger's blocks, the members' records and the final record; nothing else."""
    head = json.loads((store / "zarr.json").read_text())
    assert head["node_type"] == "group" and head["attributes"]["extractor"]["format_version"] == FORMAT_VERSION == 2
    gen = _generation(store)
    assert sorted(p.name for p in store.iterdir()) == sorted(["zarr.json", "__lock", gen.name])
    slots = {}
    for name in ("ids", "paths", "labels", "status", "errors", "digest", "fingerprint", "read_fingerprint",
                 "shard_stats", "layer3", "pooled"):
        meta = json.loads((gen / name / "zarr.json").read_text())
        t = meta.get("storage_transformers")
        slots[name] = t[0]["configuration"]["slot"] if t else None
        if t:  # an object a shard of 4 rows (layer3: its Zarr shard of 2-row chunks), or a shard's own record
            per = 1 if name == "shard_stats" else 4
            assert t == [{"name": "extractor-attempts", "configuration": {
                "slot": slots[name], "chunk_rows": per, "shard_rows": per}}], name
    assert slots == {"ids": None, "paths": None, "labels": None, "fingerprint": "rows", "status": "data",
                     "errors": "data", "digest": "data", "read_fingerprint": "data", "shard_stats": "data",
                     "layer3": "data", "pooled": "data"}
    ledger = json.loads((gen / "__root.json").read_text())["attributes"]["extractor"]["ledger_blocks"]
    assert sorted(p.name for p in (gen / "__txn" / "ledger").iterdir()) == [str(b) for b in range(ledger)]
    assert (gen / "__txn" / "final").is_file() and len(list((gen / "__txn" / "claimants").iterdir())) == 1
    attempts = sorted(p.name for p in (gen / "__attempts").iterdir())
    assert len(attempts) == 3 + 1 and all(len(a) == 16 for a in attempts)  # a shard's each, and the rows' facts
    shard = sorted(str(p.relative_to(gen / "__attempts" / a)) for a in attempts
                   for p in (gen / "__attempts" / a).rglob("*") if p.is_file() and "/c/0" in str(p) + "/")
    assert "status/c/0" in shard and "pooled/c/0/0" in shard and "layer3/c/0/0/0/0" in shard


def test_documented_id_index(store: Path):
    import extractor
    from extractor.data import text_hashes

    g = zarr.open_group(extractor.zarr_store(str(store)), mode="r")
    index, ids = g["id_index"], g["ids"][:].tolist()
    assert dict(index.attrs) == {"hash": "utf8-poly64", "n_rows": 12,
                                 "ids_digest": g.attrs["extractor"]["ids_digest"]}
    assert sorted(index.array_keys()) == ["hashes", "rows"]
    hashes, rows = index["hashes"][:], index["rows"][:]
    assert hashes.dtype == rows.dtype == np.int64 and index["rows"].metadata.dimension_names == ("by_hash",)
    assert (np.diff(hashes) >= 0).all() and sorted(rows.tolist()) == list(range(12))
    assert hashes.tolist() == text_hashes([ids[r] for r in rows]).tolist()


def test_documented_attributes(store: Path):
    meta = json.loads((_generation(store) / "__root.json").read_text())
    a = meta["attributes"]["extractor"]
    for key in ("format_version", "created", "spec", "spec_digest", "model", "captures", "classes", "n_rows",
                "n_shards", "shard_size", "chunk_rows", "ids_digest", "versions", "ledger_blocks"):
        assert key in a, key
    assert a["format_version"] == FORMAT_VERSION == 2
    assert meta["consolidated_metadata"]["metadata"]["layer3"]["shape"] == [12, 256, 4, 4]  # one read opens it all
    assert open_store(str(store)).attrs["status"] == "complete"  # the state: its final record
    assert a["classes"] == ["cats", "dogs"]
    assert set(a["model"]) >= {"name", "weights", "parameters", "state_dict_sha256"}
    assert set(a["versions"]) >= {"extractor", "torch", "torchvision", "zarr", "numpy", "python"}
    assert a["spec"]["capture"][1]["key"] == "pooled"
    cap = a["captures"]["pooled"]
    assert cap == {"layer": "layer4", "module_type": "Sequential", "what": "output", "index": None,
                   "reduce": "mean", "dtype": "float32", "shape": [512], "original_shape": [512, 2, 2],
                   "dims": ["pooled.channel"], "capture": 1}


def test_capture_attributes_make_ids_and_labels_coordinates(store: Path):
    arr = json.loads((_generation(store) / "layer3" / "zarr.json").read_text())
    assert arr["attributes"]["coordinates"] == "ids labels"
    assert arr["attributes"]["extractor"]["layer"] == "layer3"


def test_reader_needs_only_numpy_and_zarr(store: Path):
    """Open and read a store in a process where torch, torchvision, pydantic, PIL and ray cannot be imported."""
    code = textwrap.dedent(f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {{"torch", "torchvision", "pydantic", "ray", "tqdm", "PIL"}}:
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        import extractor
        s = extractor.open_store({str(store)!r})
        x = s.numpy("pooled")
        rows, b = next(s.batches("pooled", 5))
        print(x.shape, len(rows), s.ids[0], s.summary()["row_status"]["ok"])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["(12,", "512)", "5", "cats/cats00.jpg", "12"]


def test_shard_statistics_equal_float64_numpy_with_huge_and_nonfinite_values():
    from extractor.store.stats import ShardStats, dumps, merge

    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 3, 4, 4)).astype(np.float32)
    x[5, 1] *= np.float32(1e20)  # squares overflow float32: the sums must not
    x[7, 0, 0, 0] = np.nan
    x[9, 2, 1, 1] = np.inf
    a, b = ShardStats(["m.channel", "m.y", "m.x"], [3, 4, 4]), ShardStats(["m.channel", "m.y", "m.x"], [3, 4, 4])
    a.update(x[:20], np.arange(20))
    b.update(x[20:], np.arange(20, 40))  # a second shard
    b.update(x[:0], np.arange(0))  # an empty batch changes nothing
    st = merge([dumps({"m": a}), json.dumps({"m": b.to_dict()})])["m"]
    x64 = x.astype(np.float64)
    finite = np.isfinite(x64)
    v = np.where(finite, x64, 0.0)
    count = finite.sum(axis=(0, 2, 3))
    mean = v.sum(axis=(0, 2, 3)) / count
    std = np.sqrt(np.maximum((v * v).sum(axis=(0, 2, 3)) / count - mean**2, 0))
    np.testing.assert_allclose(st["mean"], mean, rtol=1e-6)
    np.testing.assert_allclose(st["std"], std, rtol=1e-5)
    assert np.isfinite(st["std"]).all()
    assert st["min"] == pytest.approx(x64[finite].min()) and st["max"] == pytest.approx(x64[finite].max())
    assert (st["nan"], st["inf"], st["nonfinite_rows"], st["first_nonfinite_rows"]) == (1, 1, 2, [7, 9])
    good = np.isfinite(x64.reshape(40, -1)).all(axis=1)
    assert st["mean_l2"] == pytest.approx(np.linalg.norm(x64.reshape(40, -1)[good], axis=1).mean(), rel=1e-6)
    assert st["rows"] == 40


def _old_record(stats) -> str:
    """A shard record as stores written before base64 sums hold it: lists of numbers."""
    return json.dumps({key: {**st.to_dict(), "count": st.count.tolist(), "sum": st.sum.tolist(),
                             "sumsq": st.sumsq.tolist()} for key, st in stats.items()})


def test_statistics_merged_as_shards_come_and_then_from_the_store_equal_one_merge_of_all(tmp_path: Path):
    """Records with base64 sums merge exactly as the list records of earlier stores (values, NaN and Inf
    counts); totals merged as shards come, merged on with the rest from the store, equal one merge of all; totals
    as one object are read back whole or not at all."""
    from extractor.data import Rows
    from extractor.store.layout import StoreArrays
    from extractor.store.stats import ShardStats, Totals, dumps, merge, merge_shards
    from extractor.store.synthetic import create_store

    rng = np.random.default_rng(0)
    shards = []
    for i in range(6):
        x = rng.standard_normal((8, 5)).astype(np.float32)
        x[i % 3, i % 5] = [np.nan, np.inf, -np.inf][i % 3]
        st = {"a": ShardStats(["a.feature"], [5]), "b": ShardStats(["b.feature"], [5])}
        st["a"].update(x, np.arange(8 * i, 8 * i + 8))
        st["b"].update(x[:4] * 3, np.arange(8 * i, 8 * i + 4))
        shards.append(st)
    new, old = [dumps(st) for st in shards], [_old_record(st) for st in shards]
    assert "[" not in json.loads(new[0])["a"]["sum"] and merge(new) == merge(old)  # exactly equal
    full = merge(new)
    assert (full["a"]["nan"], full["a"]["inf"], full["a"]["nonfinite_rows"]) == (2, 4, 6)

    url = str(tmp_path / "s.zarr")  # a store whose shards 0-2 hold records of the old form, 3-5 of the new
    rows = Rows(ids=[f"i{i}" for i in range(48)], paths=[""] * 48, labels=[0] * 48)
    group = create_store(url, rows, StoreArrays(captures={}, extras={}, shard_size=8, chunk_rows={}),
                         attrs={"n_rows": 48, "n_shards": 6, "captures": {}})
    for i in range(6):
        group["shard_stats"][i] = (old + new)[i] if i < 3 else new[i]
    assert merge_shards(opened(url)) == merge(old[:3] + new[3:])
    totals = Totals(6)
    for i in (0, 1, 2):
        totals.add(i, old[i])  # merged as they came
        group["shard_stats"][i] = "not read again"  # the totals hold them: only shards 3-5 are read
    merged = merge_shards(opened(url), totals)
    np.testing.assert_allclose(merged["a"]["mean"], full["a"]["mean"], rtol=1e-12)
    np.testing.assert_allclose(merged["b"]["std"], full["b"]["std"], rtol=1e-12)
    assert {k: v for k, v in merged["a"].items() if k not in ("mean", "std")} == \
        {k: v for k, v in full["a"].items() if k not in ("mean", "std")}
    blob = Totals.from_bytes(totals.to_bytes(), 6)  # the totals as one object, whole
    assert blob is not None and blob.summary() == totals.summary() and Totals.from_bytes(totals.to_bytes()[:-9], 6) \
        is None
    # another process's partial (shards 3 and 4, merged as it committed them): absorbed, only shard 5 read; one that
    # holds a shard the totals hold already adds nothing (a sum is not taken back out)
    # (partials are of the attempts that committed the shards: one of another attempt, a shard committed again
    # since, is left out too)
    attempts = generation(url).ledger().read().attempts("data")
    partial, overlapping, stale = Totals(6), Totals(6), Totals(6)
    for i in (3, 4):
        partial.add(i, new[i], int(attempts[i]))
        group["shard_stats"][i] = "not read either"
    overlapping.add(0, new[0], int(attempts[0]))
    stale.add(5, new[0], int(attempts[5]) + 1)
    merged = merge_shards(opened(url), Totals.from_bytes(totals.to_bytes(), 6), [overlapping, stale, partial])
    np.testing.assert_allclose(merged["a"]["mean"], full["a"]["mean"], rtol=1e-12)
    np.testing.assert_allclose(merged["b"]["std"], full["b"]["std"], rtol=1e-12)
    assert (merged["a"]["nan"], merged["a"]["inf"], merged["a"]["rows"]) == (2, 4, 48)


def test_a_driver_killed_between_checkpoints_costs_the_resume_only_the_records_since(
        image_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Issue 57: a claimant leaves its statistics as a partial every CHECKPOINT_SHARDS shards (its last one removed);
    one killed without leaving its own (as SIGKILL or a lost node: ``_leave_partial`` never runs) costs whoever
    merges them all the records of its shards since its last checkpoint, and the statistics are a whole run's."""
    from extractor.store import session, stats

    monkeypatch.setattr(session, "CHECKPOINT_SHARDS", 3)
    raw = job(image_dir, tmp_path / "s.zarr", data={"shard_size": 1, "batch_size": 1}, output={"chunk_rows": 1})
    done: list[int] = []

    def killed(name: str, info: dict) -> None:
        if name == "shard_done":
            done.append(info["shard"])
            if len(done) == 7:  # (a shard computed meanwhile is still committed and reported)
                raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(session.StoreSession, "_leave_partial", lambda self: None)
        with pytest.raises(KeyboardInterrupt):
            run(parse_spec(raw), on_event=killed)
    partials = generation(str(tmp_path / "s.zarr")).objects.list(generation(str(tmp_path / "s.zarr")).txn("partials"))
    assert len(partials) == 1 and partials[0].endswith(".0000000006")  # the last checkpoint: 6 shards; the first gone
    committed = set(np.flatnonzero(generation(str(tmp_path / "s.zarr")).ledger().read().done).tolist())
    read: list[int] = []
    real = stats.take_rows
    monkeypatch.setattr(stats, "take_rows", lambda records, rows: (read.extend(rows.tolist()), real(records, rows))[1])
    run(parse_spec({**raw, "output": {**raw["output"], "if_exists": "resume"}}))
    assert read and sorted(read) == sorted(committed - set(done[:6]))  # the killed run's after its last checkpoint
    run(parse_spec({**raw, "output": {**raw["output"], "store": str(tmp_path / "whole.zarr")}}))
    whole, resumed = open_store(str(tmp_path / "whole.zarr")).stats, open_store(str(tmp_path / "s.zarr")).stats
    for key in whole:
        np.testing.assert_allclose(resumed[key]["mean"], whole[key]["mean"], rtol=1e-9)
        np.testing.assert_allclose(resumed[key]["std"], whole[key]["std"], rtol=1e-9)
        assert resumed[key]["rows"] == whole[key]["rows"] == 12


def test_a_store_left_half_created_is_created_again_by_resume_and_overwrite(
        image_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from extractor.errors import StoreError
    from extractor.read.reader import open_store

    raw = job(image_dir, tmp_path / "s.zarr", capture=[{"layer": "layer4", "reduce": "mean"}])
    run(parse_spec(raw))
    create = zarr.Group.create_array

    def failing(self, name, **kwargs):
        if name == "status":  # before shard_done exists
            raise OSError("disk full")
        return create(self, name, **kwargs)

    monkeypatch.setattr(zarr.Group, "create_array", failing)
    raw["output"]["if_exists"] = "overwrite"
    with pytest.raises(OSError, match="disk full"):
        run(parse_spec(raw))
    monkeypatch.undo()
    raw["output"]["if_exists"] = "error"  # a plain rerun says how to go on
    with pytest.raises(StoreError, match=r"half-created.*--resume .*keeps the shards.* or --overwrite"):
        run(parse_spec(raw))
    with pytest.raises(StoreError, match=r"half-created.*--resume"):
        open_store(str(tmp_path / "s.zarr"))
    for mode in ("resume", "overwrite"):  # issue 17, defect 5: the SLURM recipe always passes --resume
        raw["output"]["if_exists"] = mode
        assert run(parse_spec(raw)).ok == 12
        assert open_store(str(tmp_path / "s.zarr")).attrs["status"] == "complete"
        if mode == "resume":
            monkeypatch.setattr(zarr.Group, "create_array", failing)
            raw["output"]["if_exists"] = "overwrite"
            with pytest.raises(OSError, match="disk full"):
                run(parse_spec(raw))
            monkeypatch.undo()


def test_documented_codecs(store: Path):
    """output.compression: lz4 (the default): each capture's inner chunks through blosc's lz4, after the shuffle
    measured best for its values' size (bits for float16, bytes for float32)."""
    gen = _generation(store)
    for name, typesize, shuffle in (("layer3", 2, "bitshuffle"), ("pooled", 4, "shuffle")):
        meta = json.loads((gen / name / "zarr.json").read_text())
        inner = meta["codecs"][0]["configuration"]["codecs"]
        assert inner == [{"name": "bytes", "configuration": {"endian": "little"}},
                         {"name": "blosc", "configuration": {"typesize": typesize, "cname": "lz4", "clevel": 5,
                                                             "shuffle": shuffle, "blocksize": 0}}], name


def test_a_store_of_the_old_default_zstd_is_read_and_resumed_keeping_its_codec(image_dir: Path, tmp_path: Path):
    """Compression never changes values: a store made with zstd (the default before issue 55) resumes under the
    new default, its redone shard written with its own codec, and reads the same values as a fresh lz4 store."""
    from helpers.stores import pending

    old, new = tmp_path / "old.zarr", tmp_path / "new.zarr"
    run(parse_spec(job(image_dir, old, output={"compression": "zstd"})))
    run(parse_spec(job(image_dir, new)))
    pending(str(old), [1])  # as if the job had stopped before shard 1
    run(parse_spec(job(image_dir, old, output={"if_exists": "resume"})))  # compression: lz4 (the default) now
    a, b = open_store(str(old)), open_store(str(new))
    assert a.attrs["status"] == "complete" and a.done_shards.all()
    codecs = json.loads((_generation(old) / "layer4" / "zarr.json").read_text())["codecs"]
    assert codecs[0]["configuration"]["codecs"][1] == {"name": "zstd", "configuration": {"level": 3,
                                                                                          "checksum": False}}
    for key in ("layer3", "layer4"):
        np.testing.assert_array_equal(a.numpy(key), b.numpy(key))


def test_a_shuffle_for_a_codec_that_does_not_shuffle_is_a_spec_error(image_dir: Path, tmp_path: Path):
    from extractor.errors import SpecError

    raw = job(image_dir, tmp_path / "s.zarr", output={"compression": "zstd", "shuffle": "bit"})
    with pytest.raises(SpecError, match=r"output\.shuffle: .*compression zstd does not shuffle; remove shuffle, or "
                                        r"set compression: lz4 or blosc"):
        parse_spec(raw)
    for compression in ("lz4", "blosc"):
        assert parse_spec({**raw, "output": {**raw["output"], "compression": compression}}).output.shuffle == "bit"


def test_a_compression_level_the_codec_refuses_is_a_spec_error_and_the_store_is_kept(image_dir: Path,
                                                                                    tmp_path: Path):
    from extractor.errors import SpecError
    from extractor.read.reader import open_store

    raw = job(image_dir, tmp_path / "s.zarr", capture=[{"layer": "layer4", "reduce": "mean"}])
    run(parse_spec(raw))
    for compression, level in (("zstd", 99), ("gzip", 10), ("blosc", -1), ("lz4", 10), ("none", 3)):
        raw["output"].update(if_exists="overwrite", compression=compression, compression_level=level)
        with pytest.raises(SpecError, match=r"output\.compression_level: "):
            parse_spec(raw)
    assert open_store(str(tmp_path / "s.zarr")).attrs["status"] == "complete"


def test_a_store_that_cannot_be_created_is_one_clear_error(image_dir: Path, tmp_path: Path):
    from extractor.cli import main

    (tmp_path / "file").write_text("not a folder")
    url = str(tmp_path / "file" / "out.zarr")
    with pytest.raises(StoreError, match=r"cannot create the store at output.store .*out.zarr: NotADirectoryError.*"
                                         r"parent folder or bucket must exist"):
        run(parse_spec(job(image_dir, Path(url))))
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(job(image_dir, Path(url))))
    assert main(["run", str(spec), "-q"]) == 1  # one line on stderr, no traceback


@pytest.mark.parametrize(("shard_size", "layer3_rows", "layer4_rows"), [(100, 100, 100), (1000, 250, 500)])
def test_shard_sizes_of_100_and_1000_run_without_chunk_rows_and_record_the_chunking(
        image_dir: Path, tmp_path: Path, shard_size: int, layer3_rows: int, layer4_rows: int):
    """issue 19: output.chunk_rows: auto (the default) fits the shard size; issue 20: per capture, the
    mean-pooled layer4 (2 KB rows) in bigger chunks than the full layer3 map (16 KB rows); the store
    records the chunking and holds what a store chunked by 2 rows holds."""
    ref = job(image_dir, tmp_path / "ref.zarr", model=RESNET18, data={"shard_size": shard_size},  # its row sizes
              cluster={"backend": "local"})
    run(parse_spec(ref))
    raw = job(image_dir, tmp_path / "s.zarr", model=RESNET18, data={"shard_size": shard_size},
              cluster={"backend": "local"})
    raw["output"].pop("chunk_rows")
    raw["output"]["sharding"] = False  # the rule of unsharded stores (sharded ones: tests/store/test_sharding.py)
    summary = run(parse_spec(raw))
    assert summary.ok == 12
    g = opened(str(tmp_path / "s.zarr"))
    assert g.attrs["extractor"]["chunk_rows"] == {"layer3": layer3_rows, "layer4": layer4_rows}
    assert g.attrs["extractor"]["spec"]["output"]["chunk_rows"] == "auto"
    assert g["layer3"].chunks[0] == g["layer4"].chunks[0] == 12  # a chunk holds at most the store's 12 rows
    for key in ("layer3", "layer4"):
        np.testing.assert_array_equal(open_store(str(tmp_path / "s.zarr")).numpy(key),
                                      open_store(str(tmp_path / "ref.zarr")).numpy(key))


@pytest.fixture
def small_auto_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """chunk_rows: auto at the scale of 12 images in shards of 4: 2 rows per chunk, or chunks of up to
    8 KB of small rows (layer4 mean-pooled: 2 KB rows, 4 per chunk; layer3: 16 KB rows, 2 per chunk)."""
    from extractor.spec import schema as spec_mod

    monkeypatch.setattr(spec_mod, "MAX_AUTO_CHUNK_ROWS", 2)
    monkeypatch.setattr(spec_mod, "MIN_AUTO_CHUNK_ROWS", 1)
    monkeypatch.setattr(spec_mod, "AUTO_CHUNK_BYTES", 8192)


def test_captures_chunked_apart_store_what_one_chunking_stores_also_with_failed_rows(
        image_dir: Path, tmp_path: Path, small_auto_chunks: None):
    import shutil

    images = tmp_path / "images"
    shutil.copytree(image_dir, images)
    bad = sorted(images.rglob("*.jpg"))[5]
    bad.write_bytes(b"not a jpeg")  # row 5: chunk 2 of layer3, chunk 1 of layer4
    run(parse_spec(job(images, tmp_path / "ref.zarr", model=RESNET18)))  # chunk_rows: 2 for both; its row sizes
    raw = job(images, tmp_path / "s.zarr", model=RESNET18,
              output={"store": str(tmp_path / "s.zarr"), "chunk_rows": "auto",
                      "sharding": False})  # the unsharded rule, as small_auto_chunks
    run(parse_spec(raw))
    g = opened(str(tmp_path / "s.zarr"))
    assert (g["layer3"].chunks[0], g["layer4"].chunks[0]) == (2, 4)
    s, ref = open_store(str(tmp_path / "s.zarr")), open_store(str(tmp_path / "ref.zarr"))
    assert (s.status == ref.status).all() and (s.status == 1).sum() == 11
    for key in ("layer3", "layer4"):
        np.testing.assert_array_equal(s.numpy(key, only_ok=False), ref.numpy(key, only_ok=False))  # NaN: row 5
    batches = list(s.batches(["layer3", "layer4"], 5, shuffle=False))
    np.testing.assert_array_equal(np.concatenate([b["layer4"] for _, b in batches]), ref.numpy("layer4", only_ok=True))


def test_a_store_resumed_with_chunk_rows_auto_keeps_its_own_chunking(
        image_dir: Path, tmp_path: Path, small_auto_chunks: None, monkeypatch: pytest.MonkeyPatch):
    """Chunking never changes values: a store made with chunk_rows 1 resumes under auto (which would
    chunk it otherwise) and is written in its own chunks."""
    import errno

    from extractor.store.writer import ShardWriter

    made = job(image_dir, tmp_path / "s.zarr", output={"store": str(tmp_path / "s.zarr"), "chunk_rows": 1})
    real_write = ShardWriter.write

    def write(self, offset, chunks):
        if self.index == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, offset, chunks)

    monkeypatch.setattr(ShardWriter, "write", write)
    with pytest.raises(ShardError):
        run(parse_spec(made))
    monkeypatch.setattr(ShardWriter, "write", real_write)
    resumed = {**made, "output": {"store": str(tmp_path / "s.zarr"), "chunk_rows": "auto", "if_exists": "resume"}}
    assert run(parse_spec(resumed)).shards_run >= 1
    g = opened(str(tmp_path / "s.zarr"))
    assert g["layer3"].chunks[0] == g["layer4"].chunks[0] == 1 and g.attrs["extractor"]["status"] == "complete"
    run(parse_spec(job(image_dir, tmp_path / "ref.zarr")))
    for key in ("layer3", "layer4"):
        np.testing.assert_array_equal(open_store(str(tmp_path / "s.zarr")).numpy(key),
                                      open_store(str(tmp_path / "ref.zarr")).numpy(key))


@pytest.mark.parametrize("kind", ["texts", "joined", "through zarr"])
def test_a_new_stores_digests_made_from_the_bytes_it_writes_are_those_a_resume_compares(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str):
    """A new store hashes its ids and paths as it writes them (not in a pass of their own): its record holds the
    digests of the definition older stores recorded (each one's UTF-8 and a NUL, SHA-256), over many chunks and
    writes, a Joined's paths, and strings that zarr writes (where numcodecs' format would differ from this one's)."""
    import hashlib

    import extractor
    import extractor.store.layout as layout
    from extractor.data import Rows
    from extractor.data.rows import Joined
    from extractor.store import StoreArrays
    from extractor.store.synthetic import create_store

    monkeypatch.setattr(layout, "ONCE_ROWS", 8)  # chunks of 8 rows, written 24 rows at a time
    monkeypatch.setattr(layout, "WRITE_ROWS", 24)
    n = 61
    ids = [f"n{i % 7:03d}/img_{i}_ünï.jpg" for i in range(n)]
    if kind == "through zarr":
        import extractor.store.chunks as chunks

        monkeypatch.setattr(chunks, "_vlen_checked", lambda: False)
    paths = Joined(["/data/train.parquet#image/"], np.arange(n)) if kind == "joined" else [f"/r/{i}" for i in ids]
    url = str(tmp_path / "s.zarr")
    create_store(url, Rows(ids=ids, paths=paths, labels=[0] * n), StoreArrays(
        captures={}, extras={}, shard_size=4, chunk_rows={}), {"n_rows": n, "n_shards": 16, "captures": {},
                                                               "ids_digest": None, "paths_digest": None})

    def by_hand(names: list[str]) -> str:
        h = hashlib.sha256()
        for name in names:
            h.update(name.encode("utf-8", "surrogateescape") + b"\0")
        return h.hexdigest()[:16]

    want_paths = [f"/data/train.parquet#image/{i}" for i in range(n)] if kind == "joined" else paths
    s = open_store(url)
    assert s.attrs["ids_digest"] == by_hand(ids) and s.attrs["paths_digest"] == by_hand(want_paths)
    assert s.ids.tolist() == ids  # what was written is what was hashed
    g = zarr.open_group(extractor.zarr_store(url), mode="r")
    assert g["id_index"].attrs["ids_digest"] == by_hand(ids)  # the id index names the same digest: it is used
