"""Feature indexes of stores (issue 42), made by the post-hoc pass and read back: an index against its capture read
whole, the agreed layout, dictionaries in every layout giving the same index, the write-time index equal to the
post-hoc one (also after a killed and resumed job, and on Ray), the lease, staleness, the reader's refusals, figures
and the command."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from helpers.images import make_images
from helpers.index_checks import ARRAYS, D_SAE, by_hand_top, check_against_numpy, refused, sae, saelens
from helpers.jobs import job
from helpers.processes import child_env
from helpers.stores import generation, made_again

from extractor.driver.runner import run
from extractor.errors import OutOfRangeError, SpecError, StoreError
from extractor.index.dictionary import load_dictionary
from extractor.index.post_hoc import index
from extractor.index.reader import open_index
from extractor.read import open_store
from extractor.spec.load import parse_spec
from extractor.store.objects import LocalObjects


# ---------------------------------------------------------------------------------------------- a store
@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("index") / "imgs"
    make_images(root, per_class=7, classes=("a", "b"), size=48)
    (root / "a" / "corrupt.jpg").write_bytes(b"not a jpeg")  # a failed row: in no index
    return root


def _job(images: Path, store: Path, **capture) -> dict:
    return job(images, store, data={"resize": None, "crop": 32, "shard_size": 4, "batch_size": 3},
               capture=[{"layer": "layer3", "reduce": "none", **capture}], output={"chunk_rows": 2})


@pytest.fixture(scope="module")
def store(images: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """15 rows (one failed) of layer3 (32 channels x 2 x 2), with a write-time index of k 4."""
    path = tmp_path_factory.mktemp("index") / "s.zarr"
    run(parse_spec(_job(images, path, feature_index={"k": 4})))
    return path


def _acts(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """layer3's ok rows as (n, positions, channels), and their store rows."""
    s = open_store(str(path))
    rows = s.ok_rows()
    x = s.numpy("layer3")
    return x.reshape(len(x), x.shape[1], -1).transpose(0, 2, 1), rows


def _arrays(ix) -> dict[str, np.ndarray]:
    return {name: np.asarray(ix.arrays[name][:]) for name in ARRAYS}


def _same(a, b) -> None:
    """Two indexes hold the same arrays (the mean where a feature fires: summed in another order, to rounding)."""
    for name, x in _arrays(a).items():
        y = np.asarray(b.arrays[name][:])
        if name == "mean_active":
            np.testing.assert_allclose(x, y, rtol=1e-12)
        else:
            np.testing.assert_array_equal(x, y, err_msg=name)


def test_an_index_of_a_store_equals_its_capture_by_hand(store: Path):
    ix = index(str(store), "layer3", k=4, name="posthoc")
    acts, rows = _acts(store)
    assert len(rows) == 14 and ix.rows == 14
    check_against_numpy(acts, rows, type("Got", (), _arrays(ix)), 4, "max")
    s = open_store(str(store))
    for f in (0, 5, 31):
        top = ix.top(f)
        assert list(top.ids) == [s.ids[r] for r in top.rows]
        for rank, row in enumerate(top.rows):
            np.testing.assert_array_equal(ix.heatmap(f, rank), s.numpy("layer3", rows=[row])[0, f])  # (y, x)
    np.testing.assert_array_equal(ix.encode_row(int(rows[3])), acts[3])
    np.testing.assert_array_equal(ix.density, ix.arrays["density_tokens"][:])
    counts, edges = ix.histogram(0)
    assert counts.sum() == (acts[:, :, 0] > 0).sum() and len(edges) == len(counts) + 1


