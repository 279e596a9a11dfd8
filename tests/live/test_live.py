"""The store's model, live (issue 59): an image already in the store run through the model rebuilt from the store's
record gives the store's own row (to its dtype's precision) and the index's features of it; a model that is not the
store's is refused; a latent or a channel switched off changes the output as the same edit made by hand. (Search by
text, on a random-weight CLIP: tests/view/test_view.py, whose store it shares.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.images import make_images
from helpers.jobs import job
from helpers.stores import root_attrs

from extractor.driver.runner import run
from extractor.index import index
from extractor.live import Live, LiveError
from extractor.read import open_store
from extractor.spec.load import parse_spec

D_SAE = 24


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, np.ndarray]]:
    """10 images through the tiny ResNet: layer3 maps (32 x 4 x 4) in float16, indexed raw and through an SAE."""
    root = tmp_path_factory.mktemp("live")
    make_images(root / "imgs", per_class=5, size=72)
    path = root / "s.zarr"
    run(parse_spec(job(root / "imgs", path, data={"crop": 64},
                       capture=[{"layer": "layer3", "reduce": "none", "dtype": "float16"}])))
    rng = np.random.default_rng(3)
    sae = {"W_enc": rng.standard_normal((32, D_SAE)).astype(np.float32),
           "b_enc": (rng.standard_normal(D_SAE) * 0.1).astype(np.float32),
           "W_dec": rng.standard_normal((D_SAE, 32)).astype(np.float32) / 6}
    np.savez(root / "sae.npz", **sae)
    index(str(path), "layer3", k=3, atlas=False)
    index(str(path), "layer3", dictionary=root / "sae.npz", k=3, atlas=False)
    return path, root / "imgs", sae


@pytest.fixture(scope="module")
def live(store) -> Live:
    made = Live(open_store(str(store[0])), device="cpu")
    yield made
    made.close()


def test_an_image_of_the_store_gives_its_own_row_and_features(store, live: Live):
    path, _, _ = store
    s = open_store(str(path))
    from extractor.index import open_index

    ix = open_index(s, "layer3@sae")
    for row in (0, 7):
        ran = live.run(Path(s.paths[row]).read_bytes())
        got, want = ran.values["layer3"], s.numpy("layer3", rows=[row])
        assert got.dtype == want.dtype == np.float16 and got.shape == want.shape
        # the job's batch and this one image forward in other orders: to float16's precision
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2**-10,
                                   atol=2**-10 * float(np.abs(want).max()))
        np.testing.assert_allclose(ix.encode(got)[0], ix.encode_row(row), rtol=1e-2, atol=1e-2)
        assert ran.output is not None and ran.output.shape == (10,)  # the tiny ResNet's head


def test_an_image_that_is_too_large_or_not_an_image_is_one_line(live: Live):
    from extractor.live import MAX_IMAGE_BYTES

    for data, said in [(b"", "no image given"), (b"not an image", "not an image this reads"),
                       (b"\0" * (MAX_IMAGE_BYTES + 1), f"at most {MAX_IMAGE_BYTES:,} are taken")]:
        with pytest.raises(LiveError, match=said) as err:
            live.run(data)
        assert "\n" not in str(err.value)


def test_a_model_that_is_not_the_stores_is_refused(store, tmp_path: Path):
    import shutil

    copy = tmp_path / "c.zarr"
    shutil.copytree(store[0], copy)
    model = root_attrs(str(copy))["model"]
    root_attrs(str(copy), model={**model, "state_dict_sha256": "0" * 64})  # a store made by other weights
    with pytest.raises(LiveError, match=r"is not the one that made it: the model's weights differ \(state-dict hash\)"):
        Live(open_store(str(copy)), device="cpu")


def _by_hand(live: Live, ran, edit) -> np.ndarray:
    """The model's output for ``ran``'s image with ``edit(x)`` (numpy, (C, H, W) -> same) applied to layer3's
    output by a hook of the test's own."""
    w = live.worker

    def hook(_m, _a, out):
        return torch.from_numpy(edit(out[0].detach().numpy().astype(np.float64)).astype(np.float32))[None]

    handle = dict(w.model.named_modules())["layer3"].register_forward_hook(hook)
    try:
        with torch.inference_mode():
            return w.model(w._prepare(ran.pixels[None]))[0].numpy()
    finally:
        handle.remove()


def test_switching_a_latent_or_a_channel_off_is_the_edit_by_hand(store, live: Live):
    path, _imgs, sae = store
    from extractor.index import open_index

    s = open_store(str(path))
    ran = live.run(Path(s.paths[3]).read_bytes())
    latents = ix_latents = open_index(s, "layer3@sae").encode(ran.values["layer3"])[0]  # (16, D_SAE)
    f = int(np.argmax(latents.sum(axis=0)))  # a latent that fires on this image

    def minus_latent(x: np.ndarray) -> np.ndarray:  # (C, H, W): x - z_f * W_dec[f] at every position
        tokens = x.reshape(32, 16).T
        z = np.maximum(tokens @ sae["W_enc"] + sae["b_enc"], 0)[:, f]
        return (tokens - z[:, None] * sae["W_dec"][f]).T.reshape(x.shape)

    got = live.switched_off(ran, open_index(s, "layer3@sae"), f)
    np.testing.assert_allclose(got, _by_hand(live, ran, minus_latent), rtol=1e-4, atol=1e-5)
    assert not np.allclose(got, ran.output, rtol=1e-3)  # it changed the output
    assert ix_latents[:, f].max() > 0
    channel = 5

    def zeroed(x: np.ndarray) -> np.ndarray:
        x = x.copy()
        x[channel] = 0
        return x

    got = live.switched_off(ran, open_index(s, "layer3"), channel)
    np.testing.assert_allclose(got, _by_hand(live, ran, zeroed), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(live.run(Path(s.paths[3]).read_bytes()).output, ran.output, rtol=1e-6)  # undone
    with pytest.raises(LiveError, match="has features 0 to 31, not 32"):
        live.switched_off(ran, open_index(s, "layer3"), 32)
