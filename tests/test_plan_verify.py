"""`python -m maxpar.plan --verify`: the predicted collectives and memory match the compiled train step.

Each strategy compiles the real train step of a tiny model on the 8 simulated CPU devices and
compares per mesh axis and collective kind (10% on bytes), with XLA:CPU's lowering differences
converted explicitly.

Where an equivalence test trains the same strategy (tests/test_equivalence.py, test_context_parallel.py,
test_deepseek_parallel.py), the case here takes that test's config whole (`trained`: its overrides, 1 row per
device, its steps), so that the session compiles the train step once: whichever runs second reads it from the
compilation cache.
"""

from __future__ import annotations

from pathlib import Path

import jax
import pytest

from helpers import MICRO
from test_context_parallel import BLOCKWISE, CASES as CONTEXT_PARALLEL
from test_deepseek_parallel import DEEPSEEK as DEEPSEEK_TRAINED, MESHES as DEEPSEEK_MESHES, STEPS as DEEPSEEK_STEPS
from test_equivalence import STRATEGIES as EQUIVALENCE, STEPS
from maxpar.core.config import load_config
from maxpar.core.schedule import Schedule, ScheduleKind
from maxpar.plan import verify
from maxpar.plan.__main__ import main, run
from maxpar.plan.comms import Comm
from maxpar.plan.hardware import load_hardware
from maxpar.plan.predict import Target, make_plan, plan_layout

REPO = Path(__file__).resolve().parents[1]
BASE = str(REPO / "configs" / "base.yml")
SMALL = [*MICRO, "per_device_batch_size=4", "hardware=tpu-v5p"]


def trained(*overrides: str, steps: int = STEPS) -> list[str]:
    """An equivalence test's mesh `overrides` as its sharded run has them (`helpers.compiled_steps`: 1 row per device,
    its `steps`, synthetic data), so the compiled train step is the same program."""
    return [*overrides, "per_device_batch_size=1", f"steps={steps}", "dataset_type=synthetic"]


