"""Which of vLLM's modules the engine path of ftis-engine's vLLM generator imports, and whether each imports here:
the check behind the wheels `benchmarks/vllm_bundle.sh` leaves out of the GPU machine's bundle.

The modules are what `from vllm import LLM, SamplingParams` and `LLM(...)` reach for a Qwen2 model on one GPU, in
process or under `--nproc` (external_launcher): the engine and its client, the scheduler and KV-cache manager, the
structured-output manager (built with every engine, used by no request of ours), the GPU worker and model runner,
the sampler, the FlashAttention and Triton attention backends, the Qwen2 model and its loader, the layer-wise reload
(`generation/vllm.py`'s filter), torch.compile's backends and CUDA graphs, sleep mode's allocator, the CUDA platform.
Each is imported in one process, in that order, and reported as one of

    ok          imported
    missing X   ModuleNotFoundError for the top-level package X (not vllm's own): a wheel left out that it needs
    no GPU      an error loading the CUDA driver or runtime (libcuda.so, libcudart): cannot be checked without a GPU
    error       anything else, with its message

`--watch X Y` also names, for each of those packages that got imported, the vLLM module whose import pulled it in
first. Run it in an environment holding the bundle's wheels and the trimmed vLLM (a CPU torch will do: vLLM 0.24
loads its CUDA extensions lazily); exit status 1 when a package is missing.

    python benchmarks/vllm_imports.py [--watch xgrammar llguidance ...]
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

MODULES = (
    "vllm", "vllm:LLM", "vllm:SamplingParams", "vllm.entrypoints.llm", "vllm.engine.arg_utils:EngineArgs",
    "vllm.lora.request:LoRARequest", "vllm.platforms:current_platform", "vllm.inputs", "vllm.outputs", "vllm.config",
    "vllm.v1.engine.llm_engine", "vllm.v1.engine.core", "vllm.v1.engine.core_client", "vllm.v1.engine.input_processor",
    "vllm.v1.engine.output_processor", "vllm.v1.engine.detokenizer", "vllm.v1.executor.abstract",
    "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.worker_base", "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu_input_batch", "vllm.v1.core.sched.scheduler",
    "vllm.v1.core.kv_cache_manager", "vllm.v1.core.kv_cache_utils", "vllm.v1.structured_output",
    "vllm.v1.sample.sampler", "vllm.v1.sample.ops.topk_topp_sampler", "vllm.v1.sample.logits_processor",
    "vllm.v1.attention.backends.flash_attn", "vllm.v1.attention.backends.triton_attn",
    "vllm.v1.attention.backends.registry", "vllm.v1.spec_decode.eagle", "vllm.v1.metrics.loggers",
    "vllm.model_executor.models.registry", "vllm.model_executor.models.qwen2", "vllm.model_executor.model_loader",
    "vllm.model_executor.model_loader.default_loader", "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.compilation.backends", "vllm.compilation.decorators", "vllm.compilation.wrapper",
    "vllm.compilation.cuda_graph", "vllm.distributed.parallel_state", "vllm.tokenizers", "vllm.tokenizers.hf",
    "vllm.transformers_utils.config", "vllm.reasoning", "vllm.multimodal", "vllm.utils.hashing",
    "vllm.usage.usage_lib", "vllm.device_allocator.cumem", "vllm.platforms.cuda",
)
# what a machine without a GPU cannot load: the driver and the CUDA runtime
NO_GPU = ("libcuda.so", "libcudart", "libnvidia", "CUDA driver", "no CUDA GPUs", "NVIDIA driver")


def classify(exc: BaseException) -> str:
    """One word and a detail: missing (a package absent), no GPU, or error."""
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, ModuleNotFoundError) and exc.name and exc.name.split(".")[0] != "vllm":
        return f"missing {exc.name.split('.')[0]}"
    if any(mark in message for mark in NO_GPU):
        return f"no GPU ({message})"
    return f"error ({type(exc).__name__}: {message})"


class FirstImporter:
    """A meta-path finder that finds nothing and notes, for each watched package, the vLLM frames that imported it
    first."""

    def __init__(self, watched: set[str]) -> None:
        self.watched = watched
        self.first: dict[str, str] = {}

    def find_spec(self, name, path=None, target=None):  # finds nothing: the next finders import the module
        top = name.split(".")[0]
        if top in self.watched and top not in self.first:
            frames = [f for f in traceback.extract_stack() if "/vllm/" in f.filename]
            self.first[top] = " <- ".join(f"{f.filename.split('/vllm/', 1)[1]}:{f.lineno}" for f in frames[::-1][:4])


def check(modules=MODULES, watched=()) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """[(module, result)] in order, and {watched package that got imported: the frames that imported it first}."""
    finder = FirstImporter(set(watched))
    sys.meta_path.insert(0, finder)
    results = []
    try:
        for target in modules:
            name, _, attribute = target.partition(":")
            try:
                module = importlib.import_module(name)
                if attribute:
                    getattr(module, attribute)
                results.append((target, "ok"))
            except BaseException as exc:  # noqa: BLE001 (a module's import may raise anything; report it)
                results.append((target, classify(exc)))
    finally:
        sys.meta_path.remove(finder)
    return results, {name: who for name, who in finder.first.items() if name in sys.modules}  # looked up and found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--watch", nargs="*", default=[], help="top-level packages to trace")
    args = parser.parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]  # a script beside this one must not shadow a library
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    results, first = check(watched=args.watch)
    for target, result in results:
        print(f"ok  {target}" if result == "ok" else f"{result}  <- {target}")
    for package in args.watch:
        print(f"{package}: {'imported by ' + first[package] if package in first else 'not imported'}")
    missing = sorted({r.split(" ")[1] for _, r in results if r.startswith("missing ")})
    print(f"{sum(r == 'ok' for _, r in results)} of {len(results)} modules imported; missing packages: "
          f"{', '.join(missing) or 'none'}; not checkable without a GPU: "
          f"{', '.join(t for t, r in results if r.startswith('no GPU')) or 'none'}")
    return 1 if missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