def test_the_index_in_the_store_has_the_agreed_layout(store: Path):
    ix = index(str(store), "layer3", k=3, name="layout")
    attrs = dict(ix.attrs)
    for name in ("index_version", "key", "features", "k", "pool", "dictionary", "rows", "source_state", "positions",
                 "grid", "prefix", "threshold", "hist_edges", "quantiles", "created", "arrays"):
        assert name in attrs, name
    assert (attrs["index_version"], attrs["key"], attrs["features"], attrs["k"]) == (2, "layer3", 32, 3)
    group = ix.arrays  # the arrays, in the subgroup the attributes name
    assert group.path.endswith(f"indexes/layout/{attrs['arrays']}") and list(ix.group.keys()) == [attrs["arrays"]]
    assert (attrs["positions"], attrs["grid"], attrs["prefix"], attrs["dictionary"]) == (4, [2, 2], 0, None)
    f, k, t, b = 32, 3, 4, len(attrs["hist_edges"]) - 1
    want = {"top_rows": ((f, k), "int64"), "top_values": ((f, k), "float32"), "top_tokens": ((f, k, t), "float32"),
            "density_tokens": ((f,), "float64"), "density_rows": ((f,), "float64"), "mean_active": ((f,), "float64"),
            "max_value": ((f,), "float32"), "histogram": ((f, b), "int64"),
            "quantile_rows": ((f, attrs["quantiles"], attrs["examples"]), "int64"),
            "quantile_values": ((f, attrs["quantiles"], attrs["examples"]), "float32")}
    for name, (shape, dtype) in want.items():
        assert (group[name].shape, str(group[name].dtype)) == (shape, dtype), name
    assert group["dead"].ndim == 1 and str(group["dead"].dtype) == "int64"


def test_the_write_time_index_equals_the_post_hoc_one(store: Path):
    written = open_index(str(store), "layer3")
    assert written.attrs["written"] == "write-time" and not written.stale
    again = index(str(store), "layer3", k=4, name="again")
    _same(written, again)


def test_a_float16_capture_is_indexed_as_its_values_by_hand_at_write_time_and_after(images: Path, tmp_path: Path):
    """A float16 map (indexed as stored: binned by float16's own table) gives numpy's index of its values, the same
    at write time and after; a row's values read back as float32."""
    path = tmp_path / "h.zarr"
    run(parse_spec(_job(images, path, dtype="float16", feature_index={"k": 4})))
    assert open_store(str(path)).numpy("layer3").dtype == np.float16
    again = index(str(path), "layer3", k=4, name="again")
    _same(open_index(str(path), "layer3"), again)
    acts, rows = _acts(path)
    values = acts.astype(np.float32)
    check_against_numpy(values, rows, type("Got", (), _arrays(again)), 4, "max")
    row = again.encode_row(int(rows[3]))
    assert row.dtype == np.float32
    np.testing.assert_array_equal(row, values[3])


def test_an_index_another_process_wrote_meanwhile_is_kept_and_this_one_refused(store: Path, tmp_path: Path):
    """Two passes making one index at once (or one paused, then woken): the one whose write lands first is the
    store's, whole; the other's write is refused (the index's attributes are one swap from the version its pass
    began at) and nothing of it is named."""
    path = tmp_path / "copy.zarr"
    shutil.copytree(store, path)
    other: list[Any] = []

    def meanwhile(rows: int) -> None:
        if not other:
            other.append(index(str(path), "layer3", k=2, name="both"))

    with pytest.raises(StoreError, match=r"index both of .* was written by another process while this one made it"):
        index(str(path), "layer3", k=4, name="both", on_progress=meanwhile)
    kept = open_index(str(path), "both")
    assert kept.k == 2 and kept.attrs["arrays"] == other[0].attrs["arrays"] and list(kept.group.keys()) == \
        [kept.attrs["arrays"]]
    _same(kept, other[0])


def test_an_index_of_a_store_made_again_since_it_was_opened_is_refused(store: Path, tmp_path: Path):
    path = tmp_path / "copy.zarr"
    shutil.copytree(store, path)
    s = open_store(str(path))
    made_again(str(path))
    with pytest.raises(StoreError, match=r"was made again .*since it was opened.*open it again"):
        index(s, "layer3", k=2, name="late")


def test_open_index_names_what_the_store_holds(store: Path):
    with pytest.raises(StoreError, match=r"holds no index 'nope'; its indexes: .*layer3"):
        open_index(str(store), "nope")
    ix = open_index(str(store), "layer3")
    with pytest.raises(IndexError, match="feature 32 out of range: the index has 32 features"):
        ix.top(32)


