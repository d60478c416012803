"""Models cut into segments (handlers/runtime/segments.py): cut placement, equality, state algebra."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from handlers.runtime.segments import (
    SegmentError,
    balanced_cuts,
    batch_nodes,
    classify,
    cut,
    merge_states,
    slice_model,
    split_state,
    state_rows,
    trace,
)
from model_store.catalog import get_spec
from model_store.factory import build_model, example_inputs, outputs_close


def slowest(times, cuts):
    bounds = [0, *cuts, len(times)]
    return max(sum(times[a:b]) for a, b in zip(bounds, bounds[1:], strict=False))


def test_balanced_cuts_by_hand():
    assert balanced_cuts([1, 1, 1, 1], range(1, 4), 2) == [2]
    assert balanced_cuts([5, 1, 1, 1, 1, 1], range(1, 6), 2) == [1]
    # Only position 3 is allowed: the cut goes there even though 1 would balance better.
    assert balanced_cuts([5, 1, 1, 1, 1, 1], [3], 2) == [3]
    assert balanced_cuts([1, 2, 3], [1, 2], 1) == []
    with pytest.raises(SegmentError, match="3 cut points"):
        balanced_cuts([1, 2, 3], [1, 2], 4)


@settings(max_examples=200, deadline=None)
@given(
    times=st.lists(st.floats(0.0, 10.0), min_size=2, max_size=9),
    segments=st.integers(1, 4),
    data=st.data(),
)
def test_balanced_cuts_are_optimal(times, segments, data):
    allowed = data.draw(st.sets(st.integers(1, len(times) - 1), min_size=min(segments - 1, len(times) - 1)))
    if len(allowed) < segments - 1:
        with pytest.raises(SegmentError):
            balanced_cuts(times, sorted(allowed), segments)
        return
    cuts = balanced_cuts(times, sorted(allowed), segments)
    assert len(cuts) == segments - 1 and cuts == sorted(set(cuts)) and set(cuts) <= allowed
    brute = min(slowest(times, list(c)) for c in itertools.combinations(sorted(allowed), segments - 1))
    assert slowest(times, cuts) == pytest.approx(brute)


class TinyUNet(nn.Module):
    """Skip connections across the whole depth: a value that must ride through every cut."""

    def __init__(self) -> None:
        super().__init__()
        self.down1 = nn.Conv2d(3, 8, 3, padding=1)
        self.down2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.mid = nn.Conv2d(16, 16, 3, padding=1)
        self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.head = nn.Conv2d(16, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.down1(x))
        b = torch.relu(self.down2(a))
        b = torch.relu(self.mid(b)) + b
        u = self.up(b)
        y = self.head(torch.cat([u, a], dim=1))
        return y.flatten(1).mean(dim=1, keepdim=True) * x.shape[-1]  # a size used at the very end


class Branchy(nn.Module):
    """Python control flow on a tensor's size: symbolic tracing fails, export takes over."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if h.shape[1] > 4:  # always true; a Proxy cannot answer it
            h = h * 2
        pos = torch.arange(h.shape[1], dtype=h.dtype)  # batch-free, recomputed where needed
        return self.b(h + pos)


