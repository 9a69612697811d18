"""model: the user's model as sparkdl builds, lays out and stores it.

Owns: calling.py (how a model is called on a batch and its output read: the one rule every path follows),
generation.py (text and pooled embeddings out), pretrained.py (`sparkdl.pretrained(path)`), transformer_layers.py
(a Hugging Face transformer cut at its blocks), trained_state.py (what trains and travels: frozen parameters do
not), adapters.py (PEFT adapters saved and merged),
objectives.py (model, loss and optimizer options -> torch objects, on driver and workers),
layer_factories.py (model=[one callable per layer]), layouts.py (strategies' layouts and rank placement,
stdlib only), losses.py, metrics.py, trained.py and tensor_files.py (the trained model as files).
May import: errors, config, storage (docs/architecture.md, "Layering"). torch is imported here.
"""
