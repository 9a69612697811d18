"""A damaged latest checkpoint in a real fit (issue 44): a fit keeps its last two steps, its latest
step's part is then truncated or has one bit flipped, and a fit that continues it (resume_run)
resumes every rank from the previous step, says so in its history and MLflow run, and ends with the
weights of a resume from that previous step. A manifest with bad types is one clear error on every
rank, not a hang."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from sparkdl import TorchEstimator
from sparkdl.errors import SparkdlError

FEATURES = [f"f{i}" for i in range(6)]
LATEST, PREVIOUS = 18, 15  # 2 epochs of 10 steps, a save every 3 steps, the last two kept


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 3))


def fit(df, checkpoints: Path, **options):  # type: ignore[no-untyped-def]
    settings = dict(model=net, feature_cols=FEATURES, label_col="label", batch_size=8, epochs=2, num_workers=2,
                    optimizer="sgd", lr=0.1, momentum=0.9, seed=5, strategy="data_parallel", tracking=False,
                    progress=False, checkpoint_dir=str(checkpoints), checkpoint_every=3, keep_checkpoints=2,
                    peer_failure_delay_s=0.5)
    settings.update(options)
    return TorchEstimator(**settings).fit(df)


@pytest.fixture(scope="module")
def written(spark, tmp_path_factory):  # type: ignore[no-untyped-def]
    """(the rows, a finished fit's checkpoints, its run id, a resume of it from step PREVIOUS)."""
    rng = np.random.default_rng(11)
    x = rng.normal(size=(160, 6))
    y = (x[:, 0] + x[:, 1] > 0).astype(int) + (x[:, 2] > 1).astype(int)
    rows = [(*map(float, r), int(t)) for r, t in zip(x, y)]
    df = spark.sparkContext.parallelize(rows, 2).toDF(FEATURES + ["label"]).cache()  # one partition per rank
    original = tmp_path_factory.mktemp("fallback") / "original"
    fit(df, original)
    (run,) = [p.name for p in original.iterdir()]
    manifest = json.loads((original / run / "manifest.json").read_text())
    assert [s["step"] for s in manifest["steps"]] == [PREVIOUS, LATEST]
    # The reference: the same checkpoints with the latest step never recorded.
    reference_dir = copied(original, original.parent / "reference")
    manifest["steps"] = manifest["steps"][:1]
    (reference_dir / run / "manifest.json").write_text(json.dumps(manifest))
    reference = fit(df, reference_dir, resume_run=run)
    assert reference.history[1]["resumed_from_step"] == PREVIOUS
    return df, original, run, reference


def copied(original: Path, to: Path) -> Path:
    shutil.copytree(original, to)
    return to


def latest_part(root: Path, run: str, rank: int) -> Path:
    return root / run / f"step-{LATEST:09d}" / f"rank-{rank}.pt"


def assert_resumed_from_previous(resumed, reference, says: str) -> None:  # type: ignore[no-untyped-def]
    record = resumed.history[1]  # step 15 is in epoch 1; epoch 0's record came with the checkpoint
    assert record["resumed_from_step"] == PREVIOUS
    assert record["checkpoint_fallback_from_step"] == LATEST and says in record["checkpoint_fallback"], record
    assert [h["steps"] for h in resumed.history] == [10, 10]
    got, want = resumed.torch_module().state_dict(), reference.torch_module().state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=0, msg=key)


def test_a_truncated_latest_checkpoint_resumes_from_the_previous_step(  # type: ignore[no-untyped-def]
        written, tmp_path, capsys) -> None:
    df, original, run, reference = written
    damaged = copied(original, tmp_path / "ck")
    part = latest_part(damaged, run, 1)
    part.write_bytes(part.read_bytes()[:100])
    resumed = fit(df, damaged, resume_run=run, tracking=True)
    assert_resumed_from_previous(resumed, reference, "rank-1.pt' does not match its checksum")
    aside = damaged / run / f"damaged-step-{LATEST:09d}"  # moved aside, not deleted; the fit saved step 18 anew
    assert (aside / "rank-1.pt").stat().st_size == 100 and (aside / "rank-0.pt").is_file()
    captured = capsys.readouterr()
    assert f"resumed from the checkpoint of step {PREVIOUS}, not the newest (step {LATEST})" in captured.err
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    tags = client.get_run(resumed.run_id).data.tags
    assert tags["checkpoint_fallback_from_step"] == str(LATEST) and tags["checkpoint_fallback_to_step"] == str(PREVIOUS)
    assert "does not match its checksum" in tags["checkpoint_fallback"]
    assert f"checkpoint_fallback_step_{PREVIOUS}.txt" in [a.path for a in client.list_artifacts(resumed.run_id)]


def test_a_bit_flipped_latest_checkpoint_resumes_from_the_previous_step(  # type: ignore[no-untyped-def]
        written, tmp_path) -> None:
    df, original, run, reference = written
    damaged = copied(original, tmp_path / "ck")
    part = latest_part(damaged, run, 0)  # rank 0's holds the replicated weights
    weight = next(iter(torch.load(part, weights_only=True)["strategy"]["module"].values()))
    data = bytearray(part.read_bytes())
    data[data.find(weight.numpy().tobytes()) + 2] ^= 0x08  # one bit of a weight: torch.load reads it all the same
    part.write_bytes(bytes(data))
    assert not torch.equal(next(iter(torch.load(part, weights_only=True)["strategy"]["module"].values())), weight)
    resumed = fit(df, damaged, resume_run=run)
    assert_resumed_from_previous(resumed, reference, "rank-0.pt' does not match its checksum")


def test_a_manifest_with_bad_types_fails_every_rank_with_one_clear_error(  # type: ignore[no-untyped-def]
        written, tmp_path) -> None:
    df, original, run, _ = written
    damaged = copied(original, tmp_path / "ck")
    where = damaged / run / "manifest.json"
    manifest = json.loads(where.read_text())
    manifest["world_size"] = None  # int(None): a TypeError on rank 0 alone before
    where.write_text(json.dumps(manifest))
    with pytest.raises(SparkdlError, match=r"(?s)checkpoint manifest .*manifest\.json.* cannot be used: "
                                           r"'world_size' must be a whole number"):
        fit(df, damaged, resume_run=run)

