"""spark: every use of the Spark session and its JVM.

Owns: session.py (what sparkdl asks of a SparkSession, for a classic py4j driver and a Spark Connect
client alike), jvm.py (the optional jvm-bridge jar: BarrierWatch, Preflight). May import: errors and
pyspark only.
"""
