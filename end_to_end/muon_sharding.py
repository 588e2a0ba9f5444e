"""Muon under FSDP/TP/EP: each way of orthogonalizing a sharded matrix, measured on 8 simulated CPU devices.

    python end_to_end/muon_sharding.py [--repeats 5] [--record docs/results] [key=value ...]

The Newton-Schulz iteration needs each layer's matrix whole (its Frobenius norm and X X^T span it). Three ways
(`maxpar.training.muon.Orthogonalization`):

  gathered     each matrix gathered onto every device that held a piece of it; all of them compute it
  spread       each matrix gathered onto one group of those devices; the layers (and experts) spread over the
               groups (the layer dim padded with zero matrices where it does not divide), so each matrix is
               computed by fewer devices (maxpar's choice)
  distributed  the matrices stay split as the parameters are; the partitioner splits the iteration's matmuls
               (a collective in each of its 5 x 3 matmuls)

For the default model (configs/base.yml), dense under FSDP(8) and FSDP(4) x TP(2), and with 4 experts under
FSDP(2) x TP(2) x EP(2), it compiles the optimizer's update alone (Muon for the hidden matrices, AdamW for the
rest) from the same parameters and gradients, and reports per way: the update's wall time (median of --repeats,
after a warm-up; 8 devices simulated on this machine's cores, so computing a matrix on every device costs 8x
here), the collectives' bytes per device (from the compiled HLO), XLA's temporary bytes, and the largest
difference of its update from the one-device update. PASS when every way equals one device (relative difference
under 1e-4 of the largest update element).
"""

from __future__ import annotations

from preamble import prepare  # end_to_end/preamble.py: this script's folder is sys.path[0]

REPO = prepare(devices=8)

import argparse  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from verdict import exit_with  # noqa: E402  end_to_end/verdict.py

from maxpar.tools import records  # noqa: E402

LOAD_START = records.load_average()
MESHES = {  # name: (model overrides, mesh overrides)
    "dense fsdp8": ((), ("ici_fsdp_parallelism=8",)),
    "dense fsdp4 x tp2": ((), ("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")),
    "moe fsdp2 x tp2 x ep2": (("num_experts=4", "num_experts_per_tok=2"),
                              ("ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "ici_expert_parallelism=2")),
}
TOLERANCE = 1e-4


def host_inputs(config, tx):
    """(params, grads, opt_state after one update) on the host: the same numbers for every mesh."""
    import jax
    import numpy as np

    from maxpar.tools.testbed import layout_on
    from maxpar.core.config import model_config
    from maxpar.model import Transformer
    from maxpar.training.train_step import create_state

    layout, mesh = layout_on(config, jax.devices()[:1])
    state = create_state(Transformer(model_config(config), layout.model), tx, layout, mesh)
    rng = np.random.default_rng(0)
    grads = [jax.tree.map(lambda p: (rng.normal(size=p.shape) * 1e-2).astype(p.dtype), jax.device_get(state.params))
             for _ in range(2)]
    _, opt_state = jax.jit(tx.update)(grads[0], state.opt_state, state.params)  # a momentum that is not zero
    return jax.device_get(state.params), grads[1], jax.device_get(opt_state)


def measure(config, layout, mesh, how, inputs, repeats: int) -> dict:
    """Compile the update for `how` on `mesh`; its time, collectives, temporaries and update."""
    import jax

    from maxpar.plan import hlo
    from maxpar.training.optimizer import make_optimizer

    tx = make_optimizer(config, layout, how)
    shardings = layout.state_shardings(mesh)
    params, grads, opt_state = (jax.device_put(x, s) for x, s in zip(
        inputs, (shardings.params, shardings.params, shardings.opt_state)))
    update = jax.jit(tx.update, in_shardings=(shardings.params, shardings.opt_state, shardings.params),
                     out_shardings=(shardings.params, shardings.opt_state))
    compiled = update.lower(grads, opt_state, params).compile()
    jax.block_until_ready(compiled(grads, opt_state, params))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(grads, opt_state, params))
        times.append(time.perf_counter() - start)
    by_kind: dict[str, float] = {}
    for c in hlo.collectives(compiled.as_text(), mesh.devices.size):
        by_kind[c.kind] = by_kind.get(c.kind, 0.0) + hlo.collective_wire_bytes(c)
    updates = jax.device_get(compiled(grads, opt_state, params)[0])
    return {"time_s": statistics.median(times), "collectives": by_kind,
            "temp_bytes": compiled.memory_analysis().temp_size_in_bytes, "updates": updates}


def largest_difference(got, want) -> float:
    """max |got - want| over every parameter, over the largest |want| element."""
    import jax
    import numpy as np

    diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))), got, want))
    scale = max(float(np.max(np.abs(np.asarray(b)))) for b in jax.tree.leaves(want))
    return max(diffs) / scale


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    records.add_record_option(parser)
    args = parser.parse_args()
    os.chdir(REPO)

    import jax

    from maxpar.tools.testbed import layout_on
    from maxpar.core.config import load_config
    from maxpar.training.muon import Orthogonalization
    from maxpar.training.optimizer import make_optimizer

    print(f"muon_sharding: the default model's Muon update on {len(jax.devices())} simulated CPU devices; "
          f"load average {LOAD_START}", flush=True)
    header = ("mesh", "way", "update ms", "all-gather MB", "all-reduce MB", "all-to-all MB", "other MB",
              "temp MB", "max diff vs 1 device")
    rows, ok = [], True
    references = {}
    for name, (model, mesh_overrides) in MESHES.items():
        base = ["configs/base.yml", "opt_type=muon", "per_device_batch_size=1", *model, *args.overrides]
        if model not in references:
            one = load_config(base)
            single = layout_on(one, jax.devices()[:1])
            inputs = host_inputs(one, make_optimizer(one, single[0]))
            references[model] = (inputs, measure(one, *single, Orthogonalization.GATHERED, inputs, 1)["updates"])
        inputs, want = references[model]
        config = load_config([*base, *mesh_overrides])
        layout, mesh = layout_on(config)
        for how in Orthogonalization:
            got = measure(config, layout, mesh, how, inputs, args.repeats)
            diff = largest_difference(got["updates"], want)
            ok &= diff < TOLERANCE
            mb = {k: v / 2**20 for k, v in got["collectives"].items()}
            other = sum(v for k, v in mb.items() if k not in ("all-gather", "all-reduce", "all-to-all"))
            rows.append([name, str(how), f"{got['time_s'] * 1e3:.0f}", f"{mb.get('all-gather', 0):.1f}",
                         f"{mb.get('all-reduce', 0):.1f}", f"{mb.get('all-to-all', 0):.1f}", f"{other:.1f}",
                         f"{got['temp_bytes'] / 2**20:.1f}", f"{diff:.1e}"])
            print(f"  {name}, {how}: {rows[-1][2]} ms [load {records.load_average()[0]}]", flush=True)
    records.print_table(header, rows)
    load_end = records.load_average()
    print(f"load average at the end: {load_end}")
    if args.record:
        print("record:", records.write_record(args.record, "muon_sharding",
                                              ["python", "end_to_end/muon_sharding.py", *sys.argv[1:]],
                                              {"rows": records.table_rows(header, rows)}, LOAD_START))
    if ok:
        print(f"PASS: every way of orthogonalizing equals the one-device update (relative difference < {TOLERANCE})")
        return 0
    print("FAIL: a way of orthogonalizing differs from the one-device update")
    return 1


if __name__ == "__main__":
    exit_with(main)
