"""The device loop of one call: runners of micro-batches, the loss, and the optimizer
step on the device."""
