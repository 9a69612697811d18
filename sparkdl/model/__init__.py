"""model: the user's model as sparkdl builds, lays out and stores it.

Owns: objectives.py (model, loss and optimizer options -> torch objects, on driver and workers),
layer_factories.py (model=[one callable per layer]), layouts.py (strategies' layouts and rank placement,
stdlib only), losses.py, metrics.py, trained.py and tensor_files.py (the trained model as files).
May import: errors, config, storage (docs/architecture.md, "Layering"). torch is imported here.
"""
