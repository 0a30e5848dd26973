"""The hand-written reader and writer agree with schema/ort_training_checkpoint.fbs, the source of truth."""

import re
from pathlib import Path

from lightning_ort_ckpt.format import DataType
from lightning_ort_ckpt.format import _schema as schema

FBS = (Path(__file__).resolve().parents[2] / "schema" / "ort_training_checkpoint.fbs").read_text()


def _tables() -> dict[str, list[tuple[str, str | None]]]:
    tables = {}
    for name, body in re.findall(r"^table (\w+) \{(.*?)^\}", FBS, re.S | re.M):
        fields = []
        for line in body.splitlines():
            m = re.match(r"\s*(\w+):[\w\[\]]+(?:\s*=\s*([-\w.]+))?;", line)
            if m:
                fields.append((m.group(1), m.group(2)))
        tables[name] = fields
    return tables


def test_slots_match_schema_field_order():
    tables = _tables()
    expected = {
        "Tensor": schema.TensorSlot, "ModuleState": schema.ModuleStateSlot,
        "ParameterOptimizerState": schema.ParameterOptimizerStateSlot, "OptimizerGroup": schema.OptimizerGroupSlot,
        "IntProperty": schema.PropertySlot, "FloatProperty": schema.PropertySlot, "StringProperty": schema.PropertySlot,
        "PropertyBag": schema.PropertyBagSlot, "Checkpoint": schema.CheckpointSlot,
    }
    assert set(tables) == set(expected)
    for table, slots in expected.items():
        assert [f for f, _ in tables[table]] == [s.name.lower() for s in slots], table


def test_defaults_and_identity_match_schema():
    tables = _tables()
    assert dict(tables["Tensor"])["external_data_offset"] == str(schema.EXTERNAL_DATA_OFFSET_DEFAULT)
    assert dict(tables["OptimizerGroup"]) == {"group_name": None, "step": "0", "initial_learning_rate": "0.0",
                                              "optimizer_states": None}
    assert re.search(r'file_identifier "(\w+)";', FBS).group(1).encode() == schema.FILE_IDENTIFIER
    assert re.search(r"root_type (\w+);", FBS).group(1) == "Checkpoint"


def test_dtype_enum_matches_schema():
    body = re.search(r"enum TensorDataType : int32 \{(.*?)\}", FBS, re.S).group(1)
    values = {n: int(v) for n, v in re.findall(r"(\w+) = (\d+)", body)}
    assert values.pop("UNDEFINED") == 0
    assert values == {d.name: d.value for d in DataType}
