"""executor: code that runs inside a barrier task on an executor, one process per rank.

Owns: worker.py (the in-task main: rendezvous -> spool -> communicator -> strategy or user loop -> result),
rendezvous.py, context.py (what a loop receives), loop.py (the built-in loop) with validation.py and
balance.py, checkpoint.py / checkpoint_async.py / reshape.py (checkpoints, across world sizes too),
reporter.py, channel_client.py and output.py (the executor's end of the driver channel), memory.py.
May import: config sections as data, wire, comm, strategies, model, data's worker-side modules,
storage, tracking.phases; never pyspark.sql, never driver/. torch is imported here (executors pay it once).
"""
