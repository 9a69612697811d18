"""The trained model as files: the ranks' parts (tensor files) and a weightless skeleton of the module.

The driver never holds a serialized copy of the model: each tensor is read from its part straight
into the module's own storage (or, for a module on the meta device, into a new tensor that the module
then takes), so loading peaks at the model once plus one piece. The skeleton is the module pickled
with its weights left out (their storages come back on the meta device), so that TorchModel.save,
the MLflow model and a lazily loaded TorchModel all pair one small pickle with the tensor files.
No pyspark, no mlflow: scoring servers load it.
"""
from __future__ import annotations

import hashlib
import io
import pickle
import threading
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from sparkdl.errors import SparkdlError, TrainingError

SKELETON_TAG = "sparkdl-weights"
# A rank's rows of a sharded table (strategy "embeddings"): f"{state-dict key}{ROWS_MARK}{first row}";
# the driver writes each piece into that tensor at its row, one piece in memory at a time.
ROWS_MARK = "#rows="


def row_piece(name: str) -> tuple[str, int] | None:
    """(state-dict key, first row) of a table piece's name; None for a whole tensor's name."""
    key, mark, start = name.partition(ROWS_MARK)
    return (key, int(start)) if mark and start.isdigit() else None
MODEL_COPY_PREFIX = "sparkdl-model-"  # a local copy of remote parts, under the private root (private_dirs)


@dataclass
class ModelParts:
    """The parts of one trained model: tensor files (local paths or URIs) whose names together
    cover the module's state dict. `owned_directory`: a driver-side directory to remove once done."""

    files: tuple[str, ...]
    owned_directory: str | None = None
    bytes_by_rank: dict[int, int] = field(default_factory=dict)
    via_by_rank: dict[int, str] = field(default_factory=dict)
    seconds_by_rank: dict[int, float] = field(default_factory=dict)  # each rank's delivery, as it timed it
    storage_directory: str | None = None  # where the ranks wrote their parts (launch.model_transfer="storage")
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)  # one load at a time

    def tensor_names(self) -> set[str]:
        return names_in(self.files)

    @property
    def nbytes(self) -> int:
        return sum(self.bytes_by_rank.values())

    def local_directory(self) -> str:
        """A directory on this machine holding every part (and nothing else): the one the parts
        arrived in, or a copy made here a piece at a time of the parts in remote storage."""
        import os
        import shutil
        import tempfile

        from sparkdl.storage.files import locate, open_input
        from sparkdl.storage.private_dirs import hold_new_directory, private_root

        directories = {os.path.dirname(f) for f in self.files if "://" not in f}
        if len(directories) == 1 and len(self.files) == len([f for f in self.files if "://" not in f]):
            only = directories.pop()
            if sorted(n for n in os.listdir(only) if not n.startswith(".")) == sorted(os.path.basename(f) for f in self.files):
                return only
        if self.owned_directory is None:  # held while this process lives: a killed driver's copy is swept
            self.owned_directory = hold_new_directory(private_root("models"), MODEL_COPY_PREFIX).path
        target = tempfile.mkdtemp(prefix="weights-", dir=self.owned_directory)
        copies = []
        for index, uri in enumerate(self.files):
            copies.append(os.path.join(target, f"part-{index}.safetensors"))
            with open_input(locate(uri)) as source, open(copies[-1], "wb") as out:
                shutil.copyfileobj(source, out, 4 << 20)
        self.files = tuple(copies)
        return target

    def remove_when_unused(self) -> None:
        """The files go when this object does (a lazily loaded TorchModel and its copies share it)."""
        import weakref

        self._finalizer = weakref.finalize(self, remove_files, self.owned_directory, self.storage_directory)

    def remove(self) -> None:
        """The driver's files of these parts, and the parts the ranks left in the run's storage."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        else:
            remove_files(self.owned_directory, self.storage_directory)
        self.owned_directory = self.storage_directory = None

    def __deepcopy__(self, memo: dict[int, Any]) -> "ModelParts":
        return self  # files, not values: copies of a lazy TorchModel read the same ones


def remove_files(owned_directory: str | None, storage_directory: str | None) -> None:
    import shutil

    from sparkdl.storage.files import delete_tree, locate
    from sparkdl.storage.private_dirs import release

    if owned_directory and not release(owned_directory):  # a held one goes with its lock file
        shutil.rmtree(owned_directory, ignore_errors=True)
    if storage_directory:
        try:
            delete_tree(locate(storage_directory))
        except (OSError, SparkdlError):
            pass


def names_in(files: Iterable[str]) -> set[str]:
    """The tensor names the files hold (their headers only); TrainingError for a file that is not
    there or not a tensor file."""
    from sparkdl.storage.files import locate, open_input
    from sparkdl.model.tensor_files import TensorFileError, read_header

    names: set[str] = set()
    for uri in files:
        try:
            with open_input(locate(uri)) as stream:
                names.update(e.name for e in read_header(stream).entries)
        except (OSError, TensorFileError) as exc:
            raise TrainingError(f"a part of the trained model cannot be read: {uri}: {exc}",
                                hint="the driver must reach every part: with model_transfer=\"storage\", a "
                                     "checkpoint_dir every executor and the driver share") from None
    return names


def load_parts(module: Any, files: Iterable[str]) -> None:
    """Every tensor of the parts into `module`: into its own parameter/buffer memory where that is
    real, contiguous and of the same dtype and shape; a meta (or mismatched) tensor is replaced. A
    table's row pieces go into the rows they name (a meta table gets its memory first)."""
    import torch

    from sparkdl.storage.files import locate, open_input
    from sparkdl.model.tensor_files import read_tensors

    own = module.state_dict(keep_vars=False)
    taken: dict[str, Any] = {}
    pieces = _RowPieces(own)

    def target(entry: Any) -> Any:
        if row_piece(entry.name) is not None:
            return pieces.target(entry)
        tensor = own.get(entry.name)
        if tensor is None or tensor.is_meta or tensor.device.type != "cpu" or not tensor.is_contiguous() \
                or tuple(tensor.shape) != entry.shape or str(tensor.dtype).removeprefix("torch.") != entry.dtype:
            return None
        return tensor

    aliases = _aliases(module)
    with torch.no_grad():
        for uri in files:
            with open_input(locate(uri)) as stream:
                for name, tensor in read_tensors(stream, target):
                    if row_piece(name) is None and tensor is not own.get(name):
                        taken[name] = tensor
    taken.update(pieces.complete())
    if taken:
        module.load_state_dict(taken, strict=False, assign=any(t.is_meta for t in own.values()))
        _tie(module, aliases, set(taken))


