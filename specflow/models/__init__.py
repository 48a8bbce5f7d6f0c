"""Native Llama-family models (Llama 2/3, Mistral, Qwen2, Qwen3) and Hugging Face checkpoint I/O."""

from specflow.models.config import CheckpointError, ModelConfig
from specflow.models.llama import LlamaForCausalLM
from specflow.models.loader import load_model, load_tokenizer, save_model

__all__ = ["CheckpointError", "LlamaForCausalLM", "ModelConfig", "load_model", "load_tokenizer", "save_model"]
