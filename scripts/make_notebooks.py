"""Write notebooks/*.ipynb from the cells below (outputs empty): `python scripts/make_notebooks.py`.

Kept as code so that the notebooks stay reviewable in diffs; tests/spark/test_notebooks.py executes
every notebook with nbclient (SPARKDL_NOTEBOOK_SMALL=1: tiny settings).
"""
from __future__ import annotations

from pathlib import Path

import nbformat

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"

SESSION = '''# Databricks (and any notebook with a session) defines `spark`; elsewhere start a local one.
import os
import sys

SMALL = os.environ.get("SPARKDL_NOTEBOOK_SMALL") == "1"  # the tests run every notebook on tiny settings
try:
    spark  # noqa: F821
except NameError:
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # executors run this kernel's Python
    spark = (SparkSession.builder.master("local[2]").appName("sparkdl-notebook")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
spark.sparkContext.setLogLevel("ERROR")'''

DATA = '''from sparkdl.datasets import DIGITS_FEATURE_COLS, digits_dataframe, train_test_split_digits

train_idx, test_idx = train_test_split_digits(seed=0)
train = digits_dataframe(spark, indices=train_idx).cache()
test = digits_dataframe(spark, indices=test_idx).cache()
print(f"{train.count()} training rows, {test.count()} test rows, {len(DIGITS_FEATURE_COLS)} features")'''

QUICKSTART = [
    ("markdown", "# sparkdl quickstart\n\nA Spark DataFrame in, a trained PyTorch model out: fit with the default "
                 "strategy (`auto`: the planner chooses), look at the MLflow run, score with `transform`, plot "
                 "the loss curve."),
    ("code", SESSION),
    ("code", DATA),
    ("code", '''from torch import nn

from sparkdl import TorchEstimator

def mlp():
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

estimator = TorchEstimator(model=mlp, feature_cols=DIGITS_FEATURE_COLS, label_col="label",
                           optimizer="adam", lr=3e-3, batch_size=32, epochs=2 if SMALL else 15,
                           num_workers=2, validation_fraction=0.2, seed=0, progress=not SMALL)
model = estimator.fit(train)
print("strategy:", model.options["train.strategy"])'''),
    ("markdown", "Every fit is one MLflow run: every option as a param, the plan, metrics per step and epoch, "
                 "the model."),
    ("code", '''import mlflow

run = mlflow.get_run(model.run_id) if model.run_id else None
if run is not None:
    print("MLflow run", run.info.run_id, "status", run.info.status)
    print({k: v for k, v in run.data.params.items() if k.startswith(("plan.", "train.strategy", "dataset.rows"))})
    print("model:", model.model_uri)'''),
    ("code", '''scored = model.transform(test)
rows = scored.select("label", "prediction").collect()
accuracy = sum(r["label"] == r["prediction"] for r in rows) / len(rows)
print(f"test accuracy {accuracy:.3f}")
assert accuracy > (0.5 if SMALL else 0.9)'''),
    ("code", '''import matplotlib

matplotlib.use("Agg") if SMALL else None
import matplotlib.pyplot as plt

epochs = [h["epoch"] + 1 for h in model.history]
plt.plot(epochs, [h["loss"] for h in model.history], marker="o", label="training loss")
plt.plot(epochs, [h["val_loss"] for h in model.history], marker="o", label="validation loss")
plt.xlabel("epoch"); plt.ylabel("cross-entropy"); plt.legend(); plt.title("digits MLP, 2 workers")
plt.show()'''),
]

PLANNER = [
    ("markdown", "# The planner: which layout, and why\n\n`sparkdl.plan` profiles the model, measures the "
                 "cluster once and prices data parallel, DiLoCo, hybrid and IST. Here across model widths and "
                 "emulated network bandwidths (`emulate_network`), without training."),
    ("code", SESSION),
    ("code", DATA),
    ("code", '''from torch import nn

import sparkdl

def mlp(width):
    return lambda: nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                 nn.Linear(width, 10))

widths = [256, 1024] if SMALL else [128, 512, 1024, 2048]
networks = {"10 Gbit/s": (10.0, 0.05), "10 Mbit/s": (0.01, 2.0)} if SMALL else \\
    {"10 Gbit/s": (10.0, 0.05), "1 Gbit/s": (1.0, 0.2), "100 Mbit/s": (0.1, 0.5), "10 Mbit/s": (0.01, 2.0)}
plans = {}
for width in widths:
    for name, (gbps, latency) in networks.items():
        plans[width, name] = sparkdl.plan(mlp(width), train, feature_cols=DIGITS_FEATURE_COLS, label_col="label",
                                          batch_size=64, num_workers=2, epochs=10,
                                          emulate_network={"latency_ms": latency, "gbps": gbps})
for (width, name), plan in plans.items():
    print(f"width {width:5d}, {name:>10}: {plan.choice.label:35s} {plan.choice.predicted_step_s * 1e3:8.2f} ms/step")'''),
    ("code", '''print(plans[widths[-1], list(networks)[-1]].explain())'''),
    ("code", '''import matplotlib

matplotlib.use("Agg") if SMALL else None
import matplotlib.pyplot as plt

fig, axes = plt.subplots(1, len(networks), figsize=(5 * len(networks), 4), sharey=False)
for ax, name in zip(axes, networks):
    for strategy in ("data_parallel", "diloco", "hybrid", "ist"):
        best = [min((c.predicted_step_s * 1e3 for c in plans[w, name].candidates
                     if c.strategy == strategy and c.feasible), default=float("nan")) for w in widths]
        ax.plot(widths, best, marker="o", label=strategy)
    ax.set_xscale("log"); ax.set_yscale("log"); ax.set_title(name); ax.set_xlabel("hidden width")
axes[0].set_ylabel("predicted step (ms)"); axes[0].legend()
plt.show()'''),
]


