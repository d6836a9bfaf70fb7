"""Numerics: precision policy (half/float casting, stochastic rounding, FP checks) and
loss scaling."""
