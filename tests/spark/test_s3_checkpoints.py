"""Checkpoints on an object store: a real S3 endpoint (moto's server on 127.0.0.1, the `s3_server`
fixture) reached through pyarrow's S3 filesystem from the executors of local-cluster. A rank killed
with SIGKILL in the middle of uploading its part makes the driver resubmit the job; every rank resumes
from the last step the manifest records, and the weights equal an uninterrupted run's. (A kill
mid-training is tested on a local path in test_checkpoints.py; the storage code is the same.)"""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pyarrow.fs as pafs
import torch

from test_checkpoints import MID_WRITE, fit, installing_loss, rows_df


def test_a_rank_killed_mid_upload_resumes_from_the_last_recorded_step_on_s3(spark, s3_server, tmp_path,  # type: ignore[no-untyped-def]
                                                                             capsys) -> None:
    """SIGKILL on rank 1's writer thread while its part of step 9 is being uploaded (the stream is
    open, the object not yet visible): the resubmitted job resumes from step 6, the manifest's last
    step, with an uninterrupted run's weights, and the bucket keeps no trace of step 9."""
    df = rows_df(spark)
    prefix = f"mid-upload-{uuid.uuid4().hex[:8]}"
    MID_WRITE.update(marker=str(tmp_path / "killed"), checkpoints=s3_server.uri(prefix))
    Path(MID_WRITE["marker"]).touch()  # present: the reference run installs no hook
    reference = fit(df, loss=installing_loss)
    os.remove(MID_WRITE["marker"])

    resumed = fit(df, loss=installing_loss, checkpoint_dir=s3_server.uri(prefix), checkpoint_every=3)
    note = Path(MID_WRITE["marker"]).read_text()
    assert "an upload not completed" in note and "recorded [3, 6]" in note, note
    captured = capsys.readouterr()
    assert "resumed from the checkpoint of step 6" in captured.out + captured.err
    got, want = resumed.torch_module().state_dict(), reference.torch_module().state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0, msg=key)
    # the bucket holds the manifest and the two steps it lists, each with both ranks' parts; nothing of step 9
    fs, bucket = s3_server.filesystem()
    objects = sorted(info.path.split(f"{prefix}/", 1)[1]
                     for info in fs.get_file_info(pafs.FileSelector(f"{bucket}/{prefix}", recursive=True))
                     if info.type == pafs.FileType.File)
    (run_id,) = {name.split("/", 1)[0] for name in objects}
    with fs.open_input_stream(f"{bucket}/{prefix}/{run_id}/manifest.json") as stream:
        manifest = json.loads(stream.read())
    kept = [f"step-{s['step']:09d}" for s in manifest["steps"]]
    assert manifest["world_size"] == 2 and kept == ["step-000000015", "step-000000018"]
    assert objects == [f"{run_id}/manifest.json"] + [f"{run_id}/{step}/rank-{r}.pt" for step in kept for r in (0, 1)]
