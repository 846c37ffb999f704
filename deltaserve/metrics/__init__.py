"""Engine metrics: Prometheus series and the periodic log line, both fed from plain step statistics."""
