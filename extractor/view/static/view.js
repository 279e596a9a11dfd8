// The viewer's pages: heatmaps drawn from the values in the page, the sortable features table, the patch explorer
// and the exported site's search. Plain JavaScript, no library; the data of each page is in #page-data.
"use strict";

const PAGE = JSON.parse(document.getElementById("page-data").textContent);
const MODE = document.body.dataset.mode;
const ROOT = document.body.dataset.root;

// A value in [0, 1] as a colour: transparent and dark red at 0 to opaque yellow at 1 (alpha rises with the value,
// so the brightest patch is the highest one).
function heatColour(v) {
  const t = Math.min(Math.max(v, 0), 1);
  return [255, Math.round(40 + 215 * t), Math.round(60 * (1 - t)), Math.round(210 * t)];
}

function drawHeat(canvas, heat) {
  const [h, w] = heat.grid;
  canvas.width = w;
  canvas.height = h;
  const ctx = canvas.getContext("2d");
  const img = ctx.createImageData(w, h);
  const scale = heat.scale > 0 ? heat.scale : 1;
  heat.values.forEach((v, i) => {
    const c = heatColour((v === null ? 0 : v) / scale);
    img.data.set(c, 4 * i);
  });
  ctx.putImageData(img, 0, 0);
}

function drawHeats() {
  document.querySelectorAll("figure.pic[data-heat]").forEach((fig) => {
    const canvas = fig.querySelector("canvas.heat");
    if (canvas) drawHeat(canvas, JSON.parse(fig.dataset.heat));
  });
}

function link(path) {
  return ROOT === "." ? path : ROOT + "/" + path;
}

// ---------------------------------------------------------------- the features table
function featuresTable() {
  const table = document.getElementById("feature-table");
  if (!table) return;
  const cols = PAGE.table;
  const n = cols.density.length;
  const body = table.querySelector("tbody");
  const filter = document.getElementById("feature-filter");
  const more = document.getElementById("feature-more");
  const count = document.getElementById("feature-count");
  let order = Array.from({ length: n }, (_, i) => i);
  let sortKey = "feature";
  let descending = false;
  let shown = 100;

  function value(key, f) {
    return key === "feature" ? f : (cols[key][f] === null ? -Infinity : cols[key][f]);
  }
  function fmt(v, percent) {
    if (v === null) return "–";
    return percent ? (100 * v).toPrecision(3) + "%" : Number(v).toPrecision(4);
  }
  function render() {
    const q = filter.value.trim();
    const rows = q ? order.filter((f) => String(f).startsWith(q)) : order;
    body.replaceChildren(...rows.slice(0, shown).map((f) => {
      const tr = document.createElement("tr");
      tr.dataset.feature = f;
      const a = document.createElement("a");
      a.href = link("index/" + PAGE.index.slug + "/" + f + ".html");
      a.textContent = f;
      const first = document.createElement("td");
      first.append(a);
      tr.append(first);
      [["density", true], ["density_rows", true], ["mean_active", false], ["max_value", false]].forEach(([k, p]) => {
        const td = document.createElement("td");
        td.textContent = fmt(cols[k][f], p);
        tr.append(td);
      });
      return tr;
    }));
    count.textContent = rows.length + " of " + n + " features" + (rows.length > shown ? ", the first " + shown + " shown" : "");
    more.hidden = rows.length <= shown;
  }
  table.querySelectorAll("th[data-sort]").forEach((th) => {
    th.addEventListener("click", () => {
      const key = th.dataset.sort;
      descending = key === sortKey ? !descending : key !== "feature";
      sortKey = key;
      order.sort((a, b) => (descending ? value(key, b) - value(key, a) : value(key, a) - value(key, b)) || a - b);
      table.querySelectorAll("th").forEach((x) => x.removeAttribute("aria-sort"));
      th.setAttribute("aria-sort", descending ? "descending" : "ascending");
      render();
    });
  });
  filter.addEventListener("input", render);
  more.addEventListener("click", () => { shown += 500; render(); });
  render();
}

