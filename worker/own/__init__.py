"""The own engine (ENGINE=hf, the default on CPU; `hf` for the Hugging Face models it loads): a step is schedule
(planner.py), run (runner.py, forward.py over the KV caches of cache.py), sample (sampling.py, grammar.py) and emit
(worker/output.py); sequences and batches in sequences.py; the prefix cache's blocks in worker/prefix.py's store; the
model (model.py) on one of worker/weights' paths."""