# ---------------------------------------------------------------------------------------------- dictionaries
def test_a_saelens_folder_gives_the_index_of_the_same_weights_as_npz_and_pt(store: Path, tmp_path: Path):
    torch = pytest.importorskip("torch")
    t = sae()
    np.savez(tmp_path / "sae.npz", **t)
    torch.save({k: torch.from_numpy(v) for k, v in t.items()}, tmp_path / "sae.pt")
    folder = saelens(tmp_path / "my_sae", t)
    a = index(str(store), "layer3", dictionary=tmp_path / "sae.npz", k=4)
    b = index(str(store), "layer3", dictionary=folder, k=4)
    c = index(str(store), "layer3", dictionary=tmp_path / "sae.pt", k=4)
    assert (a.name, b.name, c.name) == ("layer3@sae", "layer3@my_sae", "layer3@sae")
    assert b.attrs["dictionary"]["d_sae"] == D_SAE and b.attrs["dictionary"]["digest"].startswith("sha256:")
    for name, want in _arrays(a).items():
        np.testing.assert_array_equal(np.asarray(b.arrays[name][:]), want, err_msg=name)
    # and the latents by hand: relu((x - b_dec) @ W_enc + b_enc) at every position of each ok row
    acts, rows = _acts(store)
    latents = np.maximum((acts.reshape(-1, 32) - t["b_dec"]) @ t["W_enc"] + t["b_enc"], 0).reshape(len(rows), 4, -1)
    got = type("Got", (), _arrays(b))
    top = by_hand_top(latents.max(axis=1), latents.max(axis=1) > 0, 7, 4)
    np.testing.assert_array_equal(got.top_rows[7, : len(top)], rows[top])
    np.testing.assert_allclose(got.top_tokens[7, : len(top)], latents[top, :, 7], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got.density_tokens, (latents > 0).sum(axis=(0, 1)) / latents[..., 0].size)
    np.testing.assert_allclose(b.encode_row(int(rows[2])), latents[2], rtol=1e-5, atol=1e-6)
    assert not open_index(str(store), "layer3@sae").stale  # c's, of the same name as a's
    torch.save({k: torch.from_numpy(v) for k, v in sae(9).items()}, tmp_path / "sae.pt")
    assert open_index(str(store), "layer3@sae").stale  # the dictionary file changed since


def test_a_dictionary_that_does_not_fit_is_one_line_naming_the_shapes(store: Path, images: Path, tmp_path: Path):
    np.savez(tmp_path / "narrow.npz", **sae(d_in=16))
    said = refused(index, str(store), "layer3", dictionary=tmp_path / "narrow.npz")
    assert "d_in 16 (W_enc [16, 48])" in said and "capture layer3 [32, 2, 2] has 32 features per position" in said
    np.savez(tmp_path / "bad.npz", **{**sae(), "b_enc": np.zeros(7, np.float32)})
    assert "W_enc [32, 48] and b_enc [7] do not fit" in refused(load_dictionary, tmp_path / "bad.npz")
    (tmp_path / "sae.txt").write_text("W_enc")
    assert "not a dictionary file this reads (.safetensors, .npz, .pt" in refused(load_dictionary,
                                                                                   tmp_path / "sae.txt")
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    assert "not a safetensors file" in refused(load_dictionary, tmp_path / "junk.safetensors")
    np.savez(tmp_path / "nothing.npz", W_dec=np.zeros((3, 3)))
    assert "no encoder weights W_enc (or encoder.weight) among its tensors ['W_dec']" in refused(
        load_dictionary, tmp_path / "nothing.npz")
    folder = saelens(tmp_path / "wrong_cfg", sae(), d_in=64)
    assert "cfg.json says d_in 64, but W_enc is [32, 48]" in refused(load_dictionary, folder)
    gated = saelens(tmp_path / "gated", sae(), architecture="gated")
    assert "gated SAE" in refused(load_dictionary, gated)
    spec = _job(images, tmp_path / "never.zarr", feature_index={"dictionary": str(tmp_path / "narrow.npz")})
    assert "capture[0] layer3 [32, 2, 2] has 32 features" in refused(run, parse_spec(spec))
    assert not (tmp_path / "never.zarr").exists()  # refused before the store was touched


