"""A stand-in for llguidance in the trimmed vLLM 0.24 bundle of benchmarks/vllm_bundle.sh, which does not carry the
real one (3 MB). vLLM 0.24 names llguidance.LLMatcher and llguidance.LLTokenizer in a dataclass's annotations when
vllm.v1.structured_output is imported (the engine core always imports it), so those two names exist; everything else
is absent, and structured output fails with the reason. ftis-engine's generator never asks for it."""


class LLMatcher:
    """Never built: a name for vLLM's annotations."""


class LLTokenizer:
    """Never built: a name for vLLM's annotations."""


def __getattr__(name):
    raise AttributeError(f"llguidance.{name}: llguidance is not in this trimmed vLLM bundle "
                         "(benchmarks/vllm_bundle.sh): structured output is unavailable")
