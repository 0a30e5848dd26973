"""Slots and defaults of ``schema/ort_training_checkpoint.fbs``, for the hand-written reader and writer.

tests/format/test_schema.py parses the .fbs and checks these numbers against it, so the schema stays the source of
truth.
"""

from __future__ import annotations

import enum

FILE_IDENTIFIER = b"ODTC"
VERSION = 2  # the only version ORT 1.19.2 writes and accepts
EXTERNAL_DATA_OFFSET_DEFAULT = -1


class TensorSlot(enum.IntEnum):
    NAME = 0
    DOC_STRING = 1
    DIMS = 2
    DATA_TYPE = 3
    RAW_DATA = 4
    STRING_DATA = 5
    EXTERNAL_DATA_OFFSET = 6


class ModuleStateSlot(enum.IntEnum):
    REQUIRES_GRAD_PARAMS = 0
    FROZEN_PARAMS = 1
    IS_NOMINAL_STATE = 2
    HAS_EXTERNAL_DATA = 3


class ParameterOptimizerStateSlot(enum.IntEnum):
    PARAM_NAME = 0
    MOMENTUMS = 1


class OptimizerGroupSlot(enum.IntEnum):
    GROUP_NAME = 0
    STEP = 1
    INITIAL_LEARNING_RATE = 2
    OPTIMIZER_STATES = 3


class PropertySlot(enum.IntEnum):
    """Shared by IntProperty, FloatProperty and StringProperty."""

    NAME = 0
    VALUE = 1


class PropertyBagSlot(enum.IntEnum):
    INTS = 0
    FLOATS = 1
    STRINGS = 2


class CheckpointSlot(enum.IntEnum):
    VERSION = 0
    MODULE_STATE = 1
    OPTIMIZER_GROUPS = 2
    PROPERTY_BAG = 3
