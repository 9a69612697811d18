"""The trained model comes back outside the JVMs: a 63M-parameter model (252 MB fp32) trained on 4
ranks returns, equal to what the ranks trained, to a driver whose JVM has 512 MB of heap and a
16 MB spark.driver.maxResultSize (the job's rows could not carry a tenth of it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SUPPORT = Path(__file__).resolve().parents[1] / "support"


def test_a_model_sixteen_times_max_result_size_comes_back_equal_to_what_the_ranks_trained() -> None:
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYTHONPATH": os.pathsep.join(
        [str(SUPPORT.parents[1]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(SUPPORT / "big_model_driver.py")], capture_output=True, text=True,
                          env=env, timeout=600)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(lines[-1])
    print(result)
    assert result["parameters"] >= 60_000_000
    assert result["keys_equal"] and result["max_abs_diff"] <= 1e-5, result
    assert set(result["via"].values()) == {"channel"} and len(result["via"]) == 4, result  # every rank owns a part
