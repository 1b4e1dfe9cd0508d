"""Discrete-event simulator: workloads (synthetic and trace replay) and scenarios."""
