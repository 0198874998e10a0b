"""Evaluation: tasks (pass key, RULER-compatible) and scoring."""
