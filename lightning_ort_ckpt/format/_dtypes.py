"""Element types of checkpoint tensors: ORT's TensorDataType numbers, sizes, and numpy/torch equivalents.

torch is imported only when a torch dtype is asked for, so metadata work (the CLI) runs without torch.
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np


class DataType(enum.IntEnum):
    """ORT's ``TensorDataType`` (the ONNX ``TensorProto.DataType`` numbers)."""

    FLOAT = 1
    UINT8 = 2
    INT8 = 3
    UINT16 = 4
    INT16 = 5
    INT32 = 6
    INT64 = 7
    STRING = 8
    BOOL = 9
    FLOAT16 = 10
    DOUBLE = 11
    UINT32 = 12
    UINT64 = 13
    COMPLEX64 = 14
    COMPLEX128 = 15
    BFLOAT16 = 16
    FLOAT8E4M3FN = 17
    FLOAT8E4M3FNUZ = 18
    FLOAT8E5M2 = 19
    FLOAT8E5M2FNUZ = 20

    @property
    def itemsize(self) -> int:
        """Bytes per element in ``raw_data`` (0 for STRING, which has no raw bytes)."""
        return _ITEMSIZE[self]

    @property
    def external_alignment(self) -> int:
        """Alignment of this type's blob in the ``.data`` file: ORT pads to 8 for INT64 and DOUBLE only."""
        return 8 if self in (DataType.INT64, DataType.DOUBLE) else 4

    @property
    def ort_loadable(self) -> bool:
        """Whether ORT 1.19.2's ``CheckpointState.load_checkpoint`` accepts tensors of this type."""
        return self in _ORT_LOADABLE

    def to_torch(self) -> Any:
        """The torch dtype (imports torch)."""
        import torch

        return getattr(torch, _TORCH_NAME[self])

    def to_numpy(self) -> np.dtype:
        """A little-endian numpy dtype of the same size (raw unsigned ints for types numpy lacks)."""
        return np.dtype(_NUMPY[self])


_ITEMSIZE = {
    DataType.FLOAT: 4, DataType.UINT8: 1, DataType.INT8: 1, DataType.UINT16: 2, DataType.INT16: 2,
    DataType.INT32: 4, DataType.INT64: 8, DataType.STRING: 0, DataType.BOOL: 1, DataType.FLOAT16: 2,
    DataType.DOUBLE: 8, DataType.UINT32: 4, DataType.UINT64: 8, DataType.COMPLEX64: 8, DataType.COMPLEX128: 16,
    DataType.BFLOAT16: 2, DataType.FLOAT8E4M3FN: 1, DataType.FLOAT8E4M3FNUZ: 1, DataType.FLOAT8E5M2: 1,
    DataType.FLOAT8E5M2FNUZ: 1,
}

_TORCH_NAME = {
    DataType.FLOAT: "float32", DataType.UINT8: "uint8", DataType.INT8: "int8", DataType.UINT16: "uint16",
    DataType.INT16: "int16", DataType.INT32: "int32", DataType.INT64: "int64", DataType.STRING: "string",
    DataType.BOOL: "bool", DataType.FLOAT16: "float16", DataType.DOUBLE: "float64", DataType.UINT32: "uint32",
    DataType.UINT64: "uint64", DataType.COMPLEX64: "complex64", DataType.COMPLEX128: "complex128",
    DataType.BFLOAT16: "bfloat16", DataType.FLOAT8E4M3FN: "float8_e4m3fn",
    DataType.FLOAT8E4M3FNUZ: "float8_e4m3fnuz", DataType.FLOAT8E5M2: "float8_e5m2",
    DataType.FLOAT8E5M2FNUZ: "float8_e5m2fnuz",
}

_NUMPY = {
    DataType.FLOAT: "<f4", DataType.UINT8: "u1", DataType.INT8: "i1", DataType.UINT16: "<u2", DataType.INT16: "<i2",
    DataType.INT32: "<i4", DataType.INT64: "<i8", DataType.STRING: "O", DataType.BOOL: "?",
    DataType.FLOAT16: "<f2", DataType.DOUBLE: "<f8", DataType.UINT32: "<u4", DataType.UINT64: "<u8",
    DataType.COMPLEX64: "<c8", DataType.COMPLEX128: "<c16", DataType.BFLOAT16: "<u2", DataType.FLOAT8E4M3FN: "u1",
    DataType.FLOAT8E4M3FNUZ: "u1", DataType.FLOAT8E5M2: "u1", DataType.FLOAT8E5M2FNUZ: "u1",
}

_ORT_LOADABLE = frozenset({
    DataType.FLOAT, DataType.DOUBLE, DataType.INT8, DataType.INT16, DataType.INT32, DataType.INT64,
    DataType.UINT8, DataType.UINT16, DataType.UINT32, DataType.UINT64, DataType.BOOL,
})

_FROM_TORCH_NAME = {name: dt for dt, name in _TORCH_NAME.items()}
_FROM_NUMPY = {np.dtype(code).newbyteorder("<"): dt for dt, code in _NUMPY.items()
               if dt not in (DataType.BFLOAT16, DataType.STRING) and not dt.name.startswith("FLOAT8")}


def from_torch(dtype: Any) -> DataType:
    """DataType of a torch dtype; raises ValueError for types ORT's enum lacks (e.g. ``torch.uint1``)."""
    name = str(dtype).removeprefix("torch.")
    try:
        return _FROM_TORCH_NAME[name]
    except KeyError:
        raise ValueError(f"torch dtype {dtype} has no ORT TensorDataType") from None


def from_numpy(dtype: np.dtype) -> DataType:
    """DataType of a numpy dtype (strings and bytes objects map to STRING)."""
    dtype = np.dtype(dtype)
    if dtype.kind in "OUS":
        return DataType.STRING
    try:
        return _FROM_NUMPY[dtype.newbyteorder("<")]
    except KeyError:
        raise ValueError(f"numpy dtype {dtype} has no ORT TensorDataType") from None
