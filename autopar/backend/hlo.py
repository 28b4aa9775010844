"""Read compiled stages: the collectives of their HLO, their flops and bytes, and the memory a compiled step holds.

Communication is read exactly from ``Compiled.as_text()``: every all-reduce,
all-gather, reduce-scatter, all-to-all and collective-permute (or their
``-start`` async forms), with operand bytes per device and group size.

Example::

    for c in autopar.backend.hlo.collectives(exe.stages["apply_grad"]):
        print(c.kind, c.operand_bytes, c.group_size, c.bytes_sent)
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from autopar.costs.cost_model import ring_bytes_sent

if TYPE_CHECKING:
  from autopar.plan import Plan

__all__ = ["HloCollective", "collectives", "bytes_sent", "ScheduledOp", "entry_schedule",
           "module_cost", "matmul_flops", "compiled_peak", "compiled_step_memory"]

_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
          "collective-permute")
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>\(.*?\)|\S+)\s+"
    r"(?P<kind>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?P<start>-start)?\(")
_ARRAY = re.compile(r"(?P<dtype>[a-z]+[0-9]*)\[(?P<dims>[0-9,]*)\]")
_DTYPES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
           "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
           "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}


@dataclasses.dataclass(frozen=True)
class HloCollective:
  """One collective instruction.

  Attributes:
    kind: "all-reduce", "all-gather", "reduce-scatter", "all-to-all" or
      "collective-permute".
    shapes: result array shapes, as (dtype, dims) pairs.
    operand_bytes: bytes per device of its input (all operands together).
    group_size: devices in each replica group.
    count: how many times one run of the module runs it (the product of
      the known trip counts of the loops around it; 1 outside loops).
    groups: the device groups (partition ids, i.e. positions in the mesh's
      flattened devices), or None where the HLO does not list them.
  """
  kind: str
  shapes: tuple[tuple[str, tuple[int, ...]], ...]
  operand_bytes: int
  group_size: int
  count: int = 1
  groups: tuple[tuple[int, ...], ...] | None = None

  @property
  def result_bytes(self) -> int:
    return sum(_DTYPES.get(d, 4) * math.prod(s) for d, s in self.shapes)

  @property
  def bytes_sent(self) -> float:
    """Bytes each device sends in one run of the instruction, by the ring
    formulas (times ``count`` for one run of the module)."""
    return ring_bytes_sent(self.kind, self.operand_bytes, self.group_size)

  def mesh_axes(self, axis_names, mesh_shape) -> tuple[str, ...] | None:
    """The mesh axes its groups span (devices in a group differ in their
    coordinates along exactly those), or None where the groups are not
    known."""
    if self.groups is None:
      return None
    varying = set()
    for g in self.groups:
      coords = np.array(np.unravel_index(np.asarray(g), tuple(mesh_shape)))
      varying.update(i for i in range(len(mesh_shape))
                     if len(set(coords[i].tolist())) > 1)
    return tuple(axis_names[i] for i in sorted(varying))


def _text(compiled: Any) -> str:
  return compiled if isinstance(compiled, str) else compiled.as_text()


def _group_size(line: str, num_devices: int) -> int:
  groups = _groups(line, num_devices)
  return len(groups[0]) if groups else num_devices


def _groups(line: str, num_devices: int) -> tuple[tuple[int, ...], ...] | None:
  """The device groups of a collective's ``replica_groups`` (explicit, or
  iota ``[G,S]<=[dims]T(perm)``) or ``source_target_pairs``."""
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", line)
  if m:
    dims = [int(x) for x in m.group(3).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(4):
      ids = ids.transpose([int(x) for x in m.group(4).split(",")])
    return tuple(tuple(int(i) for i in row)
                 for row in ids.reshape(int(m.group(1)), int(m.group(2))))
  m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([0-9,]+)\]"
                r"(?:T\(([0-9,]+)\))?\))?\s*\{([^}]*)\}", line)
  if m:
    # Devices laid out on a named mesh (row-major; in the order of
    # ``device_ids``, an iota reshaped and transposed, where given); a group
    # is a line of devices along the named axes.
    pairs = [kv.split("=") for kv in m.group(1).split(",")]
    names = [k.strip().strip("'") for k, _ in pairs]
    dims = [int(v) for _, v in pairs]
    along = [names.index(a.strip().strip("'")) for a in m.group(4).split(",") if a.strip()]
    rest = [i for i in range(len(dims)) if i not in along]
    ids = np.arange(math.prod(dims))
    if m.group(2):
      ids = ids.reshape([int(x) for x in m.group(2).split(",")])
      if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    ids = ids.reshape(dims).transpose(rest + along)
    size = math.prod(dims[i] for i in along)
    return tuple(tuple(int(i) for i in row) for row in ids.reshape(-1, size))
  m = re.search(r"(?:replica_groups|source_target_pairs)=\{((?:\{[0-9,]*\},?)*)\}", line)
  if m:
    groups = tuple(tuple(int(x) for x in g.split(",") if x)
                   for g in re.findall(r"\{([0-9,]*)\}", m.group(1)))
    if not groups or groups == ((),):
      return (tuple(range(num_devices)),)
    return groups
  return None


def collectives(compiled: Any) -> list[HloCollective]:
  """Every collective in the HLO of ``compiled`` (a Compiled or its text),
  with how many times a run of the module runs it."""
  text = _text(compiled)
  m = re.search(r"num_partitions=(\d+)", text)
  num_devices = int(m.group(1)) if m else 1
  comps, entry = _computations(text)
  runs = _run_counts(comps, entry)
  out = []
  for comp, lines in comps.items():
    for line in lines:
      c = _collective(line, num_devices, runs.get(comp, 1))
      if c is not None:
        out.append(c)
  return out


def _collective(line: str, num_devices: int, count: int) -> HloCollective | None:
  mi = _INSTR.match(line)
  if not mi:
    return None
  kind = mi.group("kind")
  types = mi.group("type")
  if mi.group("start") and types.startswith("("):
    # Async start ops return (operands..., results...); keep the results.
    arrays = _ARRAY.findall(types)
    arrays = arrays[len(arrays) // 2:] if kind != "all-reduce" else arrays
  else:
    arrays = _ARRAY.findall(types)
  shapes = tuple((d, tuple(int(x) for x in dims.split(",") if x))
                 for d, dims in arrays)
  p = _group_size(line, num_devices)
  result = sum(_DTYPES.get(d, 4) * math.prod(s) for d, s in shapes)
  if kind == "all-gather":
    operand = result // max(p, 1)
  elif kind == "reduce-scatter":
    operand = result * p
  else:
    operand = result
  return HloCollective(kind=kind, shapes=shapes, operand_bytes=int(operand),
                       group_size=p, count=count, groups=_groups(line, num_devices))


def bytes_sent(compiled: Any) -> float:
  """Total bytes each device sends in one run of ``compiled`` (ring
  formulas; a collective in a loop counts once per trip)."""
  return float(sum(c.bytes_sent * c.count for c in collectives(compiled)))


# -- the schedule --------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ScheduledOp:
  """One instruction of the entry computation, in scheduled order.

  Attributes:
    name: the instruction's name.
    opcode: its opcode (``fusion``, ``while``, ``reduce-scatter``, ...).
    collective: the collective it is or starts (an async ``*-start``, or an
      ``async-start`` wrapping one), else None.
    backward_dot: it is, or calls a computation holding, a matmul
      (``dot``, ``convolution`` or a GEMM custom call) of the backward pass
      (JAX names those ``transpose(jvp(...))``).
    dot: as ``backward_dot``, for any matmul.
  """
  name: str
  opcode: str
  collective: str | None
  dot: bool
  backward_dot: bool


_COMP = re.compile(r"^(ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?:\(.*?\)|\S+)\s+"
                 r"(?P<op>[\w\-]+)\(")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)="
                    r"\{?(?P<names>%?[\w.\-]+(?:,\s*%[\w.\-]+)*)\}?")
_GEMM = re.compile(r'custom_call_target="[^"]*(gemm|matmul)', re.I)


def _computations(text: str) -> tuple[dict[str, list[str]], str | None]:
  """The module's computations (name -> instruction lines) and the entry's name."""
  comps: dict[str, list[str]] = {}
  entry = None
  current = None
  for line in text.splitlines():
    m = _COMP.match(line)
    if m and "=" not in line.split("{")[0].split("(")[0]:
      current = m.group("name")
      comps[current] = []
      if m.group(1):
        entry = current
      continue
    if line.strip() == "}":
      current = None
    elif current is not None:
      comps[current].append(line)
  return comps, entry


def called(line: str) -> list[str]:
  """The computations an instruction calls."""
  return [n.strip().lstrip("%") for m in _CALLS.finditer(line)
          for n in m.group("names").split(",") if n.strip()]


_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _run_counts(comps: dict[str, list[str]], entry: str | None) -> dict[str, int]:
  """Computation -> times one run of the module runs it: a while body runs
  its known trip count times per run of the computation around it (1 when
  XLA does not know it), other calls once."""
  runs: dict[str, int] = {}

  def visit(name: str, times: int, depth: int = 0):
    if depth > 64 or runs.get(name, 0) >= times:
      return
    runs[name] = times
    for line in comps.get(name, ()):
      trip = _TRIP.search(line) if " while(" in line else None
      body = re.search(r"body=%?([\w.\-]+)", line) if trip else None
      for c in called(line):
        visit(c, times * (int(trip.group(1)) if body and c == body.group(1) else 1),
              depth + 1)

  if entry is not None:
    visit(entry, 1)
  return runs


def entry_schedule(compiled: Any) -> list[ScheduledOp]:
  """The entry computation of ``compiled`` (a Compiled or its text) as run.

  A compiled module is scheduled (``is_scheduled=true``): the order of the
  entry computation's instructions is the order XLA issues them. Example,
  does the first gradient reduce-scatter start before the last backward
  matmul::

      ops = entry_schedule(exe.stages["accumulate_grad_sync"])
      first_rs = min(i for i, o in enumerate(ops) if o.collective == "reduce-scatter")
      last_dot = max(i for i, o in enumerate(ops) if o.backward_dot)
  """
  comps, entry = _computations(_text(compiled))
  if entry is None:
    return []
  memo: dict[str, tuple[str | None, bool, bool]] = {}

  def line_info(line):
    m = _OP.match(line)
    op = m.group("op") if m else ""
    base = op[:-len("-start")] if op.endswith("-start") else op
    coll = base if base in _KINDS else None
    is_dot = op in ("dot", "convolution") or bool(_GEMM.search(line))
    bwd = is_dot and "transpose(" in line
    for c in called(line):
      c_coll, c_dot, c_bwd = comp_info(c)
      if op == "async-start" and c_coll:
        coll = c_coll
      is_dot, bwd = is_dot or c_dot, bwd or c_bwd
    return coll, is_dot, bwd

  def comp_info(name):
    if name not in memo:
      memo[name] = (None, False, False)          # recursion guard
      coll, is_dot, bwd = None, False, False
      for line in comps.get(name, ()):
        c, d, b = line_info(line)
        coll, is_dot, bwd = coll or c, is_dot or d, bwd or b
      memo[name] = (coll, is_dot, bwd)
    return memo[name]

  out = []
  for line in comps[entry]:
    m = _OP.match(line)
    if not m:
      continue
    coll, is_dot, bwd = line_info(line)
    if m.group("op").endswith("-done") or m.group("op") == "async-done":
      coll = None
    out.append(ScheduledOp(name=m.group("name"), opcode=m.group("op"),
                           collective=coll, dot=is_dot, backward_dot=bwd))
  return out


# -- flops and bytes of a compiled module, loops counted -----------------------

_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>\(.*?\)|\S+)\s+"
                  r"(?P<op>[\w\-]+)\((?P<args>[^)]*)\)")
# Moves nothing (views, tuples) or runs a computation counted on its own.
_FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                   "while", "conditional", "call", "after-all", "partition-id",
                   "replica-id"})
# Element-wise opcodes HloCostAnalysis counts a flop per element of
# (transcendental ones it counts apart, not as flops).
_FLOP_OPS = frozenset({"add", "subtract", "multiply", "divide", "maximum", "minimum",
                       "compare", "select", "negate", "abs", "and", "or", "xor",
                       "not", "clamp", "remainder", "sign", "floor", "ceil",
                       "round-nearest-even", "round-nearest-afz"})


def _dims(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
  return [(m.group("dtype"), tuple(int(d) for d in m.group("dims").split(",") if d))
          for m in _ARRAY.finditer(type_text)]


def _nbytes(arrays) -> int:
  return sum(_DTYPES.get(dt, 4) * math.prod(dims) for dt, dims in arrays)


_GEMM_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')


def _custom_gemm_flops(line: str, operands, types, arrays) -> float:
  """Flops of a library GEMM (cuBLAS, a ``custom-call`` that XLA's cost
  analysis does not count): 2 x its result's size x the contracted dims'."""
  if not _GEMM.search(line) or not operands or not arrays:
    return 0.0
  m = _GEMM_CONTRACTING.search(line)
  lhs = types.get(operands[0], [("f32", ())])[0][1]
  dims = [int(d.strip().strip('"')) for d in m.group(1).split(",") if d.strip()] \
      if m else []
  k = math.prod(lhs[d] for d in dims if d < len(lhs)) if lhs else 1
  return 2.0 * math.prod(arrays[0][1]) * k


def _instructions(lines: list[str], types: dict[str, list]):
  """(line, opcode, result arrays, operand names) of each instruction of a
  computation, in order; ``types`` gathers each result's arrays by name
  (what the operands are looked up in)."""
  for line in lines:
    m = _DEF.match(line)
    if not m:
      continue
    arrays = _dims(m.group("type"))
    types[m.group("name")] = arrays
    operands = [a.strip().lstrip("%") for a in m.group("args").split(",") if a.strip()]
    yield line, m.group("op"), arrays, operands


def _direct_cost(lines: list[str], comps: dict[str, list[str]],
                 fused: bool = False) -> tuple[float, float]:
  """(flops, bytes) of one computation's own instructions: a fusion's flops
  are its fused computation's, its bytes its operands and results; loops
  and calls are left to their bodies. A library GEMM's flops are not here
  (:func:`_gemm_flops`)."""
  types: dict[str, list] = {}
  flops = nbytes = 0.0
  for line, op, arrays, operands in _instructions(lines, types):
    if op in ("dot", "convolution"):
      flops += (_matmul(line, op, arrays, operands, types) or ("", 0.0))[1]
    elif op == "fusion":
      for c in called(line):
        flops += _direct_cost(comps.get(c, ()), comps, fused=True)[0]
    elif op in _FLOP_OPS and arrays:
      flops += math.prod(arrays[0][1])
    elif op == "reduce" and operands:
      flops += math.prod(types.get(operands[0], [("f32", ())])[0][1])
    if fused or op in _FREE:
      continue
    sizes = [_nbytes(types.get(o, ())) for o in operands]
    out = _nbytes(arrays)
    if op == "fusion" and called(line):
      sizes, out = _in_place(comps.get(called(line)[0], ()), sizes, out)
    elif op == "dynamic-slice" and sizes:
      sizes[0] = out                  # reads only the slice
    elif op == "dynamic-update-slice" and len(sizes) > 1:
      sizes[0], out = 0, sizes[1]     # in place: the update read and written
    nbytes += out + sum(sizes)
  return flops, nbytes


def _in_place(lines, sizes: list[int], out: int) -> tuple[list[int], int]:
  """A fusion's operand and result bytes as XLA's cost analysis counts
  them: an operand that only dynamic slices read counts their slices, and
  a dynamic-update-slice root updates its buffer in place (the buffer
  operand is not read, the update is what is written)."""
  types: dict[str, list] = {}
  params: dict[str, int] = {}
  readers: dict[str, list[tuple[str, int, list]]] = {}
  root = None
  for line in lines:
    m = _DEF.match(line)
    if not m:
      continue
    name, op = m.group("name"), m.group("op")
    types[name] = _dims(m.group("type"))
    if op == "parameter":
      params[name] = int(m.group("args") or 0)
    args = [a.strip().lstrip("%") for a in m.group("args").split(",") if a.strip()]
    for k, a in enumerate(args):
      readers.setdefault(a, []).append((op, k, types[name]))
    if line.lstrip().startswith("ROOT"):
      root = (op, args)
  sizes = list(sizes)
  for name, k in params.items():
    rs = readers.get(name, ())
    if k < len(sizes) and rs and all(op == "dynamic-slice" and pos == 0
                                     for op, pos, _ in rs):
      sizes[k] = sum(_nbytes(t) for _, _, t in rs)
  if root is not None and root[0] == "dynamic-update-slice" and len(root[1]) > 1:
    buffer, update = root[1][0], root[1][1]
    if buffer in params and params[buffer] < len(sizes):
      sizes[params[buffer]] = 0
      out = _nbytes(types.get(update, ()))
  return sizes, out


# HLO's element types -> the dtype names autopar's flop rates are keyed by.
_RATE_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64",
                "f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2", "s8": "int8"}
_DIM_LABELS = re.compile(r"dim_labels=[^_]*_(?P<rhs>[^-]*)->")


def _matmul(line: str, op: str, arrays, operands, types) -> tuple[str, float] | None:
  """(the dtype it runs at, flops) of a dot, a convolution or a library GEMM;
  None for anything else. float32 operands at default precision run as
  "tfloat32" (``strategies.dot.work_dtype``)."""
  if op == "custom-call":
    flops = _custom_gemm_flops(line, operands, types, arrays)
  elif op in ("dot", "convolution") and arrays and operands:
    lhs = types.get(operands[0], [("f32", ())])[0][1]
    if op == "dot":
      cd = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", line)
      k = math.prod(lhs[int(d)] for d in cd.group(1).split(",") if d) if cd and lhs else 1
    else:                             # a kernel's size less its output features
      rhs = types.get(operands[1], [("f32", ())])[0][1] if len(operands) > 1 else ()
      labels = _DIM_LABELS.search(line)
      o = labels.group("rhs").find("o") if labels else -1
      k = math.prod(rhs) // rhs[o] if rhs and 0 <= o < len(rhs) and rhs[o] else 1
    flops = 2.0 * math.prod(arrays[0][1]) * k
  else:
    return None
  if not flops:
    return None
  hlo_dtype = types.get(operands[0], [(arrays[0][0], ())])[0][0] if operands else "f32"
  dtype = _RATE_DTYPES.get(hlo_dtype, hlo_dtype)
  if dtype == "float32" and "HIGHEST" not in line and "highest" not in line:
    dtype = "tfloat32"
  return dtype, flops


def matmul_flops(compiled: Any) -> dict[str, float]:
  """The flops of one run of ``compiled`` that are matmuls or convolutions
  (dots, convolutions, library GEMMs; inside fusions and loops, counted
  their runs), by the dtype they run at (``"tfloat32"`` for float32 at
  default precision, as ``strategies.dot.work_dtype`` names it). The rest
  of ``module_cost``'s flops are element-wise work, at float32's vector
  rate."""
  comps, entry = _computations(_text(compiled))
  out: dict[str, float] = {}
  for name, runs in _run_counts(comps, entry).items():
    types: dict[str, list] = {}
    for line, op, arrays, operands in _instructions(comps[name], types):
      got = _matmul(line, op, arrays, operands, types)
      if got is not None:
        out[got[0]] = out.get(got[0], 0.0) + runs * got[1]
  return out


def _gemm_flops(lines: list[str]) -> float:
  """Flops of a computation's library GEMM calls (``_custom_gemm_flops``)."""
  types: dict[str, list] = {}
  return sum(_custom_gemm_flops(line, operands, types, arrays)
             for line, op, arrays, operands in _instructions(lines, types)
             if op == "custom-call")


