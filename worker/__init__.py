"""Worker service: loads the model once and runs the continuous-batching engine."""
