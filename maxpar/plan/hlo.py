"""Read the collectives of a compiled XLA program from its HLO text.

Why text: `compiled.as_text()` is what XLA actually runs after SPMD
partitioning, so its collectives are the ground truth that `--verify` holds the
predictions against. Everything here is pure string -> data parsing; mapping a
replica group to mesh axes only needs the mesh's axis names and sizes.

XLA:TPU's programs differ from XLA:CPU's in three ways read here: collectives are
asynchronous `*-start`/`*-done` pairs (counted once, at the start); a matmul whose
operand is all-gathered or whose result is reduce-scattered becomes a "collective
matmul", a loop (`windowed_dot_general_body_ag` / `_rs`) of collective-permutes that
pass shards around the ring between partial matmuls, with its first or last permute
peeled out of the loop: those permutes are the all-gather or reduce-scatter they stand
for (`Collective.stands_for`, matched through the matmul's op_name); and its loops carry
no `known_trip_count`, so trip counts are read from the loop condition
(`counter < N`, the counter's start and step traced to constants).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Mapping, Sequence

import numpy as np

COLLECTIVE_KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

# Bytes per element of each HLO primitive type.
ELEMENT_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16, "token": 0,
}

_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s+(?P<op>[a-z][\w\-]*)\((?P<args>.*)$")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s*\((?P<params>.*)\)\s*->\s*.*\{\s*$")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_OPERAND = re.compile(r"%([\w.\-]+)")
_REPLICA_GROUPS = re.compile(
    r"replica_groups=("
    r"mesh\[[^\]]*\](?:,\s*device_ids=\([^)]*\)?\))?\s*\{[^}]*\}"  # mesh axes
    r"|\{(?:\{[0-9,\s]*\},?)*\}"                                    # explicit groups
    r"|\[\d+,\d+\]<=\[[0-9,]+\](?:T\([0-9,]+\))?)")                  # iota
_CALLEE = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%([\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class Operand:
    """One array a collective moves; tuple-shaped (combined) collectives have several."""

    nbytes: int
    dtype: str
    op_name: str                        # jax-level provenance of the instruction that produced it


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of the program and how often one step runs it."""

    name: str
    kind: str                           # one of COLLECTIVE_KINDS (async -start/-done folded in)
    dtype: str                          # element type of the operand ('mixed' for tuples of several)
    operand_bytes: int                  # bytes each device contributes (all operands of a tuple collective)
    groups: tuple[tuple[int, ...], ...]  # partition ids per replica group (pairs for collective-permute)
    count: float                        # executions per step: product of enclosing loop trip counts
    computation: str
    op_name: str                        # jax-level provenance from the metadata
    operands: tuple[Operand, ...] = ()
    unknown_trip_count: bool = False
    moving_fraction: float = 1.0        # collective-permute: share of the program's devices that send elsewhere
    every_branch: bool = False          # in a conditional's branch counted as if every branch ran (a bound)
    stands_for: str = ""                # a collective matmul's permute: the all-gather / reduce-scatter it does
    dcn: bool = False                   # XLA:TPU's multi-slice transfer between slices (its groups are slices)

    @property
    def logical_kind(self) -> str:
        """The collective this one does: its kind, or for a collective matmul's permute the one it stands for."""
        return self.stands_for or self.kind

    @property
    def group_size(self) -> int:
        return max((len(g) for g in self.groups), default=1)


def shape_bytes(type_text: str) -> tuple[int, str]:
    """(bytes, element type) of an HLO type string; tuples are summed ('mixed' if types differ)."""
    total, dtypes = 0.0, set()
    for dtype, dims in _ARRAY.findall(type_text):
        if dtype not in ELEMENT_BYTES:
            continue
        size = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += size * ELEMENT_BYTES[dtype]
        dtypes.add(dtype)
    return int(total), (dtypes.pop() if len(dtypes) == 1 else "mixed" if dtypes else "none")


