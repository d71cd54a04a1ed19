"""Pure-PyTorch transformer models for serving: no web, no metrics, no pydantic.

    from model import load_model, generate, SamplingParams
    ckpt = load_model("weights/generate-en")  # or a HF directory, a .gguf file, a manifest directory
    ids = ckpt.tokenizer.encode("To be, or not to be")
    print(generate(ckpt.model, [ids], SamplingParams(max_new_tokens=20), ckpt.tokenizer)[0].text)
"""

from model.config import ConfigError, ModelConfig
from model.engine import EngineCore, EngineEvent, EngineRequest, beam_search, generate
from model.engine.beam_search import BeamSearch
from model.engine.generation import GenerationResult, SequenceTracker, TokenEvent
from model.engine.sampling import Sampler, SamplingParams
from model.formats.checkpoint import Checkpoint, CheckpointError, is_checkpoint, load, save
from model.formats.gguf_import import GGUFImportError, GGUFModel, load_gguf
from model.formats.hf.importer import HFImportError, HFModel, is_hf_model_dir, load_hf
from model.formats.manifest import ManifestError
from model.formats.sources import is_model_dir, load_model
from model.nn.kv_cache import PagedKVCache
from model.nn.transformer import DecoderLM, EncoderDecoder, MaskedLM, TransformerModel, build_model
from model.tokenization.chat_template import ChatMessageError, ChatTemplate, ChatTemplateError
from model.tokenization.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = [
    "BeamSearch", "ChatMessageError", "ChatTemplate", "ChatTemplateError", "Checkpoint", "CheckpointError",
    "ConfigError", "DecoderLM", "EncoderDecoder", "EngineCore", "EngineEvent", "EngineRequest", "GGUFImportError",
    "GGUFModel", "GenerationResult", "HFImportError", "HFModel", "IncrementalDetokenizer", "ManifestError", "MaskedLM",
    "ModelConfig", "Sampler", "SamplingParams", "SequenceTracker", "PagedKVCache", "TokenEvent", "Tokenizer",
    "TransformerModel", "beam_search", "build_model", "generate", "is_checkpoint", "is_hf_model_dir", "is_model_dir",
    "load", "load_gguf", "load_hf", "load_model", "save",
]
