"""Spot-safe runs across separate hosts: the multi-host bed (tests/support/multihost.py) with three
worker hosts, one of which is lost for good mid-fit (its Spark Worker and executors SIGKILLed, its
link cut): data parallel goes on with 2 hosts and ends with the weights of a run that resumed the
same checkpoint on 2 workers; DiLoCo and sharded end within 2 % of the eval loss of an
uninterrupted 3-host run; the host comes back and DiLoCo grows to 3 at the next epoch end.
The session's bed, after test_multihost's scenarios (a lost host would disturb them), with one
core per worker host. Needs root.

Run alone: `.venv/bin/python -m pytest tests/spark/test_multihost_elastic.py -v` (as root)."""
from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

SUPPORT = Path(__file__).resolve().parents[1] / "support"
sys.path.insert(0, str(SUPPORT))

import multihost  # noqa: E402
from bed_controller import Controller  # noqa: E402

pytestmark = [pytest.mark.bed, pytest.mark.skipif(multihost.why_not() is not None, reason=str(multihost.why_not())),
              pytest.mark.timeout(1200)]
DRIVER = SUPPORT / "bed_elastic.py"
SCENARIOS = ["elastic-data_parallel", "elastic-diloco", "steady-diloco", "elastic-sharded", "steady-sharded",
             "below-min"]


@pytest.fixture(scope="module")
def bed_results(bed: multihost.Bed) -> dict[str, Any]:
    # One core per worker host: a lost host takes exactly one slot with it (the session's bed,
    # tests/spark/conftest.py, shared with test_multihost, whose scenarios ran on two per host).
    bed.use_worker_cores(1)
    out, ask = bed.shared / "results-elastic.json", bed.shared / "ask-elastic"
    with Controller(bed, ask) as controller:
        done = bed.run_on(bed.driver, [sys.executable, str(DRIVER), bed.master_url, str(out),
                                       ",".join(SCENARIOS), "--shared", str(bed.shared), "--ask", str(ask)],
                          timeout=1000)
    print(done.stderr[-6000:])
    assert out.exists(), f"the driver wrote no results (rc {done.returncode}):\n{done.stderr[-4000:]}"
    results = json.loads(out.read_text())
    results["controller"] = list(controller.log)
    results["kept"] = str(bed.shared)  # the session's bed keeps its shared directory to the end
    return results


def ok(results: dict[str, Any], name: str) -> dict[str, Any]:
    result = results[name]
    assert "error" not in result, f"{name}: {result.get('message')}\n{result.get('trace')}"
    assert not result.get("lost", False) or name.startswith("elastic"), result
    return result