def test_bad_settings_are_one_line_before_the_pass_and_leave_the_indexes_as_they_were(store: Path, tmp_path: Path,
                                                                                       monkeypatch, caplog):
    path = tmp_path / "copy.zarr"
    shutil.copytree(store, path)
    indexes = str(path / generation(str(path)).name / "indexes")
    before, names = _arrays(open_index(str(path), "layer3")), sorted(zarr.open_group(indexes))
    for kwargs, said in [({"threshold": -1.0}, "threshold must be a finite number >= 0"),
                         ({"threshold": float("nan")}, "fires above it), not nan"),
                         ({"threshold": float("inf")}, "not inf"),
                         ({"name": "a/b"}, "index name 'a/b': an index is named by one word"),
                         ({"name": "../escape"}, "no '/', no leading '.'"), ({"name": "."}, "index name '.'"),
                         ({"activation": "relu"}, "an activation (relu) applies to a dictionary's latents")]:
        with pytest.raises(StoreError, match=re.escape(said)):
            index(str(path), "layer3", name=kwargs.pop("name", "layer3"), **kwargs)
    monkeypatch.setattr(LocalObjects, "create", lambda *a: (_ for _ in ()).throw(OSError(30, "Read-only file system")))
    with pytest.raises(StoreError, match=r"cannot be written here .Read-only file system.; index a writable copy"):
        index(str(path), "layer3")
    monkeypatch.undo()
    after = open_index(str(path), "layer3")
    assert sorted(zarr.open_group(indexes)) == names  # nothing half-written under another name
    for name, x in before.items():
        np.testing.assert_array_equal(np.asarray(after.arrays[name][:]), x, err_msg=name)
    # k above the ok rows: the index of all of them, replaced with a word
    with caplog.at_level("WARNING", logger="extractor"):
        big = index(str(path), "layer3", k=1000)
    assert "replacing index layer3 of" in caplog.text and "k 4" in caplog.text
    assert "k 1000 is more than the 14 ok rows" in caplog.text  # said, not silent
    acts, _ = _acts(path)
    assert big.k == 14 and big.top(0).rows.size == (acts[:, :, 0].max(axis=1) > 0).sum()
    _same(big, index(str(path), "layer3", k=14, name="k14"))


@pytest.mark.parametrize("name", ["zarr.json", "__txn", "__x", "a/b", "..", "\\evil", "line\nbreak"])
def test_an_index_name_that_is_a_store_key_a_path_or_reserved_is_one_line_and_writes_nothing(
        store: Path, tmp_path: Path, name: str):
    """T5-10: ``extractor index --name zarr.json`` wrote ``indexes/zarr.json/...`` over the indexes' own metadata (a
    misleading "cannot be written here (File exists)"; on S3 it was written); ``__txn`` was written and then could
    not be opened. Each is refused in one line naming the index name, before anything is read or written, by the
    command, the API and a job's ``feature_index.name``."""
    from helpers.processes import cli

    path = tmp_path / "copy.zarr"
    shutil.copytree(store, path)
    before = {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}
    r = cli("index", str(path), "--key", "layer3", "--name", name, "-q")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith(f"error: index name {name!r}: an index is named by one word of the store")
    assert r.stderr.count("\n") == 1, r.stderr
    with pytest.raises(StoreError, match=re.escape(f"index name {name!r}")):
        index(str(path), "layer3", name=name)
    assert {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()} == before
    raw = _job(tmp_path, tmp_path / "never.zarr", feature_index={"k": 2, "name": name})
    with pytest.raises(SpecError, match=re.escape(f"capture[0].feature_index.name: index name {name!r}")):
        parse_spec(raw)


