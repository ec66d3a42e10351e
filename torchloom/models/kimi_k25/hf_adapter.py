"""Kimi K2.5 <-> transformers' Kimi_K25ForConditionalGeneration (config.json model_type
"kimi_k25").

The config.json nests a DeepSeek-V3 ``text_config`` (read by deepseek_v3's rules; Moonshot's
"kimi_k2" model_type is the same), a MoonViT ``vision_config`` and the projector's keys
(moonvit_hf.py). transformers ties the head to the embedding by the top-level
``tie_word_embeddings`` (default true), which is the one read and written.

Tensors: ``model.language_model.*`` is deepseek_v3's ``model.*``, ``lm_head.*`` the head;
``model.vision_tower.*`` and ``model.mm_projector.*`` are our ``vision_tower.*`` (MoonViT with
its projector inside). Moonshot's own release names the vision tensors otherwise (see
moonvit_hf.py); it is not read here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import fields
from typing import Any

import torch

import torchloom.models.kimi_k25.moonvit_hf as moonvit_hf
from torchloom.config.errors import ConfigError
from torchloom.models.deepseek_v3.hf_adapter import DeepSeekV3HFAdapter
from torchloom.models.hf_adapter import (
    FusedExperts,
    HFAdapter,
    RowSlice,
    refuse_unknown_keys,
)
from torchloom.models.kimi_k25.config import KimiK25Config

_VISION = "vision_tower."
_TEXT_PREFIX = "model.language_model."
_TOKEN_DEFAULTS = {"image_token_id": 163605, "video_token_id": 163840,
                   "vision_start_token_id": 163602, "vision_end_token_id": 163604}  # fmt: skip
"""transformers' Kimi_K25Config defaults of the special token ids (the released ones)."""
_TOP_KEYS = frozenset({
    "model_type", "architectures", "text_config", "vision_config", "projection_hidden_size",
    "projection_layer_norm_eps", "tie_word_embeddings", "use_cache", *_TOKEN_DEFAULTS,
})  # fmt: skip


def _in_language_model(hf_name: str) -> str:
    """deepseek_v3's name of a text tensor -> its name inside Kimi K2.5 (the head unchanged)."""
    return (
        _TEXT_PREFIX + hf_name.removeprefix("model.") if hf_name.startswith("model.") else hf_name
    )


def _out_of_language_model(hf_name: str) -> str:
    return "model." + hf_name.removeprefix(_TEXT_PREFIX)


class KimiK25HFAdapter(HFAdapter):
    model_type = "kimi_k25"
    architecture = "Kimi_K25ForConditionalGeneration"
    qk_norm = False
    defaults: dict[str, Any] = {}
    text = DeepSeekV3HFAdapter()

    # -- config.json ------------------------------------------------------------------------

    def config_from_hf(self, hf: dict[str, Any]) -> KimiK25Config:
        """The KimiK25Config of a config.json; ConfigError naming any key we do not compute."""
        if hf.get("model_type") != self.model_type:
            raise ConfigError(f"model_type is {hf.get('model_type')!r}, not 'kimi_k25'.")
        if hf.get("architectures") and list(hf["architectures"]) != [self.architecture]:
            raise ConfigError(
                f"architectures {hf['architectures']} is not supported; torchloom reads "
                f"{self.architecture} checkpoints."
            )
        refuse_unknown_keys(hf, _TOP_KEYS, "a kimi_k25 config")
        if not isinstance(hf.get("text_config"), dict):
            raise ConfigError("a 'kimi_k25' config.json needs a text_config.")
        text = {k: v for k, v in hf["text_config"].items() if k != "architectures"}
        if text.get("model_type", "deepseek_v3") not in ("deepseek_v3", "kimi_k2"):
            raise ConfigError(
                f"text_config model_type {text['model_type']!r} is not DeepSeek-V3's (or kimi_k2)."
            )
        text |= {"model_type": "deepseek_v3",
                 "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True))}  # fmt: skip
        decoder = self.text.config_from_hf(text)
        cfg = KimiK25Config(
            **{f.name: getattr(decoder, f.name) for f in fields(decoder)},
            vision=moonvit_hf.config_from_hf(hf),
            **{key: int(hf.get(key, default)) for key, default in _TOKEN_DEFAULTS.items()},
        )
        cfg.validate()
        return cfg

    def config_to_hf(
        self,
        cfg: KimiK25Config,
        dtype: str | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
    ) -> dict[str, Any]:
        text = self.text.config_to_hf(cfg, dtype, bos_token_id, eos_token_id)
        text.pop("architectures")
        hf: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "text_config": text,
            **moonvit_hf.config_to_hf(cfg.vision),
            **{key: getattr(cfg, key) for key in _TOKEN_DEFAULTS},
            "tie_word_embeddings": cfg.tie_embeddings,
        }
        if dtype is not None:
            hf["dtype"] = hf["torch_dtype"] = dtype
        return hf

    def config_for_tensors(
        self, config: KimiK25Config, tensor_names: Callable[[], Iterable[str]]
    ) -> KimiK25Config:
        """deepseek_v3's rule for announced MTP layers, on the language model's tensors."""
        return self.text.config_for_tensors(
            config, lambda: map(_out_of_language_model, tensor_names())
        )

    # -- tensor names -----------------------------------------------------------------------

    def hf_names(self, name: str, config: Any) -> str | list[str] | RowSlice | FusedExperts:
        if name.startswith(_VISION):
            return moonvit_hf.hf_name(name.removeprefix(_VISION))
        source = self.text.hf_names(name, config)
        if isinstance(source, list):  # an expert projection stacked from per-expert tensors
            return [_in_language_model(part) for part in source]
        return _in_language_model(source)

    def to_hf(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if name.startswith(_VISION):
            yield self.to_hf_name(name), tensor
            return
        for hf_name, part in self.text.to_hf(name, tensor):
            yield _in_language_model(hf_name), part

    def to_hf_name(self, name: str) -> str:
        if name.startswith(_VISION):
            return moonvit_hf.hf_name(name.removeprefix(_VISION))
        return _in_language_model(self.text.to_hf_name(name))

    def from_hf_name(self, hf_name: str) -> str | None:
        if moonvit_hf.is_hf_moonvit_name(hf_name):
            ours = moonvit_hf.from_hf_name(hf_name)
            return None if ours is None else _VISION + ours
        if hf_name.startswith("model.") and not hf_name.startswith(_TEXT_PREFIX):
            raise ConfigError(
                f"Unexpected tensor '{hf_name}' in a {self.architecture} checkpoint (expected "
                "model.language_model.*, model.vision_tower.*, model.mm_projector.* or lm_head.*)."
            )
        return self.text.from_hf_name(_out_of_language_model(hf_name))
