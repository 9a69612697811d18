"""Spark ML's own habits with sparkdl stages: the three evaluators run on transform's output and agree
with the same metrics computed from the torch module; CrossValidator tunes a ParamGridBuilder grid
of lr and batch_size; a Pipeline with a sparkdl stage saves and loads with its params."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.evaluation import (BinaryClassificationEvaluator, MulticlassClassificationEvaluator,
                                   RegressionEvaluator)
from pyspark.ml.feature import SQLTransformer
from pyspark.ml.tuning import CrossValidator, CrossValidatorModel, ParamGridBuilder
from sklearn.datasets import load_breast_cancer
from sklearn.metrics import log_loss, roc_auc_score

from sparkdl import TorchEstimator
from sparkdl.estimator import TorchModel

FEATURES = [f"f{i}" for i in range(8)]


@pytest.fixture(scope="module")
def cancer(spark):  # type: ignore[no-untyped-def]
    """scikit-learn's breast-cancer data (569 rows), 8 standardized features, a double label."""
    data = load_breast_cancer()
    x = data.data[:, :8]
    x = (x - x.mean(axis=0)) / x.std(axis=0)
    rows = [tuple(float(v) for v in row) + (float(label),) for row, label in zip(x, data.target)]
    return spark.createDataFrame(rows, FEATURES + ["label"]).repartition(2).cache()


def module_outputs(model: TorchModel, rows: list) -> torch.Tensor:  # type: ignore[type-arg]
    x = torch.tensor([[r[c] for c in FEATURES] for r in rows], dtype=torch.float32)
    with torch.no_grad():
        return model.torch_module()(x).double()


def fitted(cancer, out: int, loss: str, **options):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, out))
    options = {"epochs": 3, "lr": 0.05, "optimizer": "adam", "batch_size": 32, "num_workers": 2, "tracking": False,
               **options}
    return TorchEstimator(net, feature_cols=FEATURES, label_col="label", loss=loss, **options).fit(cancer)


def test_a_two_class_softmax_classifier_is_scored_by_both_classification_evaluators(cancer) -> None:  # type: ignore[no-untyped-def]
    model = fitted(cancer, 2, "cross_entropy")
    scored = model.transform(cancer)
    types = dict(scored.dtypes)
    assert (types["prediction"], types["rawPrediction"], types["probability"]) == ("double", "vector", "vector")
    rows = scored.collect()
    logits = module_outputs(model, rows)
    probability = torch.softmax(logits, dim=1).numpy()
    labels = np.array([r["label"] for r in rows])
    np.testing.assert_allclose(np.array([r["probability"].toArray() for r in rows]), probability, atol=1e-5)
    np.testing.assert_allclose(np.array([r["rawPrediction"].toArray() for r in rows]), logits.numpy(), atol=1e-4)
    accuracy = MulticlassClassificationEvaluator(metricName="accuracy").evaluate(scored)
    assert accuracy == pytest.approx(float((probability.argmax(axis=1) == labels).mean()))
    assert accuracy > 0.85
    logloss = MulticlassClassificationEvaluator(metricName="logLoss").evaluate(scored)
    assert logloss == pytest.approx(log_loss(labels, probability), rel=1e-4)
    # Spark's evaluator ranks by rawPrediction[1] (the class-1 logit, as for its MultilayerPerceptron)
    auc = BinaryClassificationEvaluator(metricName="areaUnderROC").evaluate(scored)
    assert auc == pytest.approx(roc_auc_score(labels, logits[:, 1].numpy()), abs=1e-3)


def test_a_one_logit_binary_classifier_writes_rawprediction_as_logistic_regression(cancer) -> None:  # type: ignore[no-untyped-def]
    model = fitted(cancer, 1, "bce_with_logits")
    model.setProbabilityCol("p")  # Spark's column Params rename or leave out ("") what transform writes
    scored = model.transform(cancer)
    assert {"prediction", "rawPrediction", "p"} <= set(scored.columns) and "probability" not in scored.columns
    rows = scored.collect()
    z = module_outputs(model, rows).reshape(-1).numpy()
    labels = np.array([r["label"] for r in rows])
    np.testing.assert_allclose(np.array([r["rawPrediction"].toArray() for r in rows]), np.stack([-z, z], 1), atol=1e-4)
    assert [r["prediction"] for r in rows] == [float(v > 0) for v in z]
    auc = BinaryClassificationEvaluator().evaluate(scored)
    assert auc == pytest.approx(roc_auc_score(labels, z), abs=1e-3) and auc > 0.9
    logloss = MulticlassClassificationEvaluator(metricName="logLoss", probabilityCol="p").evaluate(scored)
    p = 1 / (1 + np.exp(-z))
    assert logloss == pytest.approx(log_loss(labels, np.stack([1 - p, p], 1)), rel=1e-4)
    bare = model.copy({model.rawPredictionCol: "", model.probabilityCol: ""}).transform(cancer)
    assert bare.columns == cancer.columns + ["prediction"]


