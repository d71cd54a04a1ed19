"""The engine core: planned, run, then applied, one step at a time (see ``core``)."""

from model.engine.core import EngineCore, StepResult
from model.engine.grammar import GrammarError, GrammarSpec
from model.engine.offline import beam_search, generate
from model.engine.requests import EngineEvent, EngineRequest

__all__ = ["EngineCore", "EngineEvent", "EngineRequest", "GrammarError", "GrammarSpec", "StepResult", "beam_search",
           "generate"]