STRATEGIES = {
    "DP(8)": ("base.yml", trained(*EQUIVALENCE["dp8"][1]), {("data", "all-reduce")}),
    "FSDP(4)xTP(2)": ("base.yml", trained(*EQUIVALENCE["fsdp4_tp2"][1]),
                      {("fsdp", "all-gather"), ("fsdp", "all-reduce"), ("tensor", "all-reduce")}),
    # 8-way TP needs 8 kv heads; one row per device keeps the replicated batch whole.
    "TP(8)": ("base.yml", ["ici_fsdp_parallelism=1", "ici_tensor_parallelism=-1", "num_query_heads=8",
                           "num_kv_heads=8", "per_device_batch_size=1"], {("tensor", "all-reduce")}),
    "FSDP-transpose(4x2)": ("fsdp_transpose.yml", trained(*EQUIVALENCE["fsdp_transpose"][1]),
                            {("fsdp", "all-gather"), ("fsdp", "all-reduce"), ("tensor", "all-reduce")}),
    # The residual stream sequence-sharded over tensor: gathered per block, and the vocab-sharded table and
    # output projection gathered over tensor too (the logits' length takes that axis).
    "TP-sequence(4x2)": ("tp_sequence.yml", ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"],
                         {("fsdp", "all-gather"), ("fsdp", "all-reduce"), ("tensor", "all-gather"),
                          ("tensor", "all-reduce")}),
    # The feed-forward weights split on embed over tensor: the MLP's hidden activations move over tensor. The
    # seed's case for it, mlp_dim < emb_dim (XLA:CPU gathers more when mlp_dim > emb_dim; README).
    "TP-transpose(4x2)": ("tp_transpose.yml", ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", "emb_dim=256",
                                               "mlp_dim=128", "per_device_batch_size=1"],
                          {("fsdp", "all-gather"), ("fsdp", "all-reduce"), ("tensor", "all-gather"),
                           ("tensor", "all-reduce")}),
    # ZeRO-1: the moments split over data, the gradient reduce-scattered over it (XLA:CPU: all-reduce + slice),
    # the updated parameters all-gathered (mixed with fsdp and tensor: test_cli_verify_mixed_with_hlo_dump). Not
    # `trained`: at 1 row per device the data all-gather and all-reduce measure 13-19% off the prediction.
    "DP(8) ZeRO-1": ("base.yml", ["ici_data_parallelism=-1", "ici_fsdp_parallelism=1",
                                  "shard_optimizer_over_data=true"], {("data", "all-reduce"), ("data", "all-gather")}),
    # Context parallelism: weights gathered over fsdp+context like FSDP; k/v gathered (or permuted round the
    # ring) per layer in the attention shard_map; the lookup's table gradient all-reduced over context first.
    # The ring without load balancing here; balanced, on the DeepSeek model below.
    "CP(2, all_gather)xFSDP(4)": ("base.yml", trained(*CONTEXT_PARALLEL["cp2_gather_balanced_fsdp4"], *BLOCKWISE),
                                  {("fsdp+context", "all-gather"), ("context", "all-gather"),
                                   ("context", "reduce-scatter"), ("context", "all-reduce")}),
    "CP(4, ring, unbalanced)xFSDP(2)": ("base.yml", trained(*CONTEXT_PARALLEL["cp4_ring_unbalanced_fsdp2"], *BLOCKWISE),
                                        {("fsdp+context", "all-gather"), ("context", "collective-permute")}),
    # A table split on embed over fsdp only is looked up on its shards: the ids gathered, the rows moved to their
    # batch shards by an all-to-all (and their gradient back); its gradient summed over data alone.
    "DP(2)xFSDP(4) untied": ("base.yml", ["ici_data_parallelism=2", "ici_fsdp_parallelism=4",
                                          "logits_via_embedding=false"],
                             {("fsdp", "all-gather"), ("fsdp", "all-to-all"), ("fsdp", "all-reduce"),
                              ("data", "all-reduce")}),
    "DP(2)xFSDP(4) untied ZeRO-1": ("base.yml", ["ici_data_parallelism=2", "ici_fsdp_parallelism=4",
                                                 "logits_via_embedding=false", "shard_optimizer_over_data=true"],
                                    {("fsdp", "all-to-all"), ("data", "all-reduce"), ("data", "all-gather")}),
    # The table's lookup and projection gradients are reduced apart.
    "FSDP(8) tied embeddings": ("base.yml", ["ici_fsdp_parallelism=-1", "logits_via_embedding=true"],
                                {("fsdp", "all-gather"), ("fsdp", "all-reduce")}),
}

