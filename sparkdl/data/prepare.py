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


def preparation_key(data: "DataConfig", train: "TrainConfig", launch: "LaunchConfig") -> str:
    """What prepare_run's result depends on besides the DataFrames: every data option, and the few
    train and launch options it reads (keep in step with prepare_run)."""
    return repr((data, train.seed, train.loss, train.task, bool(train.resume_run), launch.num_workers,
                 is_elastic(launch)))


class PreparedRuns:
    """prepare_run's results kept for the fits of one tuning grid (TorchEstimator.fitMultiple): the
    grid's points that differ only in options prepare_run does not read (lr, epochs, the optimizer,
    the strategy) share one stats job and one dealing of the rows. Thread-safe (CrossValidator's
    parallelism fits points at once); the DataFrames are held, so their ids stay theirs."""

    def __init__(self) -> None:
        import threading

        self._lock = threading.Lock()
        self._prepared: dict[tuple[int, int, str], tuple[PreparedData, DataFrame, DataFrame | None]] = {}
        self.shared = 0  # fits that took an earlier fit's preparation

    def prepared(self, df: DataFrame, data: "DataConfig", train: "TrainConfig", launch: "LaunchConfig",
                 validation_df: DataFrame | None = None) -> PreparedData:
        key = (id(df), id(validation_df), preparation_key(data, train, launch))
        with self._lock:  # one preparation per key, even when two points ask at once
            if key in self._prepared:
                self.shared += 1
                return self._prepared[key][0]
            prepared = prepare_run(df, data, train, launch, validation_df)
            self._prepared[key] = (prepared, df, validation_df)
            return prepared


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