def strategy_notebook(title: str, intro: str, options: str, report: str) -> list[tuple[str, str]]:
    return [
        ("markdown", f"# {title}\n\n{intro}"),
        ("code", SESSION),
        ("code", DATA),
        ("code", f'''from torch import nn

from sparkdl import TorchEstimator

common = dict(feature_cols=DIGITS_FEATURE_COLS, label_col="label", batch_size=32, epochs=2 if SMALL else 8,
              num_workers=2, validation_fraction=0.2, seed=0, progress=False, tracking=False)
{options}'''),
        ("code", report),
    ]


HYBRID = strategy_notebook(
    "Hybrid: pipeline stages x data-parallel replicas",
    "The model is cut into stages by measured layer time; each replica's micro-batches flow through the "
    "stages (1F1B); the result equals data parallel's update.",
    '''deep = lambda: nn.Sequential(nn.Linear(64, 128), nn.ReLU(), *[nn.Sequential(nn.Linear(128, 128), nn.ReLU())
                                                            for _ in range(4)], nn.Linear(128, 10))
hybrid = TorchEstimator(model=deep, strategy="hybrid", stages=2, microbatches=8, optimizer="adam", lr=2e-3,
                        **common).fit(train)
dp = TorchEstimator(model=deep, strategy="data_parallel", optimizer="adam", lr=2e-3, **common).fit(train)''',
    '''for name, m in (("hybrid", hybrid), ("data parallel", dp)):
    last = m.history[-1]
    print(f"{name:14s} val accuracy {last['val_accuracy']:.3f}  parameters per rank "
          f"{last['max_param_bytes_per_rank'] / 1e3:.0f} kB")
assert hybrid.history[-1]["max_param_bytes_per_rank"] < dp.history[-1]["max_param_bytes_per_rank"]''')

IST = strategy_notebook(
    "IST: independent subnet training",
    "Each worker trains a disjoint 1/W of every hidden layer for `ist_sync_every` steps; far fewer bytes "
    "than data parallel for wide MLPs.",
    '''wide = lambda: nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
ist = TorchEstimator(model=wide, strategy="ist", ist_sync_every=30, optimizer="adam", lr=2e-3, **common).fit(train)
dp = TorchEstimator(model=wide, strategy="data_parallel", optimizer="adam", lr=2e-3, **common).fit(train)''',
    '''for name, m in (("IST", ist), ("data parallel", dp)):
    sent = sum(h["bytes_sent_all_ranks"] for h in m.history)
    print(f"{name:14s} val accuracy {m.history[-1]['val_accuracy']:.3f}  sent {sent / 1e6:8.1f} MB")
assert sum(h["bytes_sent_all_ranks"] for h in ist.history) < sum(h["bytes_sent_all_ranks"] for h in dp.history) / 10''')

DILOCO = strategy_notebook(
    "DiLoCo: synchronise every H steps",
    "Each worker takes H inner steps alone, then an outer Nesterov step applies the averaged change: one "
    "allreduce every H steps instead of every step.",
    '''mlp = lambda: nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
diloco = TorchEstimator(model=mlp, sync="diloco", sync_every=20, optimizer="adamw", lr=2e-3, **common).fit(train)
dp = TorchEstimator(model=mlp, strategy="data_parallel", optimizer="adamw", lr=2e-3, **common).fit(train)''',
    '''for name, m in (("DiLoCo H=20", diloco), ("data parallel", dp)):
    sent = sum(h["bytes_sent_all_ranks"] for h in m.history)
    print(f"{name:14s} val accuracy {m.history[-1]['val_accuracy']:.3f}  sent {sent / 1e6:8.2f} MB")
assert sum(h["bytes_sent_all_ranks"] for h in diloco.history) < sum(h["bytes_sent_all_ranks"] for h in dp.history) / 5''')


def write(name: str, cells: list[tuple[str, str]]) -> None:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_markdown_cell(text) if kind == "markdown" else nbformat.v4.new_code_cell(text)
                      for kind, text in cells]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    NOTEBOOKS.mkdir(exist_ok=True)
    nbformat.write(notebook, NOTEBOOKS / name)


if __name__ == "__main__":
    for filename, cells in (("quickstart.ipynb", QUICKSTART), ("planner.ipynb", PLANNER), ("hybrid.ipynb", HYBRID),
                            ("ist.ipynb", IST), ("diloco.ipynb", DILOCO)):
        write(filename, cells)
        print("wrote", NOTEBOOKS / filename)
