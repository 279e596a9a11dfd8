"""The package's floor plan, kept: each sub-package imports only the layers below it, the read side and the
layers under it import with torch and Ray missing, only the driver names Ray, and each face serves its names."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "extractor"
TOP = {"cli"}  # the top floor's sub-packages: they may import every layer
# the ground floor: every layer may use them
BASE = {"errors", "faults", "_text", "_face", "_threads", "_machine", "_version"}
# each sub-package and the sub-packages it may import (the layers below it)
LAYERS = {
    "spec": set(),
    "data": {"spec"},
    "store": {"data", "spec"},
    "model": {"spec", "data", "store"},  # store.sampling: the draws a store records, made alike on the device
    "compute": {"spec", "data", "model", "store", "index"},
    "driver": {"spec", "data", "model", "compute", "store", "index"},  # index: the job's write-time indexes
    "read": {"store", "data"},
    "index": {"spec", "data", "store", "read"},  # feature indexes: stores read through read's ActivationStore
    "live": {"spec", "data", "model", "compute", "store", "read", "index"},  # the store's model run on one image
    "view": {"read", "store", "data", "index", "live"},  # the top floor, beside api and cli: the viewer of a store
}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _imported(path: Path) -> set[str]:
    """The extractor sub-packages or top modules a module imports (also inside functions)."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    here = list(parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                target = [*base, *(node.module.split(".") if node.module else [])]
                names = [target] if node.module else [[*base, a.name] for a in node.names]
            elif node.module and node.module.startswith("extractor."):
                names = [node.module.split(".")[1:]]
            else:
                continue
            out |= {n[0] for n in names if n}
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("extractor.")}
    return out


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_each_layer_imports_only_the_layers_below_it(path: Path):
    parts = path.relative_to(PACKAGE).parts
    if len(parts) == 1 or parts[0] in TOP:  # api, cli/, demo: the top floor; errors, faults: the ground floor
        if path.stem in BASE:
            assert _imported(path) <= BASE, path
        return
    layer = parts[0]
    wrong = _imported(path) - LAYERS[layer] - BASE - {layer}
    assert not wrong, f"{path.relative_to(PACKAGE)} ({layer}) imports {sorted(wrong)}: a layer above it"


