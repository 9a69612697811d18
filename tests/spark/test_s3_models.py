"""The trained model through an object store (moto's S3 on 127.0.0.1, the `s3_server` fixture):
the ranks write their parts to the run's storage and the driver reads them there
(launch.model_transfer="storage"), and TorchModel.save/load round-trips through s3:// with no
Hadoop connector: all of it through sparkdl/storage/files.py and pyarrow's S3 filesystem."""
from __future__ import annotations

import uuid

import pyarrow.fs as pafs
import pytest
import torch

from sparkdl import TorchModel
from sparkdl.errors import SparkdlError
from test_checkpoints import fit, rows_df


def _objects(s3_server, prefix: str) -> list[str]:  # type: ignore[no-untyped-def]
    fs, bucket = s3_server.filesystem()
    return sorted(info.path.split(f"{prefix}/", 1)[1]
                  for info in fs.get_file_info(pafs.FileSelector(f"{bucket}/{prefix}", recursive=True, allow_not_found=True))
                  if info.type == pafs.FileType.File)


def test_parts_through_s3_then_save_and_load_on_s3(spark, s3_server) -> None:  # type: ignore[no-untyped-def]
    df = rows_df(spark)
    prefix = f"runs-{uuid.uuid4().hex[:8]}"
    reference = fit(df, loss="cross_entropy", epochs=1)
    model = fit(df, loss="cross_entropy", epochs=1, checkpoint_dir=s3_server.uri(prefix), model_transfer="storage")
    assert set(model.model_transfer.values()) == {"storage"}
    for key, value in reference.torch_module().state_dict().items():
        assert torch.equal(model.torch_module().state_dict()[key], value), key
    # loaded on the driver: the parts the ranks left in the bucket are gone, the checkpoints stay
    assert not [name for name in _objects(s3_server, prefix) if "/model/" in name]

    saved = s3_server.uri(f"models-{uuid.uuid4().hex[:8]}/net")
    model.save(saved)
    names = _objects(s3_server, saved.split("?")[0].split("/", 3)[3])
    assert "metadata/part-00000" in names and "data/module.pkl" in names and "data/weights/part-0.safetensors" in names
    loaded = TorchModel.load(saved)
    for key, value in model.torch_module().state_dict().items():
        assert torch.equal(loaded.torch_module().state_dict()[key], value), key
    scored = loaded.transform(df).orderBy(*df.columns).collect()
    assert [r.prediction for r in scored] == [r.prediction for r in model.transform(df).orderBy(*df.columns).collect()]
    with pytest.raises(SparkdlError, match="already holds a saved model"):
        model.save(saved)
    model.write().overwrite().save(saved)
    assert TorchModel.load(saved).uid == model.uid