// ---------------------------------------------------------------- the patch explorer of an image page
function showPatch(section, canvas, token, result) {
  const [h, w] = canvas.dataset.grid.split(",").map(Number);
  const title = section.querySelector(".patch-title");
  const list = section.querySelector("ol.patch-features");
  const [y, x] = [Math.floor(token / w), token % w];
  title.textContent = "Patch " + token + " (row " + y + ", column " + x + ")";
  list.dataset.patch = token;
  list.replaceChildren(...result.map((r) => {
    const li = document.createElement("li");
    li.dataset.feature = r.feature;
    const a = document.createElement("a");
    a.href = link(r.page);
    a.textContent = "feature " + r.feature;
    const v = document.createElement("span");
    v.className = "value";
    v.textContent = Number(r.value).toPrecision(4);
    li.append(a, " ", v);
    return li;
  }));
  if (!result.length) list.replaceChildren(Object.assign(document.createElement("li"), { textContent: "no feature fires here" }));
  canvas.dataset.token = token;
  paintPatches(canvas, null);
  section.dataset.ready = "true";
}

// The explorer's canvas: a feature's values over the patches (while its name is pointed at), the patch grid, the
// chosen patch outlined.
function paintPatches(canvas, values) {
  const [h, w] = canvas.dataset.grid.split(",").map(Number);
  const ctx = canvas.getContext("2d");
  const cell = canvas.width / w;
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  if (values) {
    const scale = Math.max(...values.map((v) => v || 0)) || 1;
    values.forEach((v, i) => {
      const [r, g, b, a] = heatColour((v || 0) / scale);
      ctx.fillStyle = `rgba(${r},${g},${b},${a / 255})`;
      ctx.fillRect((i % w) * cell, Math.floor(i / w) * cell, cell, cell);
    });
  }
  ctx.lineWidth = 1;
  ctx.strokeStyle = "rgba(255,255,255,0.25)";
  for (let i = 1; i < w; i++) { ctx.beginPath(); ctx.moveTo(i * cell, 0); ctx.lineTo(i * cell, canvas.height); ctx.stroke(); }
  for (let j = 1; j < h; j++) { ctx.beginPath(); ctx.moveTo(0, j * cell); ctx.lineTo(canvas.width, j * cell); ctx.stroke(); }
  if (canvas.dataset.token !== undefined) {
    const token = Number(canvas.dataset.token);
    ctx.lineWidth = 3;
    ctx.strokeStyle = "#ffd400";
    ctx.strokeRect((token % w) * cell + 1.5, Math.floor(token / w) * cell + 1.5, cell - 3, cell - 3);
  }
}

function patchExplorer() {
  document.querySelectorAll("canvas.patch-grid").forEach((canvas) => {
    const [h, w] = canvas.dataset.grid.split(",").map(Number);
    const cell = Math.max(8, Math.round(224 / w));
    canvas.width = w * cell;
    canvas.height = h * cell;
    const section = canvas.closest("section.index");
    const slug = canvas.dataset.slug;
    const here = PAGE.indexes.find((ix) => ix.slug === slug);
    paintPatches(canvas, null);
    section.querySelectorAll(".top-features li[data-feature]").forEach((li, n) => {
      li.addEventListener("mouseenter", () => paintPatches(canvas, here.top[n].values));
      li.addEventListener("mouseleave", () => paintPatches(canvas, null));
    });
    canvas.addEventListener("click", (event) => {
      const box = canvas.getBoundingClientRect();
      const x = Math.min(w - 1, Math.floor(((event.clientX - box.left) / box.width) * w));
      const y = Math.min(h - 1, Math.floor(((event.clientY - box.top) / box.height) * h));
      const token = y * w + x;
      section.dataset.ready = "false";
      if (here.patches) {
        const listed = here.patches[token].map(([feature, value]) =>
          ({ feature, value, page: "index/" + slug + "/" + feature + ".html" }));
        showPatch(section, canvas, token, listed);
      } else {
        const url = link("api/index/" + slug + "/patch/" + PAGE.picture.row + "/" + token + ".json");
        fetch(url).then((r) => r.json()).then((r) => showPatch(section, canvas, token, r.features));
      }
    });
  });
}

