"""The own engine (ENGINE=hf, the default on CPU): rows in a continuous batch over one KV cache (engine.py,
cache.py), prompts prefilled in chunks beside the running rows, the prefix cache's blocks (worker/prefix.py's
store), sampling (sampling.py), grammars (grammar.py), and one forward over a step's parts (forward.py), on a
Hugging Face model (model.py) whose weights take one of worker/weights' paths."""
