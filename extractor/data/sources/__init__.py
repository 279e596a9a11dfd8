"""The data sources, one module each: a folder (:mod:`.folder`), a manifest (:mod:`.manifest`), tar files
(:mod:`.tar`), Parquet or Arrow files (:mod:`.parquet`). :func:`~extractor.data.listing.list_rows` picks one by
``data.source``."""
