"""Observing a real step: the step itself, the byte accounting, the memory meter, the simulated device limit and
``verify`` (did the policy take effect).
"""
