"""What ranks exchange through allgather_object is typed data, never a pickle (comm/object_codec.py)."""
from __future__ import annotations

import math
import os
import pickle

import numpy as np
import pytest
import torch

from sparkdl.comm.object_codec import decode_object, encode_object


def test_what_sparkdl_sends_comes_back_the_same() -> None:
    sent = {
        "flops": 1.5e9, "threads": 2, "latency": [[0.0, math.inf], [2e-5, 0.0]], "name": "rank 1",
        "verdict": (True, "early_stopping", ""), "none": None, 3: "an int key", (1, 2): [b"\x00\xff"],
        "scores": (np.arange(4, dtype=np.float64), np.array([1, 0, 1], dtype=np.int64)),
        "tensor": torch.tensor([[1.0, 2.0]], dtype=torch.float32), "scalar": np.float32(0.5), "flag": np.bool_(True),
    }
    back = decode_object(encode_object(sent))
    assert back["latency"] == [[0.0, math.inf], [2e-5, 0.0]] and back["verdict"] == (True, "early_stopping", "")
    assert back[3] == "an int key" and back[(1, 2)] == [b"\x00\xff"] and back["none"] is None
    assert isinstance(back["scores"], tuple) and back["scores"][0].dtype == np.float64
    assert np.array_equal(back["scores"][1], [1, 0, 1])
    assert isinstance(back["tensor"], torch.Tensor) and torch.equal(back["tensor"], sent["tensor"])
    assert back["scalar"] == 0.5 and back["flag"] is True and back["threads"] == 2 and isinstance(back["flops"], float)
    assert math.isnan(decode_object(encode_object(float("nan"))))


def test_a_pickle_from_a_peer_is_never_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return os.system, (f"touch {marker}",)

    forged = pickle.dumps(Payload())
    with pytest.raises(ValueError):  # not JSON (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        decode_object(forged)
    assert not marker.exists()


@pytest.mark.parametrize("forged", [b'{"$x": 1}', b'{"a": 1, "b": 2}', b'{"$a": ["|O", [1], "AA==", false]}',
                                    b'{"$d": [[[1], 2]]}'])
def test_malformed_messages_are_refused(forged: bytes) -> None:
    with pytest.raises(ValueError):
        decode_object(forged)


def test_other_types_are_refused_at_the_sender() -> None:
    with pytest.raises(TypeError, match="set cannot cross"):
        encode_object({"x": {1, 2}})
    with pytest.raises(TypeError, match="cannot cross"):
        encode_object(np.array([object()], dtype=object))


def _gather_with_one_bad_rank(comm):  # type: ignore[no-untyped-def]
    value = {"speeds": {1.5}} if comm.rank == 1 else {"speed": 1.5}  # a set cannot cross
    try:
        comm.allgather_object(value)
    except TypeError as exc:
        after = comm.allgather_object(comm.rank)  # the ranks are still in step
        return f"{exc}", after
    return "no error", None


def test_one_ranks_unsendable_value_is_the_same_error_on_every_rank_not_a_hang() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
    from gloo_world import run_world

    results = run_world(2, _gather_with_one_bad_rank, timeout=60)
    for message, after in results:
        assert message.startswith("rank 1: allgather_object: a set cannot cross") and after == [0, 1]
