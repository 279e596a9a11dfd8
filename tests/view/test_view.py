"""The viewer (extractor.view) in a real browser: headless Chromium (Debian's, driven by Playwright) on a store made
here, served by the app and exported as a static site opened from disk."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.images import make_images
from helpers.jobs import job

CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
K = 4  # top rows per feature in the test's index


# ---------------------------------------------------------------------------------------------- the store
SAE = "layer3@sae"  # the index of a dictionary's latents (the other, "layer3": the capture's own channels)


def sae_weights(d_in: int = 32, d_sae: int = 48) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"W_enc": rng.normal(size=(d_in, d_sae)).astype(np.float32),
            "b_enc": rng.normal(scale=0.05, size=d_sae).astype(np.float32),
            "W_dec": rng.normal(size=(d_sae, d_in)).astype(np.float32) / np.sqrt(d_in)}


def make_store(tmp: Path) -> tuple[Path, Path]:
    """A store of 12 images (tiny ResNet: layer3 maps of 32 x 4 x 4, a Grad-CAM map) with two indexes of layer3:
    its channels, and the latents of a dictionary (an SAE's encoder, relu). Returns the store and the images."""
    import extractor
    import extractor.index

    images = tmp / "images"
    make_images(images, per_class=6, size=72)
    path = tmp / "view.zarr"
    raw = job(images, path, capture=[{"layer": "layer3", "reduce": "none"},
                                     {"layer": "layer4", "what": "gradcam", "size": "input", "key": "cam"}])
    raw["data"]["crop"] = 64
    store = extractor.run(raw, progress=False)
    extractor.index.index(store, "layer3", k=K)
    np.savez(tmp / "sae.npz", **sae_weights())
    extractor.index.index(store, "layer3", dictionary=tmp / "sae.npz", k=K)
    return path, images


def chromium() -> str | None:
    """Debian's Chromium (or another found on PATH), or None."""
    found = [p for p in CHROMIUM if Path(p).exists()] or [shutil.which(n) for n in ("chromium", "chromium-browser")]
    return next((p for p in found if p), None)


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, images = make_store(tmp_path_factory.mktemp("view"))
    (images / "dogs" / "dogs05.png").unlink()  # row 11: its source is gone
    return path


@pytest.fixture(scope="module")
def server(store_path: Path) -> Iterator[str]:
    """The app over the store on a free loopback port, in a thread: its base URL."""
    pytest.importorskip("flask")
    import logging

    from werkzeug.serving import make_server

    from extractor.view import create_app

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    srv = make_server("127.0.0.1", 0, create_app(str(store_path)), threaded=True)
    thread = threading.Thread(target=srv.serve_forever, name="view-test-server", daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_port}/"
    srv.shutdown()
    thread.join(10)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless Chromium for the module (skipped, saying why, where none is installed)."""
    path = chromium()
    if path is None:
        pytest.skip("no Chromium on this machine (make installs Debian's chromium: apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the view extra)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=FLAGS[1:])
        yield b
        b.close()


class Page:
    """A browser tab that records console errors and uncaught exceptions."""

    def __init__(self, browser: Any) -> None:
        self.page = browser.new_page(viewport={"width": 1200, "height": 900})
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def open(self, url: str) -> Any:
        """Load ``url`` and wait for the page's script to have run."""
        response = self.page.goto(url)
        self.page.wait_for_selector("body[data-ready=true]", state="attached")
        return response


@pytest.fixture
def tab(browser: Any) -> Iterator[Page]:
    page = Page(browser)
    yield page
    page.page.close()


def shot(tab: Page, name: str) -> None:
    """With EXTRACTOR_VIEW_SHOTS=DIR, a screenshot of the whole page in DIR (to look at; the README's are of the
    demo store, docs/figures/view_*.png)."""
    out = os.environ.get("EXTRACTOR_VIEW_SHOTS")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        tab.page.screenshot(path=str(Path(out) / f"{name}.png"), full_page=True)


# ---------------------------------------------------------------------------------------------- by hand
def maps(store_path: Path) -> np.ndarray:
    """The stored layer3 maps of every row, (N, C, H, W)."""
    from extractor.read import open_store

    s = open_store(str(store_path))
    return s.numpy("layer3", rows=np.arange(len(s)), only_ok=False).astype(np.float64)


def top_by_hand(x: np.ndarray, f: int, k: int = K) -> tuple[np.ndarray, np.ndarray]:
    """Feature ``f``'s top ``k`` rows by their maximum over positions, and those maxima."""
    pooled = x[:, f].reshape(len(x), -1).max(axis=1)
    rows = np.argsort(-pooled, kind="stable")[:k]
    return rows, pooled[rows]


def patch_by_hand(x: np.ndarray, row: int, y: int, xx: int, n: int = 10, sae: bool = False) -> list[int]:
    """The features of highest value above 0 at patch (y, x) of ``row``: layer3's channels, or with ``sae`` the
    dictionary's latents, relu(x @ W_enc + b_enc)."""
    v = x[row, :, y, xx]
    if sae:
        w = sae_weights()
        v = np.maximum(v @ w["W_enc"].astype(np.float64) + w["b_enc"], 0)
    return [int(f) for f in np.argsort(-v, kind="stable")[:n] if v[f] > 0]


# ---------------------------------------------------------------------------------------------- in the page
HEAT_ALPHA = """(fig) => {
    const c = fig.querySelector("canvas.heat");
    const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
    return {w: c.width, h: c.height, alpha: Array.from(d.filter((_, i) => i % 4 === 3))};
}"""


def check_feature_page(tab: Page, x: np.ndarray, f: int) -> None:
    """The page shows feature f's top K rows (by hand), in order, with their values, and on each the brightest
    patch of its heatmap is the position of the feature's highest value in that row."""
    rows, values = top_by_hand(x, f)
    figures = tab.page.locator("div.grid.top figure.pic")
    assert figures.count() == K
    assert [int(r) for r in figures.evaluate_all("fs => fs.map(f => f.dataset.row)")] == rows.tolist()
    shown = [float(v) for v in tab.page.locator("div.grid.top .value").all_inner_texts()]
    np.testing.assert_allclose(shown, values, rtol=1e-3)
    scale = float(x[rows, f].max())
    for n, row in enumerate(rows):
        if row == 11:  # its source is gone: a message, no picture
            assert "image not available" in figures.nth(n).inner_text()
            continue
        heat = figures.nth(n).evaluate(HEAT_ALPHA)
        grid = x[row, f]
        assert (heat["h"], heat["w"]) == grid.shape
        brightest = int(np.argmax(heat["alpha"]))
        # the brightest patch holds the highest value (to the overlay's 1/210 steps of the scale)
        assert grid.ravel()[brightest] >= grid.max() - scale / 200, (row, brightest, int(np.argmax(grid)))
        assert np.unravel_index(brightest, grid.shape) == np.unravel_index(np.argmax(grid), grid.shape) or \
            np.isclose(grid.ravel()[brightest], grid.max(), rtol=1e-2)


def click_patch(tab: Page, y: int, xx: int, grid: tuple[int, int], slug: str = "layer3") -> list[int]:
    """Click patch (y, x) of the image page's patch grid of index ``slug``; the features it lists."""
    section = tab.page.locator(f'section.index[data-slug="{slug}"]')
    canvas = section.locator("canvas.patch-grid")
    box = canvas.bounding_box()
    assert box is not None
    canvas.click(position={"x": (xx + 0.5) * box["width"] / grid[1], "y": (y + 0.5) * box["height"] / grid[0]})
    tab.page.wait_for_selector(f'section.index[data-slug="{slug}"][data-ready=true]', state="attached")
    listed = section.locator("ol.patch-features")
    assert int(listed.get_attribute("data-patch") or -1) == y * grid[1] + xx
    return [int(f) for f in listed.locator("li").evaluate_all("ls => ls.map(l => l.dataset.feature)")]


PAGES = ["index.html", "index/layer3.html", "index/layer3/0.html", "index/layer3/5.html", "image/0.html",
         "image/11.html", "search.html?q=dogs0"]


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.slow  # a server and a browser
def test_every_page_loads_without_console_errors(server: str, tab: Page):
    for path in PAGES:
        response = tab.open(server + path)
        assert response.status == 200, path
        assert not tab.errors, (path, tab.errors)
        shot(tab, path.replace("/", "_").replace("?", "_"))
    tab.open(server + "index.html")
    assert tab.page.locator("table.indexes a").all_inner_texts() == ["layer3", SAE]
    assert "12 ok" in tab.page.inner_text("p.status")
    tab.open(server + "image/11.html")  # the file was deleted after the run: said on the page, nothing broken
    main = tab.page.inner_text("main")
    assert "image not available" in main and "its source cannot be read (No such file or directory)" in main
    tab.open(server + "search.html?q=dogs0")
    hits = tab.page.locator("ol.hits li a").all_inner_texts()
    assert hits == [f"dogs/dogs0{i}.{'jpg' if i % 2 == 0 else 'png'}" for i in range(6)]


@pytest.mark.slow  # a server and a browser
def test_features_table_sorts_and_filters(server: str, tab: Page, store_path: Path):
    x = maps(store_path)
    tab.open(server + "index/layer3.html")
    rows = tab.page.locator("#feature-table tbody tr")
    assert rows.count() == x.shape[1]
    tab.page.click("th[data-sort=max_value]")  # descending first
    first = int(rows.first.get_attribute("data-feature") or -1)
    assert first == int(np.argmax(x.max(axis=(0, 2, 3))))
    tab.page.fill("#feature-filter", "2")
    shown = [int(f) for f in rows.evaluate_all("rs => rs.map(r => r.dataset.feature)")]
    assert sorted(shown) == [f for f in range(x.shape[1]) if str(f).startswith("2")]
    assert not tab.errors


@pytest.mark.slow  # a server and a browser
def test_feature_page_shows_top_images_with_heatmaps(server: str, tab: Page, store_path: Path):
    x = maps(store_path)
    f = int(np.argmax(x.max(axis=(0, 2, 3))))
    tab.open(server + f"index/layer3/{f}.html")
    check_feature_page(tab, x, f)
    tab.page.locator("div.grid.top figure.pic a.frame").first.click()  # from a feature to its image, and back
    tab.page.wait_for_selector("body[data-ready=true]", state="attached")
    assert "/image/" in tab.page.url
    tab.page.locator(".top-features a", has_text=f"feature {f}").first.click() if \
        tab.page.locator(".top-features a", has_text=f"feature {f}").count() else tab.page.go_back()
    tab.page.wait_for_selector("body[data-ready=true]", state="attached")
    assert tab.page.url.endswith(f"index/layer3/{f}.html")
    assert not tab.errors


@pytest.mark.slow  # a server and a browser
def test_clicking_a_patch_lists_the_features_firing_there(server: str, tab: Page, store_path: Path):
    x = maps(store_path)
    tab.open(server + "image/2.html")
    for y, xx in [(1, 2), (3, 0)]:
        assert click_patch(tab, y, xx, x.shape[2:]) == patch_by_hand(x, 2, y, xx)
        assert click_patch(tab, y, xx, x.shape[2:], SAE) == patch_by_hand(x, 2, y, xx, sae=True)
    assert not tab.errors
    shot(tab, "image_2_patch")


@pytest.mark.slow  # a server and a browser
def test_unknown_ids_are_a_clear_404_page(server: str, tab: Page):
    for path, says in [("image/999.html", "rows 0 to 11, not 999"), ("index/nope.html", "no index 'nope'"),
                       ("index/layer3/4096.html", "features 0 to 31, not 4096"), ("nothing/here", "no page at")]:
        response = tab.open(server + path)
        assert response.status == 404
        assert tab.page.inner_text("h1") == "Not found"
        assert says in tab.page.inner_text(".missing-reason"), path


@pytest.mark.slow  # a server and a browser
def test_the_app_is_read_only_and_takes_no_path_from_the_request(server: str):
    import urllib.error
    import urllib.request

    def status(path: str, method: str = "GET") -> int:
        try:
            with urllib.request.urlopen(urllib.request.Request(server + path, method=method)) as r:
                return r.status
        except urllib.error.HTTPError as err:
            return err.code

    assert status("index.html") == 200
    assert status("index.html", "POST") == 405 and status("image/0.html", "PUT") == 405
    for path in ["static/../app.py", "static/%2e%2e/app.py", "static/..%2fapp.py", "thumb/-1.jpg", "thumb/12.jpg",
                 "thumb/11.jpg", "image/1e3.html", "api/index/layer3/patch/0/16.json", "index/..%2findexes.html"]:
        assert status(path) == 404, path
    assert status("thumb/0.jpg") == 200 and status("static/view.js") == 200


@pytest.mark.slow  # a server and a browser
def test_the_exported_site_opens_from_disk_and_shows_the_same(store_path: Path, tmp_path: Path, tab: Page):
    from extractor.view import export_site

    written = export_site(str(store_path), tmp_path / "site", images=4, api=True)
    assert written["gone"] == 1  # row 11's image: its pages say so
    sizes = {kind: sum(p.stat().st_size for p in (tmp_path / "site").glob(pattern) if p.is_file())
             for kind, pattern in [("api_bytes", "api/**/*.json"), ("thumb_bytes", "thumb/*")]}
    assert sizes == {k: written[k] for k in sizes} and written["page_bytes"] > 0  # the sizes it says
    site = (tmp_path / "site").resolve().as_uri() + "/"
    x = maps(store_path)
    for path in ["index.html", "index/layer3.html", "image/0.html", "image/11.html", f"index/{SAE}/map.html"]:
        tab.open(site + path)
        assert not tab.errors, (path, tab.errors)
    assert int(tab.page.locator("#atlas-map").get_attribute("data-points") or -1) == 48  # the map, from disk
    f = int(np.argmax(x.max(axis=(0, 2, 3))))
    tab.open(site + f"index/layer3/{f}.html")
    check_feature_page(tab, x, f)
    tab.open(site + "image/2.html")
    assert click_patch(tab, 1, 2, x.shape[2:]) == patch_by_hand(x, 2, 1, 2)
    assert click_patch(tab, 1, 2, x.shape[2:], SAE) == patch_by_hand(x, 2, 1, 2, sae=True)
    tab.open(site + "search.html?q=cats01")
    assert tab.page.locator("ol.hits li a").all_inner_texts() == ["cats/cats01.png"]
    tab.page.click("ol.hits li a")
    tab.page.wait_for_selector("body[data-ready=true]", state="attached")
    assert tab.page.url.endswith("image/1.html")
    assert not tab.errors
    import json

    assert json.loads((tmp_path / "site" / "api" / f"index/layer3/{f}.json").read_text())["feature"] == f
    with pytest.raises(Exception, match="holds files and is no export"):
        export_site(str(store_path), tmp_path)  # a folder that is not an export is never written over


def test_thumbnails_of_tar_members_and_a_tar_that_is_gone(image_dir: Path, tmp_path: Path):
    """Thumbnails are read from the recorded source as the job read it (a tar member's bytes: the same picture as
    the file's); once the tar is gone the page says why, and the app's thumbnail is a 404 saying so."""
    import io

    from helpers.sources import write_tars
    from PIL import Image

    import extractor
    from extractor.view import Site, create_app

    images = sorted(p for p in image_dir.rglob("*") if p.is_file())
    write_tars(images, tmp_path / "tars", per_tar=12, labels={"cats": 0, "dogs": 1})
    capture = [{"layer": "layer4", "reduce": "mean"}]
    folder = extractor.run(job(image_dir, tmp_path / "f.zarr", capture=capture), progress=False)
    tars = extractor.run(job(image_dir, tmp_path / "t.zarr", capture=capture, data={
        "source": "tar", "root": None, "tars": str(tmp_path / "tars" / "shard-000.tar")}), progress=False)
    a, b = Site(folder), Site(tars)
    for row in (0, 7):
        pictures = [np.asarray(Image.open(io.BytesIO(s.thumbs.get(row)))) for s in (a, b)]
        np.testing.assert_array_equal(pictures[0], pictures[1])
        assert pictures[0].shape == (64, 64, 3)  # the job's crop
    (tmp_path / "tars" / "shard-000.tar").unlink()
    gone = Site(extractor.open_store(str(tmp_path / "t.zarr")))
    page = gone.image_page(3)
    assert "No such file or directory" in page["picture"]["gone"] and "shard-000.tar" in page["picture"]["gone"]
    client = create_app(str(tmp_path / "t.zarr")).test_client()
    answer = client.get("/thumb/3.jpg")
    assert answer.status_code == 404 and b"No such file or directory" in answer.data
    assert client.get("/image/3.html").status_code == 200
    # search by id, by a member's file name (ids of tar rows are sample keys, without the extension), by row
    assert [h["row"] for h in gone.search("cats/cats01")["hits"]] == [1]
    assert [h["id"] for h in gone.search("CATS01.PNG")["hits"]] == ["cats/cats01"]
    assert gone.search("7")["hits"][0]["row"] == 7


EVERY_PATH = ["/", "/index.html", "/search.html?q=cats", "/index/layer3.html", "/index/layer3/0.html",
         f"/index/{SAE}/1.html", "/image/1.html", "/thumb/1.jpg", "/api/store.json", "/api/search.json?q=1",
         "/api/index/layer3.json", "/api/index/layer3/0.json", "/api/image/1.json", "/api/index/layer3/patch/1/0.json"]


def _said_made_again(answer: Any, url: str) -> bool:
    """A 410 that says in one line that the store was made again, and to restart the viewer."""
    said = f"{url} was made again (or removed) since this viewer opened it: restart the viewer (extractor view {url})"
    if answer.status_code != 410:
        return False
    if answer.is_json:
        reason = answer.get_json()["reason"]
    else:
        text = answer.get_data(as_text=True)
        reason = text.split('<p class="missing-reason">', 1)[1].split("</p>", 1)[0] if "<html" in text else text
    return said in reason and "\n" not in reason.strip()


def test_a_store_made_again_or_removed_while_the_viewer_serves_it_is_said_on_every_page(
        store_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """T5-7: the viewer of a store made again (``--overwrite``) while it ran served the old store's index pages and
    thumbnails (200) and 500s elsewhere. Every request (but its own scripts and styles) now says in one line that
    the store was made again and to restart the viewer: after it was made again, after it was removed, and when it
    is made again while a page is being read."""
    pytest.importorskip("flask")
    from helpers.stores import made_again

    from extractor.view import Site, create_app

    path = tmp_path / "v.zarr"
    shutil.copytree(store_path, path)
    client = create_app(str(path)).test_client()
    assert [client.get(p).status_code for p in EVERY_PATH] == [200] * len(EVERY_PATH)
    made_again(str(path))
    assert [p for p in EVERY_PATH if not _said_made_again(client.get(p), str(path))] == []
    assert client.get("/static/view.js").status_code == 200  # the page that says so keeps its style
    page = client.get("/image/1.html").get_data(as_text=True)
    assert "The store was made again" in page and "Back to the store" not in page
    shutil.rmtree(path)
    assert [p for p in EVERY_PATH if not _said_made_again(client.get(p), str(path))] == []

    shutil.copytree(store_path, path)
    client = create_app(str(path)).test_client()
    shown = Site.image_page

    def made_again_meanwhile(site: Site, row: int) -> dict:
        made_again(str(path))  # after the request's check, before its reads
        return shown(site, row)

    monkeypatch.setattr(Site, "image_page", made_again_meanwhile)
    assert _said_made_again(client.get("/api/image/1.json"), str(path))


@pytest.mark.slow  # a server in a subprocess
def test_extractor_view_prints_its_address_and_exports_a_site(store_path: Path, tmp_path: Path):
    import re
    import subprocess
    import sys
    import urllib.error
    import urllib.request

    from helpers.processes import child_env

    command = [sys.executable, "-m", "extractor.cli", "view", str(store_path)]
    server = subprocess.Popen([*command, "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=child_env())
    try:
        line = server.stdout.readline() if server.stdout else ""  # printed once it listens
        found = re.search(r"http://127\.0\.0\.1:\d+/", line)
        assert found, (line, server.stderr.read() if server.poll() is not None and server.stderr else "")
        with urllib.request.urlopen(found.group(0) + "index/layer3@sae.html", timeout=60) as answer:
            assert answer.status == 200 and b"Features of" in answer.read()
        assert "(--port 0: a free port, chosen now)" in line
        rebound = urllib.request.Request(found.group(0) + "api/store.json", headers={"Host": "evil.example"})
        with pytest.raises(urllib.error.HTTPError) as refused:  # a name that is not the one it listens on
            urllib.request.urlopen(rebound, timeout=60)
        assert refused.value.code == 403 and b"DNS rebinding" in refused.value.read()
    finally:
        server.terminate()
        server.wait(30)
    done = subprocess.run([*command, "--export", str(tmp_path / "site"), "--features", "3", "--images", "12"],
                          capture_output=True, text=True, timeout=240, env=child_env())
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout and "the source of 1 image(s) is gone" in done.stdout
    site = tmp_path / "site"
    assert (site / "index/layer3/2.html").exists() and not (site / "index/layer3/3.html").exists()
    assert (site / "image/0.html").exists() and (site / "thumb/0.jpg").exists() and not (site / "api").exists()
    html = sum(p.stat().st_size for p in site.rglob("*.html"))
    pages = len(list(site.rglob("*.html")))
    assert f"wrote {pages} pages ({html / 1e6:.1f} MB, {html / pages / 1024:.0f} KiB a page)" in done.stdout
    again = subprocess.run([*command, "--export", str(tmp_path)], capture_output=True, text=True, timeout=120,
                           env=child_env())
    assert again.returncode != 0 and "is no export of the viewer" in again.stderr


def test_the_app_answers_only_for_the_host_it_listens_on(image_dir: Path, tmp_path: Path):
    """issue 54: the viewer answered any Host, so a page elsewhere could read the store through a name of its own
    that resolves here (DNS rebinding). Now: the address it bound, localhost on loopback, else 403 saying why."""
    pytest.importorskip("flask")
    import extractor
    from extractor.view import Hosts, create_app

    extractor.run(job(image_dir, tmp_path / "s.zarr", capture=[{"layer": "layer4", "reduce": "mean"}]), progress=False)
    loopback = Hosts.bound("127.0.0.1", "127.0.0.1")
    assert all(loopback.allows(h) for h in ("127.0.0.1:8050", "localhost:8050", "LOCALHOST", "127.0.0.1"))
    assert not any(loopback.allows(h) for h in ("evil.example:8050", "127.0.0.1.evil.example", "10.0.0.5:8050", ""))
    everywhere = Hosts.bound("0.0.0.0", "0.0.0.0")
    assert everywhere.allows("10.0.0.5:8050") and everywhere.allows("[fe80::1]:80")
    assert not everywhere.allows("evil.example:8050")
    client = create_app(str(tmp_path / "s.zarr"), loopback).test_client()
    assert client.get("/index.html").status_code == 200  # the test client's Host: localhost
    for path in ("/index.html", "/api/store.json", "/thumb/0.jpg", "/static/view.js", "/nothing/here"):
        answer = client.get(path, headers={"Host": "evil.example:8050"})
        assert answer.status_code == 403, path
        said = answer.get_data(as_text=True).strip()
        assert "\n" not in said and "not for host 'evil.example'" in said and "DNS rebinding" in said, said


def test_a_port_out_of_range_or_in_use_is_one_line_saying_which(image_dir: Path, tmp_path: Path):
    """issue 54: --port 99999 listened on another port, --port -1 was a traceback, a port in use printed Werkzeug's
    lines and exited; serve() now refuses each in one line naming the port."""
    import socket

    from helpers.processes import cli

    from extractor.errors import ExtractorError
    from extractor.view import serve

    for port in ("99999", "-1", "http"):
        r = cli("view", str(tmp_path / "none.zarr"), "--port", port)
        assert r.returncode == 2 and f"argument --port: a port is a number from 1 to 65535 (0: any free one), not " \
            f"{port}" in r.stderr, r.stderr
    with pytest.raises(ValueError, match=r"port must be a number from 1 to 65535 .0: any free one., not 70000"):
        serve(str(tmp_path / "none.zarr"), port=70000)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ExtractorError, match=rf"^port {port} of 127.0.0.1 is in use by another program: pick "
                                                 r"another with --port \(--port 0: any free one\)$"):
            serve(str(tmp_path / "none.zarr"), port=port)


# ---------------------------------------------------------------------------------------------- the atlas (issue 59)
@pytest.mark.slow  # a server and a browser
def test_the_map_draws_one_point_per_feature_zooms_and_links_each_to_its_page(server: str, tab: Page,
                                                                             store_path: Path):
    from extractor.index import open_index

    ix = open_index(str(store_path), SAE)
    tab.open(server + f"index/{SAE}.html")
    tab.page.click("a.map-link")
    tab.page.wait_for_selector("body[data-ready=true]", state="attached")
    assert tab.page.url.endswith(f"index/{SAE}/map.html")
    canvas = tab.page.locator("#atlas-map")
    assert int(canvas.get_attribute("data-points") or -1) == ix.features == 48
    assert int(canvas.get_attribute("data-shown") or -1) == 48  # the whole map fits at first
    shot(tab, "map")
    xy = ix.map.astype(np.float64)
    gaps = np.linalg.norm(xy[:, None] - xy[None], axis=2) + np.eye(len(xy)) * 1e9
    f = int(np.argmax(gaps.min(axis=1)))  # the loneliest point: a click there is it, not a neighbour
    x, y = tab.page.evaluate(f"atlasMap.screen({f})")
    scale = float(canvas.get_attribute("data-scale") or 0)
    tab.page.mouse.move(x, y)
    tab.page.mouse.wheel(0, -300)  # zoom in about the cursor: the point under it stays there
    tab.page.wait_for_function(f"Number(document.getElementById('atlas-map').dataset.scale) > {scale * 1.5}")
    x2, y2 = tab.page.evaluate(f"atlasMap.screen({f})")
    assert abs(x2 - x) < 1.5 and abs(y2 - y) < 1.5
    assert f"feature {f}:" in tab.page.inner_text("#atlas-hover")
    tab.page.mouse.click(x2, y2)
    tab.page.wait_for_url(f"**/index/{SAE}/{f}.html")
    tab.page.wait_for_selector("body[data-ready=true]", state="attached")
    assert not tab.errors


@pytest.mark.slow  # a server and a browser
def test_a_feature_page_lists_its_neighbours_by_each_measure(server: str, tab: Page, store_path: Path):
    from extractor.index import open_index

    ix = open_index(str(store_path), SAE)
    f = 5
    tab.open(server + f"index/{SAE}/{f}.html")
    for measure, near in ix.neighbours(f).items():
        listed = tab.page.locator(f'section.measure[data-measure="{measure}"] li')
        assert [int(v) for v in listed.evaluate_all("ls => ls.map(l => l.dataset.feature)")] == \
            near.features.tolist(), measure
    assert tab.page.locator("section.measure").count() == 3  # the dictionary has a decoder
    shot(tab, "feature_neighbours")
    tab.page.locator('section.measure[data-measure="decoder"] li a').first.click()
    tab.page.wait_for_selector("body[data-ready=true]", state="attached")
    assert tab.page.url.endswith(f"index/{SAE}/{int(ix.neighbours(f)['decoder'].features[0])}.html")
    assert not tab.errors


@pytest.mark.slow  # a server and a browser
def test_an_image_page_shows_the_stored_images_nearest_it_by_hand(server: str, tab: Page, store_path: Path):
    """Search by image: the rows whose pooled layer3 (mean over positions) has the highest cosine with row 2's,
    by hand."""
    x = maps(store_path)
    pooled = x.reshape(len(x), x.shape[1], -1).mean(axis=2)
    unit = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
    cos = unit @ unit[2]
    cos[2] = -np.inf
    want = np.lexsort((np.arange(len(cos)), -cos))[:8]
    tab.open(server + "image/2.html")
    shown = tab.page.locator("section.similar figure.pic")
    assert [int(r) for r in shown.evaluate_all("fs => fs.map(f => f.dataset.row)")] == want.tolist()
    np.testing.assert_allclose([float(v) for v in tab.page.locator("section.similar .value").all_inner_texts()],
                               cos[want], rtol=1e-3)
    assert not tab.errors


def _strongest_by_hand(values: np.ndarray, n: int = 12) -> list[int]:
    """The ``n`` features of highest value above 0 over a row's positions, highest first (ties: the lower)."""
    top = values.max(axis=0)
    return [int(f) for f in np.lexsort((np.arange(len(top)), -top))[:n] if top[f] > 0]


@pytest.mark.slow  # a server, a browser and the store's model
def test_running_an_image_of_the_store_shows_its_rows_features_and_switching_one_off(server: str, tab: Page,
                                                                                    store_path: Path):
    """'Run this image' on an image the store holds (row 2): the page lists the features of the store's own row (the
    index's encoding of it, by hand from numpy), each beside its stored top rows; switching the first off shows the
    model's top classes as the same edit gives them by hand."""
    from extractor.index import open_index
    from extractor.live import Live
    from extractor.read import open_store

    s = open_store(str(store_path))
    ix = open_index(s, SAE)
    tab.open(server + "image/2.html")
    tab.page.click("p.run-link a")
    tab.page.wait_for_selector("body[data-ready=true]", state="attached")
    tab.page.set_input_files("#run-file", str(s.paths[2]))
    tab.page.wait_for_selector("body[data-run]", state="attached", timeout=120_000)
    assert tab.page.get_attribute("body", "data-run") != "failed", tab.page.inner_text("#run-status")
    section = tab.page.locator(f'section.run-index[data-slug="{SAE}"]')
    items = section.locator("ol.run-features > li")
    listed = [int(f) for f in items.evaluate_all("ls => ls.map(l => l.dataset.feature)")]
    by_hand = _strongest_by_hand(ix.encode_row(2))
    assert listed == by_hand[:8]  # the page shows 8
    first = section.locator("ol.run-features > li").first
    stored = [int(r) for r in first.locator("figure.pic").evaluate_all("fs => fs.map(f => f.dataset.row)")]
    assert stored == ix.top(listed[0]).rows.tolist()
    shot(tab, "run")
    first.locator("button.switch").click()
    tab.page.wait_for_selector(f'body[data-switched="{SAE}/{listed[0]}"]', state="attached", timeout=60_000)
    live = Live(s, device="cpu")  # the same edit, made again here
    try:
        ran = live.run(Path(s.paths[2]).read_bytes())
        after = live.switched_off(ran, ix, listed[0])
    finally:
        live.close()
    p = np.exp(after - after.max())
    p /= p.sum()
    want = np.lexsort((np.arange(len(p)), -p))[:5]
    rows = tab.page.locator("#run-after tbody tr")
    assert [int(c) for c in rows.evaluate_all("rs => rs.map(r => r.dataset.class)")] == want.tolist()
    shown = [float(t.rstrip("%")) / 100 for t in rows.locator("td:nth-child(3)").all_inner_texts()]
    np.testing.assert_allclose(shown, p[want], rtol=5e-3)  # shown to 3 digits
    shot(tab, "run_switched")
    assert not tab.errors


@pytest.mark.slow  # a server
def test_the_one_request_that_is_not_a_get_takes_an_image_only_from_the_page(server: str, store_path: Path):
    """The image is posted with the viewer's own header (a form elsewhere cannot send it), bounded in size; every
    other path still answers GET only; nothing of the run is written into the store."""
    import urllib.error
    import urllib.request

    from extractor.read import open_store

    def post(path: str, data: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        request = urllib.request.Request(server + path, data=data, method="POST", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=120) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    image = Path(open_store(str(store_path)).paths[0]).read_bytes()
    before = sorted((p.relative_to(store_path), p.stat().st_mtime_ns) for p in store_path.rglob("*") if p.is_file())
    code, said = post("api/run", image, {"Content-Type": "text/plain"})
    assert code == 403 and b"X-Extractor-Run" in said
    code, said = post("api/run", b"\0" * (17 << 20), {"X-Extractor-Run": "1"})
    assert code == 413 and b"at most 16,777,216 bytes" in said
    code, said = post("api/run", b"not an image", {"X-Extractor-Run": "1"})
    assert code == 400 and b"not an image this reads" in said
    code, said = post("api/run", image, {"X-Extractor-Run": "1", "Content-Type": "application/octet-stream"})
    assert code == 200
    for path in ("index.html", "run.html", f"api/index/{SAE}/text.json"):
        assert post(path, image, {"X-Extractor-Run": "1"})[0] == 405, path
    after = sorted((p.relative_to(store_path), p.stat().st_mtime_ns) for p in store_path.rglob("*") if p.is_file())
    assert after == before  # nothing written into the store


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, dict[str, np.ndarray]]:
    """A random-weight open_clip CLIP (seeded as extractor builds it) over 8 images: its image embedding ((model))
    and a block's tokens; an index of the tokens, and one of an SAE over the embedding."""
    pytest.importorskip("open_clip")
    import extractor
    import extractor.index

    tmp = tmp_path_factory.mktemp("clip")
    make_images(tmp / "imgs", per_class=4, size=72)
    raw = job(tmp / "imgs", tmp / "c.zarr",
              model={"name": "open_clip:ViT-S-32", "device": "cpu", "kwargs": {"force_image_size": 64}},
              data={"resize": "auto", "crop": "auto", "preprocess": "auto"},
              capture=[{"layer": "(model)", "key": "embedding"},
                       {"layer": "transformer.resblocks.1", "reduce": "none", "key": "tokens"}])
    s = extractor.run(raw, progress=False)
    rng = np.random.default_rng(0)
    d = int(s["embedding"].shape[1])
    sae = {"W_enc": rng.standard_normal((d, 16)).astype(np.float32), "b_enc": np.zeros(16, np.float32),
           "W_dec": rng.standard_normal((16, d)).astype(np.float32)}
    np.savez(tmp / "sae.npz", **sae)
    extractor.index.index(s, "tokens", k=3, atlas=False)
    extractor.index.index(s, "embedding", dictionary=tmp / "sae.npz", k=3, atlas=False)
    return s, tmp, sae


def _phrase_by_hand(text: str) -> np.ndarray:
    """The phrase's unit embedding by the CLIP's text tower, built by hand as extractor builds the image tower."""
    import open_clip
    import torch

    torch.manual_seed(0)
    model = open_clip.create_model("ViT-S-32", force_image_size=64).eval()
    with torch.inference_mode():
        v = model.encode_text(open_clip.get_tokenizer("ViT-S-32")([text]))[0].numpy().astype(np.float64)
    return v / np.linalg.norm(v)


def _ranked_by_hand(s: Any, phrase: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The index of tokens' features by the mean cosine of ``phrase`` with their top rows' stored embeddings."""
    from extractor.index import open_index

    e = s.numpy("embedding", rows=np.arange(len(s)), only_ok=False).astype(np.float64)
    e = e / np.linalg.norm(e, axis=1, keepdims=True)
    top = np.asarray(open_index(s, "tokens").arrays["top_rows"][:])
    scores = np.array([np.mean([e[r] @ phrase for r in sorted(rows) if r >= 0]) for rows in top])  # in row order
    best = np.lexsort((np.arange(len(scores)), -scores))[:n]
    return best, scores[best]


def test_a_phrase_ranks_features_by_the_score_computed_by_hand(clip):
    """Search by text on a random-weight CLIP: the phrase by the text tower built by hand, each feature's score the
    mean cosine with its top rows' stored image embeddings, highest first; an SAE over the embedding itself is
    matched by its decoder directions."""
    from extractor.index import open_index
    from extractor.live import TextSearch

    s, _, sae = clip
    search = TextSearch(s)
    assert search.joint == "embedding"
    phrase = _phrase_by_hand("a photo of a dog")
    found = search.features(open_index(s, "tokens"), "a photo of a dog", n=10)
    want, scores = _ranked_by_hand(s, phrase, 10)
    assert found.how == "top rows" and found.features.tolist() == want.tolist()
    np.testing.assert_allclose(found.scores, scores, rtol=1e-4, atol=1e-6)
    found = search.features(open_index(s, "embedding@sae"), "a photo of a dog", n=16)
    w = sae["W_dec"].astype(np.float64)
    cos = (w @ phrase) / np.linalg.norm(w, axis=1)
    assert found.how == "decoder" and found.features.tolist() == np.lexsort((np.arange(16), -cos)).tolist()
    np.testing.assert_allclose(found.scores, np.sort(cos)[::-1], rtol=1e-5)


@pytest.mark.slow  # a server, a browser and a CLIP
def test_a_phrase_finds_features_through_a_clip_text_tower_in_the_page(clip, tab: Page):
    """Search by text in the page: the features listed are those ranked by the score computed by hand."""
    s, _, _ = clip
    want, _ = _ranked_by_hand(s, _phrase_by_hand("a red bicycle"), 20)
    with serving(s) as url:
        tab.open(url + "index/tokens.html")
        tab.page.fill("#text-query", "a red bicycle")
        tab.page.click("#text-search button")
        tab.page.wait_for_selector('#text-features[data-query="a red bicycle"]', state="attached", timeout=120_000)
        listed = tab.page.locator("#text-features li").evaluate_all("ls => ls.map(l => l.dataset.feature)")
        assert [int(f) for f in listed] == want.tolist()
        assert "image embeddings (embedding)" in tab.page.inner_text("#text-said")
        shot(tab, "text_search")
        assert not tab.errors


@contextlib.contextmanager
def serving(store: Any) -> Iterator[str]:
    """The app over ``store`` on a free loopback port, in a thread, while the block runs: its base URL."""
    from werkzeug.serving import make_server

    from extractor.view import create_app

    srv = make_server("127.0.0.1", 0, create_app(store), threaded=True)
    thread = threading.Thread(target=srv.serve_forever, name="view-test-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_port}/"
    finally:
        srv.shutdown()
        thread.join(10)
