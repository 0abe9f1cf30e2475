"""Learner backends: a trainable model, its optimizer, and the update loop."""
