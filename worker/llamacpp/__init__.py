"""ENGINE=llamacpp: llama.cpp hosted behind worker/core.py's seam (worker/llamacpp/engine.py)."""
