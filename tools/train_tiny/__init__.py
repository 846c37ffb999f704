"""Training a tiny Kimi Linear target, a draft and an Eagle3 head on the Python standard library.

Run as `python -m tools.train_tiny <command>` from the repository root; README.md beside this file
lists the commands, the sizes and the device recipe.
"""
