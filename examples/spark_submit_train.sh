#!/usr/bin/env bash
# The CLI under spark-submit, as a scheduled job would run it: write the digits to Parquet, then
# `spark-submit <sparkdl/cli.py> train --conf <toml>` trains, logs to MLflow and saves the model.
#
#   examples/spark_submit_train.sh [OUTPUT_DIR] [EPOCHS]       (run from the repository root)
set -euo pipefail
out=${1:-/tmp/sparkdl-submit-example}
epochs=${2:-3}
python=${PYTHON:-$PWD/.venv/bin/python}
spark_submit=$(dirname "$("$python" -c 'import pyspark; print(pyspark.__file__)')")/bin/spark-submit
rm -rf "$out" && mkdir -p "$out"

"$python" - "$out/digits.parquet" <<'PY'
import sys
from pyspark.sql import SparkSession
from sparkdl.datasets import digits_dataframe
spark = SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false").getOrCreate()
digits_dataframe(spark).write.parquet(sys.argv[1])
spark.stop()
PY

PYSPARK_PYTHON=$python "$spark_submit" --master "local[2]" --conf spark.ui.enabled=false \
  --conf spark.pyspark.python="$python" \
  "$("$python" -c 'import sparkdl.cli as c; print(c.__file__)')" train --conf conf/examples/digits.toml \
  --set input.path="$out/digits.parquet" --set output.model_path="$out/model" --set train.epochs="$epochs" \
  --set tracking.tracking_uri="sqlite:///$out/mlflow.db" --set tracking.progress=false
echo "model saved to $out/model"
