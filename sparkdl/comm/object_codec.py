"""The typed encoding of the small objects ranks exchange (Communicator.allgather_object): no pickle
between ranks. A peer's bytes are parsed as JSON and rebuilt only into plain values, so a forged
message can at worst be a wrong value, never code run on this rank.

What crosses: None, bool, int, float (NaN and infinities included), str, bytes, list, tuple, dict
(keys of those scalar types), numpy arrays and torch tensors of numeric/bool dtypes (validation
metrics gather scores), numpy scalars (as Python numbers). Anything else is refused at the sender.
"""
from __future__ import annotations

import base64
import json
from typing import Any

_TUPLE, _DICT, _BYTES, _ARRAY, _REFUSED = "$t", "$d", "$b", "$a", "$refused"
_ARRAY_KINDS = frozenset("biuf")  # bool, signed, unsigned, float: never object or structured dtypes


def encode_object(obj: Any) -> bytes:
    return json.dumps(_plain(obj), separators=(",", ":"), allow_nan=True).encode("utf-8")


def decode_object(data: bytes) -> Any:
    return _value(json.loads(data.decode("utf-8")))


class Refusal:
    """What a rank sent in place of a value it could not encode (gathered, then raised everywhere)."""

    def __init__(self, rank: int, reason: str) -> None:
        self.rank, self.reason = rank, reason


def encode_refusal(rank: int, reason: str) -> bytes:
    return json.dumps({_REFUSED: [int(rank), str(reason)]}).encode("utf-8")


def raise_refusals(values: list[Any]) -> None:
    refused = [v for v in values if isinstance(v, Refusal)]
    if refused:
        raise TypeError(f"rank {refused[0].rank}: {refused[0].reason}")


def _plain(obj: Any) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (list, tuple)):
        items = [_plain(item) for item in obj]
        return {_TUPLE: items} if isinstance(obj, tuple) else items
    if isinstance(obj, dict):
        return {_DICT: [[_key(k), _plain(v)] for k, v in obj.items()]}
    if isinstance(obj, (bytes, bytearray)):
        return {_BYTES: base64.b64encode(bytes(obj)).decode("ascii")}
    return _array_or_scalar(obj)


def _key(key: Any) -> Any:
    if key is None or isinstance(key, (bool, int, float, str)):
        return key
    if isinstance(key, tuple):
        return _plain(key)
    raise TypeError(f"allgather_object: a dict key of type {type(key).__name__} cannot cross between ranks")


def _array_or_scalar(obj: Any) -> Any:
    import numpy as np

    torch_tensor = type(obj).__module__.startswith("torch") and hasattr(obj, "detach")
    if torch_tensor:
        obj = obj.detach().cpu()
        obj = (obj.float() if str(obj.dtype) == "torch.bfloat16" else obj).numpy()  # numpy has no bfloat16
    if isinstance(obj, np.generic) and obj.dtype.kind in _ARRAY_KINDS:
        return obj.item()
    if isinstance(obj, np.ndarray) and obj.dtype.kind in _ARRAY_KINDS:
        data = np.ascontiguousarray(obj)
        return {_ARRAY: [data.dtype.str, list(data.shape), base64.b64encode(data.tobytes()).decode("ascii"),
                         bool(torch_tensor)]}
    raise TypeError(f"allgather_object: a {type(obj).__name__} cannot cross between ranks (plain values, "
                    "lists, tuples, dicts, bytes and numeric arrays only: no pickle between ranks)")


def _value(plain: Any) -> Any:
    if isinstance(plain, list):
        return [_value(item) for item in plain]
    if not isinstance(plain, dict):
        return plain
    if len(plain) != 1:
        raise ValueError("allgather_object: a malformed message from a peer (an untagged object)")
    (tag, body), = plain.items()
    if tag == _TUPLE:
        return tuple(_value(item) for item in body)
    if tag == _DICT:
        return {_hashable(_value(k)): _value(v) for k, v in body}
    if tag == _BYTES:
        return base64.b64decode(body)
    if tag == _ARRAY:
        return _array(*body)
    if tag == _REFUSED:
        return Refusal(int(body[0]), str(body[1]))
    raise ValueError(f"allgather_object: a malformed message from a peer (unknown tag {tag!r})")


def _hashable(key: Any) -> Any:
    if isinstance(key, list):
        raise ValueError("allgather_object: a malformed message from a peer (a list as a dict key)")
    return key


def _array(dtype: str, shape: list[int], data: str, as_tensor: bool) -> Any:
    import numpy as np

    kind = np.dtype(dtype)
    if kind.kind not in _ARRAY_KINDS:
        raise ValueError(f"allgather_object: a peer sent an array of dtype {dtype!r}")
    array = np.frombuffer(base64.b64decode(data), dtype=kind).reshape([int(n) for n in shape]).copy()
    if as_tensor:
        import torch

        return torch.from_numpy(array)
    return array
