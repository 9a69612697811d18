"""Issue 44 (part): a tensor file's header is checked before anything is allocated for it, so a
corrupt or hostile header (a huge shape, offsets that disagree with it, overlapping tensors) is a
TensorFileError, not a multi-gigabyte allocation or a silent misread."""
from __future__ import annotations

import io
import json
import struct

import pytest
import torch

from sparkdl.model.tensor_files import TensorFileError, read_tensors, write_tensors


def _file(header: dict, data: bytes = b"") -> io.BytesIO:
    text = json.dumps(header).encode()
    return io.BytesIO(struct.pack("<Q", len(text)) + text + data)


def test_a_good_file_still_reads() -> None:
    stream = io.BytesIO()
    write_tensors(stream, {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(2)})
    stream.seek(0)
    got = dict(read_tensors(stream))
    assert torch.equal(got["w"], torch.arange(6, dtype=torch.float32).reshape(2, 3)) and torch.equal(got["b"], torch.ones(2))


@pytest.mark.parametrize("header, message", [
    # 2^40 x 2^40 floats announced in 16 bytes: refused before torch.empty is asked for them
    ({"w": {"dtype": "F32", "shape": [1 << 40, 1 << 40], "data_offsets": [0, 16]}}, "needs"),
    ({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}, "needs 16 bytes"),
    ({"w": {"dtype": "F32", "shape": [-1, 4], "data_offsets": [0, 16]}}, "has shape"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, "needs 8 bytes"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, "overlap"),
    ({"w": {"dtype": "F32", "shape": [[4]], "data_offsets": [0, 16]}}, "bad entry"),
])
def test_a_bad_header_is_refused_before_any_allocation(header: dict, message: str) -> None:
    with pytest.raises(TensorFileError, match=message):
        list(read_tensors(_file(header, bytes(16))))


def test_a_truncated_file_with_a_consistent_header_is_refused_from_its_header(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A header that agrees with itself but not with the file (1 GiB announced, 16 bytes there): the
    header read refuses it, so no tensor of that shape is ever made."""
    from sparkdl.model.tensor_files import read_header

    header = {"w": {"dtype": "F32", "shape": [1 << 28], "data_offsets": [0, 1 << 30]}}
    with pytest.raises(TensorFileError, match="a truncated tensor file"):
        read_header(_file(header, b"\x00" * 16))
    path = tmp_path / "cut.safetensors"
    stream = io.BytesIO()
    write_tensors(stream, {"w": torch.ones(1024)})
    path.write_bytes(stream.getvalue()[:-100])  # a real file cut short
    with open(path, "rb") as cut, pytest.raises(TensorFileError, match="a truncated tensor file"):
        list(read_tensors(cut))
