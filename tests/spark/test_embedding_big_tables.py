"""Embedding tables three times one executor's memory (spark.executor.memory=1g on local-cluster):
the planner refuses to replicate them, four ranks hold a quarter each, the trained tables come back
piece by piece into file-backed memory on the driver (never its anonymous memory whole), and
transform scores a DataFrame by mapping those files on the executors instead of shipping the tables."""
from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from sparkdl import TorchEstimator
from sparkdl.data.sparse_hash import integer_rows
from sparkdl.embeddings import DLRM, TableSpec
from sparkdl.embeddings.mapped import mapped_path
from sparkdl.embeddings.sharded import initial_rows

DIM, ROWS_PER_TABLE = 16, 1 << 24  # 1 GiB of fp32 per table
SPECS = tuple(TableSpec(name, ROWS_PER_TABLE, DIM) for name in ("a", "b", "c"))
EXECUTOR_MEMORY = 1 << 30


def big_dlrm() -> nn.Module:
    return DLRM(1, SPECS, bottom=[8, DIM], top=[8])


def anonymous_rss() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.fixture(scope="module")
def big_ids(spark):  # type: ignore[no-untyped-def]
    rows = [(float(i % 5), i * 7_919_177, (i * 104_729) % ROWS_PER_TABLE, i * 3 + 1, i % 2) for i in range(32)]
    return spark.createDataFrame(rows, "x double, a bigint, b bigint, c bigint, y int").repartition(4).cache()


def test_tables_three_times_an_executor_train_sharded_come_back_and_score(spark, big_ids) -> None:  # type: ignore[no-untyped-def]
    assert sum(s.nbytes for s in SPECS) >= 3 * EXECUTOR_MEMORY
    assert spark.sparkContext.getConf().get("spark.executor.memory") == "1g"
    import sparkdl

    options = dict(feature_cols=["x"], label_col="y", loss="bce_with_logits", num_workers=4, batch_size=4,
                   sparse_cols={n: {"num_rows": ROWS_PER_TABLE} for n in "abc"}, epochs=1, lr=0.01,
                   embedding_lr=0.5, max_memory_per_rank="1g", tracking=False, progress=False)
    plan = sparkdl.plan(big_dlrm, big_ids, **options)  # the driver builds the model deferred: no tables
    assert not plan.layout.replicated and "exceed one rank's 1.0 GiB" in plan.explain(), plan.explain()
    before = anonymous_rss()
    trained = TorchEstimator(model=big_dlrm, **options).fit(big_ids)
    module = trained.torch_module()
    tables = list(module.embeddings.weights)
    assert all(mapped_path(t) for t in tables), "large tables come back file-backed"
    assert anonymous_rss() - before < EXECUTOR_MEMORY, "the tables went through the driver's memory"
    ids = big_ids.select("a").toPandas()["a"].tolist()
    touched = int(integer_rows([ids[1]], ROWS_PER_TABLE)[0])  # hashed when outside the table
    start = initial_rows(SPECS[0], touched, touched + 1)
    assert not torch.equal(tables[0][touched:touched + 1], start), "a looked-up row was trained"
    far = next(r for r in range(ROWS_PER_TABLE - 1, 0, -1) if r not in set(integer_rows(ids, ROWS_PER_TABLE)))
    torch.testing.assert_close(tables[0][far:far + 1], initial_rows(SPECS[0], far, far + 1))
    assert len(pickle.dumps(module)) < 1 << 20, "scoring ships the tables' file names, not their rows"
    scored = trained.transform(big_ids).collect()
    assert len(scored) == 32 and {r.prediction for r in scored} <= {0, 1}
