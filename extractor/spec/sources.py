"""What each data source reads from the spec, declared once: the settings that locate its images and the other
settings only it reads. The schema checks a data section against it; the store compares, and the API and CLI
name, the places it lists; :mod:`extractor.data.sources` holds one module per source, registered by these names.
Adding a source: its entry here and its module there."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PLACES", "SOURCE_ONLY", "SOURCE_SETTINGS", "SourceSettings"]


@dataclass(frozen=True)
class SourceSettings:
    """A data source's settings in ``data``."""

    places: tuple[str, ...]  # the settings that locate its images, the first the one to check when none is found
    needs: str  # what the spec's error says it needs when none of them is set
    paths: tuple[str, ...] = ()  # those of ``places`` that name files or folders (one path, or a list of them)
    only: tuple[str, ...] = ()  # settings only this source reads: another source's spec refuses them
    columns: bool = False  # it reads ``data.columns`` (a table's column names)


SOURCE_SETTINGS: dict[str, SourceSettings] = {
    "folder": SourceSettings(("root",), "data.root (the image folder)", paths=("root",)),
    "manifest": SourceSettings(("manifest",), "data.manifest (a .csv or .jsonl file)", paths=("manifest",),
                               columns=True),
    "tar": SourceSettings(("tars",), "data.tars (tar paths or URLs, brace patterns and globs allowed)",
                          paths=("tars",)),
    "parquet": SourceSettings(("parquet", "dataset"), "data.parquet (Parquet paths or URLs, globs and brace patterns "
                              "allowed) or data.dataset (a Hugging Face data set in the local cache: ORG/NAME)",
                              paths=("parquet",), only=("dataset",), columns=True),
}

# every setting that names the images' files or folders (``data.root`` also the base of a manifest's paths)
PLACES: tuple[str, ...] = tuple(dict.fromkeys(p for s in SOURCE_SETTINGS.values() for p in s.paths))
# the settings that say which images, as any source reads them: where they are, not what they become
SOURCE_ONLY: tuple[str, ...] = tuple(dict.fromkeys(p for s in SOURCE_SETTINGS.values() for p in (*s.places, *s.only)))
