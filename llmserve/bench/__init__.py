"""`llmserve bench`: a load generator for llmserve's own API and any OpenAI-compatible server."""