def _split_computations(text: str) -> list[tuple[str, bool, list[str]]]:
    """[(name, is_entry, instruction lines)] in the order printed (callees before callers)."""
    comps, current = [], None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and current is None:
            current = (header.group("name"), line.startswith("ENTRY"), [])
            continue
        if current is not None:
            if line.startswith("}"):
                comps.append(current)
                current = None
            else:
                current[2].append(line)
    return comps


def _attr(text: str, key: str) -> str | None:
    """Value of `key=` in an attribute list, balancing braces/brackets/parens."""
    start = text.find(f"{key}=")
    if start < 0:
        return None
    i = start + len(key) + 1
    depth, j = 0, i
    while j < len(text):
        ch = text[j]
        if ch in "{[(":
            depth += 1
        elif ch in "}])":
            if depth == 0:
                break
            depth -= 1
        elif ch == "," and depth == 0:
            break
        j += 1
    return text[i:j].strip()


def _trip_count(line: str) -> int | None:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
    return int(m.group(1)) if m else None


_COMPARE = re.compile(r"compare\(%([\w.\-]+(?:#\d+)?), %([\w.\-]+(?:#\d+)?)\), direction=(LT|LE|GT|GE)")
_TUPLE_INDEX = re.compile(r"get-tuple-element\(%[\w.\-]+\), index=(\d+)")


def _definitions(comps) -> dict[str, str]:
    """Instruction name -> its line, over the module (XLA keeps instruction names unique in a module)."""
    defs = {}
    for _, _, lines in comps:
        for line in lines:
            m = _INSTRUCTION.match(line)
            if m:
                defs[m.group("name")] = line
    return defs


def _constant(name: str, defs: dict[str, str], depth: int = 0) -> int | None:
    """The integer a scalar instruction is, through copies and bitcasts; None if it is not a constant."""
    m = _INSTRUCTION.match(defs.get(name, ""))
    if not m or depth > 8:
        return None
    if m.group("op") == "constant":
        value = re.match(r"\s*(-?\d+)\)", m.group("args"))
        return int(value.group(1)) if value else None
    if m.group("op") in ("copy", "bitcast", "convert"):
        operands = _OPERAND.findall(m.group("args"))
        return _constant(operands[0], defs, depth + 1) if operands else None
    return None


def _tuple_operand(name: str, index: int, defs: dict[str, str]) -> str | None:
    m = _INSTRUCTION.match(defs.get(name, ""))
    if not m or m.group("op") != "tuple":
        return None
    operands = _OPERAND.findall(m.group("args"))
    return operands[index] if index < len(operands) else None


