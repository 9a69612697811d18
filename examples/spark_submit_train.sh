#!/usr/bin/env bash
# The CLI under spark-submit, as a scheduled job would run it: write the digits to Parquet, then
# `sparkdl submit -- train --conf <toml>` (spark-submit underneath) trains, logs to MLflow and saves the model.
#
#   examples/spark_submit_train.sh [OUTPUT_DIR] [EPOCHS]       (run from the repository root)
set -euo pipefail
out=${1:-/tmp/sparkdl-submit-example}
epochs=${2:-3}
python=${PYTHON:-$PWD/.venv/bin/python}
rm -rf "$out" && mkdir -p "$out"

# The input, written with pyarrow (no Spark needed): 64 double pixel columns in [0, 1] and a label.
"$python" - "$out/digits.parquet" <<'PY'
import sys
import pyarrow as pa, pyarrow.parquet as pq
from sparkdl.datasets import DIGITS_FEATURE_COLS, load_digits
pixels, labels = load_digits()
columns = [pa.array(pixels[:, i].astype("float64") / 16.0) for i in range(pixels.shape[1])]
columns.append(pa.array(labels, pa.int64()))
pq.write_table(pa.Table.from_arrays(columns, names=[*DIGITS_FEATURE_COLS, "label"]), sys.argv[1])
PY

# `sparkdl submit <spark-submit options> -- train ...` runs spark-submit with sparkdl/cli.py as the
# application (spark-submit needs a .py file: `spark-submit $(which sparkdl)` fails) and the
# executors on this Python.
PYSPARK_PYTHON=$python "$python" -m sparkdl submit --master "local[2]" --conf spark.ui.enabled=false \
  -- train --conf conf/examples/digits.toml \
  --set input.path="$out/digits.parquet" --set output.model_path="$out/model" --set train.epochs="$epochs" \
  --set tracking.tracking_uri="sqlite:///$out/mlflow.db" --set tracking.progress=false
echo "model saved to $out/model"