def _new_table(shape: tuple[int, ...], dtype: Any) -> Any:
    """Memory for a whole table: a file-backed mapping when large (the set may exceed the driver's
    memory: embeddings/mapped.py), else plain memory."""
    import math

    import torch

    from sparkdl.embeddings.mapped import MAPPED_TABLE_BYTES, mapped_table

    if math.prod(shape) * torch.empty(0, dtype=dtype).element_size() >= MAPPED_TABLE_BYTES:
        return mapped_table(shape, dtype)
    return torch.empty(shape, dtype=dtype)


class _RowPieces:
    """Where each row piece of a sharded table goes: the module's own table when it is real, else a
    new one; complete() checks that the pieces covered every row."""

    def __init__(self, own: dict[str, Any]) -> None:
        self.own, self.made, self.rows = own, {}, {}  # type: ignore[var-annotated]

    def target(self, entry: Any) -> Any:
        import torch

        key, start = row_piece(entry.name)  # type: ignore[misc]
        table = self.made.get(key, self.own.get(key))
        if table is None:
            raise TrainingError(f"the trained model holds rows of {key!r}, which the model does not have",
                                hint="train and load the same model (its EmbeddingBagCollection)")
        usable = not table.is_meta and table.device.type == "cpu" and table.is_contiguous() \
            and str(table.dtype).removeprefix("torch.") == entry.dtype
        if not usable:
            table = self.made[key] = _new_table(tuple(table.shape), getattr(torch, entry.dtype))
        stop = start + (entry.shape[0] if entry.shape else 0)
        if tuple(entry.shape[1:]) != tuple(table.shape[1:]) or stop > table.shape[0]:
            raise TrainingError(f"rows {start}..{stop} of {key!r} do not fit its shape {tuple(table.shape)}",
                                hint="train and load the same model")
        self.rows[key] = self.rows.get(key, 0) + stop - start
        return table[start:stop]

    def complete(self) -> dict[str, Any]:
        for key, count in self.rows.items():
            table = self.made.get(key, self.own.get(key))
            if count != table.shape[0]:
                raise TrainingError(f"the trained model came back with {count} of the {table.shape[0]} rows of "
                                    f"{key!r}", hint="a rank's part was lost on its way: see the driver's log")
        return dict(self.made)


