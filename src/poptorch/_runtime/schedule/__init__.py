"""Schedules: a step of any execution strategy as one typed list of actions.

``actions.py`` defines the action types (compute, communication, memory movement);
``schedules.py`` builds every strategy's action lists (GPipe, 1F1B, interleaved 1F1B,
zero bubble, sharded, serial and parallel phases) and checks them; ``timeline.py``
lays them out in time and draws them. Nothing here runs anything: the interpreter
(``_runtime/placement/engine.py``) does.
"""