def test_data_parallel_goes_on_with_two_hosts_and_equals_a_resume_on_two(bed_results, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import bed_driver
    import bed_elastic
    from pyspark import cloudpickle

    from sparkdl import TorchEstimator

    result = ok(bed_results, "elastic-data_parallel")
    assert result["lost"] and result["workers"][-1] == 2, result
    (change,) = result["membership"]
    assert (change["from_workers"], change["to_workers"]) == (3, 2) and change["hosts_left"], change
    assert change["global_batch"] == 48 and change["per_rank_batch"] == 24, change
    lost = [e for e in bed_results["controller"] if e.get("do") == "lose"]
    assert change["hosts_left"] == [lost[0]["answer"]["host"]], (change, lost)
    (step,) = result["resized_from_step"]

    # The reference on this process's local-cluster session: the same checkpoint (its manifest cut
    # back to the step the elastic run resumed), 2 workers, the same global batch, rows and options.
    shared = Path(result["checkpoint_dir"]).parent
    (run,) = result["runs"]
    source = Path(bed_results["kept"]) / Path(result["checkpoint_dir"]).relative_to(shared) / run
    copy = tmp_path / "checkpoints"
    shutil.copytree(source, copy / run)
    manifest = json.loads((copy / run / "manifest.json").read_text())
    manifest["steps"] = [s for s in manifest["steps"] if s["step"] <= step]
    assert manifest["steps"][-1]["step"] == step and manifest["steps"][-1]["world_size"] == 3
    (copy / run / "manifest.json").write_text(json.dumps(manifest))
    for module in (bed_driver, bed_elastic):
        cloudpickle.register_pickle_by_value(module)
    df, validation = bed_elastic.frames(spark)
    bed_elastic.LOSE.update(ask="")
    reference = TorchEstimator(
        **dict(bed_elastic.TRAINING, batch_size=24), model=bed_driver.net, feature_cols=bed_driver.FEATURES,
        label_col="label", num_workers=2, strategy="data_parallel", tracking=False, progress=False,
        loss=bed_elastic.losing_loss, validation_df=validation, checkpoint_dir=str(copy), checkpoint_every=5,
        keep_checkpoints=50, resume_run=run).fit(df)
    elastic = torch.load(Path(bed_results["kept"]) / Path(result["weights"]).name, weights_only=True)
    for key, value in reference.torch_module().state_dict().items():
        torch.testing.assert_close(elastic[key], value, atol=1e-5, rtol=0, msg=key)


def test_diloco_shrinks_grows_back_when_the_host_returns_and_ends_within_2_percent(bed_results) -> None:  # type: ignore[no-untyped-def]
    result, steady = ok(bed_results, "elastic-diloco"), ok(bed_results, "steady-diloco")
    assert 2 in result["workers"] and result["workers"][-1] == 3, result
    assert [(c["from_workers"], c["to_workers"]) for c in result["membership"]] == [(3, 2), (2, 3)], result
    assert result["membership"][1]["reason"] == "slots returned" and result["membership"][1]["hosts_joined"], result
    assert result["val_loss"] <= steady["val_loss"] * 1.02, (result["val_loss"], steady["val_loss"])


def test_sharded_goes_on_with_two_hosts_within_2_percent_of_an_uninterrupted_run(bed_results) -> None:  # type: ignore[no-untyped-def]
    result, steady = ok(bed_results, "elastic-sharded"), ok(bed_results, "steady-sharded")
    assert result["lost"] and result["workers"][-1] == 2, result
    assert [(c["from_workers"], c["to_workers"]) for c in result["membership"]] == [(3, 2)], result
    assert result["val_loss"] <= steady["val_loss"] * 1.02, (result["val_loss"], steady["val_loss"])


def test_the_run_goes_on_within_the_bound_after_a_loss(bed_results) -> None:  # type: ignore[no-untyped-def]
    """From the host's loss to the re-plan for 2 workers: the executor-lost event + the replacement
    wait (launch.replacement_wait_s=5) + the re-plan's data preparation; one restart follows."""
    losses = [e for e in bed_results["controller"] if e.get("do") == "lose"]
    assert len(losses) == 5, bed_results["controller"]  # one per elastic scenario, in order, then two
    for lost, name in zip(losses, ["elastic-data_parallel", "elastic-diloco", "elastic-sharded"]):
        ((said_at, line), *_) = ok(bed_results, name)["said"]
        assert "sparkdl: workers 3 -> 2 (hosts lost; left: " in line, line
        assert said_at - lost["answer"]["at"] <= 5 + 25, (name, said_at - lost["answer"]["at"])


def test_below_min_workers_the_fit_fails_naming_the_hosts_lost_and_the_slots_found(bed_results) -> None:  # type: ignore[no-untyped-def]
    result = bed_results["below-min"]
    assert result["lost"] and result.get("error_type") == "TrainingError", result
    assert re.search(r"the run lost host\(s\) 198\.18\.0\.\d+, 198\.18\.0\.\d+: 1 slot\(s\) found after waiting "
                     r"launch.replacement_wait_s=5 s for replacements, fewer than launch.min_workers=2 \(it had 3\)",
                     result["message"]), result["message"]
    last_loss = [e for e in bed_results["controller"] if e.get("do") == "lose"][-1]
    # Detection (the executor-lost event) + the replacement wait + the check: well inside 30 s.
    assert result["failed_at"] - last_loss["answer"]["at"] <= 5 + 25, result
