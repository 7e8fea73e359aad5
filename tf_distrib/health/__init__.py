"""A worker's health: the hang watchdog, start-up phases and flight-recorder reports.

Plain Python, no TensorFlow at import: the launcher reads what the workers write here.
"""
