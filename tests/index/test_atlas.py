"""An index's atlas (issue 59): each feature's neighbours by decoder cosine, co-occurrence and correlation against
numpy by hand (both ways co-occurrence is counted), the map (one point per feature, the same seed the same map), the
sample of a larger store, and the command that adds one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers.images import make_images
from helpers.jobs import job

from extractor.driver.runner import run
from extractor.errors import StoreError
from extractor.index import add_atlas, index, open_index
from extractor.index.atlas import sample_rows
from extractor.index.neighbours import Cooccurrence, best, correlation, decoder_cosine
from extractor.read import open_store
from extractor.spec.load import parse_spec

D_SAE = 40


def _by_hand_best(scores: np.ndarray, m: int) -> tuple[list[list[int]], list[list[float]]]:
    """Each row's m highest other columns with a finite score, highest first, ties to the lower column."""
    features, values = [], []
    for f, row in enumerate(scores):
        others = [g for g in range(len(row)) if g != f and np.isfinite(row[g])]
        others.sort(key=lambda g: (-row[g], g))
        features.append(others[:m])
        values.append([float(row[g]) for g in others[:m]])
    return features, values


def _check(got: tuple[np.ndarray, ...], scores: np.ndarray, m: int) -> None:
    want, values = _by_hand_best(scores, m)
    for f in range(len(scores)):
        n = len(want[f])
        assert got[0][f, :n].tolist() == want[f], f
        assert (got[0][f, n:] == -1).all() and np.isnan(got[1][f, n:]).all()
        np.testing.assert_allclose(got[1][f, :n], values[f], rtol=1e-6)


def test_best_takes_the_highest_others_ties_to_the_lower_feature():
    s = np.array([[9.0, 1.0, 3.0, 3.0, np.nan], [2.0, 9.0, 2.0, -np.inf, 2.0]])
    features, values = best(s, 0, 3)
    assert features.tolist() == [[2, 3, 1], [0, 2, 4]]  # itself never; NaN and -inf are no score
    np.testing.assert_array_equal(values, [[3, 3, 1], [2, 2, 2]])
    features, _ = best(s[:, :3], 0, 4)
    assert features.tolist() == [[2, 1, -1, -1], [0, 2, -1, -1]]


def test_decoder_cosine_and_correlation_are_numpy_by_hand():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((50, 7))
    w[3] = 0  # no direction: no score, and nobody's neighbour
    unit = w / np.maximum(np.linalg.norm(w, axis=1, keepdims=True), 1e-300)
    cos = unit @ unit.T
    cos[3], cos[:, 3] = np.nan, np.nan
    _check(decoder_cosine(w, 6), cos, 6)
    pooled = rng.standard_normal((30, 50)) + rng.standard_normal((30, 1))  # features that move together
    pooled[:, 7] = 2.5  # constant: no correlation
    with np.errstate(invalid="ignore", divide="ignore"):
        corr = np.corrcoef(pooled.T)
    corr[7], corr[:, 7] = np.nan, np.nan
    _check(correlation(pooled, 5), corr, 5)


@pytest.mark.parametrize("way", ["compiled whole", "compiled blocks", "numpy dense", "numpy sparse"])
def test_cooccurrence_counts_and_jaccard_are_numpy_by_hand(way: str, monkeypatch: pytest.MonkeyPatch):
    """Counted by the compiled pass (every pair once into the whole matrix, or a block of features at a time), or
    without numba by a matrix product or by pairs (the cheaper for each block), in blocks of features and of pairs:
    the same counts as A.T @ A of the firing matrix, ranked by Jaccard."""
    import extractor.index.neighbours as nb

    if way.startswith("compiled"):
        pytest.importorskip("numba")
        monkeypatch.setattr(nb, "FULL_CELLS", 10**9 if way == "compiled whole" else 0)
    else:
        monkeypatch.setattr(nb, "_KERNEL", [None])
    monkeypatch.setattr(nb, "DENSE_COST", 0 if way == "numpy sparse" else 10**9)
    monkeypatch.setattr(nb, "BLOCK_CELLS", 7 * 30)  # blocks of 7 features
    monkeypatch.setattr(nb, "PAIRS", 50)  # pairs counted 50 at a time
    rng = np.random.default_rng(1)
    fire = rng.random((90, 30)) < np.linspace(0.02, 0.6, 30)
    fire[:, 4] = False  # never fires: no neighbour, nobody's
    cooc = Cooccurrence(30)
    for a in range(0, 90, 40):  # tokens added a block at a time
        cooc.add(fire[a : a + 40])
    features, scores, counts = cooc.neighbours(6)
    a = fire.astype(np.int64)
    c = a.T @ a
    n = np.diag(c)
    jaccard = np.where(c > 0, c / np.maximum(n[:, None] + n[None, :] - c, 1), np.nan)
    _check((features, scores), jaccard, 6)
    np.testing.assert_array_equal(np.where(features >= 0, counts, -1),
                                  np.where(features >= 0, np.take_along_axis(c, np.maximum(features, 0), 1), -1))
    assert (features[4] == -1).all() and not (features == 4).any()


