"""The op tables of schedules with an explicit backward (gPipe, 1F1B, zero-bubble ZB-H1, interleaved 1F1B) on their
own: no JAX."""

from __future__ import annotations

import itertools

import pytest

from maxpar.core.op_schedule import (B, F, KINDS, W, Op, OpSchedule, check, held_inputs, interleaved_order,
                                     stage_order)
from maxpar.core.schedule import pipeline_bubble

SIZES = [(s, m) for s, m in itertools.product((1, 2, 3, 4, 8), (1, 2, 4, 8, 16))]
ONE_BLOCK = tuple(kind for kind in KINDS if kind != "interleaved_1f1b")  # one block per stage
# (S, M, R) of interleaved 1F1B: M a multiple of S
INTERLEAVED = [(s, s * k, r) for s, k, r in itertools.product((1, 2, 3, 4, 8), (1, 2, 3), (2, 3, 4))]


@pytest.mark.parametrize("kind", ONE_BLOCK)
@pytest.mark.parametrize("stages,microbatches", SIZES)
def test_every_op_runs_once_after_what_it_depends_on(kind, stages, microbatches):
    schedule = OpSchedule(kind, stages, microbatches)
    check(schedule)
    tick = {(op.kind, op.microbatch, op.stage): op.tick for op in schedule.ops()}
    assert len(tick) == (3 if kind == "zero_bubble" else 2) * stages * microbatches
    for m, s in itertools.product(range(microbatches), range(stages)):  # the rules, spelled out once more
        assert tick[(B, m, s)] > tick[(F, m, s)]
        if kind == "zero_bubble":
            assert tick[(W, m, s)] > tick[(B, m, s)]
        if s:
            assert tick[(F, m, s)] >= tick[(F, m, s - 1)] + 1
        if s < stages - 1:
            assert tick[(B, m, s)] >= tick[(B, m, s + 1)] + 1


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,microbatches", SIZES)
def test_bubble_counted_on_the_table_is_the_formula(kind, stages, microbatches):
    schedule = OpSchedule(kind, stages, microbatches)
    assert schedule.num_ticks == 2 * (microbatches + stages - 1)
    assert schedule.bubble == pytest.approx(pipeline_bubble(stages, microbatches))


@pytest.mark.parametrize("stages,microbatches", SIZES)
def test_1f1b_keeps_at_most_s_minus_stage_microbatches_in_flight(stages, microbatches):
    """1F1B's point: a stage holds min(S - s, M) stage inputs, gPipe's all M."""
    assert OpSchedule("1f1b", stages, microbatches).peak_in_flight() == [
        min(stages - s, microbatches) for s in range(stages)]
    assert OpSchedule("gpipe", stages, microbatches).peak_in_flight() == [microbatches] * stages


@pytest.mark.parametrize("stages,microbatches", SIZES)
def test_zero_bubble_has_a_third_of_1f1bs_bubble_at_1f1bs_peak_memory(stages, microbatches):
    """ZB-H1 (one tick per F, B, W): S - 1 idle ticks per stage of 3 M + S - 1 when M >= S, against 1F1B's
    3 (S - 1) of 3 (M + S - 1) (its B is the unsplit backward: two of these ticks); never more stage inputs held
    than 1F1B's first stage."""
    zb = OpSchedule("zero_bubble", stages, microbatches)
    one_f_one_b = pipeline_bubble(stages, microbatches)
    if microbatches >= stages:
        assert zb.num_ticks == 3 * microbatches + stages - 1
        assert zb.bubble == pytest.approx((stages - 1) / (3 * microbatches + stages - 1))
        assert zb.bubble <= one_f_one_b / 2 or stages == 1
    assert zb.bubble < one_f_one_b or stages == 1
    assert max(zb.peak_in_flight()) == max(OpSchedule("1f1b", stages, microbatches).peak_in_flight())


def test_zero_bubble_defers_stage_ss_weight_gradients_by_s_into_the_cool_down():
    assert stage_order("zero_bubble", 0, 2, 3) == [(F, 0), (F, 1), (B, 0), (W, 0), (F, 2), (B, 1), (B, 2), (W, 1),
                                                   (W, 2)]
    assert stage_order("zero_bubble", 1, 2, 3) == [(F, 0), (B, 0), (F, 1), (B, 1), (W, 0), (F, 2), (B, 2), (W, 1),
                                                   (W, 2)]
    text = OpSchedule("zero_bubble", 2, 3).render().splitlines()
    assert text[0] == "zero_bubble: S=2 stages, M=3 microbatches, 10 ticks, bubble 10.0%"
    assert text[-3:] == ["t   7 | W1 B2", "t   8 | B2 W1", "t   9 | W2 W2"]  # stage 0's W1 fills the wait for B2


def test_1f1b_stage_orders_warm_up_then_alternate():
    assert stage_order("1f1b", 0, 4, 6) == [(F, 0), (F, 1), (F, 2), (F, 3), (B, 0), (F, 4), (B, 1), (F, 5), (B, 2),
                                            (B, 3), (B, 4), (B, 5)]
    assert stage_order("1f1b", 3, 4, 3) == [(F, 0), (B, 0), (F, 1), (B, 1), (F, 2), (B, 2)]


