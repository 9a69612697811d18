"""planner: which layout a run trains with, decided on the driver from measurements given as data.

Owns: profile.py (the model's profile), cluster.py (measured cluster facts and their cache), cost.py
and plan.py (standard library only: the cost model and the plan record), candidates.py /
outer_candidates.py / islands.py / stages.py / partition.py / ist_pricing.py (the candidates and their
layouts), step_trial.py (the run's step the ranks time), speed.py, ends.py, resolved.py (ResolvedPlan: the one validated object of a run's parallel degrees), embeddings.py
(replicated against sharded embedding tables, standard library only). Never launches a job
(driver/planning.py runs the probe and hands its figures in). May import: errors, config, comm, data,
model, strategies, embeddings (docs/architecture.md, "Layering").
"""