def inferred_trip_count(while_line: str, comps_by_name: dict[str, list[str]], defs: dict[str, str]) -> int | None:
    """Trips of a loop without `known_trip_count` (XLA:TPU prints none): its condition `counter < N` (or <=),
    the counter's start from the loop's initial tuple and its step from the body's result, all constants."""
    cond = re.search(r"condition=%([\w.\-]+)", while_line)
    body = re.search(r"body=%([\w.\-]+)", while_line)
    init = re.search(r"\bwhile\(%([\w.\-]+)\)", while_line)
    if not (cond and body and init):
        return None
    root = next((line for line in comps_by_name.get(cond.group(1), []) if line.lstrip().startswith("ROOT")), "")
    compare = _COMPARE.search(root)
    if not compare:
        return None
    lhs, rhs, direction = compare.groups()
    # `%param#0` (newer HLO text) or a get-tuple-element of the loop's parameter
    index_of = {n: re.search(r"#(\d+)$", n) or _TUPLE_INDEX.search(defs.get(n, "")) for n in (lhs, rhs)}
    if index_of[lhs] and _constant(rhs, defs) is not None and direction in ("LT", "LE"):
        index, limit = int(index_of[lhs].group(1)), _constant(rhs, defs)
    elif index_of[rhs] and _constant(lhs, defs) is not None and direction in ("GT", "GE"):
        index, limit, direction = int(index_of[rhs].group(1)), _constant(lhs, defs), direction.replace("G", "L")
    else:
        return None
    start_name = _tuple_operand(init.group(1), index, defs)
    start = _constant(start_name, defs) if start_name else None
    body_root = next((line for line in comps_by_name.get(body.group(1), []) if line.lstrip().startswith("ROOT")), "")
    root_name = _INSTRUCTION.match(body_root)
    next_name = _tuple_operand(root_name.group("name"), index, defs) if root_name else None
    step_line = _INSTRUCTION.match(defs.get(next_name or "", ""))
    step = None
    if step_line and step_line.group("op") == "add":
        for operand in _OPERAND.findall(step_line.group("args")):
            if _constant(operand, defs) is not None:
                step = _constant(operand, defs)
    if start is None or not step or step < 0:
        return None
    span = limit - start + (1 if direction == "LE" else 0)
    return max(0, -(-span // step))


def _iota(text: str) -> np.ndarray:
    """`[a,b]T(1,0)` or `[8]` (optionally after `<=`) -> the flattened device-id array."""
    m = re.fullmatch(r"\[([0-9,]+)\](?:T\(([0-9,]+)\))?", text.strip())
    if not m:
        raise ValueError(f"cannot parse iota tile {text!r}")
    dims = [int(d) for d in m.group(1).split(",")]
    array = np.arange(math.prod(dims)).reshape(dims)
    if m.group(2):
        array = array.transpose([int(p) for p in m.group(2).split(",")])
    return array.reshape(-1)


def _mesh_device_ids(ids_text: str, total: int) -> np.ndarray:
    """The device ids of a mesh replica-group spec in mesh order: listed, an iota, or 0..total-1."""
    if not ids_text:
        return np.arange(total)
    if ids_text.startswith("["):
        return _iota(ids_text)
    return np.array([int(x) for x in ids_text.split(",")])


def _axis_refs(group: str, names: list[str]) -> dict[int, list[tuple[int, int] | None]]:
    """Per mesh axis index, the grouped references to it: the whole axis (None) or sub-axes `'a':(pre)size`."""
    refs: dict[int, list[tuple[int, int] | None]] = {}
    for ref in filter(None, (r.strip() for r in group.split(","))):
        sub = re.fullmatch(r"'([^']+)'(?::\((\d+)\)(\d+))?", ref)
        if not sub:
            raise ValueError(f"cannot parse mesh axis reference {ref!r}")
        refs.setdefault(names.index(sub.group(1)), []).append(
            (int(sub.group(2)), int(sub.group(3))) if sub.group(2) else None)
    return refs


def _grouped_reshape(sizes: list[int], refs: dict[int, list[tuple[int, int] | None]]) -> tuple[list[int], list[int]]:
    """(every mesh axis as reshaped dims, those referenced by sub-axes split, the indices of the grouped dims)."""
    reshape, grouped = [], []
    for index, size in enumerate(sizes):
        if index not in refs:
            reshape.append(size)
            continue
        if refs[index] == [None]:
            grouped.append(len(reshape))
            reshape.append(size)
            continue
        prefix = 1
        for pre, sub_size in sorted(refs[index]):
            if pre != prefix:
                reshape.append(pre // prefix)
                prefix = pre
            grouped.append(len(reshape))
            reshape.append(sub_size)
            prefix *= sub_size
        if prefix != size:
            reshape.append(size // prefix)
    return reshape, grouped


def _mesh_groups(text: str) -> list[list[int]]:
    """XLA's mesh-axes replica groups: `mesh['a'=4,'b'=2], device_ids=(...) {'a'}`."""
    m = re.match(r"mesh\[(?P<axes>[^\]]*)\]\s*(?:,\s*device_ids=\((?P<ids>[^)]*\)?)\))?\s*\{(?P<group>[^}]*)\}", text)
    if not m:
        raise ValueError(f"cannot parse mesh replica groups {text!r}")
    names, sizes = [], []
    for part in m.group("axes").split(","):
        key, _, size = part.partition("=")
        names.append(key.strip().strip("'"))
        sizes.append(int(size))
    ids = _mesh_device_ids((m.group("ids") or "").strip(), math.prod(sizes))
    reshape, grouped = _grouped_reshape(sizes, _axis_refs(m.group("group"), names))
    order = [d for d in range(len(reshape)) if d not in grouped] + grouped
    group_size = math.prod(reshape[d] for d in grouped)
    return ids.reshape(reshape).transpose(order).reshape(-1, group_size).tolist()


def parse_replica_groups(text: str | None, num_partitions: int) -> list[list[int]]:
    """Every replica-group syntax XLA prints: explicit lists, iota `[g,n]<=[...]`, and mesh axes."""
    if text is None or text in ("{}", ""):
        return [list(range(num_partitions))]
    if text.startswith("mesh["):
        return _mesh_groups(text)
    if text.startswith("{"):
        return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([0-9,\s]*)\}", text[1:-1])]
    m = re.fullmatch(r"\[(\d+),(\d+)\]<=(.+)", text)
    if m:
        return _iota(m.group(3)).reshape(int(m.group(1)), int(m.group(2))).tolist()
    raise ValueError(f"cannot parse replica_groups={text!r}")


def _replica_text(line: str) -> str | None:
    """The replica_groups value, which for mesh groups contains spaces and a device_ids clause."""
    m = _REPLICA_GROUPS.search(line)
    return m.group(1) if m else None


def _symbols(comps) -> tuple[dict[str, str], dict[str, str]]:
    """(instruction name -> its result type, instruction name -> its op_name metadata) over every computation."""
    symbols: dict[str, str] = {}
    provenance: dict[str, str] = {}
    for _, _, lines in comps:
        for line in lines:
            m = _INSTRUCTION.match(line)
            if m:
                symbols[m.group("name")] = m.group("type")
                op_name = re.search(r'op_name="([^"]*)"', line)
                if op_name:
                    provenance[m.group("name")] = op_name.group(1)
    return symbols, provenance


def _multipliers(comps, branch_runs: Mapping[int, Sequence[float]]
                 ) -> tuple[dict[str, float], set[str], set[str]]:
    """(executions per step of each computation, the computations inside a loop of unknown trip count, the
    branches counted as if every one ran). Callers are printed after their callees: walked in reverse, every
    caller is counted before its callees. A conditional of n branches directly in a loop body, n in
    `branch_runs`, runs its branch k `branch_runs[n][k]` times per entry of the loop; any other runs each of
    its branches as often as itself: an upper bound, as only one runs."""
    multiplier: dict[str, float] = {name: 1 for name, entry, _ in comps if entry}
    entries: dict[str, float] = {}  # loop body -> how often its loop is entered per step
    unknown: set[str] = set()
    bound: set[str] = set()
    defs, by_name = _definitions(comps), {name: lines for name, _, lines in comps}
    for name, _, lines in reversed(comps):
        mult = multiplier.get(name)
        if mult is None:
            continue
        for line in lines:
            trips = _trip_count(line)
            if trips is None and " while(" in line:
                trips = inferred_trip_count(line, by_name, defs)
            for key, callee in _CALLEE.findall(line):
                factor = 1
                if key in ("body", "condition"):
                    factor = trips if trips is not None else 1
                    if trips is None:
                        unknown.add(callee)
                    if key == "body":
                        entries[callee] = entries.get(callee, 0) + mult
                multiplier[callee] = multiplier.get(callee, 0) + mult * factor
                if name in unknown:
                    unknown.add(callee)
                if name in bound:
                    bound.add(callee)
            branches = _OPERAND.findall(_attr(line, "branch_computations") or "")
            runs = branch_runs.get(len(branches)) if name in entries else None
            for k, callee in enumerate(branches):
                multiplier[callee] = multiplier.get(callee, 0) + (mult if runs is None else entries[name] * runs[k])
                if runs is None and len(branches) > 1 or name in bound:
                    bound.add(callee)
    return multiplier, unknown, bound


def _groups_and_moving(kind: str, line: str, num_partitions: int) -> tuple[tuple, float]:
    """A collective's replica groups (source-target pairs for a permute), and the fraction of devices whose
    data it moves (a transposed roll is split into permutes that each move some devices' data only)."""
    if kind != "collective-permute":
        return tuple(tuple(g) for g in parse_replica_groups(_replica_text(line), num_partitions)), 1.0
    pairs = re.findall(r"\{(\d+),(\d+)\}", _attr(line, "source_target_pairs") or "")
    groups = tuple((int(a), int(b)) for a, b in pairs)
    return groups, len({s for s, t in groups if s != t}) / max(num_partitions, len(groups), 1)


_WINDOWED_BODY = re.compile(r"windowed_dot_general_body_(ag|rs)")


def collective_matmuls(comps) -> dict[str, str]:
    """op_name of each matmul XLA:TPU turned into a collective matmul -> the collective its permutes do
    ('all-gather' for an `_ag` loop, 'reduce-scatter' for `_rs`; a matmul with loops of both kinds is left out)."""
    kinds: dict[str, set[str]] = {}
    for _, _, lines in comps:
        for line in lines:
            body = re.search(r"\bbody=%([\w.\-]+)", line)
            windowed = _WINDOWED_BODY.search(body.group(1)) if body and " while(" in line else None
            op_name = re.search(r'op_name="([^"]*)"', line) if windowed else None
            if op_name:
                kinds.setdefault(op_name.group(1), set()).add(
                    "all-gather" if windowed.group(1) == "ag" else "reduce-scatter")
    return {name: kind.pop() for name, kind in kinds.items() if len(kind) == 1}


_EINSUM = re.compile(r"/([a-z]+),([a-z]+)->([a-z]+)/dot_general$")


def unrolled_collective_matmul(op_name: str) -> str:
    """The collective a permute of an unrolled collective matmul does (XLA:TPU unrolls the loop of a small one, so
    no `windowed_dot_general_body` names it), read from its matmul's einsum in the op_name: one that sums over the
    batch ('b' in both operands, not in the result: a weight's gradient) reduce-scatters its result; any other
    all-gathers its weight operand. '' when the op_name names no einsum."""
    m = _EINSUM.search(op_name)
    if not m:
        return ""
    lhs, rhs, out = m.groups()
    return "reduce-scatter" if "b" in lhs and "b" in rhs and "b" not in out else "all-gather"


_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="([A-Z_]+)"')


def module_partitions(hlo_text: str) -> int | None:
    """The partitions one program runs on (`num_partitions=` of the module); on a multi-slice TPU one slice's."""
    m = re.search(r"\bnum_partitions=(\d+)", hlo_text[:20000])
    return int(m.group(1)) if m else None


def _megascale(line: str, op: str, num_slices: int) -> tuple[str, tuple] | None:
    """(collective kind, slice groups) of an XLA:TPU multi-slice transfer: a host-transfer `send` to the
    megascale runtime (`_xla_megascale_transfer_type="ALL_REDUCE"`) that the runtime runs across the slices."""
    m = _MEGASCALE.search(line) if op == "send" else None
    if not m:
        return None
    return m.group(1).lower().replace("_", "-"), (tuple(range(num_slices)),)


def collectives(hlo_text: str, num_partitions: int,
                branch_runs: Mapping[int, Sequence[float]] | None = None, num_slices: int = 1) -> list[Collective]:
    """All collectives of a compiled module with their per-step execution counts (see `_multipliers` for
    `branch_runs`: how often a loop's conditional runs each branch, averaged over the devices). On a multi-slice
    TPU the module is one slice's program: `num_partitions` its devices, and its transfers between the
    `num_slices` slices are collectives with `dcn` set, each slice one member of their group."""
    comps = _split_computations(hlo_text)
    symbols, provenance = _symbols(comps)
    multiplier, unknown, bound = _multipliers(comps, branch_runs or {})
    matmuls = collective_matmuls(comps)
    found = []
    for name, _, lines in comps:
        for line in lines:
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            op = m.group("op")
            kind = op[:-6] if op.endswith("-start") else op
            megascale = _megascale(line, op, num_slices)
            if megascale:
                kind = megascale[0]
            elif kind not in COLLECTIVE_KINDS or op.endswith("-done"):
                continue
            op_name = re.search(r'op_name="([^"]*)"', line)
            op_name = op_name.group(1) if op_name else ""
            operands = tuple(Operand(*shape_bytes(symbols.get(operand, "")), provenance.get(operand, op_name))
                             for operand in _OPERAND.findall(m.group("args").split(")")[0]))
            if megascale:  # send(data, token): the data only
                operands = tuple(o for o in operands if o.dtype not in ("token", "none"))[:1]
            dtypes = {o.dtype for o in operands}
            groups, moving = (megascale[1], 1.0) if megascale else _groups_and_moving(kind, line, num_partitions)
            found.append(Collective(
                name=m.group("name"), kind=kind, dtype=dtypes.pop() if len(dtypes) == 1 else "mixed",
                operand_bytes=sum(o.nbytes for o in operands), groups=groups, count=multiplier.get(name, 0),
                computation=name, op_name=op_name, operands=operands, unknown_trip_count=name in unknown,
                moving_fraction=moving, every_branch=name in bound,
                stands_for=(matmuls.get(op_name) or unrolled_collective_matmul(op_name))
                if kind == "collective-permute" else "",
                dcn=megascale is not None))
    return found


def axis_partitions(axis_sizes: Mapping[str, int]) -> dict[tuple[str, ...], frozenset[frozenset[int]]]:
    """For every set of non-trivial mesh axes, the device groups that vary along exactly those axes.

    Partition id i is the i-th device of the mesh in row-major order, which is
    how jax assigns a jitted computation's devices from its mesh.
    """
    names = list(axis_sizes)
    positions = np.arange(math.prod(axis_sizes.values())).reshape([axis_sizes[a] for a in names])
    live = [a for a in names if axis_sizes[a] > 1]
    result = {}
    for r in range(1, len(live) + 1):
        for subset in itertools.combinations(live, r):
            grouped = [names.index(a) for a in subset]
            rest = [i for i in range(len(names)) if i not in grouped]
            size = math.prod(axis_sizes[a] for a in subset)
            rows = positions.transpose(rest + grouped).reshape(-1, size)
            result[subset] = frozenset(frozenset(row.tolist()) for row in rows)
    return result


def label_groups(collective: Collective, axis_sizes: Mapping[str, int],
                 partitions: Mapping[tuple[str, ...], frozenset[frozenset[int]]] | None = None) -> str:
    """The mesh axes a collective runs over, e.g. 'fsdp' or 'data+fsdp'; 'none' if it moves nothing.

    Groups that split one axis into sub-axes (XLA decomposes a 4-way all-gather into two 2-way
    steps) are labelled with the axes their members differ along; anything else is 'irregular'.
    """
    names = list(axis_sizes)
    coords = np.stack(np.unravel_index(np.arange(math.prod(axis_sizes.values())),
                                       [axis_sizes[a] for a in names]), axis=1)
    if collective.kind == "collective-permute":
        moved = {names[i] for s, t in collective.groups if s != t
                 for i in np.nonzero(coords[s] != coords[t])[0].tolist()}
        return "+".join(a for a in names if a in moved) or "none"
    if collective.group_size <= 1:
        return "none"
    partitions = partitions if partitions is not None else axis_partitions(axis_sizes)
    observed = frozenset(frozenset(g) for g in collective.groups)
    for subset, groups in partitions.items():
        if groups == observed:
            return "+".join(subset)
    covered = sorted(d for g in collective.groups for d in g)
    varying = [{names[i] for i in np.nonzero((coords[list(g)] != coords[g[0]]).any(axis=0))[0].tolist()}
               for g in collective.groups]
    if covered == list(range(len(coords))) and all(v == varying[0] for v in varying) and varying[0]:
        return "+".join(a for a in names if a in varying[0])
    return "irregular"


def wire_bytes(kind: str, operand_bytes: float, group_size: int, moving_fraction: float = 1.0) -> float:
    """Bytes one device sends for a collective with bandwidth-optimal (ring) algorithms.

    all-gather: (n-1)/n of the gathered result = (n-1) x operand; reduce-scatter and
    all-to-all: (n-1)/n of the operand; all-reduce = reduce-scatter + all-gather:
    2 (n-1)/n of the operand; collective-permute: the operand, for the devices
    that send to another device (`moving_fraction`).
    """
    n = group_size
    if kind == "collective-permute":
        return operand_bytes * moving_fraction
    if n <= 1:
        return 0.0
    if kind == "all-gather":
        return operand_bytes * (n - 1)
    if kind in ("reduce-scatter", "all-to-all"):
        return operand_bytes * (n - 1) / n
    if kind == "all-reduce":
        return 2 * operand_bytes * (n - 1) / n
    raise ValueError(f"unknown collective kind {kind!r}")


def collective_wire_bytes(collective: Collective) -> float:
    """Bytes per device per execution of a parsed collective (a permute: averaged over the program's devices)."""
    return wire_bytes(collective.kind, collective.operand_bytes, collective.group_size, collective.moving_fraction)


def while_loops(hlo_text: str) -> list[tuple[str, int | None, int]]:
    """(body computation, known trip count, collectives directly in the body) of every while loop."""
    comps = _split_computations(hlo_text)
    def is_collective(line: str) -> bool:
        m = _INSTRUCTION.match(line)
        op = m.group("op") if m else ""
        return (op[:-6] if op.endswith("-start") else op) in COLLECTIVE_KINDS
    direct = {name: sum(1 for line in lines if is_collective(line)) for name, _, lines in comps}
    defs, by_name = _definitions(comps), {name: lines for name, _, lines in comps}
    found = []
    for _, _, lines in comps:
        for line in lines:
            body = re.search(r"\bbody=%([\w.\-]+)", line)
            if body and " while(" in line:
                trips = _trip_count(line)
                trips = trips if trips is not None else inferred_trip_count(line, by_name, defs)
                found.append((body.group(1), trips, direct.get(body.group(1), 0)))
    return found


# ---------------------------------------------------------------- which collectives cross processes

@dataclasses.dataclass(frozen=True)
class CrossProcessCollective:
    """A collective of a compiled program with at least one replica group spanning several processes."""

    name: str
    kind: str
    axes: str            # the mesh axes its groups run over, e.g. 'data' or 'data+fsdp' ('irregular' if none fit)
    operand_bytes: int   # bytes each device contributes per execution
    count: int           # executions per step


def cross_process_collectives(hlo_text: str, axis_sizes: Mapping[str, int],
                              process_of: Sequence[int]) -> list[CrossProcessCollective]:
    """The collectives of `hlo_text` whose traffic leaves a process, labelled with the mesh axes they run over.

    `axis_sizes` is the mesh's shape (axis order) and `process_of[i]` the process of partition id i,
    the i-th device of the mesh in row-major order (`[d.process_index for d in mesh.devices.flat]`). On a hierarchical mesh these
    are the DCN collectives, so their axes must include the DCN axes and nothing else may cross.
    """
    partitions = axis_partitions(axis_sizes)
    found = []
    for collective in collectives(hlo_text, len(process_of)):
        if any(len({process_of[i] for i in group}) > 1 for group in collective.groups):
            found.append(CrossProcessCollective(collective.name, collective.kind,
                                                label_groups(collective, axis_sizes, partitions),
                                                collective.operand_bytes, collective.count))
    return found
