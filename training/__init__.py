"""Training: optimizer, loss, the jitted step, checkpoints, telemetry and the run's settings."""