@pytest.mark.parametrize("shape", [(300, 12), (6, 40)])
def test_the_pca_map_is_the_svds_two_first_components_signed_and_seeded(shape: tuple[int, int],
                                                                       monkeypatch: pytest.MonkeyPatch):
    import extractor.index.projection as projection

    monkeypatch.setattr(projection, "_umap", lambda: None)  # where umap-learn is installed too
    x = np.random.default_rng(4).standard_normal(shape) + np.linspace(0, 3, shape[1])
    coords, made = projection.feature_map(x, seed=7)
    u, s, _ = np.linalg.svd(x - x.mean(axis=0), full_matrices=False)
    want = u[:, :2] * s[:2]
    want *= np.sign(want[np.argmax(np.abs(want), axis=0), [0, 1]])  # its largest coordinate positive
    np.testing.assert_allclose(coords, want, rtol=1e-5, atol=1e-5)
    assert made == {"method": "pca", "seed": 7} and coords.shape == (shape[0], 2)
    np.testing.assert_array_equal(projection.feature_map(x, seed=7)[0], coords)
    with pytest.raises(ImportError, match=r"umap-learn: pip install 'extractor\[atlas\]'"):
        projection.feature_map(x, method="umap")


# ---------------------------------------------------------------------------------------------- in a store
@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """14 rows of layer3 (32 channels x 2 x 2)."""
    root = tmp_path_factory.mktemp("atlas")
    make_images(root / "imgs", per_class=7, classes=("a", "b"), size=48)
    path = root / "s.zarr"
    run(parse_spec(job(root / "imgs", path, data={"resize": None, "crop": 32, "shard_size": 4, "batch_size": 7},
                       capture=[{"layer": "layer3", "reduce": "none", "feature_index": {"k": 3}}])))
    return path


