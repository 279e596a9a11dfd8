"""Dictionaries read without the library that trained them (issue 42): the encoder against the SAE by hand for
each activation (in torch and in numpy), and a damaged file one line naming it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers.index_checks import D_SAE, refused, sae, saelens

from extractor.index.dictionary import load_dictionary


@pytest.mark.parametrize("by", ["torch", "numpy"])
def test_encode_is_the_sae_by_hand_for_each_activation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, by: str):
    if by == "numpy":  # where torch is not installed
        monkeypatch.setattr("extractor.index.dictionary._torch", lambda: None)
    t = sae()
    x = np.random.default_rng(1).standard_normal((20, 32)).astype(np.float32)
    pre = (x - t["b_dec"]) @ t["W_enc"] + t["b_enc"]
    np.savez(tmp_path / "sae.npz", **t)
    np.testing.assert_allclose(load_dictionary(tmp_path / "sae.npz").encode(x), np.maximum(pre, 0), rtol=1e-5,
                               atol=1e-6)
    top = load_dictionary(tmp_path / "sae.npz", "topk:5").encode(x)
    assert ((top > 0).sum(axis=1) <= 5).all()
    for i in range(len(x)):
        keep = np.argsort(-pre[i])[:5]
        np.testing.assert_allclose(top[i, keep], np.maximum(pre[i, keep], 0), rtol=1e-5, atol=1e-6)
    threshold = np.full(D_SAE, 0.3, np.float32)
    folder = saelens(tmp_path / "jump", {**t, "threshold": threshold}, architecture="jumprelu")
    jump = load_dictionary(folder)
    assert jump.activation == "jumprelu"
    np.testing.assert_allclose(jump.encode(x), np.where(pre > 0.3, pre, 0), rtol=1e-5, atol=1e-6)




def _damaged(tmp_path: Path, how: str) -> Path:
    """A dictionary file damaged one way (each once a traceback)."""
    from safetensors.numpy import save_file

    good = tmp_path / "good.npz"
    np.savez(good, **sae())
    if how == "garbage npz":
        (path := tmp_path / "x.npz").write_bytes(b"PK\x03\x04 not a zip at all" * 20)
    elif how == "npz cut short":
        (path := tmp_path / "x.npz").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    elif how == "empty npz":
        (path := tmp_path / "x.npz").write_bytes(b"")
    elif how in ("safetensors header not of tensors", "safetensors cut short"):
        save_file(sae(), str(path := tmp_path / "x.safetensors"))
        if how == "safetensors cut short":
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        else:
            header = json.dumps({"a": 1}).encode()
            path.write_bytes(len(header).to_bytes(8, "little") + header)
    elif how == "threshold of another width":
        np.savez(path := tmp_path / "x.npz", **sae(), threshold=np.zeros(7, np.float32))
    else:
        path = saelens(tmp_path / "lens", sae())
        (path / "cfg.json").write_text("[1, 2]" if how == "cfg not an object" else json.dumps({"d_in": "abc"}))
    return path


@pytest.mark.parametrize("how", ["garbage npz", "npz cut short", "empty npz", "safetensors header not of tensors",
                                 "safetensors cut short", "threshold of another width", "cfg not an object",
                                 "cfg width not a number"])
def test_a_damaged_dictionary_file_is_one_line_naming_it(tmp_path: Path, how: str):
    path = _damaged(tmp_path, how)
    said = refused(load_dictionary, path)
    assert path.name in said or str(path) in said, said


@pytest.mark.parametrize("tensor", ["W_enc", "b_enc", "b_dec", "threshold", "encoder.weight"])
def test_a_dictionary_of_nan_or_infinite_weights_is_refused_naming_the_tensor(tmp_path: Path, tensor: str):
    """issue 54: an all-NaN dictionary (a diverged SAE) was read, and indexed as latents that are NaN or 0
    everywhere. Refused, one line naming the file and the tensor."""
    from safetensors.numpy import save_file

    t = sae()
    if tensor == "threshold":
        t["threshold"] = np.full(D_SAE, 0.1, np.float32)
    if tensor == "encoder.weight":  # a Linear's weights, (d_sae, d_in)
        t["encoder.weight"], t["encoder.bias"] = t.pop("W_enc").T.copy(), t.pop("b_enc")
    t[tensor] = t[tensor].copy()
    t[tensor].reshape(-1)[: 3 if tensor != "W_enc" else None] = np.inf if tensor == "b_dec" else np.nan
    np.savez(npz := tmp_path / "sae.npz", **t)
    said = refused(load_dictionary, npz)
    assert said.startswith(str(npz.resolve())) and f"tensor {tensor} " in said and "NaN or infinite" in said, said
    folder = saelens(tmp_path / "lens", sae())  # SAELens's folder, read by the safetensors parser
    save_file({**sae(), "W_enc": np.full((32, D_SAE), np.nan, np.float32)}, str(folder / "sae_weights.safetensors"))
    said = refused(load_dictionary, folder)
    assert f"tensor W_enc [32, {D_SAE}] holds {32 * D_SAE} NaN or infinite values (of {32 * D_SAE})" in said, said


def test_the_decoder_is_read_as_w_dec_or_a_linears_weight_and_refused_when_it_does_not_fit(tmp_path: Path):
    """issue 59: the atlas's decoder cosine and the viewer's switched-off latent read each latent's decoder direction:
    ``W_dec`` (d_sae, d_in), or ``decoder.weight`` (d_in, d_sae) as a Linear holds it."""
    t = sae()
    np.savez(tmp_path / "w.npz", **t)
    np.testing.assert_array_equal(load_dictionary(tmp_path / "w.npz").w_dec, t["W_dec"])
    linear = {k: v for k, v in t.items() if k != "W_dec"}
    np.savez(tmp_path / "l.npz", **linear, **{"decoder.weight": t["W_dec"].T})
    np.testing.assert_array_equal(load_dictionary(tmp_path / "l.npz").w_dec, t["W_dec"])
    np.savez(tmp_path / "none.npz", **linear)
    assert load_dictionary(tmp_path / "none.npz").w_dec is None
    np.savez(tmp_path / "bad.npz", **linear, W_dec=t["W_dec"].T)
    said = refused(load_dictionary, tmp_path / "bad.npz")
    assert "W_dec [32, 48] does not fit W_enc [32, 48]: the decoder is (d_sae, d_in) = (48, 32)" in said