def _aliases(module: Any) -> list[list[str]]:
    """Names of the state dict that are one tensor (tied weights: an embedding and its output layer)."""
    groups: dict[int, list[str]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _tie(module: Any, aliases: list[list[str]], loaded: set[str]) -> None:
    """Assigning tensors name by name unties shared weights: every alias takes the tensor of the
    first name that was loaded (a sharded run sends a tied tensor once, under one name)."""
    for names in aliases:
        first = next((name for name in names if name in loaded), names[0])
        owner, _, attribute = first.rpartition(".")
        shared = getattr(module.get_submodule(owner) if owner else module, attribute)
        for name in names:
            owner, _, attribute = name.rpartition(".")
            setattr(module.get_submodule(owner) if owner else module, attribute, shared)


FROZEN_PART = "frozen.safetensors"  # the driver's frozen parameters beside the ranks' parts


def add_frozen_part(parts: ModelParts, module: Any) -> None:
    """The frozen parameters the ranks did not send (model/trained_state.py), written once from the
    driver's own copy as one more file of `parts`, so that the files alone make the whole model (the
    MLflow model, a lazily loaded or saved TorchModel). Nothing when the parts hold them all."""
    import os

    from sparkdl.model.tensor_files import tensor_pieces
    from sparkdl.model.trained_state import frozen_state
    from sparkdl.storage.private_dirs import hold_new_directory, open_private, private_root

    have = parts.tensor_names()
    frozen = {name: tensor for name, tensor in frozen_state(module).items() if name not in have}
    if not frozen:
        return
    meta = sorted(name for name, tensor in frozen.items() if tensor.is_meta)
    if meta:
        raise TrainingError(f"the driver's copy of the model has no values for {len(meta)} frozen parameter(s) "
                            f"({', '.join(meta[:4])}), and the ranks do not send frozen ones",
                            hint="build frozen layers outside layer factories, or leave them trainable")
    if parts.owned_directory is None:
        parts.owned_directory = hold_new_directory(private_root("models"), MODEL_COPY_PREFIX).path
    path = os.path.join(parts.owned_directory, FROZEN_PART)
    with open_private(path) as out:
        for piece in tensor_pieces(frozen, {"format": "sparkdl-frozen-1"})[1]:
            out.write(piece)
    parts.files = (*parts.files, path)


def check_complete(module: Any, names: set[str]) -> None:
    names = {piece[0] if (piece := row_piece(n)) is not None else n for n in names}
    for group in _aliases(module):  # a tied tensor may come back under one of its names
        if names & set(group):
            names |= set(group)
    missing = sorted(set(module.state_dict()) - names)
    if missing:
        raise TrainingError(f"the trained model came back without {len(missing)} of its tensors "
                            f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''})",
                            hint="a rank's part of the model was lost on its way to the driver: see the "
                                 "driver's log and the ranks' stderr")


