"""driver: the stages of a fit that run in the driver's process, beside the SparkSession.

Owns: checks.py (validate: everything a run passes before a barrier job), planning.py (plan: options ->
one ResolvedPlan, the calibration probe's figures priced by the planner), job.py (launch: slots, the
barrier mapInArrow job, rank 0's result), attempts.py (resubmission and resume), elastic.py (resizing;
below min_workers the error naming the hosts lost), attempt_world.py (each attempt's world in the
MLflow run), channel.py (the driver channel's server), monitor.py and callbacks.py (progress, metrics,
live callbacks), parts.py (where the trained model's parts arrive), probe.py (the calibration job), shipping.py (user
code to executors). May import: config, data, planner, model, storage, spark, tracking, wire, comm and
strategies (for their declared requirements); never executor/ except the in-task main job.py hands
to mapInArrow. Imported only by the entry points (api, estimator, cli).
"""
