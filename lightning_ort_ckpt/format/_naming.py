"""The naming rule every store follows: a checkpoint's external data is its path plus ``.data`` (ORT reads it by that
name), and a checkpoint folder (a sharded checkpoint) is committed by one file whose presence makes it a checkpoint.

One module so that the local disk, the fsspec store and the layers above them name these files the same way."""

DATA_SUFFIX = ".data"
FOLDER_COMMIT_NAME = "checkpoint.ort-meta"
"""The file whose presence makes a folder a checkpoint (a sharded one: ``_dcp_folder.METADATA_NAME``); a store that
deletes a folder object by object deletes it first."""


def data_path(path: str) -> str:
    """ORT's external data file: the checkpoint path string plus ``.data``."""
    return path + DATA_SUFFIX
