"""bfloat16 in Zarr: the ``bfloat16`` data type of zarr-extensions (as zarrs and tensorstore name it), held in
numpy by ml_dtypes. zarr-python 3.1 has no such type of its own; this module gives it one, registered with
zarr's data type registry when it is imported (the store's modules import it): ``zarr.open_array``, xarray and
dask in that process then read a bfloat16 capture back as bfloat16, bit for bit what the model computed.
(zarr 3.1.6 gathers ``zarr.data_type`` entry points but never loads them, so one would not help.)

Without ml_dtypes the type still registers and every other type opens; a bfloat16 array is a one-line error
that says what to install.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from zarr.dtype import data_type_registry

from ._zarr_internal import BaseFloat

try:
    import ml_dtypes
except ImportError:  # a reader's environment without it: every other type still opens
    ml_dtypes = None  # type: ignore[assignment]

BFLOAT16: np.dtype[Any] | None = None if ml_dtypes is None else np.dtype(ml_dtypes.bfloat16)
MISSING = "a bfloat16 capture needs ml_dtypes, through which numpy holds bfloat16: pip install ml_dtypes"


class _Absent:
    """Stands for bfloat16's numpy dtype class where ml_dtypes is missing: no dtype is one."""


@dataclass(frozen=True, kw_only=True)
class BFloat16(BaseFloat):
    """The zarr data type ``bfloat16``: 2 bytes a value, floats written to JSON as zarr writes float16's."""

    dtype_cls = _Absent if BFLOAT16 is None else type(BFLOAT16)
    _zarr_v3_name: ClassVar[str] = "bfloat16"
    _zarr_v2_names: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def _from_json_v3(cls, data: Any) -> BFloat16:
        if BFLOAT16 is None:
            raise ImportError(MISSING)
        return super()._from_json_v3(data)

    @property
    def item_size(self) -> int:
        return 2


def is_bfloat16(dtype: Any) -> bool:
    """Whether ``dtype`` is ml_dtypes' bfloat16 (never without ml_dtypes: numpy takes ``== None`` as float64)."""
    return BFLOAT16 is not None and dtype == BFLOAT16


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype a store's capture record names (``float32``, ``float16``, ``bfloat16``, ...)."""
    if name == "bfloat16":
        if BFLOAT16 is None:
            raise ImportError(MISSING)
        return BFLOAT16
    return np.dtype(name)


data_type_registry.register(BFloat16._zarr_v3_name, BFloat16)
