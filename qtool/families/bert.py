"""BERT and RoBERTa encoders (sentence-transformers' all-MiniLM and most embedding models): post-norm blocks,
``LayerNorm(x + sublayer(x))``.

A post-norm block's LayerNorm output is both the next projections' input and the residual the block adds back,
so a SmoothQuant or AWQ scale folded into it would change the residual stream: no norm is a smooth module here
(qtool's fold check refuses one a recipe names). The MLP's GELU sits between ``intermediate.dense`` and
``output.dense``, so that pair does not fold either. What folds exactly is the value projection into the
attention's output projection (the attention weights mix tokens, never channels): ``attention.self.value``'s
output rows and bias into ``attention.output.dense``'s input columns, the one default mapping. LayerNorm centers
its input, so no rotation folds into it (``rms_norms`` is empty); llama.cpp's ``bert`` architecture is not written
by qtool's GGUF exporter.
"""

from .base import Family


class Bert(Family):
    model_types = ("bert", "roberta")
    title = "BERT"
    rms_norms = ()
    smooth_mappings = ({"smooth": r"re:.*attention\.self\.value", "balance": [r"re:.*attention\.output\.dense"]},)


FAMILY = Bert()
