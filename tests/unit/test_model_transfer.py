"""The trained model outside the JVMs, without Spark: tensor files, the ranks' three ways to the
driver (a real socket to a real receiver, storage, rows), merging parts into a module one tensor at a
time, the weightless skeleton, and storage's atomic writes."""
from __future__ import annotations

import io
import os
import socket
from contextlib import ExitStack

import pyarrow as pa
import pytest
import torch
from torch import nn

from sparkdl.wire.model_transfer import ModelSink, PartReceiver, deliver, part_name, record_bytes
from sparkdl.driver.parts import OpenSink, gather_parts
from sparkdl.wire.codec import collect_parts, result_batches
from sparkdl.storage.files import atomic_output, exists, locate, read_all, write_atomic
from sparkdl.model.tensor_files import TensorFileError, read_header, read_tensors, tensor_pieces, write_tensors
from sparkdl.model.trained import check_complete, load_parts, load_skeleton, module_from_files, skeleton_bytes


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.randn(5, 3), "i": torch.arange(7), "h": torch.randn(4).half(), "b": torch.randn(3).bfloat16(),
            "m": torch.tensor([True, False, True]), "empty": torch.zeros(0, 2), "t": torch.randn(3, 5).t()}


def test_tensor_files_round_trip_every_dtype_and_read_with_the_safetensors_layout() -> None:
    state = _state()
    buffer = io.BytesIO()
    total = write_tensors(buffer, state, {"rank": "1"})
    assert total == len(buffer.getvalue())
    buffer.seek(0)
    header = read_header(buffer)
    assert header.metadata == {"rank": "1"} and header.data_start % 8 == 0
    buffer.seek(0)
    back = dict(read_tensors(buffer))
    assert set(back) == set(state)
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_pieces_are_views_of_the_tensors_never_a_serialized_copy() -> None:
    big = torch.zeros(3 << 20)  # 12 MB: three 4 MB pieces
    total, pieces = tensor_pieces({"big": big}, piece_bytes=4 << 20)
    views = list(pieces)
    assert max(len(v) for v in views) <= 4 << 20 and sum(len(v) for v in views) == total
    big[0] = 7.0  # the pieces see the tensor's own memory
    assert views[1][:4].tobytes() == torch.tensor([7.0]).numpy().tobytes()


def test_a_truncated_or_foreign_file_is_refused() -> None:
    buffer = io.BytesIO()
    write_tensors(buffer, {"w": torch.ones(100)})
    with pytest.raises(TensorFileError, match="truncated"):
        list(read_tensors(io.BytesIO(buffer.getvalue()[:-10])))
    with pytest.raises(TensorFileError, match="not a tensor file"):
        list(read_tensors(io.BytesIO(b"PK\x03\x04" + b"\0" * 100)))


def _parts_to_files(tmp_path, mode: str, states: dict[int, dict]) -> tuple[list[str], dict[int, str]]:  # type: ignore[no-untyped-def]
    """Each rank delivers through `mode`; the driver gathers what the job's rows say."""
    with ExitStack() as stack:
        directory = str(tmp_path / f"driver-{mode}")
        os.makedirs(directory)
        receiver = None
        if mode == "channel":
            receiver = stack.enter_context(PartReceiver("127.0.0.1", directory))
            sink = ModelSink("channel", receiver.address, timeout_s=30)
        elif mode == "storage":
            sink = ModelSink("storage", storage_uri=str(tmp_path / "store" / "run" / "model"))
        else:
            sink = ModelSink("rows")
        batches = []
        for rank, state in states.items():
            record = deliver(sink, rank, state)
            batches += result_batches(rank, [] if rank == 0 else None, record.get("payload"), record_bytes(record))
        rows = pa.Table.from_batches(batches).to_pylist()
        parts = gather_parts(OpenSink(sink, directory, receiver), collect_parts(rows))
    return list(parts.files), parts.via_by_rank


@pytest.mark.parametrize("mode", ["channel", "storage", "rows"])
def test_parts_of_several_ranks_load_into_the_module_one_tensor_at_a_time(tmp_path, mode: str) -> None:  # type: ignore[no-untyped-def]
    trained = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    state = trained.state_dict()
    first = {k: v for k, v in state.items() if k.startswith("0.")}
    rest = {k: v for k, v in state.items() if not k.startswith("0.")}
    files, via = _parts_to_files(tmp_path, mode, {0: first, 1: rest})
    assert via == {0: mode, 1: mode}
    module = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    weight = module[0].weight
    load_parts(module, files)
    assert module[0].weight is weight  # read into the module's own memory
    for key, value in state.items():
        assert torch.equal(module.state_dict()[key], value), key


def test_a_rank_that_cannot_reach_the_driver_sends_its_part_in_the_rows(tmp_path, capfd) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    from sparkdl.wire.frames import ChannelAddress

    record = deliver(ModelSink("channel", ChannelAddress("127.0.0.1", port, "s" * 64)), 0, {"w": torch.ones(3)})
    assert record["via"] == "rows" and record["payload"]
    assert "comes back in the job's rows instead" in capfd.readouterr().err


