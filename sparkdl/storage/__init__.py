"""storage: where a run's files live, locally or on a pyarrow filesystem (S3, HDFS, ...).

Owns: files.py (checkpoints, model parts, TorchModel.save/load, kept plans: locate, read, write,
delete), shared_paths.py (is a local directory the same on the driver and every executor host?),
private_dirs.py (per-user 0700 temp roots, 0600 exclusive no-link files, lock-held directories and
the sweep of dead processes' ones).
May import: errors, spark.session.
"""
