"""data: the path from a Spark DataFrame to a rank's batches.

Driver side: prepare.py (the one call site of preparation), feed.py / feed_sql.py (feature_cols),
tensor_feed.py (input_cols), shards.py (row counts per rank), parquet_source.py (direct Parquet reads),
packed_delivery.py. Executor side (never pyspark.sql): stream.py (epoch 1 while the partition arrives),
streaming_spool.py, arrow_rows.py, batches.py, assemble.py, parquet_shards.py, spool_space.py.
Both: layout.py (the FeedLayout a TrainSpec carries), epochs.py (the steps of an epoch: one rule).
May import: errors, config, spark (docs/architecture.md, "Layering").
"""
