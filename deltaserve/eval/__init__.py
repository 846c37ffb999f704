"""Evaluation against the trained tiny models: the accuracy gate (`accuracy_gate`) and its reference file."""