def test_the_read_side_and_the_layers_under_it_import_without_torch_or_ray():
    """Every module of read, index, store, data and spec imports with torch and Ray missing (but the index's device
    pass; and the read side and the store without pydantic or Pillow either: a store opens with numpy and zarr
    alone)."""
    code = (
        "import sys, importlib, pkgutil\n"
        "for name in ('torch', 'ray', 'torchvision'): sys.modules[name] = None\n"
        "import extractor\n"
        "for pkg in ('spec', 'data', 'store', 'read', 'index'):\n"
        "    p = importlib.import_module('extractor.' + pkg)\n"
        "    for m in pkgutil.iter_modules(p.__path__):\n"
        "        if m.name not in ('torch_views', 'device'):  # torch's view and the index's device pass: with torch\n"
        "            importlib.import_module(f'extractor.{pkg}.{m.name}')\n"
        "for name in ('pydantic', 'PIL'):\n"
        "    sys.modules[name] = None\n"
        "for name in [n for n in sys.modules if n.startswith(('extractor.', 'pydantic', 'PIL'))]:\n"
        "    del sys.modules[name]\n"
        "sys.modules['pydantic'] = sys.modules['PIL'] = None\n"
        "importlib.import_module('extractor.read.reader')\n"
        "for m in ('layout', 'recorded', 'writer', 'objects', 'ledger', 'claimants', 'generation', 'views',\n"
        "          'synthetic', 'chunks', 'dtypes', 'stats', 'reuse', 'sampling'):\n"
        "    importlib.import_module('extractor.store.' + m)\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


CORE = {"zarr", "numpy", "ml_dtypes", "fsspec", "pyyaml"}  # pyproject's dependencies: `pip install extractor`


def test_the_core_install_reads_a_store_and_each_command_that_needs_more_names_its_extra(tmp_path: Path):
    """`pip install extractor` is the reader (numpy, zarr, fsspec; zarr brings PyYAML): torch, Ray and every other
    library are extras. With all of them missing, a store opens, reads and is inspected; `extractor run` and
    `extractor.run` say in one line which extra to install."""
    import re

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!\[ ;]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    assert names == CORE, names
    extras = project["optional-dependencies"]
    assert any(d.startswith("torch") for d in extras["run"]) and any(d.startswith("ray") for d in extras["ray"])
    from extractor.data import Rows
    from extractor.store.layout import StoreArrays
    from extractor.store.synthetic import create_store

    url = str(tmp_path / "s.zarr")
    meta = {"shape": [3], "dtype": "float32", "dims": ["emb.feature"], "layer": "x", "what": "output",
            "reduce": "none"}
    g = create_store(url, Rows(ids=["a", "b"], paths=["", ""], labels=[0, 1]),
                     StoreArrays(captures={"emb": meta}, extras={}, shard_size=2, chunk_rows={"emb": 2}),
                     attrs={"n_rows": 2, "n_shards": 1, "captures": {"emb": meta}, "spec": {}, "model": {}})
    g["emb"][:] = [[1, 2, 3], [4, 5, 6]]
    g["status"][:] = 1
    code = (
        "import importlib.abc, sys\n"
        "EXTRAS = {'torch', 'torchvision', 'ray', 'PIL', 'pydantic', 'tqdm', 'xxhash', 'numba', 'pyarrow', 's3fs',\n"
        "          'flask', 'jinja2', 'timm', 'transformers', 'open_clip', 'xarray', 'dask', 'sklearn', 'matplotlib'}\n"
        "class Missing(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in EXTRAS:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Missing())\n"
        "import extractor\n"
        "from extractor.cli import main\n"
        f"print(extractor.open_store({url!r}).numpy('emb').sum())\n"
        f"assert main(['inspect', {url!r}]) == 0\n"
        "assert main(['run', 'job.yaml']) == 1\n"
        "try:\n"
        "    extractor.run\n"
        "except ModuleNotFoundError as err:\n"
        "    print(err)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "21.0" and "rows    2: 2 ok" in r.stdout
    assert "error: extractor run needs pydantic, which is not installed: pip install 'extractor[run]'" in r.stderr
    assert "extractor.run needs pydantic, which is not installed: pip install 'extractor[run]'" in r.stdout


def test_only_the_driver_names_ray():
    for path in _modules():
        if path.relative_to(PACKAGE).parts[0] == "driver":
            continue
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names] + [
            n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level
        ]
        assert not [n for n in names if n == "ray" or n.startswith("ray.")], path


def test_no_test_file_imports_another_or_conftest():
    """What tests share is in tests/helpers/ (a package): a test file imports neither conftest nor another test
    file, so each can move or be renamed alone."""
    tests = PACKAGE.parent / "tests"
    own = {p.stem for p in tests.rglob("test_*.py")} | {"conftest"}
    for path in sorted(tests.rglob("*.py")):
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names] + [
            n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level
        ]
        assert not [n for n in names if n.split(".")[0] in own], path


def test_zarrs_internals_are_imported_in_one_guarded_module():
    """zarr.core is no public API: one module imports what extractor needs of it (and says the version range when a
    zarr release moves it); s3fs is used through its public calls only (``pipe_file(..., mode="create")``)."""
    for path in _modules():
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names] + [
            n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level
        ]
        inside = [n for n in names if n.startswith("zarr.core")]
        assert not inside or path.name == "_zarr_internal.py", (path, inside)
        private = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in ("_call_s3", "_s3")]
        assert not private, (path, private)


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_each_face_serves_its_names_and_no_name_is_a_module_too(package: str):
    face = importlib.import_module(f"extractor.{package}")
    modules = {p.stem for p in (PACKAGE / package).glob("*.py")}
    assert not set(face.__all__) & modules  # an imported module would shadow the name
    for name in face.__all__:
        assert getattr(face, name) is not None
    with pytest.raises(AttributeError, match=r"has no attribute 'nope' \(its face: "):
        face.nope  # noqa: B018


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in _modules()}


