"""tracking: the trained model as it is recorded, served and scored, and where a fit's time goes.

Owns: mlflow_run.py (the driver's one MLflow run per fit: params, metrics in batches, artifacts, the
logged model; ended once, FINISHED or FAILED), call_guard.py (stdlib: how its MLflow calls fail: tried
once more, said once, never switching tracking off), fit_records.py (the run's params and dataset, the model's input example), json_types.py
(the example and signature in the types a JSON client sends), pyfunc.py (the MLflow pyfunc logged as
code; MLflow loads it, sparkdl never imports it), serving.py (the module with its input layout and
output kind as it scores), inference.py (the executor side of TorchModel.transform), phases.py
(stdlib-only clocks, also used on workers). May import: errors, config, spark, storage, data, model,
strategies (docs/architecture.md, "Layering"). mlflow is imported lazily.
"""
