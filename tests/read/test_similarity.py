"""Representational comparison (issue 31): linear CKA and RSA between captures of one store or of several,
rows aligned by image id, checked against the formulas computed here."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from extractor.data.rows import Rows
from extractor.errors import StoreError
from extractor.read import compare, linear_cka, open_store
from extractor.store.layout import FAILED, OK, StoreArrays
from extractor.store.synthetic import create_store


def _store(url: str, ids: list[str], arrays: dict[str, np.ndarray], failed: tuple[int, ...] = (),
           dims: dict[str, list[str]] | None = None, digests: np.ndarray | None = None) -> None:
    n = len(ids)
    caps = {k: {"shape": list(v.shape[1:]), "dtype": "float32", "dims": (dims or {}).get(k, [f"{k}.feature"]),
                "layer": k, "what": "output", "reduce": "mean"} for k, v in arrays.items()}
    g = create_store(url, Rows(ids=ids, paths=[""] * n, labels=[0] * n),
                     StoreArrays(captures=caps, extras={}, shard_size=n, chunk_rows=dict.fromkeys(caps, 64)),
                     attrs={"n_rows": n, "n_shards": 1, "captures": caps, "format_version": 1, "spec": {}, "model": {}})
    for k, v in arrays.items():
        g[k][:] = v
    status = np.full(n, OK, np.uint8)
    status[list(failed)] = FAILED
    g["status"][:] = status
    if digests is not None:
        g["digest"][:] = digests


def _cka_by_formula(x: np.ndarray, y: np.ndarray) -> float:
    """Kornblith et al. (2019), eq. 4: HSIC of linear kernels of centred features, normalised."""
    x, y = x - x.mean(0), y - y.mean(0)
    return np.sum((x.T @ y) ** 2) / np.sqrt(np.sum((x.T @ x) ** 2) * np.sum((y.T @ y) ** 2))


def _spearman_of_rdms(x: np.ndarray, y: np.ndarray) -> float:
    iu = np.triu_indices(len(x), 1)
    a, b = ((1 - np.corrcoef(m))[iu] for m in (x, y))
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))  # no ties in continuous distances
    return float(np.corrcoef(ra, rb)[0, 1])


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("compare")
    rng = np.random.default_rng(0)
    n = 300
    x = rng.standard_normal((n, 20)).astype(np.float32)
    q, _ = np.linalg.qr(rng.standard_normal((20, 20)))
    z = (np.tanh(x[:, :12] @ rng.standard_normal((12, 30))) + rng.standard_normal((n, 30))).astype(np.float32)
    ids = [f"img{i}" for i in range(n)]
    digests = np.arange(1, n + 1, dtype=np.uint64)  # image i's content digest
    _store(str(root / "a.zarr"), ids, {"x": x, "rotated": (x @ q * 3.0).astype(np.float32), "z": z}, failed=(5,),
           digests=digests)
    order = rng.permutation(n)[: n - 40]  # another store: 260 of the images, in another order, one more failed
    _store(str(root / "b.zarr"), [ids[i] for i in order], {"x": x[order]}, failed=(0,), digests=digests[order])
    # the same images read from another source (a Parquet copy): other ids, the same bytes
    _store(str(root / "d.zarr"), [f"pq/{i}" for i in order], {"x": x[order]}, failed=(0,), digests=digests[order])
    _store(str(root / "c.zarr"), [f"other{i}" for i in range(10)], {"x": x[:10]})
    return root, x, z, order


def test_cka_and_rsa_equal_their_formulas_and_cka_is_invariant_to_rotation_and_scaling(stores):
    root, x, z, _ = stores
    a = open_store(str(root / "a.zarr"))
    got = compare([(a, "x"), (a, "rotated"), (a, "z")], rsa_rows=299)  # CKA and RSA over every shared row
    ok = np.flatnonzero(np.arange(300) != 5)  # the failed row is left out
    assert got.shared == got.cka_rows == 299 and got.rsa_rows == 299
    np.testing.assert_allclose(np.diag(got.cka), 1.0, rtol=1e-12)  # a capture against itself
    assert got.cka[0, 1] == pytest.approx(1.0, abs=1e-9)  # invariant to an orthogonal rotation and scaling by 3
    assert got.cka[0, 2] == pytest.approx(_cka_by_formula(x[ok].astype(np.float64), z[ok].astype(np.float64)),
                                          rel=1e-9)
    assert got.cka[0, 2] == pytest.approx(linear_cka(x[ok], z[ok]), rel=1e-9) and np.allclose(got.cka, got.cka.T)
    assert 0.05 < got.cka[0, 2] < 0.95  # related, not the same
    assert got.rsa[0, 2] == pytest.approx(_spearman_of_rdms(x[ok].astype(np.float64), z[ok].astype(np.float64)),
                                          abs=1e-9)
    np.testing.assert_allclose(np.diag(got.rsa), 1.0, rtol=1e-12)
    some = compare([(a, "x"), (a, "z")], rsa_rows=120)  # RSA on a seeded sample of 120, drawn from every row
    assert some.rsa_rows == 120 and abs(some.rsa[0, 1] - got.rsa[0, 2]) < 0.15


def test_captures_too_wide_for_the_feature_form_take_the_gram_form_on_a_sample(stores, monkeypatch):
    """The Gram form (n x n kernels of a sample) equals the feature form (widths x widths) on the same rows."""
    import extractor.read.similarity as similarity

    root, _x, _z, _ = stores
    a = open_store(str(root / "a.zarr"))
    features = compare([(a, "x"), (a, "z")])
    monkeypatch.setattr(similarity, "FEATURE_WIDTH", 10)  # 20 + 30 features: too wide now
    grams = compare([(a, "x"), (a, "z")], rows=299)
    np.testing.assert_allclose(grams.cka, features.cka, rtol=1e-9)
    assert compare([(a, "x"), (a, "z")]).cka_rows == 299  # the default sample (2048), cut to the shared rows
    monkeypatch.setattr(similarity, "FEATURE_BYTES", 4 * 30 * 100)  # a sample's rows of the widest: 100
    small = compare([(a, "x"), (a, "z")])
    assert small.cka_rows == 100 and "the CKA sample is 100 rows: 30 features a row" in small.report()


def test_rows_are_aligned_by_id_across_stores_and_stores_sharing_none_are_refused(stores):
    root, _x, _, order = stores
    a, b = open_store(str(root / "a.zarr")), open_store(str(root / "b.zarr"))
    got = compare([(a, "x"), (b, "x")], rows=1000)
    assert got.shared == 260 - 1 - int(5 in order[1:])  # ok in both: b's first row failed, a's row 5 failed
    assert got.cka[0, 1] == pytest.approx(1.0, abs=1e-12) and got.rsa[0, 1] == pytest.approx(1.0, abs=1e-12)
    sampled = compare([(a, "x"), (b, "x")], rows=50, seed=3)
    assert sampled.cka_rows == 50 and sampled.cka[0, 1] == pytest.approx(1.0, abs=1e-12)
    with pytest.raises(StoreError, match=r"share no image id \(nor image content digest\) whose row is ok in all of "
                                         r"them: .*a.zarr \(299 ok\)"):
        compare([(a, "x"), (open_store(str(root / "c.zarr")), "x")])
    with pytest.raises(StoreError, match="'nope' is not a capture of"):
        compare([(a, "x"), (a, "nope")])
    # stores of the same images from two sources: no id shared, aligned by content digest, the same result
    d = open_store(str(root / "d.zarr"))
    for rows in (1000, 50):
        by_id, by_digest = compare([(a, "x"), (b, "x")], rows=rows, seed=3), compare([(a, "x"), (d, "x")], rows=rows,
                                                                                    seed=3)
        assert by_digest.shared == by_id.shared and by_digest.cka_rows == by_id.cka_rows
        np.testing.assert_allclose(by_digest.cka, by_id.cka, atol=1e-12)
        np.testing.assert_allclose(by_digest.rsa, by_id.rsa, atol=1e-12)
        assert any("aligned by content digest" in note for note in by_digest.notes)


@pytest.mark.slow
def test_the_compare_command_prints_the_tables_and_json(stores):
    root, *_ = stores
    cmd = [sys.executable, "-m", "extractor.cli", "compare", f"{root / 'a.zarr'}:x", str(root / "b.zarr"), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["names"] == [f"{root / 'a.zarr'}:x", f"{root / 'b.zarr'}:x"]
    assert result["cka"][0][1] == pytest.approx(1.0, abs=1e-9)
    text = subprocess.run(cmd[:-1], capture_output=True, text=True, timeout=120).stdout
    shared = result["shared_rows"]
    assert f"linear CKA, {shared} of {shared} shared rows" in text and "RSA (Spearman of RDMs)" in text
    bad = subprocess.run([*cmd[:4], f"{root / 'a.zarr'}:nope", str(root / "b.zarr")], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 1 and "'nope' is not a capture of" in bad.stderr and "Traceback" not in bad.stderr


def test_top_rows_equal_argsort_on_the_whole_capture_for_an_index_or_a_direction(tmp_path, caplog):
    """Issue 31: the images that drive a unit or a direction, streamed batch by batch, equal argsort on the
    whole capture (pooled over tokens or positions), ok rows only."""
    from extractor.read import top_rows

    rng = np.random.default_rng(1)
    n = 700  # more than one batch of whole chunks
    tok = rng.standard_normal((n, 5, 6)).astype(np.float32)
    maps = rng.standard_normal((n, 4, 3, 3)).astype(np.float32)
    tok[17, 2, 3] = np.nan  # a row holding NaN there never comes
    _store(str(tmp_path / "s.zarr"), [f"i{r}" for r in range(n)], {"tok": tok, "map": maps}, failed=(9,),
           dims={"tok": ["tok.token", "tok.feature"], "map": ["map.channel", "map.y", "map.x"]})
    s = open_store(str(tmp_path / "s.zarr"))
    ok = np.array([r for r in range(n) if r not in (9, 17)])
    direction = rng.standard_normal(6)
    cases = [("tok", 3, "max", tok[:, :, 3].max(1)), ("tok", direction, "mean", (tok @ direction).mean(1)),
             ("map", 2, "mean", maps[:, 2].mean((1, 2))), ("map", rng.standard_normal(4), "max", None)]
    for key, feature, pool, score in cases:
        if score is None:  # a direction over a map's channels, max over positions
            score = np.tensordot(maps.astype(np.float64), feature, ([1], [0])).reshape(n, -1).max(1)
        rows, values = top_rows(s, key, feature, k=12, pool=pool)
        expect = ok[np.argsort(-score[ok], kind="stable")[:12]]
        assert rows.tolist() == expect.tolist(), (key, pool)
        np.testing.assert_allclose(values, score[expect], rtol=1e-6)
    assert "1 rows of tok hold NaN or Inf for this feature: left out" in caplog.text  # said, not silent
    with pytest.raises(StoreError, match=r"tok has 6 features along tok.feature: give an index 0 to 5, or a "
                                         r"direction of 6 values \(not 6\)"):
        top_rows(s, "tok", 6)
    with pytest.raises(StoreError, match=r"or a direction of 4 values \(not 3 values\)"):
        top_rows(s, "map", np.ones(3))
    with pytest.raises(StoreError, match=r"top rows of map: k must be >= 1, not 0"):
        top_rows(s, "map", 0, k=0)
    with pytest.raises(StoreError, match=r"top rows of map: pool must be max or mean, not 'min'"):
        top_rows(s, "map", 0, pool="min")


def test_fewer_than_three_shared_rows_and_a_pca_of_one_row_are_refused(tmp_path):
    from extractor.read.analysis import principal_components

    _store(str(tmp_path / "tiny.zarr"), ["r0", "r1"], {"a": np.ones((2, 3)), "b": np.ones((2, 4))})
    s = open_store(str(tmp_path / "tiny.zarr"))
    with pytest.raises(StoreError, match=r"share 2 ok rows; CKA and RSA need at least 3"):
        compare([(s, "a"), (s, "b")])
    with pytest.raises(StoreError, match=r"a PCA needs at least 2 rows, not 1"):
        principal_components(np.ones((1, 4)))