# -- the skeleton: the module pickled without its weights ---------------------------------------
def skeleton_bytes(obj: Any) -> bytes:
    """`obj` (a module, or a ServedModel holding one) pickled by value, each storage that backs a
    state-dict tensor of a module inside left out: a few KB whatever the model's size."""
    import torch
    from pyspark import cloudpickle

    owned = _state_storages(obj)

    class _Pickler(cloudpickle.Pickler):  # type: ignore[misc, name-defined]
        def persistent_id(self, item: Any) -> Any:
            if isinstance(item, torch.storage.TypedStorage):
                untyped = item._untyped_storage  # noqa: SLF001 - the public accessor warns (deprecated)
                if untyped.device.type != "meta" and untyped.data_ptr() in owned:
                    return (SKELETON_TAG, str(item.dtype).removeprefix("torch."), item._size())  # noqa: SLF001
            return None

    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TypedStorage's deprecation: the pickler meets them anyway
        _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def load_skeleton(data: bytes) -> Any:
    """The object skeleton_bytes pickled; the left-out tensors are on the meta device."""
    import torch

    class _Unpickler(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> Any:
            if not (isinstance(pid, tuple) and len(pid) == 3 and pid[0] == SKELETON_TAG):
                raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
            return torch.storage.TypedStorage(int(pid[2]), dtype=getattr(torch, pid[1]), device="meta", _internal=True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return _Unpickler(io.BytesIO(data)).load()


def _state_storages(obj: Any) -> set[int]:
    import torch

    modules = [obj] if isinstance(obj, torch.nn.Module) else \
        [v for v in vars(obj).values() if isinstance(v, torch.nn.Module)] if hasattr(obj, "__dict__") else []
    return {t.untyped_storage().data_ptr() for m in modules for t in m.state_dict().values()
            if not t.is_meta and t.numel() > 0}


_IN_PROCESS: dict[str, Any] = {}  # skeleton digest -> the loaded object it was made from


@contextmanager
def serving_in_process(skeleton: bytes, loaded: Any) -> Iterator[None]:
    """While a model is being logged, loading it again in this process (MLflow does, to check the
    input example) returns `loaded` itself instead of a second copy of the weights."""
    digest = hashlib.sha256(skeleton).hexdigest()
    if loaded is not None:
        _IN_PROCESS[digest] = loaded
    try:
        yield
    finally:
        _IN_PROCESS.pop(digest, None)


def module_from_files(skeleton: bytes, files: Iterable[str]) -> Any:
    """The module (or ServedModel) of `skeleton` with its weights read from `files`, in eval mode
    (the object itself when this process is logging it: serving_in_process)."""
    same = _IN_PROCESS.get(hashlib.sha256(skeleton).hexdigest())
    if same is not None:
        return same
    obj = load_skeleton(skeleton)
    module = getattr(obj, "module", obj)
    files = list(files)
    check_complete(module, names_in(files))
    load_parts(module, files)
    module.eval()
    return obj


def real_where_state_cannot_reach(module: Any, model: Any, seed: int) -> Any:
    """The driver's meta copy (layer factories) takes the trained tensors themselves when loaded, so
    the whole model exists on the driver once; a layer with tensors no state dict carries (a
    non-persistent buffer) is built for real from its factory first."""
    from sparkdl.model.layer_factories import LayerFactories, on_meta

    factories = LayerFactories.of(model)
    if factories is not None and on_meta(module):
        for index in range(len(factories)):  # frozen parameters never come back from the ranks either
            if _meta_beyond_state(module[index], f"{index}.") or _frozen_meta(module[index]):
                module[index] = factories.layer(index, seed)
    return module


def _meta_beyond_state(layer: Any, prefix: str) -> bool:
    """A meta layer with a tensor its state dict does not hold (loading could not make it real)."""
    from sparkdl.model.layer_factories import on_meta

    if not on_meta(layer):
        return False
    named = {n for n, _ in layer.named_parameters()} | {n for n, _ in layer.named_buffers()}
    attributes = (v for m in layer.modules() for v in vars(m).values())  # a tensor kept as a plain attribute
    return bool(named - set(layer.state_dict())) or any(getattr(v, "is_meta", False) is True for v in attributes)


def _frozen_meta(layer: Any) -> bool:
    return any(p.is_meta and not p.requires_grad for p in layer.parameters())