// ---------------------------------------------------------------- the exported site's search (no server to ask)
function exportedSearch() {
  if (!PAGE.rows) return;
  const q = (new URLSearchParams(location.search).get("q") || "").trim();
  const input = document.querySelector("main form input[name=q]");
  if (input) input.value = q;
  if (!q) return;
  const low = q.toLowerCase();
  const hits = PAGE.rows.filter(([row, id, name]) => id === q || String(row) === q ||
    id.toLowerCase().includes(low) || name.toLowerCase().includes(low));
  document.querySelector(".search-count").textContent = hits.length + " images match " + q +
    (hits.length > 50 ? " (the first 50 shown)" : "") + ".";
  document.querySelector("ol.hits").replaceChildren(...hits.slice(0, 50).map(([row, id]) => {
    const li = document.createElement("li");
    const a = document.createElement("a");
    a.href = link("image/" + row + ".html");
    a.textContent = id;
    li.append(a);
    return li;
  }));
}

// ---------------------------------------------------------------- an index's map: a zoomable scatter of its features
const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];

function viridis(t) {
  const u = Math.min(Math.max(t, 0), 1) * (VIRIDIS.length - 1);
  const i = Math.min(Math.floor(u), VIRIDIS.length - 2);
  const f = u - i;
  return VIRIDIS[i].map((c, k) => Math.round(c + f * (VIRIDIS[i + 1][k] - c)));
}

function atlasMap() {
  const canvas = document.getElementById("atlas-map");
  if (!canvas || !PAGE.map) return;
  const m = PAGE.map;
  const n = m.x.length;
  const ctx = canvas.getContext("2d");
  const W = canvas.width, H = canvas.height;
  const logs = m.density.map((d) => (d === null || d <= 0 ? null : Math.log10(d)));
  const alive = logs.filter((v) => v !== null);
  const lo = alive.length ? Math.min(...alive) : 0, hi = alive.length ? Math.max(...alive) : 1;
  const colours = logs.map((v) => (v === null ? "rgba(150,150,150,0.6)" :
    "rgb(" + viridis(hi > lo ? (v - lo) / (hi - lo) : 1).join(",") + ")"));
  const xs = m.x.map((v) => v || 0), ys = m.y.map((v) => v || 0);
  const view = { cx: 0, cy: 0, scale: 1 };
  function fit() {
    const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
    view.cx = (x0 + x1) / 2;
    view.cy = (y0 + y1) / 2;
    view.scale = 0.9 * Math.min(W / Math.max(x1 - x0, 1e-9), H / Math.max(y1 - y0, 1e-9));
  }
  const sx = (f) => (xs[f] - view.cx) * view.scale + W / 2;
  const sy = (f) => H / 2 - (ys[f] - view.cy) * view.scale;
  const radius = n > 5000 ? 2 : n > 500 ? 3 : 5;
  function draw() {
    ctx.clearRect(0, 0, W, H);
    let shown = 0;
    for (let f = 0; f < n; f++) {
      const x = sx(f), y = sy(f);
      if (x < -radius || y < -radius || x > W + radius || y > H + radius) continue;
      ctx.fillStyle = colours[f];
      ctx.beginPath();
      ctx.arc(x, y, radius, 0, 2 * Math.PI);
      ctx.fill();
      shown++;
    }
    canvas.dataset.points = n;
    canvas.dataset.shown = shown;
    canvas.dataset.scale = view.scale;
  }
  // canvas pixels of a mouse event (the canvas may be drawn smaller than its pixels)
  function at(event) {
    const box = canvas.getBoundingClientRect();
    return [(event.clientX - box.left) * W / box.width, (event.clientY - box.top) * H / box.height];
  }
  function nearest(px, py) {
    let best = -1, dist = (radius + 5) ** 2;
    for (let f = 0; f < n; f++) {
      const d = (sx(f) - px) ** 2 + (sy(f) - py) ** 2;
      if (d < dist) { dist = d; best = f; }
    }
    return best;
  }
  const linked = (f) => m.written === undefined || f < m.written;
  const hover = document.getElementById("atlas-hover");
  let drag = null;
  canvas.addEventListener("wheel", (event) => {
    event.preventDefault();
    const [px, py] = at(event);
    const wx = (px - W / 2) / view.scale + view.cx, wy = view.cy - (py - H / 2) / view.scale;
    view.scale *= Math.pow(1.2, -event.deltaY / 100);
    view.cx = wx - (px - W / 2) / view.scale;  // the point under the cursor stays under it
    view.cy = wy + (py - H / 2) / view.scale;
    draw();
  }, { passive: false });
  canvas.addEventListener("pointerdown", (event) => { drag = { at: at(event), moved: 0 }; });
  canvas.addEventListener("pointermove", (event) => {
    const [px, py] = at(event);
    if (drag) {
      view.cx -= (px - drag.at[0]) / view.scale;
      view.cy += (py - drag.at[1]) / view.scale;
      drag.moved += Math.abs(px - drag.at[0]) + Math.abs(py - drag.at[1]);
      drag.at = [px, py];
      draw();
      return;
    }
    const f = nearest(px, py);
    canvas.style.cursor = f >= 0 && linked(f) ? "pointer" : "crosshair";
    hover.textContent = f >= 0 ? "feature " + f + ": density " +
      (m.density[f] === null ? "–" : (100 * m.density[f]).toPrecision(3) + "%") : "Point at a feature.";
  });
  canvas.addEventListener("pointerup", (event) => {
    const click = drag && drag.moved < 4;
    drag = null;
    if (!click) return;
    const f = nearest(...at(event));
    if (f >= 0 && linked(f)) location.href = link(m.feature.replace(/F\.html$/, f + ".html"));
  });
  document.getElementById("atlas-reset").addEventListener("click", () => { fit(); draw(); });
  // for tests and for pointing: where feature f is drawn, in the page's pixels
  window.atlasMap = {
    view, nearest,
    screen(f) {
      const box = canvas.getBoundingClientRect();
      return [box.left + sx(f) * box.width / W, box.top + sy(f) * box.height / H];
    },
  };
  fit();
  draw();
}

