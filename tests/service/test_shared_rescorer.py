"""A fill-mask model whose rescorer the registry serves: the rescorer shares the served decoder
(its model and decode step, not a second copy), the decoder loads first and stays loaded while
the fill-mask model is (no unload, no eviction), its bytes are counted once, and the answers are
those of a rescorer with its own copy."""

from __future__ import annotations

import dataclasses

import pytest

import service.models.loading as registry_module
from model import load_model
from model.config import DTYPES
from model.decode import prepare_weights
from model.formats.manifest import RescoreSpec
from service.engines.encoder import EncoderEngine
from service.engines.errors import InvalidRequestError
from service.metrics import Metrics
from service.models.memory import source_weight_bytes
from service.models.registry import EngineRegistry
from tests.service.conftest import settings_for

pytestmark = pytest.mark.asyncio


async def test_the_rescorer_shares_the_served_decoder_while_loaded(weights_dir, monkeypatch):
    spec = RescoreSpec(weights_dir / "generate-tiny", candidates=6, mlm_weight=0.5, context=8)
    monkeypatch.setattr(registry_module, "rescore_spec", lambda path: spec if path.name == "fill-mask-tiny" else None)
    real_load = registry_module.load_model

    def load_with_rescorer(path, *args):  # as a manifest naming a rescorer would load
        ckpt = real_load(path, *args)
        return dataclasses.replace(ckpt, fill_rescore=spec) if path.name == "fill-mask-tiny" else ckpt

    monkeypatch.setattr(registry_module, "load_model", load_with_rescorer)
    settings = settings_for(weights_dir, models="fill-mask-tiny,generate-tiny", preload="none", warmup=False)
    registry = EngineRegistry(settings, Metrics())
    await registry.start()
    mlm = load_model(weights_dir / "fill-mask-tiny")
    prepare_weights(mlm.model, settings.decode_options(), mlm.tokenizer)  # as the registry serves it
    own = EncoderEngine("fill-mask-tiny", dataclasses.replace(mlm, fill_rescore=spec), settings, Metrics())
    await own.start()
    try:
        fill_entry, decoder_entry = registry.entries["fill-mask-tiny"], registry.entries["generate-tiny"]
        assert registry.loader._estimate(fill_entry) == source_weight_bytes(fill_entry.path, DTYPES["float32"],
                                                                     rescorer=False)
        fill = await registry.load("fill-mask-tiny")
        decoder = registry.engines["generate-tiny"]  # loaded first, for the rescorer
        assert fill.rescorer.shared and fill.rescorer.model is decoder.model
        assert fill.rescorer.native is decoder.core.decode_step or fill.rescorer.native is None
        assert not own.rescorer.shared and own.rescorer.model is not decoder.model
        assert fill.step_bytes() == 0 and own.step_bytes() > 0  # the decoder's entry counts its bytes
        assert decoder_entry.users == 1 and fill_entry.rescorer_source is decoder_entry and decoder_entry.in_use()

        texts = ["the quick brown [MASK] jumps over", "[MASK] the [MASK]"]
        rows = fill.tokenize(texts, "text")
        assert await fill.fill_mask(rows, 8, texts) == await own.fill_mask(rows, 8, texts)

        with pytest.raises(InvalidRequestError, match=r"fill-mask rescorer of \['fill-mask-tiny'\]"):
            await registry.unload("generate-tiny")
        await registry.loader.make_room(fill_entry, 0)  # nothing to evict, and the decoder is never idle for it
        assert decoder_entry.engine is decoder
        await registry.unload("fill-mask-tiny")
        assert decoder_entry.users == 0 and not decoder_entry.in_use()
        await registry.unload("generate-tiny")  # now it may go
        assert decoder_entry.engine is None
    finally:
        await own.stop(1.0)
        await registry.stop(1.0)


async def test_without_the_decoder_served_nothing_is_shared(weights_dir, monkeypatch):
    spec = RescoreSpec(weights_dir / "generate-tiny", candidates=6, mlm_weight=0.5, context=8)
    monkeypatch.setattr(registry_module, "rescore_spec", lambda path: spec if path.name == "fill-mask-tiny" else None)
    registry = EngineRegistry(settings_for(weights_dir, models="fill-mask-tiny", preload="none"), Metrics())
    await registry.start()
    try:
        entry = registry.entries["fill-mask-tiny"]
        assert registry.loader.rescorer_entry(entry) is None
        assert registry.loader._estimate(entry) == source_weight_bytes(entry.path, DTYPES["float32"], rescorer=True)
    finally:
        await registry.stop(1.0)
    off = EngineRegistry(settings_for(weights_dir, models="fill-mask-tiny,generate-tiny", preload="none",
                                      fill_mask_rescore=False), Metrics())
    await off.start()
    try:  # rescoring switched off: nothing shared, nothing held
        assert off.loader.rescorer_entry(off.entries["fill-mask-tiny"]) is None
    finally:
        await off.stop(1.0)
    half = EngineRegistry(settings_for(weights_dir, models="fill-mask-tiny,generate-tiny", preload="none",
                                       dtype="bfloat16"), Metrics())
    await half.start()
    try:  # a bfloat16 decoder would score otherwise than the float32 copy the rescorer loads
        assert half.loader.rescorer_entry(half.entries["fill-mask-tiny"]) is None
    finally:
        await half.stop(1.0)
