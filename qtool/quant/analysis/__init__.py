"""The encoding analyzers, one module per family (the public names are re-exported by
:mod:`qtool.quant.analyzers`, which is where callers import them from):

* :mod:`.base`: :class:`EncodingAnalyzer`, :class:`NoStatisticsError`, :class:`StatisticsMergeError`,
  ``merge_statistics`` and the helpers every family uses;
* :mod:`.minmax`: :class:`MinMaxEncodingAnalyzer` and :class:`MinMaxStatistics`;
* :mod:`.histogram`: AIMET's histograms, :class:`PercentileEncodingAnalyzer`, :class:`HistogramBatch`,
  :class:`HistogramBatches`, :class:`HistogramState`;
* :mod:`.sqnr`: :class:`SqnrEncodingAnalyzer`, :class:`TfEnhancedEncodingAnalyzer`;
* :mod:`.mse`: :class:`MseEncodingAnalyzer` and :class:`MseStatistics`.

Imports run one way: ``base`` <- ``minmax`` / ``histogram`` <- ``sqnr``; ``mse`` uses ``base`` (and
:mod:`qtool.quant.affine`). This package imports none of them itself.
"""
