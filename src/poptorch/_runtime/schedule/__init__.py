"""Schedules: a step of any execution strategy as one typed list of actions (``actions``),
built and checked (``schedules``) and drawn (``timeline``). Nothing here runs anything:
the interpreters (``program/interpreter.py``, ``placement/engine.py``) do.
"""