@pytest.fixture(scope="module")
def sae(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(2)
    t = {"W_enc": rng.standard_normal((32, D_SAE)).astype(np.float32) * 0.5,
         "b_enc": (rng.standard_normal(D_SAE) * 0.1 - 0.3).astype(np.float32),
         "W_dec": rng.standard_normal((D_SAE, 32)).astype(np.float32)}
    path = tmp_path_factory.mktemp("sae") / "sae.npz"
    np.savez(path, **t)
    return path, t


def _latents(path: Path, t: dict[str, np.ndarray], rows: np.ndarray) -> np.ndarray:
    """The SAE's latents at each position of ``rows`` by hand (numpy): (n, 4, D_SAE)."""
    x = open_store(str(path)).numpy("layer3", rows=np.sort(rows))
    x = x.reshape(len(x), 32, 4).transpose(0, 2, 1)
    out = np.maximum(x @ t["W_enc"] + t["b_enc"], 0)
    return out[np.argsort(np.argsort(rows))]  # in the order of rows


def test_an_sae_index_keeps_each_latents_neighbours_equal_to_numpy_by_hand(store: Path, sae, tmp_path: Path):
    path, t = sae
    ix = index(str(store), "layer3", dictionary=path, k=3)
    atlas = ix.atlas
    assert atlas["measures"] == ["decoder", "cooccurrence", "correlation"] and atlas["rows"] == 14
    rows = ix.atlas_rows
    assert sorted(rows.tolist()) == open_store(str(store)).ok_rows().tolist()  # a small store: every row
    latents = ix.encode(open_store(str(store)).numpy("layer3", rows=np.sort(rows)))[np.argsort(np.argsort(rows))]
    np.testing.assert_allclose(latents, _latents(store, t, rows), rtol=1e-5, atol=1e-5)  # the SAE, by hand
    w = t["W_dec"].astype(np.float64)
    unit = w / np.linalg.norm(w, axis=1, keepdims=True)
    cos = unit @ unit.T
    fire = (latents > 0).reshape(-1, D_SAE).astype(np.int64)  # every token of every row
    c = fire.T @ fire
    n = np.diag(c)
    jaccard = np.where(c > 0, c / np.maximum(n[:, None] + n[None, :] - c, 1), np.nan)
    pooled = latents.max(axis=1).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        corr = np.corrcoef(pooled.T)
    corr[~np.isfinite(corr)] = np.nan
    for f in (0, 7, 39):
        got = ix.neighbours(f)
        want, values = _by_hand_best(cos, 16)
        assert got["decoder"].features.tolist() == want[f]
        np.testing.assert_allclose(got["decoder"].scores, values[f], rtol=1e-6)
        want, values = _by_hand_best(jaccard, 16)
        assert got["cooccurrence"].features.tolist() == want[f]
        np.testing.assert_array_equal(got["cooccurrence"].counts, c[f, want[f]])
        np.testing.assert_allclose(got["cooccurrence"].scores, values[f], rtol=1e-6)
        want, values = _by_hand_best(corr, 16)
        assert got["correlation"].features.tolist() == want[f]
        np.testing.assert_allclose(got["correlation"].scores, values[f], rtol=1e-5)
    assert ix.map.shape == (D_SAE, 2) and np.isfinite(ix.map).all()
    assert ix.atlas["map"] == {"method": "pca", "seed": 0, "source": "decoder"} or \
        ix.atlas["map"]["method"] == "umap"  # where umap-learn is installed
    again = add_atlas(str(store), ix.name)  # the same seed: the same map, the same neighbours
    np.testing.assert_array_equal(again.map, ix.map)
    np.testing.assert_array_equal(again.neighbours(7)["correlation"].features, ix.neighbours(7)["correlation"].features)
    assert again.atlas["arrays"] != ix.attrs["atlas"]["arrays"]  # a new atlas; the one replaced read whole still
    third = add_atlas(str(store), ix.name)
    assert sorted(k for k in third.arrays.group_keys() if k.startswith("atlas-")) == \
        sorted([again.atlas["arrays"], third.atlas["arrays"]])  # older ones go


def test_a_raw_index_has_no_decoder_and_its_map_comes_from_its_activations(store: Path):
    ix = open_index(str(store), "layer3")  # the job's write-time index: no atlas yet
    assert ix.atlas is None
    with pytest.raises(StoreError, match=r"has no atlas: add one with extractor index .* --name layer3 --atlas"):
        ix.neighbours(0)
    from extractor.cli import main

    assert main(["index", str(store), "--name", "layer3", "--atlas", "-q"]) == 0
    ix = open_index(str(store), "layer3")
    assert ix.atlas["measures"] == ["cooccurrence", "correlation"] and ix.atlas["map"]["source"] == "activations"
    assert ix.map.shape == (32, 2)
    assert set(ix.neighbours(3)) == {"cooccurrence", "correlation"}
    ix2 = index(str(store), "layer3", k=3, name="plain", atlas=False)
    assert ix2.atlas is None


def test_a_larger_store_is_sampled_top_rows_first_and_counted_within_the_token_budget(store: Path, sae):
    """Of more rows than asked for: the features' top rows rank by rank up to half, a seeded draw of the rest; the
    co-occurrence of the first rows whose tokens fit; numpy by hand over those same rows."""
    path, t = sae
    ix = index(str(store), "layer3", dictionary=path, k=3, name="small", atlas=False)
    rows = sample_rows(ix, 6, seed=0)
    top1 = [int(r) for r in dict.fromkeys(np.asarray(ix.arrays["top_rows"][:, 0]).tolist()) if r >= 0][:3]
    assert len(rows) == 6 and set(top1) <= set(rows.tolist())
    np.testing.assert_array_equal(sample_rows(ix, 6, seed=0), rows)  # the same seed, the same sample
    ix = add_atlas(str(store), "small", rows=6, tokens=4 * 4)
    assert (ix.atlas["rows"], ix.atlas["cooccurrence_rows"]) == (6, 4)
    np.testing.assert_array_equal(ix.atlas_rows, rows)
    latents = _latents(store, t, rows)
    fire = (latents[:4] > 0).reshape(-1, D_SAE).astype(np.int64)  # the tokens of the first 4 rows
    c = fire.T @ fire
    n = np.diag(c)
    want, _ = _by_hand_best(np.where(c > 0, c / np.maximum(n[:, None] + n[None, :] - c, 1), np.nan), 16)
    for f in range(D_SAE):
        got = ix.neighbours(f)["cooccurrence"]
        assert got.features.tolist() == want[f] and (got.counts == c[f, got.features]).all()