def test_a_write_that_fails_midway_leaves_the_index_it_was_replacing(store: Path, tmp_path: Path, monkeypatch):
    """A disk filling up while an index is written again: the one it was replacing is read as before, whole; the
    next write that lands leaves nothing of the failed one."""
    path = tmp_path / "copy.zarr"
    shutil.copytree(store, path)
    before = _arrays(open_index(str(path), "layer3"))
    create, made = zarr.Group.create_array, []

    def full(self, *args, **kwargs):
        made.append(args[0] if args else kwargs.get("name"))
        if len(made) == 4:
            raise OSError(28, "No space left on device")
        return create(self, *args, **kwargs)

    monkeypatch.setattr(zarr.Group, "create_array", full)
    with pytest.raises(OSError, match="No space left on device"):
        index(str(path), "layer3", k=2)
    monkeypatch.undo()
    kept = open_index(str(path), "layer3")
    assert kept.k == 4 and not kept.stale
    for name, x in before.items():
        np.testing.assert_array_equal(np.asarray(kept.arrays[name][:]), x, err_msg=name)
    again = index(str(path), "layer3", k=2)  # the failed write's arrays go; the index replaced stays, once
    assert again.k == 2 and sorted(again.group.keys()) == sorted([again.attrs["arrays"], kept.attrs["arrays"]])


def test_an_index_made_again_while_open_reads_as_it_was_and_says_so(store: Path, tmp_path: Path):
    path = tmp_path / "copy.zarr"
    shutil.copytree(store, path)
    ix = open_index(str(path), "layer3")
    before = _arrays(ix)
    assert not ix.stale and not ix.replaced
    index(str(path), "layer3", k=2)
    assert ix.replaced and ix.stale
    assert _arrays(ix).keys() == before.keys()
    for name, x in _arrays(ix).items():  # the index it opened, whole: kept until the next write
        np.testing.assert_array_equal(x, before[name], err_msg=name)
    second = open_index(str(path), "layer3")
    assert second.top(0).rows.size == 2
    third = index(str(path), "layer3", k=3)  # the first one's arrays go; the second's stay, once
    assert sorted(third.group.keys()) == sorted([third.attrs["arrays"], second.attrs["arrays"]])
    assert ix.attrs["arrays"] not in third.group


def test_an_index_of_version_1_is_read_and_replaced_whole(store: Path, tmp_path: Path):
    """Version 1 kept the arrays in the index's group itself (before December 3, 2026)."""
    path = tmp_path / "copy.zarr"
    shutil.copytree(store, path)
    node = path / generation(str(path)).name / "indexes" / "layer3"
    at = zarr.open_group(str(node), mode="r").attrs["arrays"]
    for part in (node / at).iterdir():
        if part.name != "zarr.json":
            shutil.move(str(part), str(node / part.name))
    shutil.rmtree(node / at)
    group = zarr.open_group(str(node), mode="r+")
    group.attrs.put({**{k: v for k, v in group.attrs.items() if k != "arrays"}, "index_version": 1})
    old = open_index(str(path), "layer3")
    assert old.attrs["index_version"] == 1 and old.arrays.path == old.group.path
    _same(old, open_index(str(store), "layer3"))
    new = index(str(path), "layer3", k=4)
    assert new.attrs["index_version"] == 2 and list(new.group.keys()) == [new.attrs["arrays"]]


def test_the_viewer_answers_a_failed_rows_patch_and_a_unicode_digit_search_without_a_500(store: Path):
    pytest.importorskip("flask")
    from extractor.view import create_app

    client = create_app(str(store)).test_client()
    failed = int(np.flatnonzero(open_store(str(store)).status != 1)[0])
    answer = client.get(f"/api/index/layer3/patch/{failed}/0.json")
    assert answer.status_code == 404 and "it holds no activations" in answer.get_json()["reason"]
    assert client.get("/api/index/layer3/patch/0/0.json").status_code == 200
    for q in ("%C2%B2", "%C2%B9"):
        answer = client.get(f"/api/search.json?q={q}")
        assert answer.status_code == 200 and answer.get_json()["hits"] == []


