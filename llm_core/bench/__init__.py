"""`swallow bench NAME`: benchmarks that print one JSON object with their baseline."""