// ---------------------------------------------------------------- run an image (the local app only)
function el(tag, props, ...children) {
  const e = Object.assign(document.createElement(tag), props || {});
  e.append(...children);
  return e;
}

function pictureOf(p) {
  const fig = el("figure", { className: "pic" });
  fig.dataset.row = p.row;
  if (p.gone) fig.append(el("div", { className: "gone", textContent: "image not available: " + p.gone }));
  else fig.append(el("a", { href: link(p.page), className: "frame" }, el("img", { src: link(p.thumb), alt: p.id })));
  fig.append(el("figcaption", {}, el("a", { href: link(p.page), textContent: p.id }), el("br"),
    p.label + (p.value === null ? "" : " · "), el("span", { className: "value", textContent: p.value === null ? "" : Number(p.value).toPrecision(4) })));
  return fig;
}

function getJSON(url) {
  return fetch(url).then((r) => r.json().then((body) => {
    if (!r.ok) throw new Error(body.error || body.reason || r.statusText);
    return body;
  }));
}

function showClasses(list, classes) {
  list.replaceChildren(...(classes || []).map((c) => {
    const li = el("li", {}, c.name + " ", el("span", { className: "value", textContent: (100 * c.p).toPrecision(3) + "%" }));
    li.dataset.class = c.class;
    return li;
  }));
  if (!classes) list.replaceChildren(el("li", { textContent: "the model's output is no vector of class scores" }));
}

function switchOff(run, slug, feature) {
  const box = document.getElementById("run-switched");
  box.hidden = true;
  getJSON(link("api/run/" + run + "/off/" + slug + "/" + feature + ".json")).then((r) => {
    document.getElementById("run-switched-title").textContent = "With feature " + feature + " of " + slug + " switched off";
    const body = document.querySelector("#run-after tbody");
    body.replaceChildren(...(r.after || []).map((c) => {
      const tr = el("tr", {}, el("td", { textContent: c.name }), el("td", { className: "value", textContent: (100 * c.before).toPrecision(3) + "%" }),
        el("td", { className: "value", textContent: (100 * c.p).toPrecision(3) + "%" }));
      tr.dataset.class = c.class;
      return tr;
    }));
    box.hidden = false;
    box.dataset.feature = feature;
    box.dataset.slug = slug;
    document.body.dataset.switched = slug + "/" + feature;
  }).catch((e) => { document.getElementById("run-status").textContent = e.message; });
}

