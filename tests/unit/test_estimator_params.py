"""sparkdl's options as Spark ML Params (estimator_params.py), without a SparkSession: what
ParamGridBuilder, CrossValidator and explainParams() see, and the RunConfig a fit builds from them."""
from __future__ import annotations

import pytest
import torch
from pyspark.ml.tuning import ParamGridBuilder

from sparkdl import TorchEstimator
from sparkdl.config import RunConfig
from sparkdl.config.sections import option_owners
from sparkdl.errors import ConfigError
from sparkdl.estimator import TorchModel
from sparkdl.estimator_params import option_docs


def estimator(**options):  # type: ignore[no-untyped-def]
    return TorchEstimator(torch.nn.Linear(3, 2), feature_cols=["a", "b", "c"], **options)


def test_every_option_is_a_documented_typed_param_with_its_default() -> None:
    est = estimator(lr=0.05)
    names = {p.name for p in est.params}
    assert set(option_owners()) <= names
    assert {"featuresCol", "labelCol", "predictionCol", "probabilityCol", "rawPredictionCol", "weightCol"} <= names
    assert est.getLr() == 0.05 and est.isSet(est.lr)
    assert est.getBatchSize() == RunConfig().data.batch_size and not est.isSet(est.batch_size)
    assert est.getProbabilityCol() == "probability" and est.getRawPredictionCol() == "rawPrediction"
    text = est.explainParams()
    assert "lr: train.lr: Learning rate. Number > 0. (default: 0.001, current: 0.05)" in text
    assert "batch_size: data.batch_size: Rows per batch" in text
    documented = [p for p in est.params if p.name in option_owners() and "see conf/defaults.toml" in p.doc]
    assert len(option_docs()) >= len(option_owners()) - 2 and len(documented) <= 2
    with pytest.raises(TypeError, match="batch_size"):
        est.setBatchSize("many")
    with pytest.raises(TypeError, match="lr"):
        est.setLr(True)


def test_a_grid_of_copies_trains_with_its_own_values_and_leaves_the_estimator_alone() -> None:
    est = estimator(epochs=2)
    grid = ParamGridBuilder().addGrid(est.lr, [0.1, 0.01]).addGrid(est.batch_size, [16, 32]).build()
    assert len(grid) == 4
    configs = [est.copy(point).config for point in grid]
    assert sorted((c.train.lr, c.data.batch_size) for c in configs) == [(0.01, 16), (0.01, 32), (0.1, 16), (0.1, 32)]
    assert all(c.train.epochs == 2 and c.data.feature_cols == ("a", "b", "c") for c in configs)
    assert est.config.train.lr == RunConfig().train.lr and est.config.data.batch_size == 64
    copied = est.copy({est.lr: 0.3})
    assert copied.uid == est.uid and copied.model is est.model and copied.getLr() == 0.3


def test_spark_column_names_map_onto_sparkdls_and_must_agree() -> None:
    est = TorchEstimator(torch.nn.Linear(3, 2), featuresCol="features", labelCol="y", predictionCol="p",
                         weightCol="w")
    config = est.config
    assert (config.data.feature_cols, config.data.label_col, config.data.prediction_col, config.data.weight_col) \
        == (("features",), "y", "p", "w")
    assert est.setLabelCol("z").config.data.label_col == "z"
    with pytest.raises(ConfigError, match="labelCol='y' and label_col='t' are both set"):
        TorchEstimator(torch.nn.Linear(3, 2), featuresCol="f", labelCol="y", label_col="t").config  # noqa: B018
    with pytest.raises(ConfigError, match="unknown option 'learning_rate'"):
        estimator(learning_rate=0.1)
    assert estimator().setParams(lr=0.2, probabilityCol="").getProbabilityCol() == ""


def test_a_base_config_gives_the_defaults_and_the_model_carries_the_score_columns() -> None:
    base = RunConfig.from_kwargs(feature_cols=["x"], epochs=7, lr=0.5)
    est = TorchEstimator(torch.nn.Linear(1, 1), config=base, batch_size=8)
    assert est.getEpochs() == 7 and not est.isSet(est.epochs) and est.config.data.batch_size == 8
    model = TorchModel(module=torch.nn.Linear(1, 1), prediction_col="p", probability_col="", raw_prediction_col="r")
    columns = model.score_columns()
    assert (columns.prediction, columns.probability, columns.raw_prediction) == ("p", "", "r")
    assert columns.scores("class") == ("r",) and columns.scores("value") == ()
    assert model.copy({model.predictionCol: "q"}).prediction_col == "q" and model.prediction_col == "p"