def test_the_receiver_refuses_a_wrong_secret_and_keeps_no_half_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from dataclasses import replace

    with PartReceiver("127.0.0.1", str(tmp_path)) as receiver:
        wrong = ModelSink("channel", replace(receiver.address, secret="x" * 64), timeout_s=10)
        record = deliver(wrong, 0, {"w": torch.ones(3)})
    assert record["via"] == "rows"
    assert os.listdir(tmp_path) == []


def test_meta_modules_take_the_tensors_and_missing_tensors_are_named(tmp_path) -> None:  # type: ignore[no-untyped-def]
    trained = nn.Linear(3, 2)
    path = tmp_path / part_name(0)
    with open(path, "wb") as out:
        write_tensors(out, {"weight": trained.weight})
    with torch.device("meta"):
        module = nn.Linear(3, 2)
    from sparkdl.errors import TrainingError

    with pytest.raises(TrainingError, match="without 1 of its tensors \\(bias\\)"):
        check_complete(module, {"weight"})
    load_parts(module, [str(path)])
    assert not module.weight.is_meta and torch.equal(module.weight, trained.weight)


def test_the_skeleton_leaves_the_weights_out_and_keeps_other_tensors(tmp_path) -> None:  # type: ignore[no-untyped-def]
    module = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 2))
    module.register_buffer("table", torch.arange(4.0), persistent=False)  # no state dict holds it
    data = skeleton_bytes(module)
    assert len(data) < 10_000  # 66K parameters (264 KB) left out
    skeleton = load_skeleton(data)
    assert skeleton[0].weight.is_meta and torch.equal(skeleton.table, torch.arange(4.0))
    path = tmp_path / "part.safetensors"
    with open(path, "wb") as out:
        write_tensors(out, module.state_dict())
    rebuilt = module_from_files(data, [str(path)])
    x = torch.randn(3, 256)
    assert torch.equal(rebuilt(x), module(x)) and not rebuilt.training


def test_storage_writes_are_atomic(tmp_path) -> None:  # type: ignore[no-untyped-def]
    where = locate(str(tmp_path / "a" / "b.bin"))
    write_atomic(where, b"x" * 100)
    assert read_all(where) == b"x" * 100
    with pytest.raises(RuntimeError):
        with atomic_output(where) as stream:
            stream.write(b"half")
            raise RuntimeError("killed mid-write")
    assert read_all(where) == b"x" * 100 and os.listdir(tmp_path / "a") == ["b.bin"]
    assert not exists(locate(str(tmp_path / "nothing")))


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def test_tied_weights_stay_one_tensor_through_the_skeleton_and_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    trained = _Tied()
    path = tmp_path / "part.safetensors"
    with open(path, "wb") as out:
        write_tensors(out, trained.state_dict())
    rebuilt = module_from_files(skeleton_bytes(trained), [str(path)])
    assert rebuilt.head.weight is rebuilt.embed.weight and torch.equal(rebuilt.embed.weight, trained.embed.weight)
    assert len(list(rebuilt.parameters())) == 1


def test_a_missing_part_is_named_before_anything_loads(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from sparkdl.errors import TrainingError

    module = nn.Linear(3, 2)
    with pytest.raises(TrainingError, match="cannot be read"):
        module_from_files(skeleton_bytes(module), [str(tmp_path / "gone.safetensors")])


def test_hadoop_only_schemes_are_not_taken_for_local_names() -> None:
    from sparkdl.storage.files import is_local_path, pyarrow_reaches

    assert not pyarrow_reaches("dbfs:/mnt/models/m") and not pyarrow_reaches("hdfs:/user/m")
    assert pyarrow_reaches("/tmp/m") and pyarrow_reaches("file:/tmp/m") and pyarrow_reaches("relative/m")
    assert is_local_path("/tmp/m") and not is_local_path("dbfs:/m") and not is_local_path("s3://b/m")


def test_an_explicit_channel_fails_instead_of_falling_back() -> None:
    from sparkdl.wire.frames import ChannelAddress

    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    sink = ModelSink("channel", ChannelAddress("127.0.0.1", port, "s" * 64), fallback=False)
    with pytest.raises(OSError, match='model_transfer="channel"'):
        deliver(sink, 1, {"w": torch.ones(3)})


def test_a_part_altered_on_the_way_is_refused_and_keeps_no_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from sparkdl.wire.frames import challenge_of, hello_frame, read_frame
    from sparkdl.wire.handshake import TO_PEER, FrameSeal, StreamTag

    with PartReceiver("127.0.0.1", str(tmp_path)) as receiver:
        address, payload = receiver.address, b"a model part" * 100
        with socket.create_connection((address.host, address.port), timeout=5) as sock, sock.makefile("rb") as stream:
            challenge = challenge_of(read_frame(stream, 1 << 16))
            tag = StreamTag(address.secret, challenge)
            tag.update(payload)  # the tag of what the rank sent; a host on the way changed one byte
            sock.sendall(hello_frame(address.secret, "model", challenge, 0, bytes=len(payload)))
            inbound = FrameSeal(address.secret, challenge, TO_PEER)
            assert read_frame(stream, 1 << 16, inbound) == {"welcome": 1}
            sock.sendall(payload.replace(b"model", b"mode!", 1) + tag.digest())
            reply = read_frame(stream, 1 << 16, inbound)
    assert reply is not None and reply["ok"] is False and "authentication tag" in reply["error"], reply
    assert "authentication tag" in receiver.errors[0]
    assert os.listdir(tmp_path) == []
