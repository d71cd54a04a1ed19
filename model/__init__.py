"""Pure-PyTorch transformer models for serving: no web, no metrics, no pydantic.

    from model import load, generate, SamplingParams
    ckpt = load("weights/generate-en")
    ids = ckpt.tokenizer.encode("To be, or not to be")
    print(generate(ckpt.model, [ids], SamplingParams(max_new_tokens=20), ckpt.tokenizer)[0].text)
"""

from model.beam_search import BeamSearch
from model.checkpoint import Checkpoint, CheckpointError, is_checkpoint, load, save
from model.config import ConfigError, ModelConfig
from model.engine import EngineCore, EngineEvent, EngineRequest, beam_search, generate
from model.generation import GenerationResult, SequenceTracker, TokenEvent
from model.hf_import import HFImportError, HFModel, is_hf_model_dir, load_hf
from model.kv_cache import SlotKVCache
from model.sampling import Sampler, SamplingParams
from model.tokenizer import IncrementalDetokenizer, Tokenizer
from model.transformer import DecoderLM, EncoderDecoder, MaskedLM, TransformerModel, build_model

__all__ = [
    "BeamSearch", "Checkpoint", "CheckpointError", "ConfigError", "DecoderLM", "EncoderDecoder", "EngineCore",
    "EngineEvent", "EngineRequest", "GenerationResult", "HFImportError", "HFModel", "IncrementalDetokenizer",
    "MaskedLM", "ModelConfig", "Sampler", "SamplingParams", "SequenceTracker", "SlotKVCache", "TokenEvent",
    "Tokenizer", "TransformerModel", "beam_search", "build_model", "generate", "is_checkpoint", "is_hf_model_dir",
    "load", "load_hf", "save",
]
