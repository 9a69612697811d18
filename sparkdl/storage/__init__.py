"""storage: where a run's files live, locally or on a pyarrow filesystem (S3, HDFS, ...).

Owns: files.py (checkpoints, model parts, TorchModel.save/load, kept plans: locate, read, write,
delete), shared_paths.py (is a local directory the same on the driver and every executor host?).
May import: errors, spark.session.
"""
