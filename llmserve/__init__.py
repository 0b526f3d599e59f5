"""The `llmserve` command: runs one service, or the whole stack locally."""
