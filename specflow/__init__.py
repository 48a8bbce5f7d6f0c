"""specflow: speculative decoding research framework (drafters x tree builders x verifiers)."""

from specflow.engine import SpecEngine
from specflow.pipeline import EngineConfig, Pipeline
from specflow.registry import DRAFTERS, TREE_BUILDERS, VERIFIERS
from specflow.request import RequestOutput
from specflow.sampling import SamplingParams

__all__ = ["DRAFTERS", "TREE_BUILDERS", "VERIFIERS", "EngineConfig", "Pipeline", "RequestOutput",
           "SamplingParams", "SpecEngine"]
