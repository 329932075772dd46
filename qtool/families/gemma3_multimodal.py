"""Gemma 3 with its image encoder (``model_type: gemma3``, ``Gemma3ForConditionalGeneration``: the 4B, 12B and 27B
checkpoints): a SigLIP vision tower and a projector beside the Gemma 3 text model, whose settings sit in
``text_config``.

The text model is :mod:`.gemma3`'s in every respect. llama.cpp's converter writes it alone (the vision tower and
projector go to a separate ``mmproj`` file, which qtool does not write): the text settings read from
``text_config`` and the checkpoint's ``language_model.`` prefix dropped from the tensor names. qtool's plans leave
the media encoders float by default (``config.resolve.MEDIA_TOWER``).
"""

from pathlib import Path
from typing import Any, Dict

from ..errors import CheckpointError
from .gemma3 import Gemma3

_MEDIA = ("vision_tower.", "multi_modal_projector.")


class Gemma3Multimodal(Gemma3):
    model_types = ("gemma3",)
    title = "Gemma 3 (multimodal)"

    def check_gguf(self, config: Dict[str, Any], where: Path) -> Dict[str, Any]:
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError(f"{where}: a gemma3 config without a text_config object")
        return super().check_gguf({**{k: v for k, v in config.items() if k != "text_config"}, **text}, where)

    def gguf_skip(self, key: str) -> bool:
        return any(key.startswith(m) or f".{m}" in key for m in _MEDIA)

    def gguf_key(self, key: str) -> str:
        # the original checkpoints' language_model.model.*, transformers 5's model.language_model.*
        for prefix, to in (("language_model.", ""), ("model.language_model.", "model.")):
            if key.startswith(prefix):
                return to + key[len(prefix):]
        return key


FAMILY = Gemma3Multimodal()
