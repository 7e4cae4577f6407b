"""tidal: an LLM serving engine that keeps goodput high while load and request lengths swing.

``from tidal import LLM, SamplingParams`` loads the engine lazily, so importing tidal's pure
parts (``tidal.core``, ``tidal.policies``) never imports torch.
"""

from tidal.core.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from tidal.engine.llm import LLM
        return LLM
    raise AttributeError(name)