def module_cost(compiled: Any) -> tuple[float, float]:
  """(flops, bytes accessed) of one run of ``compiled``, loops counted.

  XLA's ``cost_analysis()`` counts a loop's body once, whatever its trip
  count (a scan over 24 layers costs one layer), and leaves out the flops
  of GEMMs run as library calls (cuBLAS: a float32 MLP step on an H200
  read as 3 % of its flops). This takes its figures and adds, for each
  computation a loop runs more than once, its own instructions' flops and
  bytes (read from the HLO text, as ``cost_analysis`` counts them: a
  fusion's operands and results) times the extra runs, and every library
  GEMM's flops times its runs."""
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else {}
  flops = float(analysis.get("flops", 0.0))
  nbytes = float(analysis.get("bytes accessed", 0.0))
  comps, entry = _computations(_text(compiled))
  fused = {c for lines in comps.values() for line in lines if " fusion(" in line
           for c in called(line)}
  for name, runs in _run_counts(comps, entry).items():
    if name in fused:
      continue
    # GEMMs run as library calls (cuBLAS on GPUs) are not in cost_analysis.
    flops += runs * _gemm_flops(comps[name])
    if runs > 1:
      f, b = _direct_cost(comps[name], comps)
      flops += (runs - 1) * f
      nbytes += (runs - 1) * b
  return flops, nbytes


def compiled_peak(plan: "Plan", stages, schedule: Sequence[str]) -> int:
  """The most bytes per device the compiled step holds while a stage runs
  (:func:`compiled_step_memory`, the step's inputs as ``plan`` shards
  them)."""
  held = sum(v.bytes_per_device(plan.axis_sizes) for v in plan.inputs)
  return max((b for _, b in compiled_step_memory(stages, schedule, held)), default=0)


def compiled_step_memory(stages, schedule: Sequence[str],
                         held: int) -> tuple[tuple[str, int], ...]:
  """Per stage of ``schedule`` (once each), the bytes per device the step
  holds while it runs: the stage's arguments (or, if more, the ``held``
  bytes of the step's inputs plus what the previous stage returned: the
  arrays kept between stages whether passed in or not), its outputs not
  aliased to arguments, and its temporaries."""
  out, carried = [], 0
  seen = set()
  for name in schedule:
    m = stages[name].memory_analysis()
    if name not in seen:
      seen.add(name)
      live = max(m.argument_size_in_bytes, held + carried)
      out.append((name, int(live + m.output_size_in_bytes - m.alias_size_in_bytes
                            + m.temp_size_in_bytes)))
    carried = m.output_size_in_bytes
  return tuple(out)
