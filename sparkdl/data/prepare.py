"""The one preparation call of fit, plan and run: every option taken from the run's config, so the
three cannot drift apart (validation rows, seed, invalid rows, classification), whichever layout
the run uses (feature_cols: data/feed.py; input_cols: data/tensor_feed.py; sparse_cols:
data/sparse_feed.py), and whoever delivers
the rows (Spark's rows, blocks of rows packed on the JVM: data/packed_delivery.py, or the ranks
reading a plain Parquet scan: data/parquet_source.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pyspark.sql import DataFrame

from sparkdl.data.feed import PreparedData, is_classification, prepare
from sparkdl.data.packed_delivery import with_packed_delivery
from sparkdl.data.parquet_source import direct_candidate, with_parquet_source
from sparkdl.data.sparse_feed import prepare_sparse
from sparkdl.data.tensor_feed import prepare_tensors

LABELS_KEYWORD = "labels"  # loss="model": Hugging Face's keyword for the labels a model computes its loss from
from sparkdl.config.elastic import is_elastic

if TYPE_CHECKING:
    from sparkdl.config import DataConfig, LaunchConfig, TrainConfig


def prepare_run(df: DataFrame, data: "DataConfig", train: "TrainConfig", launch: "LaunchConfig",
                validation_df: DataFrame | None = None, custom_loop: bool = False) -> PreparedData:
    """The data stage: the DataFrame checked, split, counted and dealt into launch.num_workers shards,
    with the delivery data.delivery allows; train gives the seed, the loss (classification or
    regression) and resume_run."""
    classification = is_classification(df, data, train, custom_loop)
    # A run that may resume at another size deals its rows in a fixed order, so a resized attempt
    # sees what a fresh fit at that size would (a shuffle's arrival order varies run to run).
    fixed = is_elastic(launch) or bool(train.resume_run)
    if data.sparse_cols is not None:
        return prepare_sparse(df, data, classification=classification, num_workers=launch.num_workers,
                              validation_df=validation_df, seed=train.seed, fixed_order=fixed)
    if data.input_cols is not None:
        return prepare_tensors(df, data, classification=classification, num_workers=launch.num_workers,
                               validation_df=validation_df, seed=train.seed, fixed_order=fixed,
                               label_keyword=LABELS_KEYWORD if train.loss == "model" else None)
    scan = direct_candidate(df, data, validation_df)
    prepared = prepare(df, data.feature_cols, data.label_col, classification=classification,
                       num_workers=launch.num_workers, validation_df=validation_df,
                       validation_fraction=data.validation_fraction, seed=train.seed,
                       on_invalid=data.on_invalid, weight_col=data.weight_col,
                       count_kept_partitions=scan is None,  # direct reads count the rows from the footers
                       fixed_order=fixed)
    return with_packed_delivery(with_parquet_source(prepared, scan, data.delivery, launch.num_workers), data.delivery)
