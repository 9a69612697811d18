"""A recommender model through fit: categorical columns (data.sparse_cols) looked up in embedding
tables sharded over two executors (strategy "embeddings"), the trained tables returned piece by
piece, transform and MLflow's pyfunc scoring the same rows alike."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from sparkdl import TorchEstimator
from sparkdl.data.sparse_hash import integer_rows, string_rows
from sparkdl.embeddings import DLRM, Bag, TableSpec
from sparkdl.embeddings.optimizers import RowwiseAdagrad
from sparkdl.embeddings.sharded import initial_rows
from sparkdl.errors import ConfigError, ModelError

ROWS, DIM, USERS, ITEMS, TAGS = 64, 4, 50, 40, 30
SPECS = (TableSpec("users", USERS, DIM), TableSpec("items", ITEMS, DIM), TableSpec("tags", TAGS, DIM))
SPARSE = {"user": {"table": "users", "num_rows": USERS}, "item": {"table": "items", "num_rows": ITEMS},
          "tags": {"num_rows": TAGS, "weights_col": "tag_w"}}
COMMON = dict(num_workers=2, tracking=False, progress=False, loss="bce_with_logits", feature_cols=["f0", "f1"],
              sparse_cols=SPARSE, label_col="clicked", shuffle=False)


def dlrm() -> nn.Module:
    return DLRM(2, SPECS, bottom=[8, DIM], top=[8], features={"user": "users", "item": "items", "tags": "tags"})


def click_rows() -> list[tuple]:
    rng = np.random.default_rng(3)
    rows = []
    for i in range(ROWS):
        user = int(rng.integers(0, USERS)) if i % 7 else 10**9 + i  # every 7th out of range: hashed
        tags = [int(t) for t in rng.integers(0, TAGS, size=int(rng.integers(0, 4)))]
        rows.append((float(rng.normal()), float(rng.normal()), user, f"item-{rng.integers(0, 60)}", tags,
                     [float(w) for w in rng.uniform(0.5, 2.0, size=len(tags))], int(rng.integers(0, 2))))
    return rows


@pytest.fixture(scope="module")
def clicks(spark):  # type: ignore[no-untyped-def]
    schema = ("f0 double, f1 double, user bigint, item string, tags array<int>, tag_w array<double>, "
              "clicked int")
    return spark.createDataFrame(click_rows(), schema).repartition(2).cache()


def local_batch(rows: list[tuple]) -> tuple[torch.Tensor, dict[str, Bag], torch.Tensor]:
    """The rows as the model sees them, ids mapped to table rows by the documented rules."""
    dense = torch.tensor([[r[0], r[1]] for r in rows], dtype=torch.float32)
    users = torch.from_numpy(integer_rows([r[2] for r in rows], USERS))
    items = torch.from_numpy(string_rows([r[3] for r in rows], ITEMS))
    tags = torch.tensor([t for r in rows for t in r[4]], dtype=torch.int64)
    weights = torch.tensor([w for r in rows for w in r[5]], dtype=torch.float32)
    lengths = torch.tensor([len(r[4]) for r in rows])
    single = torch.arange(len(rows))
    sparse = {"user": Bag(users, single), "item": Bag(items, single), "tags": Bag.from_lengths(tags, lengths, weights)}
    return dense, sparse, torch.tensor([float(r[6]) for r in rows])


def one_step_reference(lr: float, table_lr: float) -> nn.Module:
    """One process, one step on every row: SGD on the dense layers, row-wise Adagrad on the rows touched."""
    torch.manual_seed(0)
    model = dlrm()
    dense, sparse, labels = local_batch(click_rows())
    loss = nn.functional.binary_cross_entropy_with_logits(model(dense, sparse), labels)
    loss.backward()
    optimizer, tables = RowwiseAdagrad(lr=table_lr), model.embeddings.weights
    with torch.no_grad():
        for param in model.parameters():
            if all(param is not t for t in tables) and param.grad is not None:
                param -= lr * param.grad
        for table in tables:
            rows = torch.nonzero(table.grad.abs().sum(1)).reshape(-1)
            optimizer.update(table.data, optimizer.init_state(table.data), rows, table.grad[rows])
    return model


def test_one_sharded_step_through_fit_equals_one_process_on_every_row(clicks) -> None:  # type: ignore[no-untyped-def]
    estimator = TorchEstimator(model=dlrm, epochs=1, batch_size=ROWS // 2, optimizer="sgd", lr=0.1,
                               embedding_lr=0.05, **COMMON)
    trained = estimator.fit(clicks)
    assert trained.options.get("train.strategy") == "embeddings", trained.options
    expected = one_step_reference(lr=0.1, table_lr=0.05)
    got = trained.torch_module().state_dict()
    for name, value in expected.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
    untouched = torch.ones(USERS, dtype=torch.bool)
    untouched[local_batch(click_rows())[1]["user"].ids] = False
    torch.testing.assert_close(got["embeddings.weights.0"][untouched],
                               initial_rows(SPECS[0], 0, USERS)[untouched])  # rows no batch touched: as drawn


def test_trained_model_scores_a_dataframe_as_the_module_does(clicks) -> None:  # type: ignore[no-untyped-def]
    trained = TorchEstimator(model=dlrm, epochs=2, batch_size=8, lr=0.01, embedding_optimizer="adam",
                             **COMMON).fit(clicks)
    assert len(trained.history) == 2 and all(np.isfinite(h["loss"]) for h in trained.history)
    scored = trained.transform(clicks).orderBy("user", "item").collect()
    assert len(scored) == ROWS
    rows = [(r.f0, r.f1, r.user, r.item, list(r.tags), list(r.tag_w), r.clicked) for r in scored]
    dense, sparse, _ = local_batch(rows)
    with torch.no_grad():
        expected = torch.sigmoid(trained.torch_module()(dense, sparse)) > 0.5
    assert [bool(r.prediction) for r in scored] == expected.tolist()
    from pyspark.sql import functions as F

    with pytest.raises(Exception, match="column 'user' .* holds a null id"):
        trained.transform(clicks.withColumn("user", F.when(F.col("f0") > 0, F.col("user")))).collect()


def test_a_model_without_the_declared_tables_is_refused_before_training(clicks) -> None:  # type: ignore[no-untyped-def]
    def short() -> nn.Module:
        return DLRM(2, SPECS[:2], bottom=[8, DIM], top=[8])

    with pytest.raises(ModelError, match="table 'tags'"):
        TorchEstimator(model=short, epochs=1, batch_size=8, **COMMON).fit(clicks)
    with pytest.raises(ConfigError, match="not train.strategy='data_parallel'"):
        TorchEstimator(model=dlrm, epochs=1, batch_size=8, strategy="data_parallel", **COMMON).fit(clicks)


def test_auto_placement_prices_replicated_against_sharded_and_says_which(clicks) -> None:  # type: ignore[no-untyped-def]
    import sparkdl

    options = {**COMMON, "epochs": 1, "batch_size": 8}
    auto = sparkdl.plan(dlrm, clicks, **options)
    assert auto.strategy == "embeddings"
    text = auto.explain()
    assert "chosen:" in text and "replicated" in text and "sharded" in text, text
    chosen = dict(auto.params)["embeddings.placement"]
    assert auto.layout.replicated == (chosen == "replicated")
    assert f"embeddings: tables {'replicated' if chosen == 'replicated' else 'sharded'}" in text
    # Whole tables with their gradients and state over the budget: only sharding fits.
    tight = sparkdl.plan(dlrm, clicks, max_memory_per_rank=3000, **options)
    assert not tight.layout.replicated and dict(tight.params)["embeddings.placement"] == "sharded"
    assert "exceed one rank's" in tight.explain()
    named = sparkdl.plan(dlrm, clicks, embedding_placement="replicated", **options)
    assert named.layout.replicated and "chosen:" not in named.explain()
    kept = TorchEstimator(model=dlrm, plan=named.to_json(), **options).fit(clicks)  # trains the kept layout
    assert "touched" in kept.history[0]["embedding_bytes_per_step"]  # replicated's touched-row mask went out


KILL = {"path": "", "calls": 0}


def killing_bce(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """BCE with logits; rank 1 kills its process (SIGKILL) at its 10th step, once per marker file."""
    import os
    import signal
    from pathlib import Path

    # Counted on the ranks only: the driver's probe calls it too, and KILL travels by value as it is then.
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else -1
    KILL["calls"] += rank >= 0
    if rank == 1 and KILL["calls"] == 10 and KILL["path"] and not os.path.exists(KILL["path"]):
        Path(KILL["path"]).touch()
        from sparkdl.executor.checkpoint_async import wait_idle

        wait_idle(60)  # the saves queued so far are on disk: the resume point does not race the disk
        os.kill(os.getpid(), signal.SIGKILL)
    return nn.functional.binary_cross_entropy_with_logits(output, labels.float())


@pytest.mark.parametrize("placement", ["sharded", "replicated"])
def test_a_killed_rank_resumes_its_shards_exactly(clicks, tmp_path, capsys, placement) -> None:  # type: ignore[no-untyped-def]
    import os

    options = {**COMMON, "loss": killing_bce, "task": "regression", "epochs": 2, "batch_size": 4, "lr": 0.01,
               "embedding_optimizer": "adam", "embedding_placement": placement, "peer_failure_delay_s": 0.5}
    KILL.update(path=str(tmp_path / "killed"), calls=0)
    open(KILL["path"], "w").close()  # present: the reference run never kills
    reference = TorchEstimator(model=dlrm, **options).fit(clicks)
    os.remove(KILL["path"])
    resumed = TorchEstimator(model=dlrm, checkpoint_dir=str(tmp_path / "checkpoints"), checkpoint_every=3,
                             **options).fit(clicks)
    assert os.path.exists(KILL["path"]), "rank 1 was never killed"
    err = capsys.readouterr().err
    assert "attempt 1 of 4 failed" in err, err
    assert any(h.get("resumed_from_step") for h in resumed.history), (resumed.history, err)
    assert resumed.history[1]["loss"] == pytest.approx(reference.history[1]["loss"], rel=1e-5)
    got, want = resumed.torch_module().state_dict(), reference.torch_module().state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=0, msg=key)


def test_the_logged_model_serves_raw_ids_from_pandas_as_transform_scores_them(clicks, mlflow_server) -> None:  # type: ignore[no-untyped-def]
    """MLflow's pyfunc gets the user's columns (ids out of range, strings, lists with weights) and maps
    them to rows with the rules training used; also with the model never loaded on the driver."""
    import mlflow.pyfunc

    options = {**COMMON, "tracking": True, "tracking_uri": mlflow_server.uri, "epochs": 1, "batch_size": 8}
    for load in (True, False):
        model = TorchEstimator(model=dlrm, load_model=load, **options).fit(clicks)
        assert model.model_uri
        rows = spark_rows = clicks.orderBy("user", "item").collect()
        frame = clicks.sparkSession.createDataFrame(spark_rows, clicks.schema).toPandas()
        mlflow.set_tracking_uri(mlflow_server.uri)
        try:
            served = mlflow.pyfunc.load_model(model.model_uri).predict(
                frame[["f0", "f1", "user", "item", "tags", "tag_w"]])
        finally:
            mlflow.set_tracking_uri(None)
        scored = {(r.user, r.item): r.prediction for r in model.transform(clicks).collect()}
        assert list(served["prediction"]) == [scored[(r.user, r.item)] for r in rows]


def test_late_embedding_updates_stay_within_their_bound_and_validation_looks_rows_up(clicks) -> None:  # type: ignore[no-untyped-def]
    trained = TorchEstimator(model=dlrm, epochs=2, batch_size=4, lr=0.01, embedding_staleness=2,
                             validation_fraction=0.25, metrics=["auc"], **COMMON).fit(clicks)
    lags = [h["max_embedding_max_lag_per_rank"] for h in trained.history]
    assert max(lags) == 2, trained.history  # updates did run late, never later than the bound
    assert all(0.0 <= h["val_auc"] <= 1.0 and np.isfinite(h["val_loss"]) for h in trained.history)


@pytest.mark.parametrize("first, then", [("sharded", "sharded"), ("replicated", "sharded")])
def test_checkpoints_carry_over_to_another_number_of_ranks_and_placement(clicks, tmp_path, first, then) -> None:  # type: ignore[no-untyped-def]
    """Two ranks checkpoint an epoch's end; four ranks (and another placement) continue that
    checkpoint, each keeping only its own rows, cut from the old parts one at a time: with nothing
    left to train the tables come back as the two ranks had them."""
    import os

    checkpoints = tmp_path / "checkpoints"
    options = {**COMMON, "batch_size": 8, "embedding_optimizer": "adam"}
    one = TorchEstimator(model=dlrm, epochs=1, embedding_placement=first, **options).fit(clicks)
    TorchEstimator(model=dlrm, epochs=2, embedding_placement=first, checkpoint_dir=str(checkpoints),
                   **options).fit(clicks)  # saves the end of epoch 1
    (run_id,) = os.listdir(checkpoints)
    four = {**options, "num_workers": 4, "batch_size": 4, "checkpoint_dir": str(checkpoints), "resume_run": run_id}
    carried = TorchEstimator(model=dlrm, epochs=1, embedding_placement=then, **four).fit(clicks)
    got, want = carried.torch_module().state_dict(), one.torch_module().state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=0, rtol=0, msg=key)
    if first == then:  # and training goes on from there on four ranks
        more = TorchEstimator(model=dlrm, epochs=2, embedding_placement=then, **four).fit(clicks)
        assert more.history[-1]["steps"] == 64 // 16 and np.isfinite(more.history[-1]["loss"])


def test_tables_the_columns_cannot_use_are_refused_before_training(clicks) -> None:  # type: ignore[no-untyped-def]
    def unnamed() -> nn.Module:  # two columns on one table, the model not told which
        return DLRM(2, SPECS, bottom=[8, DIM], top=[8])

    shared = {**SPARSE, "user": {"table": "items", "num_rows": ITEMS}}
    with pytest.raises(ModelError, match=r"(?s)columns \['user', 'item'\] share table 'items'.*features="):
        TorchEstimator(model=unnamed, epochs=1, batch_size=8, **{**COMMON, "sparse_cols": shared}).fit(clicks)

    def mean_tags() -> nn.Module:
        specs = SPECS[:2] + (TableSpec("tags", TAGS, DIM, pooling="mean"),)
        return DLRM(2, specs, bottom=[8, DIM], top=[8], features={"user": "users", "item": "items", "tags": "tags"})

    with pytest.raises(ModelError, match="pools by 'mean'"):
        TorchEstimator(model=mean_tags, epochs=1, batch_size=8, **COMMON).fit(clicks)
    wide = {**SPARSE, "tags": {**SPARSE["tags"], "dim": DIM + 1}}
    with pytest.raises(ModelError, match="4 wide in the model but dim=5"):
        TorchEstimator(model=dlrm, epochs=1, batch_size=8, **{**COMMON, "sparse_cols": wide}).fit(clicks)
