"""pdserve: LLM serving with prefill/decode disaggregation and DualPath KV loading.

The offline API is imported lazily so that scheduler-side modules (kvcache bookkeeping, the DualPath
scheduler, the simulator) can be used without importing torch.
"""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from pdserve.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pdserve.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