# Unscanned layers (no layer loop in the program): without remat the forward's gathered weights are kept for
# the backward pass; with remat they are gathered again.
UNSCANNED = {
    "FSDP(4)xTP(2) unscanned": ("base.yml", ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"]),
    "FSDP(4)xTP(2) unscanned remat=minimal": ("base.yml", ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2",
                                                           "remat_policy=minimal"]),
    "TP-sequence(4x2) unscanned": ("tp_sequence.yml", ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"]),
}


def checked(result: dict) -> set[tuple[str, str]]:
    return {(b["axis"], b["collective"]) for b in result["buckets"] if b["status"] == "ok"}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_verify_passes(name):
    config_file, overrides, expected = STRATEGIES[name]
    result, text, status = run([str(REPO / "configs" / config_file), *SMALL, *overrides, "--verify"])
    v = result["verify"]
    assert status == 0 and v["passed"], text
    assert expected <= checked(v), text
    assert all(b["status"] != "MISMATCH" for b in v["buckets"])
    assert any("2 trips" in loop for loop in v["loops"])  # the layer scan, counted twice


@pytest.mark.parametrize("name", list(UNSCANNED))
def test_verify_passes_unscanned(name):
    config_file, overrides = UNSCANNED[name]
    result, text, status = run([str(REPO / "configs" / config_file), *SMALL, *overrides, "scan_layers=false",
                                "--verify"])
    v = result["verify"]
    assert status == 0 and v["passed"], text
    assert ("fsdp", "all-gather") in checked(v), text
    assert not v["loops"]


@pytest.fixture(scope="module")
def fsdp8():
    config = load_config([BASE, *SMALL, *trained(*EQUIVALENCE["fsdp8"][1])])
    return config, verify.compile_train_step(config, jax.devices())


def test_verify_passes_for_fsdp8_and_names_the_cpu_lowering(fsdp8):
    config, compiled = fsdp8
    target = Target(load_hardware("tpu-v5p"), 8, 1)
    layout = plan_layout(config, target)
    result = verify.compare(make_plan(config, target, layout=layout), layout, compiled, config)
    assert result["passed"], result["failures"]
    assert {("fsdp", "all-gather"), ("fsdp", "all-reduce")} <= checked(result)
    # The target reduce-scatters the gradients; XLA:CPU all-reduces them (and says so).
    grads = next(b for b in result["buckets"] if b["axis"] == "fsdp" and b["collective"] == "all-reduce")
    assert grads["predicted_target"]["reduce-scatter"] > 0
    assert any("reduce-scatter -> all-reduce" in n for n in result["notes"])
    state = result["memory"][0]
    assert state["what"].startswith("train state") and state["error"] == pytest.approx(0, abs=1e-9)


def test_verify_fails_when_the_prediction_is_wrong(fsdp8):
    config, compiled = fsdp8
    wrong_config = load_config([BASE, *SMALL, "ici_data_parallelism=-1", "ici_fsdp_parallelism=1"])
    target = Target(load_hardware("tpu-v5p"), 8, 1)
    wrong_layout = plan_layout(wrong_config, target)
    wrong = make_plan(wrong_config, target, layout=wrong_layout)
    result = verify.compare(wrong, wrong_layout, compiled, config)
    assert not result["passed"]
    assert any(b["status"] == "MISMATCH" for b in result["buckets"])


def test_cli_verify_mixed_with_hlo_dump(tmp_path, capsys):
    """DP(2) x FSDP(2) x TP(2) with ZeRO-1 through the command line: exit status, the table, the HLO dump. Mixed, a
    top-level weight's gradient is reduce-scattered over data and fsdp at once; the updated parameters are
    all-gathered over data."""
    status = main([BASE, *SMALL, *trained(*EQUIVALENCE["dp2_fsdp2_tp2_zero1"][1]), "--verify", "--dump_hlo",
                   str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 0, out[-3000:]
    assert "verify: PASS" in out and "MISMATCH" not in out and "2 trips" in out  # the layer scan
    for note in ("reduce-scatter -> all-reduce", "all-reduced one by one"):
        assert note in out
    for axis, kind in (("data", "all-reduce"), ("data", "all-gather"), ("data+fsdp", "all-reduce"),
                       ("fsdp", "all-gather"), ("fsdp", "all-reduce"), ("tensor", "all-reduce")):
        assert any(line.split()[:2] == [axis, kind] and " ok " in line for line in out.splitlines()), out
    assert "all-gather" in (tmp_path / "train_step.hlo.txt").read_text()


def test_cpu_conversions_are_explicit():
    def comm(**kw):
        base = dict(pattern="p", axes=("fsdp",), network="ici", collective="all-gather", phase="forward",
                    dtype="float32", operand_bytes=100.0, group_size=4, count=2, scales_with_batch=False)
        return Comm(**{**base, **kw})
    assert verify.on_backend(comm(), "tpu") == ("all-gather", 600.0, [])
    kind, size, notes = verify.on_backend(comm(collective="reduce-scatter", operand_bytes=400.0), "cpu")
    assert (kind, size) == ("all-reduce", 2 * 2 * 400 * 3 / 4) and "ReduceScatterCreator" in notes[0]
    kind, size, notes = verify.on_backend(comm(collective="all-reduce", cpu_parts=3), "cpu")
    assert size == 3 * 2 * 2 * 100 * 3 / 4 and "AllReduceReassociate" in notes[0]
    kind, size, notes = verify.on_backend(comm(dtype="bfloat16", count=1), "cpu")
    assert size == 2 * 100 * 3 and any("float32" in n for n in notes)


def test_known_mispredictions_are_named():
    unscanned_full = load_config([BASE, *SMALL, "remat_policy=full", "scan_layers=false"])
    assert any("unscanned layers with remat_policy=full" in n
               for n in verify.known_mispredictions(unscanned_full, False, None))
    assert any("TP-sequence" in n for n in verify.known_mispredictions(load_config([BASE, *SMALL, "remat_policy=full"]),
                                                                       True, None))
    assert verify.known_mispredictions(load_config([BASE, *SMALL]), True, None) == []
    # the pipelined ones, by the schedule the layout resolved (not by the config key)
    bf16 = load_config([BASE, *SMALL, "dtype=bfloat16"])
    one_f_one_b = Schedule(2, 4, 1, 4, kind=ScheduleKind.ONE_F_ONE_B)
    assert any("pipeline_schedule=1f1b with dtype=bfloat16" in n
               for n in verify.known_mispredictions(bf16, False, one_f_one_b))
    assert verify.known_mispredictions(bf16, False, Schedule(2, 4, 1, 4)) == []  # gPipe: autodiff's backward
    assert verify.known_mispredictions(bf16, False, None) == []


DEEPSEEK = {
    "FSDP(4)xTP(2)": (["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"],
                      {("fsdp", "all-gather"), ("fsdp", "reduce-scatter"), ("tensor", "all-reduce")},
                      ("MTP attention", "TP shared-expert", "MTP TP MoE")),
    # The dense prefix and the MTP module outside the loop (their weights gathered per pass, the MTP experts'
    # once per microbatch), a MoE layer per stage with its experts over expert. test_deepseek_parallel.py's
    # pp2_ep2_fsdp2 config (its bias rate too).
    "PP(2)xEP(2)xFSDP(2)": (trained(*DEEPSEEK_TRAINED, *DEEPSEEK_MESHES["pp2_ep2_fsdp2"], steps=DEEPSEEK_STEPS),
                            {("fsdp+expert", "all-gather"), ("expert", "all-to-all"), ("fsdp", "reduce-scatter"),
                             ("stage", "collective-permute")},
                            ("FSDP dense-prefix weight all-gather (backward)", "MTP EP token all-to-all")),
    # Without its experts (CP refuses MoE layers): the ring carries every head's k [qk_nope + qk_rope] and
    # v [v_head_dim] for the stack's layers and the MTP module's; the unsharded weights' gradients (norms, MLA's
    # latent side) summed over context first, then fsdp.
    "CP(4, ring)xFSDP(2)": (["num_experts=1", "num_experts_per_tok=1", "n_routing_groups=0", "topk_routing_group=0",
                             "first_num_dense_layers=0", "ici_context_parallelism=4", "ici_fsdp_parallelism=2",
                             "attention=blockwise", "attention_block_size=8", "context_parallel_strategy=ring"],
                            {("context", "collective-permute"), ("context", "all-reduce"), ("fsdp", "all-reduce"),
                             ("fsdp+context", "all-gather")},
                            ("CP ring dk collective-permute (backward)", "CP ring v collective-permute (forward)")),
}


@pytest.mark.parametrize("name", list(DEEPSEEK))
def test_verify_passes_for_the_deepseek_model(name):
    """MLA (its head-split projections' latent input gradients, its per-head k and v under CP), the shared
    experts' and the MTP module's collectives (its layer, lookup and output head) are predicted on the tiny
    DeepSeek model."""
    overrides, expected, patterns = DEEPSEEK[name]
    result, text, status = run([BASE, *SMALL, "model_name=deepseek-tiny", "num_decoder_layers=3", *overrides,
                                "--verify"])
    v = result["verify"]
    assert status == 0 and v["passed"], text
    assert expected <= checked(v), text
    assert all(p in text for p in patterns), text
