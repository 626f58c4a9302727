"""sketchkv: long-context inference for hybrid LLMs that keeps every token and reads ~1% per step."""
from sketchkv.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams"]


def __getattr__(name):  # keep `import sketchkv` light: torch/model code loads on first use of LLM
    if name == "LLM":
        from sketchkv.llm import LLM
        return LLM
    raise AttributeError(name)
