"""sparkv: cloud-edge KV-cache streaming for on-device LLMs."""

__version__ = "0.1.0"
