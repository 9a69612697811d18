"""wire: everything that crosses between the driver and the executor tasks, imported by both sides.

Owns: spec.py (TrainSpec, the one typed picklable object shipped to every task), codec.py (results,
history, failures and parts as Arrow rows), frames.py and handshake.py (the driver channel's frames
and the proof of a run's secret), admission.py (what a peer may hold on the driver before it proves
the secret), model_transfer.py (ranks' model parts to the driver, both ends),
stopping.py (the verdicts a loop reports and the driver acts on). May import: config, model.layouts,
data.layout / data.parquet_shards (the layouts a spec carries), storage, model.tensor_files. Never
driver/ or executor/.
"""
