"""Quick start for sparse-autoencoder training on ViT activations, as notebook cells (# %%).

Runs a job from Python on sample images, opens the store, trains a tiny sparse autoencoder for a
few steps on shuffled token rows, plots (or prints) its loss and indexes the store by its latents (what each
latent responds to, for `extractor view`). Run it as a script
(`python examples/sae_quickstart.py [WORK_DIR]`) or cell by cell in Jupyter / VS Code.
"""

# %% Sample images and a small ViT (weights: random here; pretrained for real features)
import sys
from pathlib import Path

import torch

import extractor
from extractor.demo import write_sample_images

work = Path(sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else "work")
write_sample_images(work / "images", per_class=8, size=64)
store = extractor.run({
    "model": {"name": "timm:vit_small_patch16_224", "weights": "random", "kwargs": {"img_size": 64, "depth": 4}},
    "data": {"root": str(work / "images"), "shard_size": 16, "batch_size": 16},
    "capture": [{"layer": "blocks.3", "dtype": "float16", "key": "resid"}],   # the residual stream after block 3
    "output": {"store": str(work / "sae.zarr"), "chunk_rows": 8, "if_exists": "overwrite"},
    "cluster": {"backend": "local"},
})
print(store)

# %% Token rows: every patch token of every image once per epoch, shuffled across images
loader = store.dataloader("resid", batch_size=128, tokens=True, drop_prefix=True, dtype=torch.float32,
                          drop_last=True)
d_model = store.captures["resid"]["shape"][-1]

# %% A tiny sparse autoencoder: ReLU codes with an L1 penalty
torch.manual_seed(0)
encoder, decoder = torch.nn.Linear(d_model, 4 * d_model), torch.nn.Linear(4 * d_model, d_model)
opt = torch.optim.Adam([*encoder.parameters(), *decoder.parameters()], lr=1e-3)
losses = []
for _epoch in range(3):  # three passes over every token
    for batch in loader:
        x = batch["resid"]
        codes = torch.relu(encoder(x))
        loss = (decoder(codes) - x).pow(2).mean() + 1e-3 * codes.abs().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
print(f"{len(losses)} steps; loss {losses[0]:.4f} -> {losses[-1]:.4f}")

# %% The dictionary saved as extractor reads one (W_enc: d_in x d_sae), the store indexed by its latents
import numpy as np  # noqa: E402 - a cell of its own

from extractor.index import index  # noqa: E402

np.savez(work / "sae.npz", W_enc=encoder.weight.detach().T.numpy(), b_enc=encoder.bias.detach().numpy(),
         W_dec=decoder.weight.detach().T.numpy())
ix = index(store, "resid", dictionary=work / "sae.npz", k=8)  # patch tokens, as the SAE was trained
print(ix)  # its pages: extractor view WORK/sae.zarr

# %% The loss curve
try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.plot(losses)
    plt.xlabel("step")
    plt.ylabel("loss")
    plt.savefig(work / "sae_loss.png")
    print(f"wrote {work / 'sae_loss.png'}")
except ImportError:
    print("losses:", " ".join(f"{v:.4f}" for v in losses))