function showRun(r) {
  document.getElementById("run-picture").src = r.picture || "";
  showClasses(document.getElementById("run-classes"), r.classes);
  document.getElementById("run-indexes").replaceChildren(...r.indexes.map((ix) => {
    const section = el("section", { className: "index run-index" }, el("h2", { textContent: "Features of " + ix.name }));
    section.dataset.slug = ix.slug;
    const list = el("ol", { className: "run-features" });
    ix.top.forEach((t) => {
      const button = el("button", { type: "button", textContent: "switch off", className: "switch" });
      button.addEventListener("click", () => switchOff(r.id, ix.slug, t.feature));
      const li = el("li", {}, el("a", { href: link(t.page), textContent: "feature " + t.feature }), " ",
        el("span", { className: "value", textContent: Number(t.value).toPrecision(4) }), " ", button,
        el("div", { className: "grid small" }, ...t.stored.map(pictureOf)));
      li.dataset.feature = t.feature;
      list.append(li);
    });
    if (!ix.top.length) list.append(el("li", { textContent: "no feature fires on this image" }));
    section.append(el("p", { className: "hint", textContent: "Its strongest features, each beside the stored images where it is highest." }), list);
    return section;
  }));
  const near = document.getElementById("run-nearest");
  near.hidden = !r.nearest;
  if (r.nearest) {
    document.getElementById("run-nearest-said").textContent = "By " + r.nearest.pooled + " (cosine).";
    near.querySelector(".grid").replaceChildren(...r.nearest.pictures.map(pictureOf));
  }
  document.getElementById("run-result").hidden = false;
  document.body.dataset.run = r.id;
}

function runPage() {
  const input = document.getElementById("run-file");
  if (!input) return;
  const status = document.getElementById("run-status");
  input.addEventListener("change", () => {
    const file = input.files[0];
    if (!file) return;
    status.textContent = "running " + file.name + " (the first run builds the model)…";
    delete document.body.dataset.run;
    file.arrayBuffer().then((bytes) => fetch(link("api/run"), {
      method: "POST", body: bytes, headers: { "Content-Type": "application/octet-stream", "X-Extractor-Run": "1" },
    })).then((r) => r.json().then((body) => { if (!r.ok) throw new Error(body.error); return body; }))
      .then((made) => getJSON(link("api/run/" + made.id + ".json")))
      .then((r) => { status.textContent = ""; showRun(r); })
      .catch((e) => { status.textContent = e.message; document.body.dataset.run = "failed"; });
  });
}

// ---------------------------------------------------------------- features by text (the local app only)
function textSearch() {
  const form = document.getElementById("text-search");
  if (!form) return;
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const q = document.getElementById("text-query").value;
    const said = document.getElementById("text-said");
    const list = document.getElementById("text-features");
    getJSON(link("api/index/" + form.dataset.slug + "/text.json") + "?q=" + encodeURIComponent(q)).then((r) => {
      said.textContent = r.features.length ? "Scored by " + (r.how === "decoder" ?
        "the cosine of the phrase with each latent's decoder direction" :
        "the mean cosine of the phrase with the image embeddings (" + r.joint + ") of each feature's top rows") + ":" : "";
      list.replaceChildren(...r.features.map((f) => {
        const li = el("li", {}, el("a", { href: link(f.page), textContent: "feature " + f.feature }), " ",
          el("span", { className: "value", textContent: Number(f.score).toPrecision(4) }));
        li.dataset.feature = f.feature;
        return li;
      }));
      list.dataset.query = q;
    }).catch((e) => { said.textContent = e.message; list.replaceChildren(); list.dataset.query = q; });
  });
}

drawHeats();
featuresTable();
runPage();
textSearch();
patchExplorer();
exportedSearch();
atlasMap();
document.body.dataset.ready = "true";
