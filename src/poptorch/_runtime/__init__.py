"""Runtime of the executor: batching, device loop, weight sync, schedules."""