def seeded(module: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    for p in module.parameters():
        nn.init.normal_(p, std=0.3)
    return module.eval()


@pytest.mark.parametrize("segments", [1, 2, 3, 5])
def test_a_sliced_unet_equals_the_model_at_every_batch_size(segments):
    model = seeded(TinyUNet())
    x = torch.randn(2, 3, 16, 16)
    sliced = slice_model(model, (x,), segments, check=lambda got, exp: torch.allclose(got, exp, atol=1e-5))
    assert len(sliced) == segments
    for rows in (1, 4, 7):
        batch = torch.randn(rows, 3, 16, 16)
        with torch.no_grad():
            assert torch.allclose(sliced(batch), model(batch), atol=1e-5)
    # Every state between segments is batch-first, whatever the skip connection carries.
    state = sliced.start(torch.randn(5, 3, 16, 16))
    for seg in sliced:
        with torch.no_grad():
            state = seg(state)
        assert state_rows(state) == 5 and all(v.shape[0] == 5 for v in state.values())


def test_export_takes_over_where_symbolic_tracing_fails():
    model = seeded(Branchy())
    x = torch.randn(3, 6)
    with pytest.raises(Exception):  # noqa: B017 - any tracing error; this is why export exists
        torch.fx.symbolic_trace(model)
    sliced = slice_model(model, (x,), 2, check=lambda got, exp: torch.allclose(got, exp, atol=1e-6))
    with torch.no_grad():
        for rows in (1, 9):
            batch = torch.randn(rows, 6)
            assert torch.allclose(sliced(batch), model(batch), atol=1e-6)


def test_split_and_merge_keep_each_request_its_rows():
    """What DVABatch's split and stretch rely on: rows advanced apart equal rows advanced together."""
    model = seeded(TinyUNet())
    sliced = slice_model(model, (torch.randn(2, 3, 16, 16),), 3)
    x = torch.randn(6, 3, 16, 16)
    with torch.no_grad():
        whole = sliced[0](sliced.start(x))
        first, second = split_state(whole, [2, 4])
        # The two parts go on separately for one segment, then join again.
        joined = merge_states([sliced[1](first), sliced[1](second)])
        out = sliced.finish(sliced[2](joined))
        assert torch.allclose(out, model(x), atol=1e-5)
    with pytest.raises(SegmentError, match="cannot split"):
        split_state(whole, [2, 2])
    with pytest.raises(SegmentError, match="different segments"):
        merge_states([whole, sliced[1](first)])


class RowIndexed(nn.Module):
    """Looks its rows up by position, as BERT looks up its mask: ``arange(batch)`` is batch-shaped but
    is a row index, not a row of anyone's data."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(x.shape[0])
        scaled = torch.tanh(x * 2.0)
        looked_up = scaled[rows]
        return torch.sigmoid(looked_up + 1.0) * x


def test_a_row_index_is_not_state_so_any_cut_splits_and_merges_by_rows():
    """A value like ``arange(batch)`` must be recomputed in the segment that needs it: carried across a cut,
    a split batch's second part would index past its own rows, and a merged one would read its first's."""
    model = RowIndexed()
    x = torch.randn(2, 4)
    gm = trace(model, (x,))
    batch = classify(gm, (x,))
    assert not batch["arange"] and batch["x"] and batch["tanh"]
    rows = torch.randn(5, 4)
    for position in range(1, len(batch_nodes(gm, batch))):
        sliced = cut(gm, batch, [position])
        with torch.no_grad():
            first, second = split_state(sliced[0](sliced.start(rows)), [2, 3])
            parts = [sliced.finish(sliced[1](first)), sliced.finish(sliced[1](second))]
            joined = sliced.finish(sliced[1](merge_states([second, first])))
            expected = model(rows)
        assert torch.allclose(torch.cat(parts), expected), position
        assert torch.allclose(joined, torch.cat([expected[2:], expected[:2]])), position


def test_cut_rejects_an_empty_segment():
    model = seeded(TinyUNet())
    x = torch.randn(2, 3, 16, 16)
    gm = trace(model, (x,))
    batch = classify(gm, (x,))
    with pytest.raises(SegmentError, match="empty segment"):
        cut(gm, batch, [2, 2])
    assert len(batch_nodes(gm, batch)) > 5


def test_a_model_with_a_batch_free_output_is_refused():
    class Constant(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ones(4) * x.shape[1]

    with pytest.raises(SegmentError):
        slice_model(Constant(), (torch.randn(2, 3),), 1)


@pytest.mark.slow
def test_resnet50_in_four_time_balanced_segments():
    spec = get_spec("resnet50")
    model = build_model(spec)
    example = example_inputs(spec, 2)
    sliced = slice_model(model, example, 4, repeats=1, check=lambda got, exp: outputs_close(got, exp, 1e-4))
    assert len(sliced) == 4
    with torch.no_grad():
        x = example_inputs(spec, 3, seed=1)
        assert outputs_close(sliced(*x), model(*x), 1e-4)


def test_the_catalog_unet_cut_mid_encoder_hands_its_skips_to_the_next_segment():
    spec = get_spec("unet")
    model = build_model(spec)
    sliced = slice_model(model, example_inputs(spec, 2), 2, repeats=1, check=lambda g, e: outputs_close(g, e, 1e-4))
    with torch.no_grad():
        x = example_inputs(spec, 3, seed=1)
        state = sliced[0](sliced.start(*x))
        assert len(state) > 1 and state_rows(state) == 3  # the decoder's skips cross the cut
        out = sliced.finish(sliced[1](state))
        assert out.shape == (3, spec.num_labels, *spec.image_shape[1:])
        assert outputs_close(out, model(*x), 1e-4)


@pytest.mark.slow
def test_bert_sliced_through_export_runs_other_batch_sizes_and_lengths():
    spec = get_spec("bert-base")
    model = build_model(spec)
    ids, mask = example_inputs(spec, 2)
    ids, mask = ids[:, :16], mask[:, :16]
    sliced = slice_model(
        model, (ids, mask), 3, dynamic_dims=(0, 1), repeats=1, check=lambda g, e: outputs_close(g, e, 1e-4)
    )
    with torch.no_grad():
        ids2, mask2 = example_inputs(spec, 3, seed=2)
        ids2, mask2 = ids2[:, :24], mask2[:, :24].clone()
        mask2[0, 20:] = 0  # a padded row
        assert outputs_close(sliced(ids2, mask2), model(ids2, mask2), 1e-4)
        one = (ids2[:1, :8].clone(), mask2[:1, :8].clone())
        assert outputs_close(sliced(*one), model(*one), 1e-4)


def test_segment_profile_reads_between_and_beyond_measured_sizes(tmp_path):
    from handlers.runtime.segment_profile import ProfileError, SegmentProfile, load_segment_profile
    from serving_harness.machine import hardware_fingerprint

    prof = SegmentProfile("m", 2, (1, 2, 8), ((1.0, 2.0, 5.0), (3.0, 3.0, 9.0)), hardware_fingerprint())
    assert prof.segments == 2
    assert prof.ms(0, 2) == 2.0 and prof.ms(0, 4) == pytest.approx(3.0) and prof.ms(0, 16) == pytest.approx(9.0)
    assert prof.remaining_ms(0, 8) == 14.0 and prof.remaining_ms(1, 8) == 9.0 and prof.remaining_ms(2, 8) == 0.0
    back = load_segment_profile(prof.save(tmp_path / "p.json"))
    assert back == prof
    other = SegmentProfile("m", 2, (1,), ((1.0,),), {"cpu_model": "elsewhere"})
    with pytest.raises(ProfileError, match="other hardware"):
        load_segment_profile(other.save(tmp_path / "o.json"))
    assert load_segment_profile(tmp_path / "o.json", force=True).segments == 1
    with pytest.raises(ProfileError, match="increasing"):
        SegmentProfile("m", 1, (2, 1), ((1.0, 1.0),))
    with pytest.raises(ProfileError, match="one time per batch"):
        SegmentProfile("m", 1, (1, 2), ((1.0,),))
    (tmp_path / "bad.json").write_text('{"model": "m"}')
    with pytest.raises(ProfileError, match="malformed"):
        load_segment_profile(tmp_path / "bad.json")


def test_measured_segment_profile_covers_every_segment_and_batch():
    from handlers.runtime.segment_profile import measure_segments

    model = seeded(TinyUNet())
    sliced = slice_model(model, (torch.randn(2, 3, 16, 16),), 3)
    prof = measure_segments(sliced, lambda b: (torch.randn(b, 3, 16, 16),), [1, 4], "tiny", warmup=1, iters=2)
    assert prof.segments == 3 and prof.batches == (1, 4)
    assert all(t > 0 for row in prof.times_ms for t in row)


def test_a_profile_keeps_sampling_a_fast_size_until_its_runs_add_up_to_the_minimum_time():
    """Counted, not timed: with no minimum each size runs warm-up + iters times; with a minimum no run of
    this model can reach in its samples (an hour), each size runs the most it may (max_iters)."""
    from handlers.runtime.segment_profile import measure_segments

    model = seeded(TinyUNet())
    sliced = slice_model(model, (torch.randn(2, 3, 16, 16),), 3)
    made: list[int] = []

    def inputs(batch: int) -> tuple[torch.Tensor, ...]:
        made.append(batch)
        return (torch.randn(batch, 3, 16, 16),)

    measure_segments(sliced, inputs, [1, 4], "tiny", warmup=1, iters=2, progress=False)
    assert made == [1, 4] * 3
    made.clear()
    measure_segments(sliced, inputs, [1, 4], "tiny", warmup=1, iters=2, progress=False, min_ms=3.6e6, max_iters=9)
    assert made == [1, 4] * 10


def test_profiles_compared_with_each_other_are_measured_round_by_round_together():
    """Two input classes: each round runs every (class, size) once, so drift reads alike in both profiles;
    ``run_stages`` are what run each class's stages (the server's own programs)."""
    from handlers.runtime.segment_profile import measure_classes

    model = seeded(TinyUNet())
    sliced = slice_model(model, (torch.randn(2, 3, 16, 16),), 3)
    made: list[tuple[str, int]] = []

    def inputs(name: str, side: int):
        def make(batch: int) -> tuple[torch.Tensor, ...]:
            made.append((name, batch))
            return (torch.randn(batch, 3, side, side),)

        return make

    ran: list[int] = []

    def run_stage(stage: int, state):
        ran.append(stage)
        return sliced[stage](state)

    small, large = measure_classes(
        sliced, [inputs("small", 16), inputs("large", 32)], [1, 2], "tiny", warmup=0, iters=2,
        progress=False, run_stages=[run_stage, run_stage],
    )  # fmt: skip
    assert made == [("small", 1), ("small", 2), ("large", 1), ("large", 2)] * 2
    assert ran == [0, 1, 2] * 8
    assert small.batches == large.batches == (1, 2) and small.segments == large.segments == 3


def test_packrat_segments_refuses_bad_arguments_clearly(capsys):
    from packrat_plugin.cli import main

    assert main(["segments", "resnet50", "--batches", "0"]) == 2
    assert "positive sizes" in capsys.readouterr().err
    assert main(["segments", "no-such-model"]) == 2
    assert "no-such-model" in capsys.readouterr().err


@pytest.mark.slow
def test_packrat_segments_writes_a_profile_of_a_catalog_model(tmp_path, capsys):
    from handlers.runtime.segment_profile import load_segment_profile
    from packrat_plugin.cli import main

    out = tmp_path / "resnet50.json"
    args = ["segments", "resnet50", "-n", "2", "--batches", "1,2", "--warmup", "0", "--iters", "1", "--out", str(out)]
    assert main(args) == 0
    prof = load_segment_profile(out)
    assert prof.model == "resnet50" and prof.segments == 2 and prof.batches == (1, 2)
    assert "segment 1" in capsys.readouterr().out
