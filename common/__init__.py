"""Wire protocol shared by every llmserve service: messages, Redis keys, settings."""