def _face_names(path: Path) -> dict[str, str]:
    """A face's names and the modules (in its package) that hold them: its ``if TYPE_CHECKING:`` imports, as
    ``_face.face`` reads them (the package's own face: its ``_LAZY`` table)."""
    from extractor._face import listed

    names = {name: module for name, (module, _) in listed(path).items()}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["_LAZY"] and \
                isinstance(node.value, ast.Dict):
            names.update({k.value: v.value for k, v in zip(node.value.keys, node.value.values, strict=True)
                          if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)})
    return names


FACES = {name: _face_names(path) for name, path in MODULES.items() if path.name == "__init__.py"}


def _module_imports(path: Path) -> set[str]:
    """The package's modules a module imports, anywhere in it (top level, in functions, under TYPE_CHECKING):
    ``from . import x`` is module ``x`` where it is one; a name imported from a face is the module the face loads
    it from (``from ..data import read_bytes``: ``data.sources``)."""
    name = _module_name(path)
    package = (name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]) if name else []
    out: set[str] = set()

    def add(target: list[str], imported: str | None) -> None:
        dotted = ".".join([*target, imported] if imported else target)
        if dotted not in MODULES:
            dotted = ".".join(target)
            face = FACES.get(dotted, {})
            if imported in face:
                dotted = f"{dotted}.{face[imported]}" if dotted else face[imported]
        while dotted not in MODULES and "." in dotted:
            dotted = dotted.rsplit(".", 1)[0]
        if dotted in MODULES and dotted != name:
            out.add(dotted)

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                target = [*package[: len(package) - node.level + 1], *(node.module.split(".") if node.module else [])]
            elif node.module and (node.module == "extractor" or node.module.startswith("extractor.")):
                target = node.module.split(".")[1:]
            else:
                continue
            for a in node.names:
                add(target, a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("extractor."):
                    add(a.name.split(".")[1:], None)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules that import each other (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for group in groups:  # a path back to its first module, inside the group: the cycle to name
        start, members = group[0], set(group)
        paths = {start: [start]}
        todo = [start]
        while todo:
            v = todo.pop(0)
            for w in sorted(graph[v] & members):
                if w == start:
                    out.append([*paths[v], start])
                    todo = []
                    break
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    todo.append(w)
    return out


def test_no_module_imports_itself_through_others():
    """No import cycle anywhere in the package, lazy imports (in functions, under TYPE_CHECKING) included: each
    names how one module reaches itself again. A name taken from a face is an import of the module holding it."""
    graph = {name: _module_imports(path) for name, path in MODULES.items()}
    for face, names in FACES.items():  # a face loads its modules when a name is asked for, not at its own import
        graph[face] = {m for m in graph[face] if m.removeprefix(f"{face}.") not in set(names.values())}
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def _past_a_face(path: Path, source: str | None = None) -> list[str]:
    """The imports of ``path`` that reach into another sub-package's module (``from ..store.layout import X``)
    instead of importing from its face (``from ..store import X``), also inside functions."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    here = list(parts[:-1])
    targets: list[list[str]] = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here[: len(here) - node.level + 1]
            targets.append([*base, *(node.module.split(".") if node.module else [])])
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("extractor."):
            targets.append(node.module.split(".")[1:])
        elif isinstance(node, ast.Import):
            targets += [a.name.split(".")[1:] for a in node.names if a.name.startswith("extractor.")]
    own = here[0] if here else None
    return [".".join(t) for t in targets if len(t) >= 2 and t[0] != own and (PACKAGE / t[0]).is_dir()]


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_reaches_past_another_layers_face(path: Path):
    """Another layer is used through its face (its ``__init__``'s list): what is not on it is private to it."""
    past = _past_a_face(path)
    assert not past, f"{path.relative_to(PACKAGE)} imports {past}: import those names from the package's face"


def test_a_face_skipping_import_is_found():
    code = ("from ..store.layout import ROW_ARRAYS\nfrom ..store import Lease\nfrom . import runner\n"
            "from .schedule import IN_FLIGHT\nimport extractor.data.rows\n")
    assert _past_a_face(PACKAGE / "driver" / "x.py", code) == ["store.layout", "data.rows"]