def test_a_row_that_is_not_there_or_not_ok_is_one_line(store: Path):
    ix = open_index(str(store), "layer3")
    s = open_store(str(store))
    failed = int(np.flatnonzero(s.status != 1)[0])
    with pytest.raises(OutOfRangeError, match=f"row {len(s)} out of range: .* has {len(s)} rows"):
        ix.encode_row(len(s))
    with pytest.raises(OutOfRangeError, match="row -1 out of range"):
        ix.encode_row(-1)
    with pytest.raises(StoreError, match=f"row {failed} .*corrupt.* is not ok"):
        ix.encode_row(failed)


def test_the_write_time_index_of_a_dictionary_equals_the_post_hoc_one(images: Path, tmp_path: Path):
    np.savez(tmp_path / "sae.npz", **sae(3))
    path = tmp_path / "d.zarr"
    run(parse_spec(_job(images, path, feature_index={"k": 3, "dictionary": str(tmp_path / "sae.npz")})))
    written = open_index(str(path), "layer3@sae")
    again = index(str(path), "layer3", dictionary=tmp_path / "sae.npz", k=3, name="again")
    assert written.attrs["dictionary"] == again.attrs["dictionary"]
    for name, a in _arrays(written).items():
        np.testing.assert_allclose(a, np.asarray(again.arrays[name][:]), rtol=1e-6, err_msg=name)


# ---------------------------------------------------------------------------------------------- killed, resumed
KILL_AFTER_TWO_SHARDS = """
import os, signal, sys, yaml
from extractor.driver.runner import run
from extractor.spec.load import parse_spec
done = []
def kill(name, info):
    if name == "shard_done":
        done.append(info["shard"])
        if len(done) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
run(parse_spec(yaml.safe_load(open(sys.argv[1]))), on_event=kill)
"""


