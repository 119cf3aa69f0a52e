"""Sweeps over specjax runs and the papers' tables and plots, built from results JSONL alone."""
