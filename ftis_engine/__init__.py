"""ftis-engine: collaborative GRPO across heterogeneous LLMs with F-TIS."""

import logging

__version__ = "0.1.0"

# transformers imports torchao (the memory-saving optimizer's library) whenever it is installed, and at import
# torchao warns about optional GPU extensions a CPU build cannot load, and torch about how torchao registers its
# enums: notes about those libraries, not about the user's run
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").addFilter(lambda record: "is an Enum subclass" not in record.getMessage())
