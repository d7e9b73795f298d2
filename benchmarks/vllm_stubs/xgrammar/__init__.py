"""A stand-in for xgrammar in the trimmed vLLM 0.24 bundle of benchmarks/vllm_bundle.sh, which does not carry the
real one (45 MB with apache-tvm-ffi: most of a piece). vLLM 0.24 names xgrammar.GrammarMatcher and
xgrammar.CompiledGrammar in a dataclass's annotations when vllm.v1.structured_output is imported (the engine core
always imports it), so those two names exist; everything else is absent, and structured output (a request with a
grammar or a JSON schema) fails with the reason. ftis-engine's generator never asks for it."""


class GrammarMatcher:
    """Never built: a name for vLLM's annotations."""


class CompiledGrammar:
    """Never built: a name for vLLM's annotations."""


def __getattr__(name):
    raise AttributeError(f"xgrammar.{name}: xgrammar is not in this trimmed vLLM bundle (benchmarks/vllm_bundle.sh): "
                         "structured output is unavailable")