def test_a_killed_and_resumed_job_writes_the_index_a_post_hoc_pass_makes_and_an_older_one_goes_stale(
        images: Path, tmp_path: Path):
    import yaml

    path = tmp_path / "k.zarr"
    raw = _job(images, path, feature_index={"k": 4, "pool": "mean"})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(raw))
    proc = subprocess.run([sys.executable, "-c", KILL_AFTER_TWO_SHARDS, str(tmp_path / "job.yaml")],
                          env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    s = open_store(str(path))
    assert s.attrs["status"] == "running" and 2 <= s.done_shards.sum() < 4 and "indexes" not in s.group
    early = index(s, "layer3", k=4, pool="mean", name="early")  # the shards committed so far
    assert not early.stale and early.rows == int((s.status == 1).sum())
    raw["output"]["if_exists"] = "resume"
    summary = run(parse_spec(raw))
    assert summary.shards_skipped >= 2
    assert open_index(str(path), "early").stale  # more shards were committed since
    written = open_index(str(path), "layer3")
    again = index(str(path), "layer3", k=4, pool="mean", name="again")
    assert written.rows == again.rows == 14 and not written.stale
    _same(written, again)
    assert open_store(str(path)).group["index_parts/layer3"].shape[0] == 4  # a shard's part each


# ---------------------------------------------------------------------------------------------- a ViT's patches
VIT = {"name": "timm:vit_small_patch16_224", "weights": "random", "device": "cpu",
       "kwargs": {"img_size": 32, "patch_size": 8, "depth": 2, "embed_dim": 48, "num_heads": 2}}


@pytest.fixture(scope="module")
def vit(images: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny ViT's blocks.1 tokens (a CLS, then 4 x 4 patches) of the 14 ok rows, with a write-time index of k 2."""
    pytest.importorskip("timm")
    path = tmp_path_factory.mktemp("vit") / "v.zarr"
    run(parse_spec(job(images, path, model=VIT, data={"resize": 32, "crop": 32, "shard_size": 8, "batch_size": 4},
                       capture=[{"layer": "blocks.1", "reduce": "none", "feature_index": {"k": 2}}])))
    return path


def _tokens(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """blocks.1's ok rows (n, 17, 48), and their store rows."""
    s = open_store(str(path))
    return s.numpy("blocks.1"), s.ok_rows()


def test_an_index_of_a_vit_counts_its_patches_only_as_its_heatmaps_show_them(vit: Path):
    """issue 54: densities, maxima and top rows were taken over every token, the CLS included, while the heatmaps
    and the viewer show the patches. Now the index (post-hoc and write-time) is of the patches, by hand, unless
    asked to include the prefix tokens; its record and listing say which."""
    x, rows = _tokens(vit)
    patches = index(str(vit), "blocks.1", k=2, name="patches")
    check_against_numpy(x[:, 1:], rows, type("Got", (), _arrays(patches)), 2, "max")
    assert (patches.attrs["positions"], patches.grid, patches.attrs["prefix"], patches.attrs["left_out"],
            patches.covers) == (16, (4, 4), 0, 1, "patches")
    every = index(str(vit), "blocks.1", k=2, name="every", include_prefix=True)
    check_against_numpy(x, rows, type("Got", (), _arrays(every)), 2, "max")
    assert (every.attrs["positions"], every.attrs["prefix"], every.covers) == (17, 1, "all")
    assert not np.array_equal(patches.density, every.density)  # over 16 tokens a row, not 17
    for f in (0, 47):
        for rank, row in enumerate(patches.top(f).rows):
            np.testing.assert_array_equal(patches.heatmap(f, rank), x[rows == row][0, 1:, f].reshape(4, 4))
        np.testing.assert_array_equal(every.heatmap(f, 0), x[rows == every.top(f).rows[0]][0, 1:, f].reshape(4, 4))
    np.testing.assert_array_equal(patches.encode_row(int(rows[3])), x[3, 1:])
    np.testing.assert_array_equal(every.encode_row(int(rows[3])), x[3])
    written = open_index(str(vit), "blocks.1")  # the job's write-time index: the patches too, the same index
    assert written.attrs["written"] == "write-time" and written.covers == "patches"
    _same(written, index(str(vit), "blocks.1", k=2, name="again"))
    from extractor.index import describe

    assert "over patch tokens only (the 1 token besides the patches left out)" in next(describe(patches))
    assert "over every token, the 1 token besides the patches included" in next(describe(every))


def test_an_sae_indexed_with_normalize_sees_the_tokens_a_normalised_stream_gives(vit: Path, store: Path,
                                                                                 tmp_path: Path):
    """issue 54: an SAE trained on token_batches(normalize="norm") was indexed on raw tokens (another scale), and
    norm divided by a mean over every token, CLS included. ``normalize`` applies the stream's own statistics: the
    index's latents are the SAE applied by hand (numpy) to the stream's normalised batches of the same tokens."""
    t = sae(d_in=48)
    np.savez(tmp_path / "sae.npz", **t)
    s = open_store(str(vit))
    _x, rows = _tokens(vit)
    latents = np.zeros((len(rows), 16, D_SAE), np.float32)
    for at, batch in s.token_batches("blocks.1", 37, shuffle=False, drop_prefix=True, normalize="norm"):
        by_hand = np.maximum((batch - t["b_dec"]) @ t["W_enc"] + t["b_enc"], 0)
        latents[np.searchsorted(rows, at[:, 0]), at[:, 1] - 1] = by_hand
    ix = index(str(vit), "blocks.1", dictionary=tmp_path / "sae.npz", k=3, normalize="norm")
    scale = s.stats["blocks.1"]["patches"]["mean_token_l2"]
    assert ix.attrs["normalize"] == {"asked": ["norm"], "scale": scale, "shifted": False, "over": "patches"}
    assert scale != pytest.approx(s.stats["blocks.1"]["mean_token_l2"], rel=1e-3)  # the CLS moves the mean norm
    for r in (0, 5, 13):
        np.testing.assert_allclose(ix.encode_row(int(rows[r])), latents[r], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ix.max_value, latents.max(axis=(0, 1)), rtol=1e-5)
    got = _arrays(ix)
    for f in range(D_SAE):
        by_hand = rows[by_hand_top(latents.max(axis=1), latents.max(axis=1) > 0, f, 3)]
        assert list(got["top_rows"][f][got["top_rows"][f] >= 0]) == list(by_hand), f
    np.testing.assert_allclose(got["density_tokens"], (latents > 0).mean(axis=(0, 1)), atol=1.5 / latents[..., 0].size)
    raw = index(str(vit), "blocks.1", dictionary=tmp_path / "sae.npz", k=3, name="raw")
    assert not np.allclose(raw.density, ix.density)  # as saved: another scale, other latents
    from extractor.cli import main

    assert main(["index", str(vit), "--key", "blocks.1", "--dictionary", str(tmp_path / "sae.npz"), "--k", "3",
                 "--normalize", "norm", "--name", "cli", "-q"]) == 0
    np.testing.assert_array_equal(open_index(str(vit), "cli").density, ix.density)
    with pytest.raises(StoreError, match=r"normalize='norm' scales the tokens of a token sequence .* layer3 is no"):
        index(str(store), "layer3", normalize="norm")
    with pytest.raises(ValueError, match="normalize takes 'mean', 'norm' or both, not 'unit'"):
        index(str(vit), "blocks.1", normalize="unit")


def test_figures_draw_a_features_top_images_and_the_densities(store: Path):
    pytest.importorskip("matplotlib")
    from extractor.read.figures import pixels

    ix = open_index(str(store), "layer3")
    f = int(np.argmax(ix.density_rows))
    assert pixels(ix.top_figure(f)).shape[2] == 3
    assert pixels(ix.density_figure()).shape[2] == 3


@pytest.mark.slow
def test_on_ray_the_workers_parts_make_the_index_a_post_hoc_pass_makes(ray_cluster, images: Path, tmp_path: Path):
    """Two Ray workers write the parts of their shards; the driver merges them."""
    path = tmp_path / "r.zarr"
    raw = _job(images, path, feature_index={"k": 4})
    raw["cluster"] = {"backend": "ray", "workers": 2, "cpus_per_worker": 1}
    summary = run(parse_spec(raw))
    assert summary.shards_run == 4
    _same(open_index(str(path), "layer3"), index(str(path), "layer3", k=4, name="again"))


def test_the_command_makes_lists_and_draws_an_index(store: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                                                    monkeypatch: pytest.MonkeyPatch):
    pytest.importorskip("matplotlib")
    from extractor.cli import main

    assert main(["index", str(store), "--key", "layer3", "--k", "4", "--name", "cli", "-q"]) == 0
    said = capsys.readouterr().out
    assert "index cli: 32 features of layer3, top 4 rows by max, 14 rows" in said and "dead: " in said
    _same(open_index(str(store), "cli"), open_index(str(store), "layer3"))  # as the job's write-time index
    assert main(["index", str(store), "--json"]) == 0
    listed = {ix["name"]: ix for ix in json.loads(capsys.readouterr().out)}
    assert listed["cli"]["features"] == 32 and not listed["cli"]["stale"] and "layer3" in listed
    assert main(["index", str(store), "--name", "cli", "--feature", "3", "--out", str(tmp_path / "f.png")]) == 0
    assert (tmp_path / "f.png").stat().st_size > 0
    np.savez(tmp_path / "narrow.npz", **sae(d_in=16))
    assert main(["index", str(store), "--key", "layer3", "--dictionary", str(tmp_path / "narrow.npz"), "-q"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: dictionary") and "d_in 16" in err and "\n" not in err
    for args, said in [(["--name", "cli", "--feature", "32"], "error: feature 32 out of range"),
                       (["--key", "layer3", "--threshold", "nan"], "error: threshold must be a finite number")]:
        assert main(["index", str(store), *args, "--out", str(tmp_path / "g.png"), "-q"]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith(said) and "\n" not in err, err
    with pytest.raises(SystemExit):
        main(["index", str(store), "--name", "cli", "--feature", "3", "--columns", "0"])
    assert "--columns: must be at least 1" in capsys.readouterr().err
    from helpers.processes import cli

    monkeypatch.setenv("EXTRACTOR_PROGRESS_S", "0")  # a line at every update (not a terminal: lines, not a bar)
    r = cli("index", str(store), "--key", "layer3", "--k", "4", "--name", "rows")
    assert r.returncode == 0, r.stderr
    assert "14 rows to process" in r.stderr and " of 14 rows (" in r.stderr and "images" not in r.stderr, r.stderr
