"""ftis-engine: collaborative GRPO across heterogeneous LLMs with F-TIS."""

__version__ = "0.1.0"
