"""Tensors as files in the safetensors layout, written and read a piece at a time.

A file is an 8-byte little-endian header length, a JSON header {name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {str: str}} and the tensors' raw bytes back to back.
It is the format Hugging Face and MLflow users already read (the `safetensors` package opens these
files), it holds no code (loading cannot run any), and its bytes can be produced straight from the
tensors' memory: a rank streams its part of the model without a serialized copy, and the driver
reads each tensor into its final storage without one either. Stdlib + torch; worker-side.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Iterator, Mapping

PIECE_BYTES = 4 << 20  # the unit of writing and reading: what is in flight or buffered at most
_HEADER_LENGTH = struct.Struct("<Q")
_MAX_HEADER_BYTES = 100 << 20

_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
           "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
           "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_NAMES = {torch_name: code for code, torch_name in _DTYPES.items()}
_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "F8_E4M3": 1, "F8_E5M2": 1}


class TensorFileError(ValueError):
    """A file that is not a tensor file of this layout (truncated, corrupt, another format)."""


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str  # torch dtype name, "float32"
    shape: tuple[int, ...]
    begin: int  # offsets into the data section
    end: int


@dataclass(frozen=True)
class Header:
    entries: tuple[Entry, ...]
    metadata: dict[str, str]
    data_start: int  # where the data section starts in the file

    @property
    def nbytes(self) -> int:
        return self.data_start + (max((e.end for e in self.entries), default=0))


def _contiguous(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """CPU, contiguous, detached tensors; a tensor that is already so is not copied."""
    return {name: t.detach().cpu().contiguous() for name, t in tensors.items()}


def encode_header(tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> bytes:
    """The length prefix and JSON header for `tensors` (CPU, contiguous), in their order."""
    header: dict[str, Any] = {}
    offset = 0
    for name, tensor in tensors.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _NAMES:
            raise TensorFileError(f"tensor {name!r} has dtype {dtype}, which a tensor file cannot hold")
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _NAMES[dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # data section 8-byte aligned, as safetensors writes it
    return _HEADER_LENGTH.pack(len(text)) + text


def tensor_pieces(tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None,
                  piece_bytes: int = PIECE_BYTES) -> tuple[int, Iterator[memoryview]]:
    """(total bytes, the file's bytes as views of at most piece_bytes): views into the tensors
    themselves, never a serialized copy of them."""
    ready = _contiguous(tensors)
    head = encode_header(ready, metadata)
    total = len(head) + sum(t.numel() * t.element_size() for t in ready.values())

    def pieces() -> Iterator[memoryview]:
        yield memoryview(head)
        for tensor in ready.values():
            if tensor.numel() == 0:
                continue
            raw = memoryview(_bytes_of(tensor).numpy()).cast("B")
            for start in range(0, len(raw), piece_bytes):
                yield raw[start: start + piece_bytes]

    return total, pieces()


def write_tensors(stream: BinaryIO, tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> int:
    """Write a tensor file to `stream`; returns its bytes."""
    total, pieces = tensor_pieces(tensors, metadata)
    for piece in pieces:
        stream.write(piece)
    return total


def read_header(stream: Any) -> Header:
    """The header of a tensor file open at its start (any object with read()). Where the stream
    says how many bytes it holds (a file, a pyarrow file, a seekable buffer), the tensors' offsets
    must lie within them: a truncated file or a hostile header allocates nothing."""
    available = _bytes_left(stream)
    raw = _read_exactly(stream, _HEADER_LENGTH.size)
    (size,) = _HEADER_LENGTH.unpack(raw)
    if not 2 <= size <= _MAX_HEADER_BYTES:
        raise TensorFileError(f"not a tensor file (header length {size})")
    try:
        header = json.loads(_read_exactly(stream, size).decode("utf-8"))
    except ValueError:
        raise TensorFileError("not a tensor file (header is not JSON)") from None
    metadata = header.pop("__metadata__", {}) or {}
    entries = []
    for name, spec in header.items():
        try:
            begin, end = (int(v) for v in spec["data_offsets"])
            entries.append(Entry(name, _DTYPES[spec["dtype"]], tuple(int(d) for d in spec["shape"]), begin, end))
            item = _ITEM_BYTES[spec["dtype"]]
        except (KeyError, TypeError, ValueError, AttributeError):
            raise TensorFileError(f"not a tensor file (bad entry {name!r})") from None
        _check_entry(entries[-1], item)
    entries.sort(key=lambda e: e.begin)
    for before, after in zip(entries, entries[1:]):
        if after.begin < before.end:
            raise TensorFileError(f"not a tensor file (tensors {before.name!r} and {after.name!r} overlap)")
    data_start = _HEADER_LENGTH.size + size
    needed = data_start + max((e.end for e in entries), default=0)
    if available is not None and needed > available:
        raise TensorFileError(f"a truncated tensor file (its header places tensors up to byte {needed}, the "
                              f"file holds {available})")
    return Header(tuple(entries), dict(metadata), data_start)


def _bytes_left(stream: Any) -> int | None:
    """Bytes from the stream's position to its end, or None where the stream cannot say (a socket,
    a pyarrow input stream). Any failure to tell is "cannot say": the check is a bound, not a read."""
    import os

    probes = (lambda: stream.size(),  # pyarrow's random-access files
              lambda: os.fstat(stream.fileno()).st_size)
    try:
        position = int(stream.tell())
    except Exception:  # noqa: BLE001 - streams raise many types for "not supported"
        return None
    for probe in probes:
        try:
            return int(probe()) - position
        except Exception:  # noqa: BLE001
            continue
    try:
        end = int(stream.seek(0, os.SEEK_END))
        stream.seek(position)
        return end - position
    except Exception:  # noqa: BLE001
        return None


def _check_entry(entry: Entry, item_bytes: int) -> None:
    """A header's word is checked before anything is allocated for it: a corrupt or hostile header
    must not make the reader allocate a tensor of its shape (issue 44)."""
    elements = 1
    for size in entry.shape:
        if size < 0:
            raise TensorFileError(f"not a tensor file (tensor {entry.name!r} has shape {list(entry.shape)})")
        elements *= size
    if entry.begin < 0 or entry.end < entry.begin or entry.end - entry.begin != elements * item_bytes:
        raise TensorFileError(f"not a tensor file (tensor {entry.name!r}: {entry.dtype}{list(entry.shape)} needs "
                              f"{elements * item_bytes} bytes, its offsets [{entry.begin}, {entry.end}] give "
                              f"{entry.end - entry.begin})")


def read_tensors(stream: Any, target: Callable[[Entry], Any] | None = None) -> Iterator[tuple[str, Any]]:
    """(name, tensor) for each tensor of a file open at its start, read in file order a piece at a
    time into `target(entry)` (a tensor of the entry's dtype and shape to fill, e.g. the module's own
    parameter) or, when target is None or returns None, into a new tensor."""
    import torch

    header = read_header(stream)
    position = header.data_start
    for entry in header.entries:
        skip = header.data_start + entry.begin - position
        if skip:
            _read_exactly(stream, skip)
        tensor = target(entry) if target is not None else None
        if tensor is None:
            tensor = torch.empty(entry.shape, dtype=getattr(torch, entry.dtype))
        _check_fits(entry, tensor)
        if entry.end > entry.begin:
            _fill(stream, memoryview(_bytes_of(tensor).numpy()).cast("B"))
        position = header.data_start + entry.end
        yield entry.name, tensor


def _check_fits(entry: Entry, tensor: Any) -> None:
    if tuple(tensor.shape) != entry.shape or str(tensor.dtype).removeprefix("torch.") != entry.dtype \
            or not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise TensorFileError(f"tensor {entry.name!r} is {entry.dtype}{list(entry.shape)} in the file; the target "
                              f"is {tensor.dtype}{list(tensor.shape)} on {tensor.device}")
    if tensor.numel() * tensor.element_size() != entry.end - entry.begin:
        raise TensorFileError(f"tensor {entry.name!r}: the file gives {entry.end - entry.begin} bytes for it")


def _bytes_of(tensor: Any) -> Any:
    """The tensor's memory as a flat uint8 tensor (no copy): numpy has no bfloat16."""
    import torch

    return tensor.reshape(-1).view(torch.uint8)


def _fill(stream: Any, view: memoryview) -> None:
    done = 0
    while done < len(view):
        piece = view[done: done + PIECE_BYTES]
        if hasattr(stream, "readinto"):
            got = stream.readinto(piece)
        else:
            data = stream.read(len(piece))
            got = len(data)
            piece[:got] = data
        if not got:
            raise TensorFileError("tensor file ends early (truncated)")
        done += got


def _read_exactly(stream: Any, size: int) -> bytes:
    data = stream.read(size)
    while len(data) < size:
        more = stream.read(size - len(data))
        if not more:
            raise TensorFileError("tensor file ends early (truncated)")
        data += more
    return bytes(data)