def test_render_prints_the_table():
    text = OpSchedule("1f1b", 2, 3).render()
    assert text.splitlines() == [
        "1f1b: S=2 stages, M=3 microbatches, 8 ticks, bubble 25.0%",
        "t   0 | F0 .",
        "t   1 | F1 F0",
        "t   2 | .  B0",
        "t   3 | B0 F1",
        "t   4 | F2 B1",
        "t   5 | B1 F2",
        "t   6 | .  B2",
        "t   7 | B2 .",
    ]


def test_describe_names_the_bubble_and_the_stage_inputs_held():
    assert OpSchedule("1f1b", 4, 8).describe() == (
        "1f1b pipeline: S=4 stages, M=8 microbatches, 22 ticks (a block's forward or backward each); "
        "bubble 27.3% = (S-1)/(M+S-1); at most 4 of the M stage inputs held per stage")


def test_check_rejects_a_table_out_of_dependency_order_or_with_a_missing_op():
    schedule = OpSchedule("1f1b", 2, 2)
    ops = schedule.ops()

    class Broken(OpSchedule):
        def ops(self):
            return self.table

    def broken(table):
        bad = Broken("1f1b", 2, 2)
        object.__setattr__(bad, "table", table)
        return bad

    swapped = [Op(op.tick, op.stage, op.microbatch, B if op.kind == F else F) if op.stage == 1 else op for op in ops]
    with pytest.raises(AssertionError, match="before its inputs"):
        check(broken(swapped))
    with pytest.raises(AssertionError, match="exactly once"):
        check(broken(ops[:-1]))


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="valid: gpipe, 1f1b, zero_bubble, interleaved_1f1b"):
        OpSchedule("interleaved", 2, 2)


@pytest.mark.parametrize("stages,microbatches,repeats", INTERLEAVED)
def test_interleaved_runs_every_block_op_once_in_block_order(stages, microbatches, repeats):
    """Block v = r S + s runs on stage s; F(m, v) after F(m, v - 1), including the wrap from stage S - 1 to stage 0
    of the next repeat; B in reverse; each op once."""
    schedule = OpSchedule("interleaved_1f1b", stages, microbatches, repeats)
    check(schedule)
    blocks = stages * repeats
    tick = {(op.kind, op.microbatch, op.repeat * stages + op.stage): op.tick for op in schedule.ops()}
    assert len(tick) == len(schedule.ops()) == 2 * microbatches * blocks
    for m, v in itertools.product(range(microbatches), range(blocks)):
        assert tick[(B, m, v)] > tick[(F, m, v)]
        if v:
            assert tick[(F, m, v)] >= tick[(F, m, v - 1)] + 1
        if v < blocks - 1:
            assert tick[(B, m, v)] >= tick[(B, m, v + 1)] + 1


@pytest.mark.parametrize("stages,microbatches,repeats", INTERLEAVED)
def test_interleaved_divides_the_bubble_by_about_r_and_holds_its_warm_up(stages, microbatches, repeats):
    """2 (R M + S - 1) ticks of one block's op: circular's bubble (S-1)/(RM+S-1), 1F1B's over about R; stage s
    holds its warm-up's 2 (S - s - 1) + (R - 1) S block inputs + 1, at most all R M."""
    schedule = OpSchedule("interleaved_1f1b", stages, microbatches, repeats)
    assert schedule.num_ticks == 2 * (repeats * microbatches + stages - 1)
    assert schedule.bubble == pytest.approx(pipeline_bubble(stages, microbatches, repeats))
    one_f_one_b = OpSchedule("1f1b", stages, microbatches).bubble
    assert schedule.bubble < one_f_one_b or stages == 1
    assert schedule.peak_in_flight() == [min(repeats * microbatches, 2 * (stages - s - 1) + (repeats - 1) * stages + 1)
                                         for s in range(stages)]
    assert held_inputs("interleaved_1f1b", stages, microbatches, repeats) == max(schedule.peak_in_flight())


def test_interleaved_stage_order_goes_through_groups_of_s_microbatches():
    """Megatron-LM's order: F over the repeats for a group of S microbatches, B the repeats reversed; stage 0 of
    S = 2 warms up with 2 + 2 forwards."""
    assert interleaved_order(0, 2, 4, 2) == [
        (F, 0, 0), (F, 1, 0), (F, 0, 2), (F, 1, 2), (F, 2, 0), (B, 0, 2), (F, 3, 0), (B, 1, 2), (F, 2, 2), (B, 0, 0),
        (F, 3, 2), (B, 1, 0), (B, 2, 2), (B, 3, 2), (B, 2, 0), (B, 3, 0)]
    assert OpSchedule("interleaved_1f1b", 2, 2, 2).render().splitlines() == [
        "interleaved_1f1b: S=2 stages, M=2 microbatches, R=2 repeats, 10 ticks, bubble 20.0%",
        "t   0 | F0.0 .", "t   1 | F1.0 F0.0", "t   2 | F0.1 F1.0", "t   3 | F1.1 F0.1", "t   4 | .    B0.1",
        "t   5 | B0.1 F1.1", "t   6 | .    B1.1", "t   7 | B1.1 B0.0", "t   8 | B0.0 B1.0", "t   9 | B1.0 ."]


@pytest.mark.parametrize("args,message", [
    (("interleaved_1f1b", 4, 6, 2), "multiple of the stages, got 6 for 4"),
    (("1f1b", 2, 4, 2), "1f1b runs one block per stage, not 2"),
])
def test_what_interleaved_cannot_run_is_refused(args, message):
    with pytest.raises(ValueError, match=message):
        OpSchedule(*args)