def test_a_regressor_is_scored_by_the_regression_evaluator(cancer) -> None:  # type: ignore[no-untyped-def]
    model = fitted(cancer, 1, "mse")
    scored = model.transform(cancer)
    assert dict(scored.dtypes)["prediction"] == "double" and "probability" not in scored.columns
    rows = scored.collect()
    predicted = module_outputs(model, rows).reshape(-1).numpy()
    labels = np.array([r["label"] for r in rows])
    rmse = RegressionEvaluator(metricName="rmse").evaluate(scored)
    assert rmse == pytest.approx(math.sqrt(float(((predicted - labels) ** 2).mean())), rel=1e-4)
    assert RegressionEvaluator(metricName="r2").evaluate(scored) > 0.5


def test_cross_validator_tunes_lr_and_batch_size_and_pipelines_keep_the_params(cancer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    est = TorchEstimator(net, feature_cols=FEATURES, label_col="label", epochs=2, optimizer="adam", num_workers=2,
                         tracking=False)
    # lr 1e-6 cannot move the weights in two epochs: by log loss (smaller is better) 0.05 must win
    grid = ParamGridBuilder().addGrid(est.lr, [0.05, 1e-6]).addGrid(est.batch_size, [32, 64]).build()
    validator = CrossValidator(estimator=est, estimatorParamMaps=grid, numFolds=2, seed=7,
                               evaluator=MulticlassClassificationEvaluator(metricName="logLoss"))
    tuned = validator.fit(cancer)
    assert isinstance(tuned.bestModel, TorchModel) and len(tuned.avgMetrics) == 4
    best = grid[int(np.argmin(tuned.avgMetrics))]
    assert best[est.lr] == 0.05 and min(tuned.avgMetrics) < 0.35
    slow = [tuned.avgMetrics[i] for i, point in enumerate(grid) if point[est.lr] == 1e-6]
    assert min(slow) > min(tuned.avgMetrics) + 0.1
    assert tuned.bestModel.options["train.lr"] == 0.05
    assert MulticlassClassificationEvaluator().evaluate(tuned.transform(cancer)) > 0.85

    # An unfitted Pipeline with the estimator saves and loads with its params (the set ones and the defaults).
    est.setBatchSize(48).setProbabilityCol("")
    pipeline = Pipeline(stages=[SQLTransformer(statement="SELECT * FROM __THIS__"), est])
    pipeline.save(str(tmp_path / "pipeline"))
    loaded = Pipeline.load(str(tmp_path / "pipeline")).getStages()[1]
    assert isinstance(loaded, TorchEstimator) and loaded.uid == est.uid
    assert (loaded.getBatchSize(), loaded.getEpochs(), loaded.getOptimizer(), loaded.getProbabilityCol()) \
        == (48, 2, "adam", "")
    assert loaded.config == est.config
    assert [p.shape for p in loaded.model.parameters()] == [p.shape for p in net.parameters()]

    # The fitted validator's best model in a PipelineModel: saved and loaded with its column params.
    best_model = tuned.bestModel.copy({tuned.bestModel.predictionCol: "label_hat"})
    PipelineModel(stages=[best_model]).save(str(tmp_path / "fitted"))
    reloaded = PipelineModel.load(str(tmp_path / "fitted")).stages[0]
    assert reloaded.getPredictionCol() == "label_hat" and reloaded.getRawPredictionCol() == "rawPrediction"
    want = [r["label_hat"] for r in best_model.transform(cancer).collect()]
    assert [r["label_hat"] for r in reloaded.transform(cancer).collect()] == want
    assert isinstance(tuned, CrossValidatorModel)
