"""What every worker of `--nproc N` imports, imported once by the launcher's fork server (launch.py) so that each
worker forked from it starts with it imported: torch, transformers' model code, peft and the engine's worker
modules cost a spawned process about 9 CPU-seconds here, every worker and every restart.

SERVER_ENVIRON is the environment the server started with: a worker puts the launcher's environment at launch
time in its place (launch.start_worker), keeping what the elastic agent set for its rank."""

from __future__ import annotations

import contextlib
import importlib
import os

SERVER_ENVIRON = dict(os.environ)
IMPORTED_BY = os.getpid()  # the fork server, in a worker forked from it

MODULES = (
    "torch", "torch.distributed", "torch.utils.tensorboard",
    "transformers", "transformers.modeling_utils", "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2", "peft",
    "ftis_engine.launch", "ftis_engine.run", "ftis_engine.session", "ftis_engine.wiring", "ftis_engine.tasks",
    "ftis_engine.generation.hf", "ftis_engine.exchange.weights",
)

# a CUDA check made while importing asks NVML, not the CUDA driver, whose state a forked child could not use (the
# launcher starts a server by default only without CUDA; FTIS_START_METHOD=forkserver forces one)
os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
for _name in MODULES:
    # a module that cannot be imported here fails (or not) in the worker that needs it, with its own message; the
    # server itself must not fail, or no worker starts
    with contextlib.suppress(Exception):
        importlib.import_module(_name)
if "PYTORCH_NVML_BASED_CUDA_CHECK" in SERVER_ENVIRON:
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = SERVER_ENVIRON["PYTORCH_NVML_BASED_CUDA_CHECK"]
else:
    del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]
