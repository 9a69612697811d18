"""Parts of benchmarks/peers.py: one module per comparison (ingest, launch, steps, horovod), shared
helpers in common.py, the JSON/PNG/Markdown report in report.py. Each part exposes
`measure(spark, args) -> dict` with "figures" (medians), "ratios" (pairwise, same run) and "notes"."""
