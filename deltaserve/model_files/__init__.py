"""Model files: presets, the hub tensor layout, random weights, a byte tokenizer and checkpoint I/O.

Modules are imported by name (`deltaserve.model_files.checkpoint_io`, ...); this package imports
nothing itself, so the loader can read checkpoints without pulling in `transformers`.
"""
