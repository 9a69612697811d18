"""`sparkdl submit [spark-submit options] -- train|plan ...`: the CLI under spark-submit in one command.

spark-submit runs a Python application only from a `.py` file: handed the `sparkdl` console script
(no suffix) it takes it for a JAR and fails with "Failed to get main class in JAR". This builds the
spark-submit command line with the path of sparkdl/cli.py as the application, the executors'
Python defaulting to this one, and runs it. Standard library only.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from sparkdl.errors import ConfigError
from sparkdl.tracking.redaction import redact_command

USAGE = ("usage: sparkdl submit [spark-submit options] -- {train,plan} [sparkdl options]\n"
         "  e.g. sparkdl submit --master spark://host:7077 --executor-memory 4g -- train --conf job.toml")


def spark_submit_path() -> str:
    """SPARK_HOME's spark-submit when set, else the one inside the pyspark package, else PATH's."""
    home = os.environ.get("SPARK_HOME")
    if home and (Path(home) / "bin" / "spark-submit").is_file():
        return str(Path(home) / "bin" / "spark-submit")
    try:
        import pyspark

        bundled = Path(pyspark.__file__).parent / "bin" / "spark-submit"
        if bundled.is_file():
            return str(bundled)
    except ImportError:
        pass
    found = shutil.which("spark-submit")
    if found is None:
        raise ConfigError("spark-submit was not found (no SPARK_HOME, no pyspark, nothing on PATH)",
                          hint="pip install pyspark, or set SPARK_HOME")
    return found


def submit_command(argv: Sequence[str]) -> list[str]:
    """The spark-submit command line for `sparkdl submit <argv>`."""
    args = list(argv)
    if "--" not in args:
        raise ConfigError("sparkdl submit needs `--` between the spark-submit options and sparkdl's", hint=USAGE)
    split = args.index("--")
    spark_args, sparkdl_args = args[:split], args[split + 1:]
    if not sparkdl_args or sparkdl_args[0] not in ("train", "plan"):
        raise ConfigError(f"sparkdl submit runs `train` or `plan` under spark-submit, got {sparkdl_args[:1]}",
                          hint=USAGE)
    python = os.environ.get("PYSPARK_PYTHON", sys.executable)
    extra = [] if any(a.startswith("spark.pyspark.python") for a in spark_args) else \
        ["--conf", f"spark.pyspark.python={python}"]  # executors run the driver's Python (DESIGN.md)
    application = str(Path(__file__).resolve().parent / "cli.py")
    return [spark_submit_path(), *spark_args, *extra, application, *sparkdl_args]


def run_submit(argv: Sequence[str]) -> int:
    command = submit_command(argv)
    # --conf values such as spark.hadoop.fs.s3a.secret.key and URL passwords are masked in what is shown
    print("sparkdl submit: " + " ".join(redact_command(command)), file=sys.stderr, flush=True)
    env = {**os.environ, "PYSPARK_PYTHON": os.environ.get("PYSPARK_PYTHON", sys.executable),
           # pyspark's scripts (find-spark-home, ...) are found through PATH, next to this Python
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    return subprocess.call(command, env=env)
