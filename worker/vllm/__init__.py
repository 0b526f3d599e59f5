"""ENGINE=vllm: vLLM's engine hosted behind worker/core.py's seam (engine.py), its model directory, engine
arguments and tokenizer (model.py), a migrated request's penalties (resume.py) and its statistics as the worker's
metrics (stats.py). Imported only by a worker that hosts vLLM."""

# The extra_args key of vLLM's SamplingParams that carries a migrated request's delivered tokens, from engine.py,
# which sets it, to resume.py, which vLLM runs.
DELIVERED = "llmserve_delivered"
